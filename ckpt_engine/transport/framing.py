"""Framing on the sync group: every step of a version is a broadcast from the sender, of a size both sides
know in advance. Control frames have a fixed size; payload sizes are announced in the previous frame; bucket
sizes come from the layout.

Per version::

    control BEGIN(len)  -> payload VersionHeader
    per bucket k:  control BUCKET(k, nbytes, n) + n int64 digests  -> bucket bytes   (or ABORT(len) -> reason)
    control END(len)    -> payload VersionTrailer                                     (or ABORT(len) -> reason)
    allgather of fixed-size Ack frames (every rank's outcome)

A control frame is int64[8]: MAGIC, protocol, kind, version, a, b, c, d, followed by the digests for BUCKET.
The protocol is 1, or 2 in the BEGIN frame of a version whose tensors include pieces of chunked ones
(see messages.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from ckpt_engine.codec import decode, encode
from ckpt_engine.errors import ProtocolError
from ckpt_engine.plan.hashing import host_buffer
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.messages import PROTO_VERSION, SUPPORTED_PROTOS, Ack

MAGIC = 0x434B5054  # "CKPT"
CONTROL_LEN = 8
ACK_BYTES = 16384
_MAX_ACK_NAMES = 16
_MAX_REASON_CHARS = 2000


class FrameKind(IntEnum):
    BEGIN = 1
    BUCKET = 2
    END = 3
    ABORT = 4
    CLOSE = 5


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    version: int = 0
    a: int = 0
    b: int = 0
    c: int = 0
    d: int = 0
    extra: list[int] = field(default_factory=list)
    proto: int = PROTO_VERSION


class Channel:
    """Both sides call the same sequence of methods. The sender passes values; receivers get them back."""

    def __init__(self, group: SyncGroup, src: int = 0) -> None:
        self.group = group
        self.src = src
        self.is_src = group.rank == src
        self._device = group.device.comm_device
        self.open = False  # sender only: a version began and has not ended, so its frames need no ring

    def frame(self, frame: Frame | None, extra_len: int, what: str, extra: torch.Tensor | None = None,
              timeout_s: float | None = None) -> Frame:
        """Broadcast a control frame carrying ``extra_len`` int64 values after the header."""
        tensor = torch.zeros(CONTROL_LEN + extra_len, dtype=torch.int64, device=self._device)
        if self.is_src:
            if frame is None:
                raise ValueError("the sender must pass a frame")
            head = [MAGIC, frame.proto, int(frame.kind), frame.version, frame.a, frame.b, frame.c, frame.d]
            tensor[:CONTROL_LEN] = torch.tensor(head, dtype=torch.int64)
            if extra is not None and extra_len:
                tensor[CONTROL_LEN:] = extra.to(self._device)
        self.group.wait(self.group.broadcast(tensor, self.src), what, timeout_s)
        return frame if self.is_src and frame is not None else _parse(tensor.cpu().tolist(), what)

    def payload(self, data: bytes | None, length: int, what: str) -> bytes:
        if length == 0:
            return b""
        if self.is_src:
            if data is None or len(data) != length:
                raise ValueError("the sender must pass exactly `length` bytes")
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
        else:
            tensor = torch.empty(length, dtype=torch.uint8, device=self._device)
        self.group.broadcast_and_wait(tensor, what, self.src)
        return data if self.is_src and data is not None else bytes(host_buffer(tensor.cpu()))

    def data(self, buf: torch.Tensor) -> Any:
        """Start the broadcast of a bucket's bytes. Returns the work to wait on."""
        return self.group.broadcast(buf, self.src)

    def wait(self, work: Any, what: str) -> None:
        self.group.wait(work, what)

    def exchange_acks(self, ack: Ack, timeout_s: float | None) -> list[Ack | ProtocolError]:
        """Every rank contributes its Ack. Returns all ranks' Acks in rank order; an unreadable one is given as
        the ProtocolError saying why."""
        raw = _ack_bytes(ack)
        tensor = torch.zeros(ACK_BYTES, dtype=torch.uint8)
        tensor[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        gathered = self.group.allgather(tensor.to(self._device), "acknowledgements", timeout_s)
        return [_read_ack(t) for t in gathered]


def _parse(values: list[int], what: str) -> Frame:
    magic, proto, kind, version, a, b, c, d = values[:CONTROL_LEN]
    if magic != MAGIC:
        raise ProtocolError(f"{what}: bad magic {magic:#x}, not a ckpt-engine frame")
    if proto not in SUPPORTED_PROTOS:
        raise ProtocolError(f"{what}: protocol {proto} is not supported (this side speaks "
                            f"{', '.join(map(str, SUPPORTED_PROTOS))})")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"{what}: unknown frame kind {kind}") from None
    return Frame(frame_kind, version, a, b, c, d, values[CONTROL_LEN:], proto)


def _ack_bytes(ack: Ack) -> bytes:
    if ack.reason and len(ack.reason) > _MAX_REASON_CHARS:
        ack = ack.model_copy(update={"reason": ack.reason[:_MAX_REASON_CHARS] + "..."})
    if len(ack.bad_tensors) > _MAX_ACK_NAMES:
        ack = ack.model_copy(update={"bad_tensors": ack.bad_tensors[:_MAX_ACK_NAMES]})
    body = encode(ack)
    if len(body) + 4 > ACK_BYTES:
        body = encode(ack.model_copy(update={"bad_tensors": [], "reason": (ack.reason or "")[:200]}))
    return struct.pack("<I", len(body)) + body


def _read_ack(tensor: torch.Tensor) -> Ack | ProtocolError:
    raw = bytes(host_buffer(tensor.cpu()))
    (length,) = struct.unpack("<I", raw[:4])
    if length == 0 or length > ACK_BYTES - 4:
        return ProtocolError(f"acknowledgement frame has a bad length {length}")
    try:
        return decode(Ack, raw[4 : 4 + length])
    except ProtocolError as exc:
        return exc
