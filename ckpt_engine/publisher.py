"""Trainer-side front of the library: plans the layout, snapshots into the version cache (cached mode) or
sends the live tensors (``bypass_cpu``), and keeps re-sendable versions."""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from ckpt_engine.cache import VersionCache
from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import ConfigError
from ckpt_engine.group import SyncGroup
from ckpt_engine.layout import DEFAULT_ALIGNMENT, Layout, plan_layout
from ckpt_engine.sender import Sender, Transfer, WireHook
from ckpt_engine.tensors import NamedTensors, specs_of

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        group: SyncGroup,
        *,
        bucket_size: int,
        alignment: int = DEFAULT_ALIGNMENT,
        keep_versions: int = 2,
        digest_algo: DigestAlgo | None = None,
        ack_timeout_s: float | None = None,
        wire_hook: WireHook | None = None,
    ) -> None:
        if bucket_size <= 0:
            raise ConfigError(f"bucket_size must be positive, got {bucket_size}")
        self.bucket_size = bucket_size
        self.alignment = alignment
        self.cache = VersionCache(group.device, keep_versions)
        self.sender = Sender(group, digest_algo=digest_algo, ack_timeout_s=ack_timeout_s, wire_hook=wire_hook)
        self._layout: Layout | None = None

    def layout_for(self, tensors: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of these tensors; re-planned only when names, dtypes or shapes changed."""
        specs = specs_of(tensors)
        if self._layout is None or self._layout.specs != tuple(specs):
            self._layout = plan_layout(specs, self.bucket_size, self.alignment)
            log.info("planned layout %s: %d tensors in %d buckets, %d bytes", self._layout.digest,
                     self._layout.num_tensors, len(self._layout.buckets), self._layout.total_bytes)
        return self._layout

    def publish(self, version: int, named: NamedTensors, *, bypass_cpu: bool = False,
                step: int | None = None) -> Transfer:
        """Start sending ``version``. Cached mode returns after the snapshot (``params_released`` is set);
        bypass_cpu returns at once and reads the tensors until ``params_released`` is set."""
        layout = self.layout_for(named.tensors)
        if bypass_cpu:
            return self.sender.send_live(version, layout, named.tensors, aliases=named.aliases, step=step)
        self.cache.snapshot(version, layout, named.tensors, aliases=named.aliases, step=step)
        return self.sender.send_cached(self.cache, version)

    def republish(self, version: int) -> Transfer:
        """Send a cached version again (rollback, or a receiver that missed it)."""
        return self.sender.send_cached(self.cache, version)

    def close(self) -> None:
        self.sender.close()
