"""The receiving side of a version: receives buckets into a staging buffer, recomputes every tensor digest,
compares it with the sender's, and hands the named tensors to ``load`` only when the whole version is
verified. On any mismatch, abort or missing bucket, ``load`` is not called and the reason is reported.

Staging holds one version (the layout's total bytes) and is reused across versions; views handed to
``load`` point into it and are valid only during the call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ckpt_engine.device import comm_empty
from ckpt_engine.errors import CkptEngineError, ProtocolError
from ckpt_engine.group import SyncGroup
from ckpt_engine.hashing import bucket_digests, check_algo, version_digest
from ckpt_engine.layout import Bucket, Layout
from ckpt_engine.protocol import AbortMessage, Ack, VersionHeader, VersionTrailer, decode
from ckpt_engine.tensors import slot_view
from ckpt_engine.wire import Channel, Frame, FrameKind

log = logging.getLogger(__name__)


@dataclass
class VersionPayload:
    """What ``load`` receives: a verified version as named tensor views (aliases included)."""

    version: int
    step: int | None
    mode: str
    version_digest: str
    tensors: dict[str, torch.Tensor]


LoadFn = Callable[[VersionPayload], None]


@dataclass
class ReceiveResult:
    version: int | None
    ok: bool
    reason: str | None = None
    version_digest: str | None = None
    bad_tensors: list[str] = field(default_factory=list)
    loaded: bool = False
    bytes_received: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _Incoming:
    header: VersionHeader
    layout: Layout
    algo: str
    staging: torch.Tensor
    digests: list[int] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)


class _SenderAborted(CkptEngineError):
    pass


class Receiver:
    """Receives versions on a sync group where this process is a receiving rank."""

    def __init__(self, group: SyncGroup, load: LoadFn, *, verify: bool = True) -> None:
        self.group = group
        self.channel = Channel(group)
        if self.channel.is_src:
            raise ProtocolError("rank 0 is the sender of the sync group; receivers have ranks >= 1")
        self.load = load
        self.verify = verify
        self.committed: VersionPayload | None = None
        self._layouts: dict[str, Layout] = {}
        self._staging: torch.Tensor | None = None
        self._views_key: tuple[str, int] | None = None
        self._base_views: dict[str, torch.Tensor] = {}

    def receive(self, begin_timeout_s: float | None = None) -> ReceiveResult | None:
        """Receive one version (None when the sender closed the group). Transfer failures come back as a
        result with ``ok=False`` and a reason; the group is then marked broken if the failure was on the wire."""
        started = time.perf_counter()
        seconds: dict[str, float] = {}
        try:
            frame = self.channel.frame(None, 0, "version begin", timeout_s=begin_timeout_s)
            if frame.kind == FrameKind.CLOSE:
                return None
            incoming = self._begin(frame)
        except _SenderAborted as exc:
            return ReceiveResult(None, False, str(exc))
        except CkptEngineError as exc:
            return ReceiveResult(None, False, self._desynced(exc))
        result = ReceiveResult(incoming.header.version, False)
        try:
            self._receive_buckets(incoming, result, seconds)
            frame = self.channel.frame(None, 0, "version end")
            trailer = decode(VersionTrailer, self._payload_of(frame, FrameKind.END, "version trailer"))
            self._conclude(incoming, trailer, result, seconds)
        except _SenderAborted as exc:
            result.reason = str(exc)
            return self._finish(result, seconds, started)
        except CkptEngineError as exc:
            result.reason = self._desynced(exc)
            return self._finish(result, seconds, started)
        self._acknowledge(result, seconds, started)
        return result

    def _desynced(self, exc: CkptEngineError) -> str:
        """A failure mid-stream leaves this rank out of step with the sender: the group must be rebuilt."""
        reason = f"{type(exc).__name__}: {exc}"
        if self.group.broken is None:
            self.group.broken = reason
        return reason

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

    def _begin(self, frame: Frame) -> _Incoming:
        raw = self._payload_of(frame, FrameKind.BEGIN, "version header")
        header = decode(VersionHeader, raw)
        layout = self._layout(header)
        return _Incoming(header, layout, check_algo(header.digest_algo), self._staging_for(layout))

    def _payload_of(self, frame: Frame, expected: FrameKind, what: str) -> bytes:
        if frame.kind == FrameKind.ABORT:
            raw = self.channel.payload(None, frame.a, "abort reason")
            raise _SenderAborted(f"sender aborted version {frame.version}: {decode(AbortMessage, raw).reason}")
        if frame.kind != expected:
            raise ProtocolError(f"expected {expected.name} frame, got {frame.kind.name}")
        return self.channel.payload(None, frame.a, what)

    def _receive_buckets(self, incoming: _Incoming, result: ReceiveResult, seconds: dict[str, float]) -> None:
        previous: tuple[Bucket, torch.Tensor, list[int]] | None = None
        for bucket in incoming.layout.buckets:
            k = bucket.index
            frame = self.channel.frame(None, len(bucket.slots), f"bucket {k} header")
            if frame.kind != FrameKind.BUCKET:
                self._payload_of(frame, FrameKind.BUCKET, "bucket")
            if frame.a != k or frame.b != bucket.nbytes or frame.c != len(bucket.slots):
                raise ProtocolError(f"bucket {k}: frame says index {frame.a}, {frame.b} bytes, {frame.c} tensors; "
                                    f"layout says {bucket.nbytes} bytes, {len(bucket.slots)} tensors")
            view = incoming.staging[bucket.flat_offset : bucket.flat_offset + bucket.nbytes]
            t0 = time.perf_counter()
            work = self.channel.data(view) if bucket.nbytes else None
            if previous is not None:
                self._check_bucket(incoming, *previous, seconds)  # overlaps with bucket k on the wire
            if work is not None:
                self.channel.wait(work, f"bucket {k} data")
            seconds["recv"] = seconds.get("recv", 0.0) + time.perf_counter() - t0
            result.bytes_received += bucket.nbytes
            previous = (bucket, view, frame.extra)
        if previous is not None:
            self._check_bucket(incoming, *previous, seconds)

    def _check_bucket(self, incoming: _Incoming, bucket: Bucket, view: torch.Tensor, expected: list[int],
                      seconds: dict[str, float]) -> None:
        if not self.verify:
            incoming.digests.extend(expected)
            return
        t0 = time.perf_counter()
        computed = bucket_digests(bucket, view, incoming.algo, incoming.layout.digest).cpu().tolist()  # type: ignore[arg-type]
        for slot, got, want in zip(bucket.slots, computed, expected):
            if got != want:
                incoming.bad.append(slot.name)
        incoming.digests.extend(computed)
        seconds["verify"] = seconds.get("verify", 0.0) + time.perf_counter() - t0

    def _conclude(self, incoming: _Incoming, trailer: VersionTrailer, result: ReceiveResult,
                  seconds: dict[str, float]) -> None:
        header = incoming.header
        digest = version_digest(incoming.algo, incoming.layout.digest, incoming.digests)
        result.version_digest = digest
        result.bad_tensors = incoming.bad
        if trailer.version != header.version:
            result.reason = f"trailer is for version {trailer.version}, header for {header.version}"
            return
        if incoming.bad:
            result.reason = (f"digest mismatch in {len(incoming.bad)} tensor(s): {', '.join(incoming.bad[:8])}"
                             f"{' ...' if len(incoming.bad) > 8 else ''}")
            return
        if digest != trailer.version_digest:
            result.reason = f"version digest {digest} != sender's {trailer.version_digest}"
            return
        t0 = time.perf_counter()
        try:
            self.load(VersionPayload(header.version, header.step, header.mode, digest, self._views(incoming)))
        except Exception as exc:  # the adapter's failure is reported, never swallowed
            result.reason = f"load failed: {type(exc).__name__}: {exc}"
            log.exception("load of version %d failed", header.version)
            return
        finally:
            seconds["load"] = time.perf_counter() - t0
        result.ok = result.loaded = True
        self.committed = VersionPayload(header.version, header.step, header.mode, digest, {})

    def _acknowledge(self, result: ReceiveResult, seconds: dict[str, float], started: float) -> None:
        self._finish(result, seconds, started)
        ack = Ack(version=result.version or 0, rank=self.group.rank, ok=result.ok,
                  version_digest=result.version_digest, reason=result.reason, bad_tensors=result.bad_tensors,
                  seconds=result.seconds)
        try:
            self.channel.exchange_acks(ack, None)
        except CkptEngineError as exc:
            result.ok = False
            result.reason = f"{result.reason or 'loaded'}; acknowledgement failed: {exc}"

    def _finish(self, result: ReceiveResult, seconds: dict[str, float], started: float) -> ReceiveResult:
        seconds["total"] = time.perf_counter() - started
        result.seconds = seconds
        if not result.ok:
            log.warning("version %s not loaded: %s", result.version, result.reason)
        return result

    def _views(self, incoming: _Incoming) -> dict[str, torch.Tensor]:
        """Named views into staging; built once per (layout, staging buffer) and reused across versions."""
        layout, staging = incoming.layout, incoming.staging
        key = (layout.digest, staging.data_ptr())
        if self._views_key != key:
            self._base_views = {s.name: slot_view(staging, s, layout.buckets[s.bucket].flat_offset)
                                for s in layout.slots}
            self._views_key = key
        views = self._base_views
        if incoming.header.aliases:
            views = dict(views)
            for alias, canonical in incoming.header.aliases.items():
                if canonical not in views:
                    raise ProtocolError(f"alias {alias!r} points at unknown tensor {canonical!r}")
                views[alias] = views[canonical]
        return views

    def _layout(self, header: VersionHeader) -> Layout:
        layout = self._layouts.get(header.layout_digest)
        if layout is not None:
            return layout
        if header.layout is None:
            raise ProtocolError(f"version {header.version} names layout {header.layout_digest}, which this "
                                "receiver was never sent")
        if header.layout.digest != header.layout_digest:
            raise ProtocolError("header's layout_digest differs from its layout's digest")
        layout = header.layout.to_layout()
        self._layouts = {layout.digest: layout}  # keep only the newest: layouts change rarely
        return layout

    def _staging_for(self, layout: Layout) -> torch.Tensor:
        need = max(layout.total_bytes, 1)
        if self._staging is None or self._staging.numel() < need:
            self._staging = None
            self._staging = comm_empty(need, self.group.device)
        return self._staging
