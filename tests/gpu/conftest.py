"""GPU tests: always collected; skipped with a reason where the machine lacks what they need."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA devices; skipped without them")
