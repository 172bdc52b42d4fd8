"""The receiving side of a version on the sync group (collective transport): receives buckets into a
staging buffer, recomputes every tensor digest, compares it with the sender's, and hands the named tensors
to ``load`` only when the whole version is verified. On any mismatch, abort or missing bucket, ``load`` is
not called and the reason is reported.

Staging holds one version (the layout's total bytes) and is reused across versions; views handed to
``load`` point into it and are valid only during the call.
"""

from __future__ import annotations

import logging
import time

import torch

from ckpt_engine.errors import CkptEngineError, ProtocolError, StagingUnavailable
from ckpt_engine.receive.assembly import (
    Incoming,
    LoadFn,
    ReceiveResult,
    SenderAborted,
    VersionAssembler,
    VersionPayload,
)
from ckpt_engine.transport.framing import Channel, Frame, FrameKind
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.messages import AbortMessage, VersionHeader, VersionTrailer, decode

log = logging.getLogger(__name__)
__all__ = ["LoadFn", "ReceiveResult", "Receiver", "VersionPayload"]


class Receiver:
    """Receives versions on a sync group where this process is a receiving rank."""

    def __init__(self, group: SyncGroup, load: LoadFn, *, verify: bool = True,
                 assembler: VersionAssembler | None = None) -> None:
        """``assembler``: share one across receivers of the same model (another group generation, or the
        same-host path) so the version this process holds, and its staging, carry over."""
        self.group = group
        self.channel = Channel(group)
        if self.channel.is_src:
            raise ProtocolError("rank 0 is the sender of the sync group; receivers have ranks >= 1")
        self.assembler = assembler or VersionAssembler(group.device, load, verify=verify)

    @property
    def committed(self) -> VersionPayload | None:
        return self.assembler.committed

    def receive(self, begin_timeout_s: float | None = None) -> ReceiveResult | None:
        """Receive one version (None when the sender closed the group). Transfer failures come back as a
        result with ``ok=False`` and a reason; the group is then marked broken if the failure was on the wire."""
        header: VersionHeader | None = None
        try:
            frame = self.channel.frame(None, 0, "version begin", timeout_s=begin_timeout_s)
            if frame.kind == FrameKind.CLOSE:
                return None
            header = decode(VersionHeader, self._payload_of(frame, FrameKind.BEGIN, "version header"))
            incoming = self.assembler.begin(header)
        except StagingUnavailable as exc:
            return self._drain(header, exc)  # type: ignore[arg-type]
        except SenderAborted as exc:
            return ReceiveResult(None, False, str(exc))
        except CkptEngineError as exc:
            return ReceiveResult(None, False, self._desynced(exc))
        try:
            self._receive_buckets(incoming)
            frame = self.channel.frame(None, 0, "version end")
            trailer = decode(VersionTrailer, self._payload_of(frame, FrameKind.END, "version trailer"))
        except SenderAborted as exc:
            return self.assembler.finish(incoming, str(exc))
        except CkptEngineError as exc:
            return self.assembler.finish(incoming, self._desynced(exc))
        result = self.assembler.conclude(incoming, trailer)
        self._acknowledge(result)
        return result

    def serve(self, max_versions: int | None = None, begin_timeout_s: float | None = None) -> list[ReceiveResult]:
        """Receive versions until the sender closes the group, ``max_versions`` is reached or the group breaks."""
        results: list[ReceiveResult] = []
        while max_versions is None or len(results) < max_versions:
            result = self.receive(begin_timeout_s)
            if result is None:
                break
            results.append(result)
            if self.group.broken is not None:
                break
        return results

    def _drain(self, header: VersionHeader, problem: StagingUnavailable) -> ReceiveResult:
        """This receiver cannot hold the version: take part in the rest of it with one bucket of scratch, so the
        sender and the other receivers go on, then acknowledge the failure (``unable``: it leaves the quorum)."""
        result = ReceiveResult(header.version, False, str(problem), unable=str(problem))
        try:
            layout = self.assembler.layout_of(header)
            scratch = torch.empty(max(layout.max_bucket_bytes, 1), dtype=torch.uint8, device=self.channel._device)
            for bucket in layout.buckets:
                frame = self.channel.frame(None, len(bucket.slots), f"bucket {bucket.index} header")
                if frame.kind != FrameKind.BUCKET:
                    self._payload_of(frame, FrameKind.BUCKET, "bucket")
                if bucket.nbytes:
                    self.channel.wait(self.channel.data(scratch[: bucket.nbytes]), f"bucket {bucket.index} data")
            frame = self.channel.frame(None, 0, "version end")
            self._payload_of(frame, FrameKind.END, "version trailer")
        except SenderAborted:
            return result
        except (CkptEngineError, RuntimeError, MemoryError) as exc:
            result.reason = f"{problem}; and could not follow the rest of the version: {self._desynced(exc)}"
            return result
        self._acknowledge(result)
        return result

    def _desynced(self, exc: Exception) -> str:
        """A failure mid-stream leaves this rank out of step with the sender: the group must be rebuilt."""
        reason = f"{type(exc).__name__}: {exc}"
        if self.group.broken is None:
            self.group.broken = reason
        return reason

    def _payload_of(self, frame: Frame, expected: FrameKind, what: str) -> bytes:
        if frame.kind == FrameKind.ABORT:
            raw = self.channel.payload(None, frame.a, "abort reason")
            raise SenderAborted(f"sender aborted version {frame.version}: {decode(AbortMessage, raw).reason}")
        if frame.kind != expected:
            raise ProtocolError(f"expected {expected.name} frame, got {frame.kind.name}")
        return self.channel.payload(None, frame.a, what)

    def _receive_buckets(self, incoming: Incoming) -> None:
        previous = None
        for bucket in incoming.layout.buckets:
            k = bucket.index
            frame = self.channel.frame(None, len(bucket.slots), f"bucket {k} header")
            if frame.kind != FrameKind.BUCKET:
                self._payload_of(frame, FrameKind.BUCKET, "bucket")
            if frame.a != k or frame.b != bucket.nbytes or frame.c != len(bucket.slots):
                raise ProtocolError(f"bucket {k}: frame says index {frame.a}, {frame.b} bytes, {frame.c} tensors; "
                                    f"layout says {bucket.nbytes} bytes, {len(bucket.slots)} tensors")
            t0 = time.perf_counter()
            work = self.channel.data(incoming.bucket_view(bucket)) if bucket.nbytes else None
            if previous is not None:
                self.assembler.check_bucket(incoming, *previous)  # overlaps with bucket k on the wire
            if work is not None:
                self.channel.wait(work, f"bucket {k} data")
            incoming.add_seconds("recv", time.perf_counter() - t0)
            incoming.result.bytes_received += bucket.nbytes
            previous = (bucket, frame.extra)
        if previous is not None:
            self.assembler.check_bucket(incoming, *previous)

    def _acknowledge(self, result: ReceiveResult) -> None:
        try:
            self.channel.exchange_acks(result.ack(self.group.rank), None)
        except CkptEngineError as exc:
            result.ok = False
            result.reason = f"{result.reason or 'loaded'}; acknowledgement failed: {exc}"
