"""How far a cached version's snapshot has got, bucket by bucket: its send reads bucket k as soon as bucket k
is in the cache, while the trainer's thread is still copying the later ones.

The snapshot's thread says each bucket it filled (with a device mark on CUDA/NPU: the copy is queued, not
done) or that it failed; the send's thread waits, bounded, for the bucket it needs next. A failure reaches
the send at the first bucket it had not seen filled, and the send aborts the version there.
"""

from __future__ import annotations

import threading
import time
from typing import Any

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
