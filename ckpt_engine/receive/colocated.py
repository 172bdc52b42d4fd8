"""Colocated receiver: maps the sender's shared slots once, then per bucket copies the announced slot into
its staging buffer and releases the slot at once, so the sender can refill it. The copy is verified while the
next bucket is prepared. The checks and the whole-version rule are the collective receiver's."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckpt_engine.codec import decode
from ckpt_engine.device import DeviceInfo, stream_synchronize
from ckpt_engine.errors import CkptEngineError, ProtocolError, StagingUnavailable, SyncTimeoutError
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.receive.assembly import Incoming, LoadFn, ReceiveResult, SenderAborted, VersionAssembler
from ckpt_engine.receive.streamed import receive_streamed
from ckpt_engine.transport.messages import VersionHeader, VersionTrailer
from ckpt_engine.transport.same_host import IPC_PROTO, FramedSocket, PeerGone, abstract_address, map_slot

log = logging.getLogger(__name__)
_ABANDON_CHECK_S = 0.1


class BucketNotice(BaseModel):
    """Per-bucket metadata. ``seq``, ``slot``, ``index`` and ``digests`` are required; the rest is optional
    and checked against the layout when present, so an older sender that omits them still works."""

    model_config = ConfigDict(extra="ignore")
    seq: int
    index: int = Field(ge=0)
    digests: list[int]
    slot: int = Field(0, ge=0, le=1)
    in_place: bool = False  # the bytes are already in the shared buffer named at begin, so nothing is copied
    nbytes: int | None = None
    names: list[str] | None = None


class IpcReceiver:
    def __init__(self, name: str, agent_id: str, rank: int, load: LoadFn, *, device: DeviceInfo,
                 verify: bool = True, timeout_s: float = 60.0, connect_timeout_s: float = 30.0,
                 assembler: VersionAssembler | None = None) -> None:
        self.agent_id, self.rank, self.timeout_s = agent_id, rank, timeout_s
        self.assembler = assembler or VersionAssembler(device, load, verify=verify)
        self.device = device
        self.slots: dict[int, torch.Tensor] = {}  # the sender's two bucket slots
        self.buffers: dict[int, torch.Tensor] = {}  # the sender's shareable cache buffers (zero-copy versions)
        self.channel = FramedSocket(_connect(name, connect_timeout_s))
        self.channel.send({"type": "hello", "agent_id": agent_id, "rank": rank, "proto": IPC_PROTO})
        self.broken: str | None = None

    def receive(self, begin_timeout_s: float | None = None,
                abandon: Callable[[], str | None] | None = None) -> ReceiveResult | None:
        """Receive one version; None when the sender closed the channel. Failures come back with ok=False.
        ``abandon()`` is asked while no version has begun. A reason it returns means the version will not come
        (e.g. its daemon is gone) and ends the wait. Once the first frame arrived, the version is seen through."""
        try:
            reason = self._await_first_frame(begin_timeout_s, abandon)
            if reason is not None:
                return ReceiveResult(None, False, f"stopped waiting for the version: {reason}")
            message = self._next(begin_timeout_s, {"begin", "abort", "close"})
            if message["type"] == "close":
                self.broken = "the sender closed the channel"  # the next version needs a new connection
                return None
            if message["type"] == "abort":
                return ReceiveResult(None, False, f"sender aborted the version: {_reason(message)}")
            buffer = message.get("buffer")
            shared = self._buffer(buffer) if buffer is not None else None
            header = decode(VersionHeader, message["header"])
            incoming = self.assembler.begin(header, staging=shared)
        except StagingUnavailable as exc:
            return self._drain(header, exc)
        except PeerGone:
            self.broken = "the sender is gone"  # e.g. it dropped this receiver as too slow: reconnect next time
            return None
        except CkptEngineError as exc:
            return ReceiveResult(None, False, self._broke(exc))
        feed = _Feed(self, incoming)
        if incoming.choice.mode == "stream":
            result = receive_streamed(self.assembler, incoming, feed, self._broke)
        else:
            result = self._receive_whole(incoming, feed)
        if feed.ended:  # after an abort or a broken channel there is nobody to acknowledge to
            try:
                self.channel.send({"type": "ack", "ack": result.ack(self.rank).model_dump()})
            except CkptEngineError as exc:
                result.ok, result.reason = False, f"{result.reason or 'loaded'}; acknowledgement failed: {exc}"
        return result

    def _receive_whole(self, incoming: Incoming, feed: _Feed) -> ReceiveResult:
        try:
            for _ in self.assembler.flow(incoming, feed):
                pass
            trailer = feed.trailer()
        except CkptEngineError as exc:
            reason = str(exc) if isinstance(exc, _Aborted) else self._broke(exc)
            return self.assembler.finish(incoming, reason)
        return self.assembler.conclude(incoming, trailer)

    def close(self) -> None:
        self.channel.close()

    def _drain(self, header: VersionHeader, problem: StagingUnavailable) -> ReceiveResult:
        """For a receiver that cannot hold the version: release every bucket as it is announced, so the sender
        and the other receivers go on, then acknowledge the failure. ``unable`` makes it leave the quorum for a
        while."""
        result = ReceiveResult(header.version, False, str(problem), unable=str(problem))
        try:
            layout = self.assembler.layout_of(header)
            for _ in layout.buckets:
                message = self._next(self.timeout_s, {"bucket", "abort"})
                if message["type"] == "abort":
                    return result
                self.channel.send({"type": "release", "seq": _notice(message).seq})
            if self._next(self.timeout_s, {"end", "abort"})["type"] == "abort":
                return result
            self.channel.send({"type": "ack", "ack": result.ack(self.rank).model_dump()})
        except CkptEngineError as exc:
            result.reason = f"{problem}; and could not follow the rest of the version: {self._broke(exc)}"
        return result

    def _await_first_frame(self, timeout_s: float | None, abandon: Callable[[], str | None] | None) -> str | None:
        """Wait in short slices until the sender says something, asking ``abandon`` in between. Returns its
        reason, or None once a frame is there for the caller to read."""
        if abandon is None:
            return None
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while not self.channel.readable(min(_ABANDON_CHECK_S, deadline - time.monotonic())):
            reason = abandon()
            if reason is not None:
                return reason
            if time.monotonic() >= deadline:
                raise SyncTimeoutError("IPC peer sent nothing within the timeout")
        return None

    def _next(self, timeout_s: float | None, expected: set[str]) -> dict[str, Any]:
        """The next frame of an expected type. Slot maps are handled on the way."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        while True:
            message, fds = self.channel.recv(limit)
            if message["type"] == "map":
                self._map(message, fds)
                continue
            if message["type"] == "map_buffer":
                description = message.get("buffer") or {}
                self.buffers[int(description.get("index", -1))] = map_slot(description, fds[0] if fds else None,
                                                                         self.device)
                self.channel.send({"type": "mapped"})
                continue
            if message["type"] not in expected:
                raise ProtocolError(f"expected one of {sorted(expected)}, got {message['type']!r}")
            return message

    def _map(self, message: dict[str, Any], fds: list[int]) -> None:
        slots = message.get("slots")
        if not isinstance(slots, list):
            raise ProtocolError("a map frame needs its slots")
        memfds = iter(fds)
        self.slots = {}
        for description in slots:
            fd = next(memfds, None) if description.get("kind", "memfd") == "memfd" else None
            self.slots[int(description["index"])] = map_slot(description, fd, self.device)
        self.channel.send({"type": "mapped", "generation": message.get("generation")})

    def _buffer(self, index: Any) -> torch.Tensor:
        buffer = self.buffers.get(index) if isinstance(index, int) else None
        if buffer is None:
            raise ProtocolError(f"version announced in shared buffer {index!r}, which was never mapped")
        return buffer

    def _slot(self, index: int) -> torch.Tensor:
        slot = self.slots.get(index)
        if slot is None:
            raise ProtocolError(f"bucket announced in slot {index}, which was never mapped")
        return slot

    def _broke(self, exc: BaseException) -> str:
        self.broken = f"{type(exc).__name__}: {exc}"
        return self.broken


class _Aborted(SenderAborted):
    pass


class _Feed:
    """The buckets of one version as the hub announces them (receive/assembly.py's Feed). Each is copied out of
    its shared slot, unless the version is read in place, and the slot is released at once so the sender can
    refill it."""

    parallel = 1  # one bucket at a time through the channel

    def __init__(self, receiver: IpcReceiver, incoming: Incoming) -> None:
        self.receiver, self.version = receiver, incoming.header.version
        self.ended = False  # the version's end was read

    def start(self, bucket: Bucket, into: torch.Tensor) -> Callable[[], list[int]]:
        receiver = self.receiver
        message = receiver._next(receiver.timeout_s, {"bucket", "abort"})
        if message["type"] == "abort":
            raise _Aborted(f"sender aborted version {self.version}: {_reason(message)}")
        notice = _notice(message)
        if notice.index != bucket.index or (notice.nbytes is not None and notice.nbytes != bucket.nbytes) or (
                notice.names is not None and notice.names != [s.name for s in bucket.slots]):
            raise ProtocolError(f"bucket {bucket.index}: notice for index {notice.index} does not match the layout")
        if bucket.nbytes and not notice.in_place:
            into.copy_(receiver._slot(notice.slot)[: bucket.nbytes])
            # A device copy is only queued: the sender may refill the slot as soon as it is released.
            stream_synchronize(receiver.device)
        receiver.channel.send({"type": "release", "seq": notice.seq})
        return lambda: notice.digests

    def follow_the_rest(self, layout: Layout) -> None:
        pass  # there is one sender, and after its abort nothing more comes

    def trailer(self) -> VersionTrailer:
        message = self.receiver._next(self.receiver.timeout_s, {"end", "abort"})
        if message["type"] == "abort":
            raise _Aborted(f"sender aborted version {self.version}: {_reason(message)}")
        self.ended = True
        return decode(VersionTrailer, message["trailer"])


def _notice(message: dict[str, Any]) -> BucketNotice:
    try:
        return BucketNotice.model_validate(message)
    except ValidationError as exc:
        raise ProtocolError(f"invalid bucket notice: {exc.errors()[0]}") from exc


def _reason(message: dict[str, Any]) -> str:
    raw = message.get("reason")
    if isinstance(raw, bytes):
        try:
            from ckpt_engine.transport.messages import AbortMessage

            return decode(AbortMessage, raw).reason
        except ProtocolError:
            return "(unreadable reason)"
    return str(raw)


def _connect(name: str, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(abstract_address(name))
            return sock
        except OSError as exc:
            sock.close()
            if time.monotonic() > deadline:
                raise SyncTimeoutError(f"no IPC hub {name!r} on this host within {timeout_s:.0f}s: {exc}") from exc
            time.sleep(0.05)
