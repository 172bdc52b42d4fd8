"""ckpt-engine as a verl checkpoint-engine backend: ``actor_rollout_ref.rollout.checkpoint_engine.backend:
ckpt_engine``. Importing this module registers it in verl's CheckpointEngineRegistry; verl imports it through
``custom_backend_module: ckpt_engine.workers.adapters.verl`` or the ``verl.plugins`` entry point
(pyproject.toml). This module imports verl: nothing else in ckpt_engine imports it."""

from __future__ import annotations

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .sync import BACKEND, VerlSync


@CheckpointEngineRegistry.register(BACKEND)
class CkptEngineCheckpointEngine(VerlSync, CheckpointEngine):
    """Every verl sync as one versioned, verified ckpt-engine version (sync.py has the how)."""
