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


def test_an_invalid_message_is_named_without_its_bytes() -> None:
    """Found by the outside attack: the error carried pydantic's whole input (a 50 MiB message made a 90 MB
    string), and a reserved byte gave an error with no text at all."""
    huge = msgpack.packb({"kind": "send", "version": "x" * (8 << 20)})
    with pytest.raises(ProtocolError) as caught:
        decode(Assignment, huge)
    assert len(str(caught.value)) < 600 and "version" in str(caught.value)
    with pytest.raises(ProtocolError, match=r"FormatError|ExtraData|ValueError"):
        decode(Assignment, b"\xc1")


def test_a_message_too_large_for_its_peers_is_refused_where_it_is_made() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(Assignment(kind="send", version=1, ipc_peers={f"{i:064d}": 1 for i in range(MAX_MESSAGE_BYTES // 60)}))


def _ranks_told(rank: int, port: int, how: str) -> str:
    """Trainer rank ``rank`` of 2 at a boundary where rank 0's assignment cannot be sent (``unsendable``) or
    arrives as garbage (``garbage``: rank 0 broadcasts bytes that are no Assignment, as a broken peer would)."""
    import datetime

    import torch
    import torch.distributed as dist

    from ckpt_engine.errors import TrainerGroupError
    from ckpt_engine.workers.trainer_ranks import TrainerRanks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    ranks = TrainerRanks(dist.group.WORLD)
    try:
        if rank == 0 and how == "garbage":
            junk = b"\x81\xa4kind\xa4send"  # a map without a version
            dist.broadcast(torch.tensor([len(junk)]), src=0)
            dist.broadcast(torch.frombuffer(bytearray(junk), dtype=torch.uint8), src=0)
            return "sent garbage"
        mine = Assignment(kind="send", version=2**70) if rank == 0 else None  # (no msgpack int holds it)
        ranks.broadcast_assignment(mine)
        return "agreed"
    except TrainerGroupError as exc:
        return f"TrainerGroupError: {exc}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["unsendable", "garbage"])
def test_an_assignment_that_cannot_be_sent_or_read_ends_every_ranks_loop_alike(how: str) -> None:
    """Found by the outside attack: rank 1 raised a ProtocolError outside the job's collective (not the
    documented TrainerGroupError) while rank 0 went on; an assignment rank 0 could not encode left the others
    waiting in the broadcast until their timeout."""
    from tests.daemon_harness import free_port
    from tests.procs import run_processes

    port = free_port()
    said = run_processes([(_ranks_told, (0, port, how)), (_ranks_told, (1, port, how))], timeout_s=120)
    assert said[1].startswith("TrainerGroupError"), said
    if how == "unsendable":
        assert said[0].startswith("TrainerGroupError") and "could not be sent" in said[1], said
    else:
        assert "invalid Assignment" in said[1], said
