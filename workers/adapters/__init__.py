"""Adapters that apply a verified version to an inference engine: a plain torch / transformers module
(in place), vLLM (worker extension and native weight-transfer client) and SGLang (HTTP client)."""
