"""Benchmarks of ckpt-engine: ``ckpt-engine bench [--quick]`` (or ``python -m ckpt_engine.bench.suite``) runs them all
and writes docs/benchmarks.md; see bench/suite.py."""
