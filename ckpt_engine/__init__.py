"""ckpt-engine: bucketed, versioned, hash-verified weight sync from trainers to rollout engines.

The library's folders are its pipeline: ``plan`` (layout, digests, modes: pure), ``send`` (publisher, cache),
``transport`` (sync group, framing, messages), ``receive`` (assembly, receivers), ``control`` (the daemon's
messages, tokens, client). The names most users need are importable from here; they load on first use, so
``import ckpt_engine`` stays cheap (no torch.distributed set-up, no CUDA probing). The agents that run the
library inside trainers and rollout engines are ``ckpt_engine.workers.TrainerAgent`` / ``RolloutAgent``."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from ckpt_engine import _moved

_moved.install()

_PUBLIC = {
    "Publisher": "ckpt_engine.send.publisher",
    "Receiver": "ckpt_engine.receive.collective",
    "SyncGroup": "ckpt_engine.transport.group",
    "open_store": "ckpt_engine.transport.group",
    "detect_device": "ckpt_engine.device",
    "named_tensors_of": "ckpt_engine.plan.tensors",
    "EngineConfig": "ckpt_engine.config",
    "load_config": "ckpt_engine.config",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
