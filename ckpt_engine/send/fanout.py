"""bypass_cpu for a sharded version: each owner gathers its buckets of the version once, in layout order, and
every class of receivers cuts its pieces from them while they are held. So an FSDP model is gathered once
whatever the classes, and no byte goes through host memory.

The gathered buckets wait in a bounded window (:class:`GatheredWindow`). The gathering thread puts each one;
every class that needs it takes it and lets it go when it moves on. While ``depth`` buckets are held the
gathering waits, so device memory stays at about ``depth`` buckets beyond what the classes' sends hold.

A tensor larger than a bucket is gathered piece by piece, since an FSDP gather brings only the rows a piece
spans. :class:`Assembler` puts it together whole, on its own device, before its slices are cut, so it is held
from the bucket where its last piece lies (:func:`ready_at`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.plan.tensors import piece_of

Tensors = Mapping[str, torch.Tensor]


def ready_at(layout: Layout) -> dict[str, int]:
    """The bucket where each tensor is whole: its only bucket, or the one of its last piece."""
    return {slot.name: bucket.index for bucket in layout.buckets for slot in bucket.slots}


class Assembler:
    """Gives the whole tensors each gathered bucket completes. A tensor the bucket holds whole is given as it
    is. A chunked one is given once its last piece came: as the source gave it where the source does not
    gather, else copied together from its pieces."""

    def __init__(self) -> None:
        self._partial: dict[str, torch.Tensor] = {}

    def take(self, bucket: Bucket, tensors: Tensors) -> dict[str, torch.Tensor]:
        ready: dict[str, torch.Tensor] = {}
        for slot in bucket.slots:
            source = tensors[slot.name]
            if not slot.is_piece or tuple(source.shape) == slot.shape:
                if slot.part == slot.parts - 1:
                    ready[slot.name] = source
                continue
            whole = self._partial.get(slot.name)
            if whole is None:
                whole = self._partial[slot.name] = torch.empty(slot.shape, dtype=source.dtype, device=source.device)
            size = whole.element_size()
            first = slot.start // size
            flat = whole.view(-1)
            flat[first : first + slot.nbytes // size].copy_(piece_of(source, slot))
            if slot.part == slot.parts - 1:
                ready[slot.name] = self._partial.pop(slot.name)
        return ready


class GatheredWindow:
    """One owner's gathered buckets, shared by the classes' sends.

    ``needs``: per class, the indices of the buckets it will take, in order. ``put``, called by the gathering
    thread, waits while ``depth`` buckets are held. ``take``, called by a class, waits until its bucket is there
    and lets go of the ones it took before. ``done``, called by a class that ended (sent or failed), lets go of
    all it holds or would still take. ``fail`` ends every wait with the reason. Every wait is bounded by
    ``timeout_s``."""

    def __init__(self, needs: Mapping[str, set[int]], depth: int, timeout_s: float) -> None:
        if depth < 1:
            raise ValueError(f"a window holds at least one bucket, not {depth}")
        self._needs = {key: set(indices) for key, indices in needs.items()}
        self._depth, self._timeout_s = depth, timeout_s
        self._held: dict[int, tuple[Tensors, Any, set[str]]] = {}  # index -> (tensors, device point, holders)
        self._cond = threading.Condition()
        self._failed: str | None = None

    def put(self, index: int, tensors: Tensors, point: Any = None) -> None:
        with self._cond:
            if not any(index in indices for indices in self._needs.values()):
                return
            self._wait(lambda: len(self._held) < self._depth, f"room for bucket {index} (a class is slow)")
            # Read who needs it after the wait: a class that ended meanwhile would otherwise hold it for good.
            holders = {key for key, indices in self._needs.items() if index in indices}
            if not holders:
                return
            self._held[index] = (tensors, point, holders)
            self._cond.notify_all()

    def take(self, key: str, index: int) -> tuple[Tensors, Any]:
        with self._cond:
            for earlier in [i for i, (_, _, holders) in self._held.items() if i < index and key in holders]:
                self._let_go(earlier, key)
            if index not in self._needs.get(key, ()):
                raise CkptEngineError(f"class {key[:12]} took bucket {index}, which it was not planned to take")
            self._wait(lambda: index in self._held, f"bucket {index} to be gathered")
            tensors, point, _ = self._held[index]
            return tensors, point

    def done(self, key: str) -> None:
        with self._cond:
            self._needs[key] = set()
            for index in [i for i, (_, _, holders) in self._held.items() if key in holders]:
                self._let_go(index, key)

    def fail(self, reason: str) -> None:
        with self._cond:
            self._failed = self._failed or reason
            self._held.clear()
            self._cond.notify_all()

    def wait_empty(self) -> None:
        """Wait until every class has let go of every bucket it took, i.e. all of it is in their send buffers."""
        with self._cond:
            self._wait(lambda: not self._held and not any(self._needs.values()), "the classes to read their buckets")

    @property
    def held(self) -> int:
        with self._cond:
            return len(self._held)

    def _let_go(self, index: int, key: str) -> None:
        self._needs[key].discard(index)
        holders = self._held[index][2]
        holders.discard(key)
        if not holders:
            del self._held[index]
            self._cond.notify_all()

    def _wait(self, ready, what: str) -> None:
        if not self._cond.wait_for(lambda: self._failed is not None or ready(), self._timeout_s):
            waiting = sorted(key[:12] for key, indices in self._needs.items() if indices)
            raise SyncTimeoutError(f"waited {self._timeout_s:.0f}s for {what} (held: buckets {sorted(self._held)}; "
                                   f"classes still to take theirs: {waiting})")
        if self._failed is not None:
            raise CkptEngineError(self._failed)
