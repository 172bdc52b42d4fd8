"""The receiving side of a version on the sync group (collective transport). Buckets land where the version's
staging puts them (receive/staging.py). Every tensor digest is recomputed and compared with the sender's, and
the named tensors reach ``load`` only once verified: the whole version at once, or bucket by bucket to a load
that takes a stream. On any mismatch, abort or missing bucket, nothing more reaches ``load`` and the reason is
reported.

Staging buffers are reused across versions. Views handed to ``load`` point into them, so they are valid only
during the call, or, streamed, until the next tensor is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ckpt_engine.codec import decode
from ckpt_engine.errors import CkptEngineError, ProtocolError, StagingUnavailable
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.plan.modes import DEFAULT_STAGING, Staging
from ckpt_engine.receive.assembly import (
    Incoming,
    LoadFn,
    ReceiveResult,
    SenderAborted,
    VersionAssembler,
    VersionPayload,
)
from ckpt_engine.receive.streamed import receive_streamed
from ckpt_engine.transport.framing import Channel, Frame, FrameKind
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.messages import AbortMessage, VersionHeader, VersionTrailer

log = logging.getLogger(__name__)
__all__ = ["LoadFn", "ReceiveResult", "Receiver", "VersionPayload"]


class Receiver:
    """Receives versions on a sync group where this process is a receiving rank. Versions several trainer ranks
    own come on one group per owner: ``groups[r]`` is owner r's, and owner 0 also sends the header and trailer."""

    def __init__(self, group: SyncGroup | Sequence[SyncGroup], load: LoadFn, *, verify: bool = True,
                 staging: Staging = DEFAULT_STAGING, streams: bool = False,
                 assembler: VersionAssembler | None = None) -> None:
        """``staging``: see receive/staging.py. ``streams``: ``load`` iterates ``payload.items()``, so it can
        be given a streamed version. ``assembler``: share one across receivers of the same model (another group
        generation, or the same-host path) so that the version this process holds, and its staging, carry over."""
        self.groups = [group] if isinstance(group, SyncGroup) else list(group)
        self.group = self.groups[0]
        self.channels = [Channel(g) for g in self.groups]
        self.channel = self.channels[0]
        if any(channel.is_src for channel in self.channels):
            raise ProtocolError("rank 0 is the sender of a sync group; receivers have ranks >= 1")
        self.assembler = assembler or VersionAssembler(self.group.device, load, verify=verify, staging=staging,
                                                       streams=streams)

    @property
    def committed(self) -> VersionPayload | None:
        return self.assembler.committed

    def receive(self, begin_timeout_s: float | None = None,
                abandon: Callable[[], str | None] | None = None) -> ReceiveResult | None:
        """Receive one version; None when the sender closed the group. Transfer failures come back as a result
        with ``ok=False`` and a reason, and a failure on the wire marks the group broken."""
        header: VersionHeader | None = None
        try:
            # The sender rings before its first frame, maybe at its next step boundary long after the rendezvous.
            # Waiting for that in the store keeps the collective's own wait as short as any other's.
            why = self.group.await_ring(begin_timeout_s if begin_timeout_s is not None else self.group.timeout_s,
                                        abandon)
            if why is not None:  # ``abandon`` gave a reason before any version began (see SyncGroup.await_ring)
                return ReceiveResult(None, False, f"stopped waiting for the version: {why}")
            frame = self.channel.frame(None, 0, "version begin")
            if frame.kind == FrameKind.CLOSE:
                self._closed_by_the_others(begin_timeout_s)
                return None
            header = decode(VersionHeader, self._payload_of(frame, FrameKind.BEGIN, "version header"))
            incoming = self.assembler.begin(header)
            feed = _Feed(self, self._owners(header, incoming))
        except StagingUnavailable as exc:
            return self._drain(header, exc)  # type: ignore[arg-type]
        except SenderAborted as exc:
            return ReceiveResult(None, False, str(exc))
        except CkptEngineError as exc:
            return ReceiveResult(None, False, self._desynced(exc))
        if incoming.choice.mode == "stream":
            result = receive_streamed(self.assembler, incoming, feed, self._desynced)
        else:
            result = self._receive_whole(incoming, feed)
        if feed.ended:  # after an abort or a broken wire nobody exchanges acknowledgements
            self._acknowledge(result)
        return result

    def _receive_whole(self, incoming: Incoming, feed: _Feed) -> ReceiveResult:
        try:
            for _ in self.assembler.flow(incoming, feed):
                pass
            trailer = feed.trailer()
        except SenderAborted as exc:
            feed.follow_the_rest(incoming.layout)
            return self.assembler.finish(incoming, str(exc))
        except CkptEngineError as exc:
            return self.assembler.finish(incoming, self._desynced(exc))
        return self.assembler.conclude(incoming, trailer)

    def _closed_by_the_others(self, timeout_s: float | None) -> None:
        """The lead closed: take the other owners' CLOSE too, so they are not left announcing it to a receiver
        that went away. Each is waited for at most ``timeout_s``; whatever else comes is dropped."""
        for channel in self.channels[1:]:
            try:
                channel.group.await_ring(min(timeout_s or 10.0, 10.0))
                channel.frame(None, 0, "close", timeout_s=min(timeout_s or 10.0, 10.0))
            except CkptEngineError as exc:
                log.info("owner group %s did not close cleanly: %s", channel.group.name, exc)

    def _owners(self, header: VersionHeader, incoming: Incoming) -> list[int]:
        """The owner of each bucket: rank 0 for all, or as the header says, checked against what this receiver
        can follow."""
        buckets = len(incoming.layout.buckets)
        if header.owners is None:
            return [0] * buckets
        if header.owner_ranks > len(self.channels):
            raise ProtocolError(f"version {header.version} has {header.owner_ranks} owners; this receiver joined "
                                f"the groups of {len(self.channels)}")
        if len(header.owners) != buckets or any(not 0 <= o < header.owner_ranks for o in header.owners):
            raise ProtocolError(f"version {header.version}: owners do not fit its {buckets} buckets")
        return list(header.owners)

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
        """For a receiver that cannot hold the version: take part in the rest of it with one bucket of scratch,
        so the sender and the other receivers go on, then acknowledge the failure. ``unable`` makes it leave the
        quorum."""
        result = ReceiveResult(header.version, False, str(problem), unable=str(problem))
        try:
            layout = self.assembler.layout_of(header)
            owners = header.owners or [0] * len(layout.buckets)
            scratch = torch.empty(max(layout.max_bucket_bytes, 1), dtype=torch.uint8, device=self.channel._device)
            for bucket in layout.buckets:
                channel = self.channels[owners[bucket.index]]
                frame = channel.frame(None, len(bucket.slots), f"bucket {bucket.index} header")
                if frame.kind != FrameKind.BUCKET:
                    self._payload_of(frame, FrameKind.BUCKET, "bucket", channel)
                if bucket.nbytes:
                    channel.wait(channel.data(scratch[: bucket.nbytes]), f"bucket {bucket.index} data")
            frame = self.channel.frame(None, 0, "version end")
            self._payload_of(frame, FrameKind.END, "version trailer")
        except SenderAborted:
            return result
        except (CkptEngineError, RuntimeError, MemoryError) as exc:
            result.reason = f"{problem}; and could not follow the rest of the version: {self._desynced(exc)}"
            return result
        self._acknowledge(result)
        return result

    def _desynced(self, exc: BaseException) -> str:
        """Mark the groups broken, since a failure mid-stream leaves this rank out of step with the senders.
        Returns the reason."""
        reason = f"{type(exc).__name__}: {exc}"
        for group in self.groups:
            if group.broken is None:
                group.broken = reason
        return reason

    def _payload_of(self, frame: Frame, expected: FrameKind, what: str, channel: Channel | None = None) -> bytes:
        channel = channel or self.channel
        if frame.kind == FrameKind.ABORT:
            raw = channel.payload(None, frame.a, "abort reason")
            raise SenderAborted(f"sender aborted version {frame.version}: {decode(AbortMessage, raw).reason}")
        if frame.kind != expected:
            raise ProtocolError(f"expected {expected.name} frame, got {frame.kind.name}")
        return channel.payload(None, frame.a, what)

    def _acknowledge(self, result: ReceiveResult) -> None:
        try:
            self.channel.exchange_acks(result.ack(self.group.rank), None)
        except CkptEngineError as exc:
            result.ok = False
            result.reason = f"{result.reason or 'loaded'}; acknowledgement failed: {exc}"


class _Feed:
    """The buckets of one version on the owners' groups (receive/assembly.py's Feed), each from its owner. An
    owner that aborts sends nothing more of the version; the others go on to its end."""

    def __init__(self, receiver: Receiver, owners: list[int]) -> None:
        self.receiver, self.owners = receiver, owners
        self.parallel = len(set(owners))  # whole staging: one bucket of each owner on the wire at once
        self.started: set[int] = set()
        self.aborted: dict[int, str] = {}
        self.ended = False  # the version's end was read

    def start(self, bucket: Bucket, into: torch.Tensor) -> Callable[[], list[int]] | None:
        k, owner = bucket.index, self.owners[bucket.index]
        if owner in self.aborted:
            if owner == 0:  # asked again, e.g. by a stream draining the rest: nothing more comes from the lead
                raise SenderAborted(self.aborted[0])
            return None
        self.started.add(k)
        channel = self.receiver.channels[owner]
        frame = channel.frame(None, len(bucket.slots), f"bucket {k} header")
        if frame.kind != FrameKind.BUCKET:
            try:
                self.receiver._payload_of(frame, FrameKind.BUCKET, "bucket", channel)
            except SenderAborted as exc:
                self.aborted[owner] = str(exc)
                if owner == 0:  # the lead aborted: nothing more comes on its group for this version
                    raise
                return None
        if frame.a != k or frame.b != bucket.nbytes or frame.c != len(bucket.slots):
            raise ProtocolError(f"bucket {k}: frame says index {frame.a}, {frame.b} bytes, {frame.c} tensors; "
                                f"layout says {bucket.nbytes} bytes, {len(bucket.slots)} tensors")
        work = channel.data(into) if bucket.nbytes else None

        def wait() -> list[int]:
            if work is not None:
                channel.wait(work, f"bucket {k} data")
            return frame.extra

        return wait

    def follow_the_rest(self, layout: Layout) -> None:
        """After the lead aborted the version part way, take the other owners' remaining buckets into scratch.
        They hear of the abort only in their vote after their last bucket, and this lets them reach that vote now
        rather than at their group's timeout. Best effort: a failure here leaves the groups to be rebuilt."""
        rest = [b for b in layout.buckets if b.index not in self.started and self.owners[b.index] != 0]
        if not rest:
            return
        scratch = torch.empty(max(b.nbytes for b in rest) or 1, dtype=torch.uint8,
                              device=self.receiver.channel._device)
        try:
            for bucket in rest:
                wait = self.start(bucket, scratch[: bucket.nbytes])  # None when that owner aborted too
                if wait is not None:
                    wait()
        except CkptEngineError as exc:
            self.receiver._desynced(exc)

    def trailer(self) -> VersionTrailer:
        if 0 in self.aborted:
            raise SenderAborted(self.aborted[0])
        frame = self.receiver.channel.frame(None, 0, "version end")
        trailer = decode(VersionTrailer, self.receiver._payload_of(frame, FrameKind.END, "version trailer"))
        if self.aborted:  # another owner aborted, so the version is not whole even though the lead ended it
            raise ProtocolError(f"owner(s) {sorted(self.aborted)} aborted, yet the version ended: {self.aborted}")
        self.ended = True
        return trailer
