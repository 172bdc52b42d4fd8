"""Sharded delivery's pure rules as tables: the wire form of a spec, piece names back to slices, where a piece
sits in a local shard, tied names, the daemon's classes and seats, when a sharded version cannot go, and the
commit rule against each receiver's class digest."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ckpt_engine.control.messages import ClassDone, ClassLane, Register, Report, parse_shard_spec
from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.shards import (
    Slice,
    local_range,
    resolve_aliases,
    spec_from_wire,
    spec_key,
    spec_to_wire,
    split_piece_name,
)
from ckpt_engine.server.decisions import quorum as rules
from ckpt_engine.server.decisions.commit import judge
from ckpt_engine.server.decisions.receiver_classes import expected_by_receiver, plan_lanes
from tests.test_decisions import agent


def test_a_spec_round_trips_its_wire_form_sorted() -> None:
    spec = {"w": (Slice(0, 8, 4), Slice(0, 0, 4)), "o": (Slice(1, 2, 2),)}
    wire = spec_to_wire(spec)
    assert wire == {"w": [[0, 0, 4], [0, 8, 4]], "o": [[1, 2, 2]]}
    assert spec_from_wire(wire) == {"w": (Slice(0, 0, 4), Slice(0, 8, 4)), "o": (Slice(1, 2, 2),)}
    assert spec_key(spec_from_wire(wire)) == spec_key(spec)


@pytest.mark.parametrize("wire", [{"w": [[0, 1]]}, {"w": [[0, 0, 0]]}, {"w": [[-1, 0, 2]]}, {"w": [[0, 1, 2, 3]]}])
def test_a_malformed_wire_slice_is_a_config_error(wire) -> None:
    with pytest.raises(ConfigError):
        spec_from_wire(wire)


@pytest.mark.parametrize("spec", [{"w": [[0, 0]]}, {"w": []}, {"w": [[True, 0, 1]]}, {"": [[0, 0, 1]]},
                                  {"w": [[0, 0, 1 << 60]]}, {"w": [[0, "0", 1]]}])
def test_register_refuses_malformed_specs_before_the_daemon_sees_them(spec) -> None:
    body = dict(role="receiver", host="h", pid=1, device="cpu", shard_spec=spec)
    with pytest.raises(ValidationError):
        Register.model_validate(body, strict=True)


@pytest.mark.parametrize("name,expected", [
    ("qkv.weight@0:128:64", ("qkv.weight", Slice(0, 128, 64))),
    ("o.weight@1:0:8", ("o.weight", Slice(1, 0, 8))),
    ("norm.weight", ("norm.weight", None)),
    ("odd@name", ("odd@name", None)),  # an @ in a tensor's own name is not a piece
    ("x@0:0:0", ("x@0:0:0", None)),  # no empty slice
    ("a@ 0:0:1", ("a@ 0:0:1", None)), ("a@+0:0:1", ("a@+0:0:1", None)), ("a@0_0:0:1", ("a@0_0:0:1", None)),
    ("a@0:0:\u0661", ("a@0:0:\u0661", None)), ("@0:0:1", ("@0:0:1", None)), ("a@00:0:1", ("a@00:0:1", None)),
    ("a@0:0:1 ", ("a@0:0:1 ", None)),  # only exactly what piece_name writes is a piece
])
def test_piece_names_split_back_into_tensor_and_slice(name, expected) -> None:
    assert split_piece_name(name) == expected


def test_a_piece_sits_after_the_slices_before_it_in_the_local_shard() -> None:
    spec = {"qkv": (Slice(0, 16, 2), Slice(0, 0, 4), Slice(0, 8, 2))}  # q, k, v ranges of one rank
    assert local_range(spec, "qkv", Slice(0, 0, 4)) == Slice(0, 0, 4)
    assert local_range(spec, "qkv", Slice(0, 8, 2)) == Slice(0, 4, 2)
    assert local_range(spec, "qkv", Slice(0, 16, 2)) == Slice(0, 6, 2)
    assert local_range(spec, "norm", None) is None
    with pytest.raises(ConfigError, match="not in this receiver's shard spec"):
        local_range(spec, "qkv", Slice(0, 4, 4))


def test_a_tied_name_takes_its_canonical_tensors_slices() -> None:
    aliases = {"lm_head.weight": "embed.weight"}
    rows = (Slice(0, 0, 8),)
    assert resolve_aliases({"lm_head.weight": rows}, aliases) == {"embed.weight": rows}
    assert resolve_aliases({"lm_head.weight": rows, "embed.weight": rows}, aliases) == {"embed.weight": rows}
    with pytest.raises(ConfigError, match="tied"):
        resolve_aliases({"lm_head.weight": rows, "embed.weight": (Slice(0, 8, 8),)}, aliases)


def sharded(spec: dict | None):
    receiver = agent()
    if spec:
        typed = parse_shard_spec(spec)  # (as the registration's message parses it)
        receiver.shard_spec, receiver.shard_key = typed, spec_key(typed)
    return receiver


def test_no_spec_no_classes_and_each_spec_its_own_class_with_group_ranks() -> None:
    plain = [agent(), agent()]
    assert plan_lanes(plain, {a.agent_id: r for r, a in enumerate(plain, 1)}).lanes == []
    r0a, r1, whole, r0b = (sharded({"w": [[0, 0, 4]]}), sharded({"w": [[0, 4, 4]]}), sharded(None),
                           sharded({"w": [[0, 0, 4]]}))
    quorum = {r0a.agent_id: 1, r1.agent_id: 2, whole.agent_id: 3, r0b.agent_id: 4}
    plan = plan_lanes([r0a, r1, whole, r0b], quorum)
    assert [(lane.part, lane.ranks) for lane in plan.lanes] == [("class-0/", [1, 4]), ("class-1/", [2]),
                                                                 ("class-2/", [3])]
    assert plan.lanes[2].key == "whole" and plan.lanes[2].spec == {}
    assert plan.seats[r0b.agent_id] == (r0a.shard_key, "class-0/", 2, 3)  # rank 2 of a group of 3
    assert plan.seats[whole.agent_id] == ("whole", "class-2/", 1, 2)
    done = [ClassDone(key=r0a.shard_key, ok=False, reason="rank 2: colocated receiver dropped", version_digest="d0"),
            ClassDone(key=r1.shard_key, ok=False, reason="the send failed part way"),
            ClassDone(key="whole", ok=True, version_digest="dw")]
    expected = expected_by_receiver(plan, done)  # (a class's failure for one receiver: the others verified d0)
    assert expected == {r0a.agent_id: "d0", r0b.agent_id: "d0", r1.agent_id: None, whole.agent_id: "dw"}


def test_colocated_receivers_have_no_seat_in_their_classs_group_and_a_class_of_them_only_none() -> None:
    r0_here, r0_far, r1_here = sharded({"w": [[0, 0, 4]]}), sharded({"w": [[0, 0, 4]]}), sharded({"w": [[0, 4, 4]]})
    quorum = {r0_far.agent_id: 1, r0_here.agent_id: 2, r1_here.agent_id: 3}
    plan = plan_lanes([r0_here, r0_far, r1_here], quorum, {r0_here.agent_id, r1_here.agent_id})
    assert [(lane.ranks, lane.ipc_peers) for lane in plan.lanes] == [([1], {r0_here.agent_id: 2}),
                                                                     ([], {r1_here.agent_id: 3})]
    assert plan.seats == {r0_far.agent_id: (r0_far.shard_key, "class-0/", 1, 2)}  # the group: trainer + r0_far
    assert plan.key_of(r1_here.agent_id) == r1_here.shard_key  # judged against its class's digest all the same
    done = [ClassDone(key=r0_far.shard_key, ok=True, version_digest="d0"),
            ClassDone(key=r1_here.shard_key, ok=True, version_digest="d1")]
    assert expected_by_receiver(plan, done) == {r0_far.agent_id: "d0", r0_here.agent_id: "d0",
                                                r1_here.agent_id: "d1"}
    with pytest.raises(ValidationError, match="no receivers"):
        ClassLane(key="k", part="class-0/")


@pytest.mark.parametrize("transport,colocated", [("auto", 1), ("collective", 0), ("ipc", 0)])
def test_a_sharded_version_goes_by_the_same_rules_of_transport(transport, colocated) -> None:
    receivers = [sharded({"w": [[0, 0, 4]]}), agent(host_id="elsewhere")]
    assert rules.within_class_limit(receivers) == receivers
    for receiver in receivers:
        receiver.model.serving = 4
    assert rules.sparse_base(receivers) == 4  # each class gets the pieces that changed since
    trainer = agent("trainer")
    here, problem = rules.transports(trainer, receivers, 1, transport)
    assert len(here) == colocated and (problem is None) == (transport != "ipc")  # (ipc: the far one cannot)
    assert rules.transports(trainer, receivers, 2, "auto") == ([], None)  # several owners: sync groups only


def test_each_receiver_is_judged_against_its_class_digest() -> None:
    quorum = {"a": 1, "b": 2, "c": 3}
    done = Report(agent_id="t", session="s" * 16, version=5, event="done", ok=True, version_digest="identity")
    reports = {a: Report(agent_id=a, session="s" * 16, version=5, event="received", ok=True, version_digest=d)
               for a, d in (("a", "d0"), ("b", "d1"), ("c", "d0"))}
    outcome = judge(quorum, reports, done, engines={}, applied={}, owner_failures={}, transports={},
                    expected="identity", stale=None, need=3, expected_for={"a": "d0", "b": "d1", "c": "d1"})
    assert outcome.status == "failed" and outcome.committed == []
    verdicts = {e["agent_id"]: (e["ok"], e["reason"]) for e in outcome.entries}
    assert verdicts["a"] == (True, None) and verdicts["b"] == (True, None)
    assert verdicts["c"][0] is False and "differs from the version's d1" in verdicts["c"][1]
    none = judge(quorum, reports, done, engines={}, applied={}, owner_failures={}, transports={}, expected=None,
                 stale=None, need=1, expected_for={"a": "d0", "b": "d1", "c": "d0"})
    assert none.status == "failed"  # no identity: nothing commits


def test_more_classes_than_a_version_carries_leave_the_newest_unproven_ones_for_later() -> None:
    """(issue 35: 257 registrations with distinct specs made every version a 503)"""
    proven = [sharded({"w": [[0, 1000 + i, 1]]}) for i in range(2)]
    for receiver in proven:
        receiver.model.serving, receiver.model.proven = 3, True
    flood = [sharded({"w": [[0, i, 1]]}) for i in range(257)]
    kept = rules.within_class_limit([*flood, *proven])
    ids = [r.agent_id for r in kept]
    assert len({r.shard_key for r in kept}) == 256 and all(r.agent_id in ids for r in proven)
    assert ids == [r.agent_id for r in [*flood, *proven] if r.agent_id in ids]  # (in the quorum's order)
    assert flood[-1].agent_id not in ids and flood[-2].agent_id not in ids  # the last registered wait
    mixed = flood[:255] + [agent()]
    assert rules.within_class_limit(mixed) == mixed  # 255 + whole = 256 classes: all go
    same = [sharded({"w": [[0, 0, 1]]}) for _ in range(300)]
    assert rules.within_class_limit(same) == same  # one class, whatever the receivers


def test_a_spec_key_is_a_cryptographic_digest_of_the_normalised_spec() -> None:
    import hashlib
    import json

    key = spec_key({"w": (Slice(0, 4, 4), Slice(0, 0, 4))})
    canonical = json.dumps([["w", [[0, 0, 4], [0, 4, 4]]]], separators=(",", ":")).encode()
    assert key == hashlib.sha256(canonical).hexdigest()[:32]


def test_a_tensor_named_like_a_piece_is_refused_for_sharded_versions_and_not_blamed_on_receivers() -> None:
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import specs_of
    from ckpt_engine.send.class_senders import ClassSenders, SpecUnfit

    def layout(tensors):
        return plan_layout(specs_of(tensors), 1 << 16)

    senders = ClassSenders(detect_device("cpu"), bucket_size=1 << 16, alignment=64, options={})
    spec = {"a": (Slice(0, 0, 2),)}
    with pytest.raises(ConfigError, match="cannot be sent sharded") as refused:
        senders._plan_of(spec, layout({"a": torch.zeros(4), "a@0:0:1": torch.zeros(1)}), None, {})
    assert not isinstance(refused.value, SpecUnfit)
    with pytest.raises(SpecUnfit, match="no tensor 'b'"):
        senders._plan_of({"b": (Slice(0, 0, 2),)}, layout({"a": torch.zeros(4)}), None, {})


def test_an_identity_of_several_owners_is_merged_in_the_versions_order() -> None:
    from ckpt_engine.errors import CkptEngineError
    from ckpt_engine.plan.layout import TensorSpec, plan_layout
    from ckpt_engine.plan.owners import plan_owners
    from ckpt_engine.send.class_senders import merged_by_owner

    layout = plan_layout([TensorSpec(f"t{i}", "float32", (256,)) for i in range(6)], 1024)  # one tensor a bucket
    owners = plan_owners(layout, 2)
    told = [[], []]
    for slot in layout.slots:
        told[owners.of[slot.bucket]].append(100 + slot.index)  # each owner its own tensors' values, in order
    assert merged_by_owner(layout, owners, told) == [100 + i for i in range(6)]
    told[1].pop()
    with pytest.raises(CkptEngineError, match="owner rank 1 told"):
        merged_by_owner(layout, owners, told)


def _agreeing_rank(rank: int, port: int) -> list:
    """Trainer rank ``rank`` of 2 at three step boundaries: a sharded version due, nothing due, a plain one."""
    import datetime

    import torch.distributed as dist

    from ckpt_engine.control.messages import Assignment, ClassLane
    from ckpt_engine.workers.trainer_ranks import TrainerRanks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    lanes = [ClassLane(key="k" * 32, part="class-0/", spec={"w": [[0, 0, 4]]}, ranks=[1, 3]),
             ClassLane(key="whole", part="class-1/", spec={}, ranks=[2])]
    due = [Assignment(kind="send", version=7, generation=3, world_size=4, owners=2, keep=[5], classes=lanes), None,
           Assignment(kind="send", version=8, mode="bypass_cpu", sparse=True, sparse_base=6)]
    ranks = TrainerRanks(dist.group.WORLD)
    try:
        return [None if a is None else a.model_dump(mode="json")
                for a in (ranks.broadcast_assignment(mine if rank == 0 else None) for mine in due)]
    finally:
        dist.destroy_process_group()


def test_the_assignment_reaches_the_other_trainer_ranks_as_it_left_rank_0() -> None:
    """Rank 0's assignment, classes and all, in the one wire form (ckpt_engine.codec) over the job's own gloo
    group: rank 1 holds what rank 0 holds, and a boundary with nothing due is nothing on both."""
    from tests.daemon_harness import free_port
    from tests.procs import run_processes

    port = free_port()
    told = run_processes([(_agreeing_rank, (0, port)), (_agreeing_rank, (1, port))], timeout_s=120)
    assert told[0] == told[1]
    assert told[1][1] is None and told[1][0]["classes"][0]["spec"] == {"w": [[0, 0, 4]]}
    assert told[1][2]["mode"] == "bypass_cpu" and told[1][2]["sparse_base"] == 6
