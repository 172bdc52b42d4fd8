"""Benchmarks of ckpt-engine (run ``python -m bench.sync_bench``)."""
