"""vLLM adapters. Nothing here imports vLLM at module level (backend.py does, and only vLLM loads it).

- ``backend.py`` + ``plugin.py``: ckpt-engine as a vLLM weight-transfer backend ("ckpt_engine"), registered by
  the ``vllm.general_plugins`` entry point; versions are received and verified inside each worker and applied
  with vLLM's layerwise reload when ckpt-engine's driver runs vLLM's weight-update API.
- ``control.py``: the driver's controls for a server (HTTP), an in-process ``LLM``, and the worker extension.
- ``extension.py``: ``CkptEngineWorkerExtension`` for ``--worker-extension-cls`` (older deployments).
- ``nccl_client.py``: a bridge into vLLM's own ``nccl`` backend (schema-exact; needs CUDA).
"""

from ckpt_engine.workers.adapters.vllm.control import ExtensionControl, HttpControl, LLMControl, start_vllm_driver
from ckpt_engine.workers.adapters.vllm.extension import CkptEngineWorkerExtension
from ckpt_engine.workers.adapters.vllm.nccl_client import VLLMWeightTransferClient

__all__ = ["CkptEngineWorkerExtension", "ExtensionControl", "HttpControl", "LLMControl", "VLLMWeightTransferClient",
           "start_vllm_driver"]
