"""How far a cached version's snapshot has got, bucket by bucket: its send reads bucket k as soon as bucket k
is in the cache, while the trainer's thread is still copying the later ones.

The snapshot's thread says each bucket it filled (with a device mark on CUDA/NPU: the copy is queued, not
done) or that it failed; the send's thread waits, bounded, for the bucket it needs next. A failure reaches
the send at the first bucket it had not seen filled, and the send aborts the version there.

While the snapshot holds the training loop, the live tensors are as good as the cache (:class:`LiveReads`): a
send that fills device slots reads its buckets from them (device to device) instead of waiting for each
bucket's device→host copy and copying it back to the device.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckpt_engine.errors import CkptEngineError


class SnapshotFailed(CkptEngineError):
    """The snapshot of a version stopped part way: the buckets after the last filled one never came."""


class FillProgress:
    """Buckets filled so far, in order, by one thread; read by another."""

    def __init__(self, version: int, buckets: int) -> None:
        self.version, self.buckets = version, buckets
        self._marks: list[Any] = []
        self._error: str | None = None
        self._changed = threading.Condition()

    @property
    def done(self) -> bool:
        with self._changed:
            return len(self._marks) == self.buckets

    def filled(self, index: int, mark: Any | None) -> None:
        """Bucket ``index`` is in the cache (``mark``: where its device copies end, None on CPU)."""
        with self._changed:
            if index != len(self._marks):
                raise CkptEngineError(f"version {self.version}: bucket {index} filled out of order "
                                      f"(next is {len(self._marks)})")
            self._marks.append(mark)
            self._changed.notify_all()

    @property
    def error(self) -> str | None:
        """Why the snapshot stopped part way (None: it did not, or not yet)."""
        with self._changed:
            return self._error

    def failed(self, reason: str) -> None:
        with self._changed:
            if self._error is None and len(self._marks) < self.buckets:
                self._error = reason
            self._changed.notify_all()

    def wait(self, index: int, timeout_s: float) -> Any | None:
        """The mark of bucket ``index`` once it is filled; SnapshotFailed if the snapshot failed first or took
        longer than ``timeout_s`` for it."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self._marks) <= index:
                if self._error is not None:
                    raise SnapshotFailed(f"the snapshot of version {self.version} failed at bucket "
                                         f"{len(self._marks)}: {self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SnapshotFailed(f"the snapshot of version {self.version} did not fill bucket {index} "
                                         f"within {timeout_s:g} s (it has {len(self._marks)} of {self.buckets})")
                self._changed.wait(left)
            return self._marks[index]


class LiveReads:
    """The live tensors of a version whose snapshot holds the training loop, lent to its send: the snapshot's
    thread lends them before its first copy and takes them back before it lets the loop go on (:meth:`end`),
    waiting for the send's reads it had queued by then. Every read runs under the lock, so none is queued once
    they are taken back."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], ready: Any | None) -> None:
        """``ready``: a device mark on the training loop's stream after which the tensors hold the version (the
        send's stream waits for it before its first read; None on CPU)."""
        self._tensors: Mapping[str, torch.Tensor] | None = tensors
        self.ready = ready
        self._last: Any | None = None  # the mark after the send's latest read
        self._lock = threading.Lock()
        self.reads = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[Mapping[str, torch.Tensor] | None]:
        """The tensors to read from (None once the loop went on: read the cache); the caller queues its copies
        inside and says where they end with :meth:`read`."""
        with self._lock:
            yield self._tensors

    def read(self, mark: Any | None) -> None:
        """Called inside :meth:`reading`: the copies just queued end at ``mark``."""
        self._last = mark
        self.reads += 1

    def end(self) -> Any | None:
        """No more reads from now on; returns the mark the caller must wait for before the tensors change."""
        with self._lock:
            self._tensors = None
            return self._last
