"""Agents that run the library inside other processes (installed as ``ckpt_engine.workers``):
the trainer agent in each FSDP rank and the rollout agent with its engine adapters."""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"TrainerAgent": "ckpt_engine.workers.trainer_agent", "RolloutAgent": "ckpt_engine.workers.rollout_agent",
           "EngineDriver": "ckpt_engine.workers.driver"}
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:  # loaded on first use: importing an adapter does not start torch.distributed
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_engine.workers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
