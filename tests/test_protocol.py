"""Wire messages: round trips, older peers (missing optional fields), malformed input."""

from __future__ import annotations

import msgpack
import pytest

from ckpt_engine.codec import decode, encode
from ckpt_engine.errors import LayoutMismatchError, ProtocolError
from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.transport.messages import Ack, LayoutMessage, VersionHeader


def layout():
    return plan_layout([TensorSpec("a", "bfloat16", (3, 4)), TensorSpec("b", "int64", ())], 1024)


def test_header_round_trip_rebuilds_the_same_layout() -> None:
    header = VersionHeader(version=3, mode="cached", digest_algo="xxh3-64", layout=LayoutMessage.of(layout()),
                           layout_digest=layout().digest,
                           step=30, aliases={"tied": "a"})
    back = decode(VersionHeader, encode(header))
    assert back == header
    assert back.layout.to_layout() == layout()


def test_an_older_peer_without_optional_fields_still_works() -> None:
    minimal = {"version": 1, "mode": "bypass_cpu", "digest_algo": "xxh3-64", "layout_digest": layout().digest}
    header = decode(VersionHeader, msgpack.packb(minimal))
    assert header.step is None and header.aliases == {} and header.proto == 1 and header.layout is None


def test_a_newer_peer_with_unknown_fields_still_works() -> None:
    ack = decode(Ack, msgpack.packb({"version": 1, "rank": 2, "ok": True, "added_in_v7": [1, 2]}))
    assert ack.ok and ack.bad_tensors == []


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"version": "x"}),
                                 msgpack.packb({"version": 1, "rank": 0})])
def test_malformed_messages_are_protocol_errors(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(Ack, raw)


def test_truncated_message_is_a_protocol_error() -> None:
    raw = encode(Ack(version=1, rank=1, ok=True, reason="x" * 50))
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(Ack, raw[:-10])


def test_layout_with_a_forged_digest_is_rejected() -> None:
    message = LayoutMessage.of(layout()).model_copy(update={"digest": "0" * 16})
    with pytest.raises(LayoutMismatchError):
        message.to_layout()


def test_unknown_dtype_on_the_wire_is_rejected() -> None:
    message = LayoutMessage.of(layout()).model_copy(update={"dtypes": ["__import__", "int64"]})
    with pytest.raises(ProtocolError, match="unknown dtype"):
        message.to_layout()


def test_mode_is_validated() -> None:
    raw = msgpack.packb({"version": 1, "mode": "whatever", "digest_algo": "xxh3-64", "layout_digest": "x"})
    with pytest.raises(ProtocolError):
        decode(VersionHeader, raw)


def test_a_payloads_specs_are_read_only_with_and_without_aliases() -> None:
    """Found by the outside attack: the layout's shared map was read-only without aliases and a plain dict with
    them, so a load that changed it worked on tied models only, and would have changed every later version's."""
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import specs_of
    from ckpt_engine.receive.assembly import Incoming, VersionAssembler
    from ckpt_engine.receive.payload import ReceiveResult
    from ckpt_engine.receive.staging import StagingChoice

    layout = plan_layout(specs_of({"w": torch.zeros(3), "b": torch.zeros(2)}), bucket_size=1 << 12)
    assembler = VersionAssembler(detect_device("cpu"), lambda payload: None)
    for aliases in ({}, {"tied": "w"}):
        header = VersionHeader(version=1, mode="cached", digest_algo="xxh3-64", layout_digest=layout.digest,
                               aliases=aliases)
        incoming = Incoming(header, layout, "xxh3-64", StagingChoice("device", "test"), ReceiveResult(1, False))
        specs = assembler.specs(incoming)
        assert set(specs) == {"w", "b", *aliases}
        with pytest.raises(TypeError):
            specs["x"] = specs["w"]  # type: ignore[index]
    assert set(layout.spec_of) == {"w", "b"}  # the layout's own map never took the alias
