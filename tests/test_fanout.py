"""The bypass_cpu fan-out's rules (send/fanout.py) as tables: where a tensor is whole, assembling a tensor
gathered in pieces, and the bounded window of gathered buckets the classes share."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.plan.tensors import piece_of
from ckpt_engine.send.fanout import Assembler, GatheredWindow, ready_at


def test_a_tensor_is_whole_at_the_bucket_of_its_last_piece() -> None:
    layout = plan_layout([TensorSpec("a", "float32", (8,)), TensorSpec("big", "float32", (40,)),
                          TensorSpec("c", "float32", (4,))], 64, 16)  # big: 160 bytes over 3+ buckets
    ready = ready_at(layout)
    big_buckets = [b.index for b in layout.buckets for s in b.slots if s.name == "big"]
    assert len(big_buckets) > 1 and ready["big"] == big_buckets[-1]
    assert ready["a"] == 0 and ready["c"] == layout.buckets[-1].index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_a_tensor_gathered_in_pieces_is_put_together_whole(dtype) -> None:
    big = (torch.rand(10, 4) * 8).to(dtype)
    layout = plan_layout([TensorSpec("small", "float32", (2,)), TensorSpec("big", str(dtype).split(".")[1], (10, 4))],
                         32, 8)
    assembler, wholes, given_whole = Assembler(), {}, Assembler()
    for bucket in layout.buckets:
        sources = {s.name: piece_of(big, s).clone() if s.name == "big" else torch.zeros(2) for s in bucket.slots}
        wholes.update(assembler.take(bucket, sources))  # (as an FSDP gather brings them: only the piece's elements)
        given = given_whole.take(bucket, {s.name: big if s.name == "big" else torch.zeros(2) for s in bucket.slots})
        assert ("big" in given) == (bucket.index == ready_at(layout)["big"])
        if "big" in given:
            assert given["big"] is big  # a source that gives it whole: taken as it is, no copy
    assert torch.equal(wholes["big"], big) and wholes["big"].shape == (10, 4)


def test_the_window_holds_at_most_depth_buckets_and_lets_go_as_classes_move_on() -> None:
    window = GatheredWindow({"x": {0, 2}, "y": {1}}, depth=2, timeout_s=0.2)
    window.put(0, {"t": torch.zeros(1)})
    window.put(1, {"t": torch.ones(1)})
    with pytest.raises(SyncTimeoutError, match="room for bucket 2"):
        window.put(2, {"t": torch.ones(1)})  # both held
    window.put(3, {})  # needed by no class: not held, never waits
    assert window.take("x", 0)[0]["t"].item() == 0
    window.done("y")  # y ended (sent or failed): lets go of bucket 1
    window.put(2, {"t": torch.full((1,), 2.0)})
    assert window.take("x", 2)[0]["t"].item() == 2 and window.held == 1  # taking 2 let go of 0
    window.done("x")
    window.wait_empty()
    assert window.held == 0


def test_a_class_waits_for_its_bucket_and_a_failure_ends_every_wait() -> None:
    window = GatheredWindow({"x": {0, 1}}, depth=1, timeout_s=5)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(window.take("x", 0)[0]))
    taker.start()
    window.put(0, {"t": torch.zeros(1)})
    taker.join(5)
    assert got and not taker.is_alive()
    with pytest.raises(CkptEngineError, match="was not planned"):
        window.take("x", 7)
    errors: list = []

    def take_one() -> None:
        try:
            window.take("x", 1)
        except CkptEngineError as exc:
            errors.append(str(exc))

    waiting = threading.Thread(target=take_one)
    waiting.start()
    window.fail("the gather failed")
    waiting.join(5)
    assert errors == ["the gather failed"]
    with pytest.raises(CkptEngineError, match="the gather failed"):
        window.put(1, {"t": torch.zeros(1)})
    with pytest.raises(SyncTimeoutError):
        GatheredWindow({"x": {0}}, depth=1, timeout_s=0.05).wait_empty()  # a class that never took its bucket


def test_a_class_ending_while_a_gather_waits_for_room_does_not_hold_that_bucket() -> None:
    """(issue 35: a class that failed at once, its receiver killed, ended while the next bucket waited for room;
    the bucket was then held for it for good and the trainer waited out the window's timeout)"""
    window = GatheredWindow({"dead": {0, 1, 2}, "live": {0, 1, 2}}, depth=2, timeout_s=10)
    window.put(0, {"t": torch.zeros(1)})
    window.put(1, {"t": torch.ones(1)})
    gathering = threading.Thread(target=window.put, args=(2, {"t": torch.full((1,), 2.0)}))
    gathering.start()  # waits for room
    window.done("dead")
    window.take("live", 0)
    window.take("live", 1)  # lets go of 0: room for 2, which only "live" needs now
    gathering.join(10)
    assert not gathering.is_alive()
    window.take("live", 2)
    window.done("live")
    window.wait_empty()
    assert window.held == 0
