"""A version being sent: its outcome (``TransferResult``) and the handle the caller holds (``Transfer``).

``Transfer.params_released`` is set as soon as the source tensors are no longer read: right away for a cached
version (the cache holds the bytes), after the last bucket has been filled for a live (``bypass_cpu``) one.
``on_done`` callbacks run on the thread that ends the transfer (no thread waits for one)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.modes import Mode
from ckpt_engine.plan.owners import Owners
from ckpt_engine.ranks import QuorumRank
from ckpt_engine.transport.messages import Ack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WirePlan:
    """What went on the wire of a version, as its header says: the layout (a sparse version's changes, a class's
    pieces), its owners, tied names, step and the header's other fields (a sparse version's base and whole-model
    digests). A pull offer of the same bytes describes them so."""

    layout: Layout
    owners: Owners
    aliases: Mapping[str, str]
    step: int | None
    extra: Mapping[str, Any]


@dataclass(frozen=True)
class Kept:
    """Where a send also keeps bytes of the buckets it sends, for pullers that read them from there: ``spans``,
    per bucket of its layout, (offset in the bucket, bytes, offset in ``memory``) (plan/pull_reads.py
    ``kept_spans``: a class's column pieces; ``whole_spans``: every bucket of a bypass_cpu share)."""

    memory: torch.Tensor
    spans: Sequence[Sequence[tuple[int, int, int]]]

    def copy(self, index: int, bucket: torch.Tensor) -> None:
        """Keep bucket ``index``'s spans of ``bucket``, its bytes as they were digested."""
        for offset, nbytes, at in self.spans[index]:
            self.memory[at : at + nbytes].copy_(bucket[offset : offset + nbytes])


# What a send keeps, from its layout and owners (a sparse send's are known only once it found its changes).
KeepFor = Callable[[Layout, Owners], Kept]


@dataclass
class TransferResult:
    version: int
    mode: Mode
    ok: bool
    reason: str | None
    version_digest: str | None
    receivers: list[Ack]
    bytes_sent: int  # by this rank (an owner's share of the version)
    buckets: int
    tensors: int
    seconds: dict[str, float] = field(default_factory=dict)
    finished_at: float = 0.0  # time.perf_counter() when every acknowledgement was in (or the transfer failed)
    tensors_skipped: int = 0  # sparse: unchanged tensors not sent
    bytes_skipped: int = 0  # sparse: their bytes
    base_version: int | None = None  # sparse: the version the receivers held
    absent_ranks: list[QuorumRank] = field(default_factory=list)  # receivers that never joined the rendezvous
    rendezvous_failed: bool = False  # the version's sync group did not form (absent_ranks: whom it names)
    version_bytes: int = 0  # of the whole version on the wire (every owner's share), once all were sent
    # a sharded version: each class's outcome (key, ok, reason, version_digest of its pieces, bytes)
    classes: list[dict] = field(default_factory=list)
    wire_plan: WirePlan | None = None  # the lead's: what it put on the wire (a pull offer after it describes it)

    @property
    def committed_ranks(self) -> list[int]:
        return [ack.rank for ack in self.receivers if ack.ok]


class Transfer:
    """Handle of one version being sent."""

    def __init__(self, version: int, mode: Mode) -> None:
        self.version = version
        self.mode = mode
        self.gathered_bytes = 0  # bytes of full tensors this rank assembled for it (gathers of a sharded model)
        self.params_released = threading.Event()
        self._done = threading.Event()
        self._result: TransferResult | None = None
        self._callbacks: list[Callable[[TransferResult], None]] = []
        self._callbacks_lock = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    def on_done(self, callback: Callable[[TransferResult], None]) -> None:
        """Call ``callback(result)`` once the transfer has ended: at once if it has, else on the thread that ends
        it (no thread waits for it). A callback that raises is logged; the others still run."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        _call(callback, self.result(0))

    def result(self, timeout_s: float | None = None) -> TransferResult:
        if not self._done.wait(timeout_s):
            raise SyncTimeoutError(f"version {self.version} still in transfer after {timeout_s}s")
        if self._result is None:
            raise CkptEngineError(f"version {self.version}: transfer ended without a result")
        return self._result

    def _finish(self, result: TransferResult) -> None:
        """Ends the transfer: its callbacks run first, so whoever waits for ``result()`` finds them done."""
        self._result = result
        self.params_released.set()
        while True:
            with self._callbacks_lock:
                callbacks, self._callbacks = self._callbacks, []
                if not callbacks:
                    self._done.set()
                    return
            for callback in callbacks:
                _call(callback, result)


def _call(callback: Callable[[TransferResult], None], result: TransferResult) -> None:
    try:
        callback(result)
    except Exception:  # a consumer of the outcome (e.g. the report to the daemon) must not stop the others
        log.exception("a callback on the outcome of version %d failed", result.version)
