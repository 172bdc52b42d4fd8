"""The one wire form (ckpt_engine.codec): every typed message between processes round-trips, and hostile
bytes are a ProtocolError, never a crash or a half-read message."""

from __future__ import annotations

import msgpack
import pytest

from ckpt_engine.codec import MAX_MESSAGE_BYTES, decode, encode
from ckpt_engine.control.messages import Assignment, ClassLane
from ckpt_engine.errors import ProtocolError
from ckpt_engine.transport.messages import Ack, VersionTrailer

SHARDED = Assignment(
    kind="send", version=12, mode="bypass_cpu", step=40, generation=3, world_size=5, owners=2, keep=[11, 9],
    ipc_peers={"agent-a": 2}, expected_digest="ab" * 16,
    classes=[ClassLane(key="tp2-0", part="class-0/", spec={"w": [[0, 0, 4]]}, ranks=[1, 2], ipc_peers={"x": 3}),
             ClassLane(key="whole", part="class-1/", ranks=[4])])


@pytest.mark.parametrize("message", [
    SHARDED,
    Assignment(kind="send", version=1),
    Assignment(kind="send", version=7, source_version=5, sparse=True, sparse_base=4),
    Ack(version=3, rank=1, ok=False, reason="bad", bad_tensors=["a"], seconds={"verify": 0.5}),
    VersionTrailer(version=3, version_digest="cd" * 16),
], ids=["sharded-assignment", "plain-assignment", "re-push", "ack", "trailer"])
def test_every_message_round_trips(message) -> None:
    assert decode(type(message), encode(message)) == message


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"kind": "send"}),
    msgpack.packb({"kind": "send", "version": 1, "owners": 0}),
    msgpack.packb({"kind": "send", "version": 1, "classes": [{"key": "k", "part": "../x"}]}),
    encode(SHARDED)[:-3],
], ids=["empty", "reserved-byte", "not-a-map", "missing-version", "owners-zero", "hostile-part", "truncated"])
def test_hostile_bytes_are_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(Assignment, raw)


def test_an_oversized_message_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(Assignment, b"\x80" * (MAX_MESSAGE_BYTES + 1))
