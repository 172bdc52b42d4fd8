"""Where an owner keeps the column pieces of the sharded classes its receivers pull (plan/pull_reads.py
``kept_spans``), as each class's send cuts and digests them: a puller reads each such piece in one read from
here, where reading it from the cached tensor would take one read a row.

One host buffer per class, reused from version to version (so registered with the NIXL agent once), grown when a
layout needs more. Only one version is in flight at a time, so a version's pieces are not overwritten while its
pullers read them; a straggler of an ended version that reads the next one's bytes fails their digests.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping

import torch

from ckpt_engine.device import DeviceInfo, host_empty
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.owners import Owners
from ckpt_engine.plan.pull_reads import kept_nbytes, kept_spans
from ckpt_engine.send.transfer import KeepFor, Kept, WirePlan


class KeptPieces:
    """By class key: the memory its pulled sends keep their column pieces in (thread-safe: the trainer offers a
    version while its send may already keep into it)."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._memory: dict[str, torch.Tensor] = {}

    def keep_for(self, key: str, cut_from: Layout, rank: int) -> KeepFor:
        """What owner rank ``rank``'s send of class ``key`` (pieces of tensors laid out as ``cut_from``) keeps,
        once its wire layout is known."""

        def keep(layout: Layout, owners: Owners) -> Kept:
            spans = kept_spans(layout, owners, cut_from)
            return Kept(self._memory_of(key, kept_nbytes(spans, owners, rank)), spans)

        return keep

    def offered(self, plans: Mapping[str, WirePlan], cut_from: Layout, rank: int) -> dict[str, torch.Tensor]:
        """The memory each class of ``plans`` (by class key) keeps its pieces in, for an offer of them."""
        return {key: self._memory_of(key, kept_nbytes(kept_spans(plan.layout, plan.owners, cut_from), plan.owners,
                                                     rank)) for key, plan in plans.items()}

    def keep_only(self, keys: Collection[str]) -> None:
        """Let go of the memory of classes no longer pulled (the pull server deregisters it once cooled)."""
        with self._lock:
            self._memory = {key: memory for key, memory in self._memory.items() if key in keys}

    def _memory_of(self, key: str, nbytes: int) -> torch.Tensor:
        with self._lock:
            memory = self._memory.get(key)
            if memory is None or memory.numel() < nbytes:
                memory = self._memory[key] = host_empty(max(nbytes, 1), self.device)
            return memory
