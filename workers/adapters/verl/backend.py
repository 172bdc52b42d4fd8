"""ckpt-engine as a verl checkpoint-engine backend: ``actor_rollout_ref.rollout.checkpoint_engine.backend:
ckpt_engine``. Importing this module registers it in verl's CheckpointEngineRegistry; verl imports it through
``custom_backend_module: ckpt_engine.workers.adapters.verl`` or the ``verl.plugins`` entry point
(pyproject.toml). This module imports verl: nothing else in ckpt_engine imports it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .actor import VerlActor
from .rollout import VerlRollout
from .sync import BACKEND, VerlSync


@CheckpointEngineRegistry.register(BACKEND)
class CkptEngineCheckpointEngine(CheckpointEngine):
    """Every verl sync as one versioned, verified ckpt-engine version. verl constructs it with ``is_master`` on
    actor ranks only: that picks the side (``side``: actor.py or rollout.py; sync.py has what they share)."""

    wire_format = VerlSync.wire_format

    def __init__(self, bucket_size: int, is_master: bool | None = None, **engine_kwargs: Any) -> None:
        # verl always passes a bucket size; its own default (update_weights_bucket_megabytes unset) is left to the
        # deployment, as every knob verl leaves unset (ckpt_engine/config/knobs.py)
        given = None if bucket_size == _verl_default_bucket_size() else bucket_size
        self.side: VerlActor | VerlRollout = (VerlActor(given, bool(is_master), **engine_kwargs)
                                              if is_master is not None else VerlRollout(given, **engine_kwargs))

    def prepare(self) -> dict[str, Any]:
        return self.side.prepare()

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        return VerlSync.build_topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, **topology: Any) -> None:
        self.side.init_process_group(**topology)

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, Any]:
        return await self.side.send_weights(weights, global_steps=global_steps)

    def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        return self.side.receive_weights(global_steps=global_steps)  # (not awaited: verl does not await it)

    def finalize(self) -> None:
        self.side.finalize()

    def close(self) -> None:
        self.side.close()


def _verl_default_bucket_size() -> int | None:
    """verl's default ``update_weights_bucket_megabytes``, in bytes as verl passes it (None: not found)."""
    from dataclasses import MISSING, fields

    try:
        from verl.workers.config.rollout import CheckpointEngineConfig
    except ImportError:  # (another verl: then every bucket size counts as set)
        return None
    default = next((f.default for f in fields(CheckpointEngineConfig) if f.name == "update_weights_bucket_megabytes"),
                   MISSING)
    return int(default) << 20 if isinstance(default, int) else None
