"""The daemon's decisions (server/decisions/) as tables, in milliseconds: the receiver state machine, the quorum
rule, the commit rule, catch-up and repair, and the two sync policies. No processes, no clock: the time is
an argument."""

from __future__ import annotations

import itertools

import pytest

from ckpt_engine.control.messages import MAX_KEPT, Report
from ckpt_engine.server.decisions import quorum
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.cadence import CatchUpPause, offer
from ckpt_engine.server.decisions.commit import expected_digest, judge
from ckpt_engine.server.decisions.policy import FRAMEWORK, PLAIN, policy_of
from ckpt_engine.server.decisions.receivers import MOVES, NEW, SERVING, STAGED, TORN, UNABLE, ReceiverModel
from ckpt_engine.server.decisions.repair import kept_for_repairs, plan_catch_up, repair_source

HB = 10.0
NOW = 1000.0
_ids = itertools.count()


def agent(role: str = "receiver", *, silent_s: float = 0.0, engine: str | None = None, driven: bool = False,
          members: int | None = None, framework: str | None = None, rank: int = 0, trainer_ranks: int = 1,
          host_id: str | None = "h", device: str = "cpu", serving: int | None = None, proven: bool = True,
          whole_versions: bool = False) -> AgentRecord:
    n = next(_ids)
    a = AgentRecord(f"a{n}", "s" * 48, n, role, rank, "host", 100 + n, device, host_id, 0.0, NOW - silent_s,
              engine=engine, driven=driven, members=members, framework=framework, trainer_ranks=trainer_ranks,
              poll_wait_s=1.0, whole_versions=whole_versions)
    a.model.serving = a.model.last_served = serving
    a.model.proven = proven and serving is not None
    return a


# ---- the receiver state machine ---------------------------------------------------------------------------
def test_every_move_is_listed_and_names_a_method() -> None:
    for move in MOVES:
        method = "staged_version" if move == "staged" else move
        assert callable(getattr(ReceiverModel, method)), move


MOVE_CASES = [
    # (moves applied in order, expected state, serving, last_served)
    ([("registered", 3)], NEW, 3, 3),  # a claim, not proof
    ([("registered", None), ("took", 4), ("proved",)], SERVING, 4, 4),
    ([("registered", None), ("took", 4)], NEW, 4, 4),  # took it, but the version did not commit
    ([("registered", None), ("took", 4), ("proved",), ("tore", "oom")], TORN, None, 4),
    ([("registered", None), ("took", 4), ("proved",), ("tore", "oom"), ("took", 4)], SERVING, 4, 4),
    ([("registered", None), ("took", 4), ("proved",), ("lost_track",)], NEW, None, 4),
    ([("registered", None), ("took", 4), ("proved",), ("benched", "silent")], UNABLE, 4, 4),
    ([("registered", None), ("took", 4), ("proved",), ("refused", 4)], SERVING, 4, 4),
    ([("registered", None), ("took", 4), ("proved",), ("refused", None)], NEW, None, 4),
]


def _apply(model: ReceiverModel, moves, *, driven: bool = False) -> None:
    for move, *args in moves:
        if move == "registered":
            model.registered(args[0], NOW, 1.0)
        elif move in ("took", "refused"):
            getattr(model, move)(args[0], driven=driven)
        elif move == "benched":
            model.benched(args[0], NOW)
        else:
            getattr(model, move)(*args)


@pytest.mark.parametrize(("moves", "state", "serving", "last_served"), MOVE_CASES)
def test_receiver_moves(moves, state: str, serving, last_served) -> None:
    model = ReceiverModel()
    _apply(model, moves)
    assert (model.state(NOW), model.serving, model.last_served) == (state, serving, last_served)


def test_a_driven_worker_serves_only_once_its_driver_applied() -> None:
    model = ReceiverModel()
    model.registered(None, NOW, 1.0)
    model.staged_version(5)
    assert model.state(NOW) == STAGED
    model.took(5, driven=True)  # its own outcome: verified; the engine's model is the driver's to say
    assert model.serving is None and model.state(NOW) == NEW
    model.applied(5)
    model.proved()
    assert model.state(NOW) == SERVING and model.serving == model.last_served == 5


def test_a_bench_grows_and_ends_and_a_fresh_tear_is_repaired_at_once() -> None:
    model = ReceiverModel()
    first = model.benched("did not join", NOW)
    second = model.benched("did not join", NOW)
    assert second > first and model.state(NOW) == UNABLE and model.state(NOW + second + 0.1) != UNABLE
    model.catch_up_failed(NOW)
    assert model.catch_up_due > NOW
    model.tore("apply failed")
    assert model.catch_up_due == 0.0 and model.catch_up_attempts == 0  # repaired at once, then with backoff


# ---- the quorum rule -----------------------------------------------------------------------------------------
def _candidates(receivers, drivers=None, *, regular=True, source=lambda r: 7):
    return quorum.candidates(receivers, drivers or {}, NOW, HB, regular=regular, repair_source=source)


def test_a_quorum_takes_heard_able_proven_receivers_of_plain_versions() -> None:
    ok = agent(serving=3)
    silent = agent(serving=3, silent_s=7.0)  # past poll wait + half a heartbeat
    benched = agent(serving=3)
    benched.model.benched("x", NOW)
    verl = agent(serving=3, framework="verl")
    newcomer = agent()  # holds nothing proven: a catch-up first, when the cache has something
    assert _candidates([ok, silent, benched, verl, newcomer]) == [ok]
    assert _candidates([ok, newcomer], source=lambda r: None) == [ok, newcomer]  # nothing to catch up with
    assert _candidates([ok, newcomer], regular=False) == [ok, newcomer]


def test_an_engine_is_in_or_out_whole() -> None:
    w1, w2 = (agent(engine="e", driven=True, members=2, serving=3) for _ in range(2))
    driver = agent("driver", engine="e", members=2)
    assert _candidates([w1, w2], {"e": driver}) == [w1, w2]
    assert _candidates([w1], {"e": driver}) == []  # one worker missing
    assert _candidates([w1, w2], {"e": agent("driver", engine="e", silent_s=8.0)}) == []  # its driver silent
    w2.model.tore("oom")
    assert _candidates([w1, w2], {"e": driver}) == []  # one worker torn: both are repaired together


def test_why_a_receiver_is_out_is_said_for_each() -> None:
    silent = agent(serving=3, silent_s=7.0)
    benched = agent(serving=3)
    benched.model.benched("did not report", NOW)
    torn = agent(serving=3)
    torn.model.tore("oom")
    problem = quorum.quorum_problem(agent("trainer"), [], [silent, benched, torn], {}, 1, NOW, HB, lambda r: 7)
    assert f"receiver {silent.agent_id}: silent for 7.0s" in problem
    assert f"receiver {benched.agent_id}: out for" in problem and "did not report" in problem
    assert f"receiver {torn.agent_id}: torn (oom)" in problem
    assert quorum.quorum_problem(None, [], [], {}, 1, NOW, HB, lambda r: 7).startswith("no trainer")


@pytest.mark.parametrize(("ranks", "heard", "transport", "source_owners", "owners"), [
    (2, [0, 1], "auto", None, 2), (2, [0], "auto", None, 1), (2, [0, 1], "ipc", None, 1), (1, [0], "auto", None, 1),
    (2, [0], "auto", 2, 2),  # a re-push has as many owners as its source
    (2, [0, 1], "nixl", None, 2),  # pullers read each bucket from the rank that owns it
])
def test_owners(ranks: int, heard: list[int], transport: str, source_owners, owners: int) -> None:
    trainers = {r: agent("trainer", rank=r, trainer_ranks=ranks, silent_s=0 if r in heard else 8.0)
                for r in range(ranks)}
    assert quorum.owners_for(trainers[0], trainers, source_owners, transport, NOW, HB) == owners


def test_transports_and_sparse_base() -> None:
    trainer = agent("trainer", host_id="h")
    near, far = agent(host_id="h", serving=3), agent(host_id="other", serving=3)
    assert quorum.transports(trainer, [near, far], 1, "auto") == ([near], None)
    assert quorum.transports(trainer, [near, far], 1, "collective") == ([], None)
    assert "not on the trainer's host" in quorum.transports(trainer, [near, far], 1, "ipc")[1]
    assert quorum.transports(trainer, [near], 2, "auto") == ([], None)  # several owners: collective only
    assert quorum.transports(trainer, [near, far], 1, "nixl") == ([], None)  # (pullers are chosen apart)
    assert quorum.sparse_base([near, far]) == 3
    assert quorum.sparse_base([near, agent(serving=4)]) is None
    assert quorum.sparse_base([near, agent(serving=3, whole_versions=True)]) is None


def test_pullers() -> None:
    a, b = agent(serving=3), agent(host_id="other")
    assert quorum.pullers([a, b], "nixl", "cached") == ([a, b], None)
    assert quorum.pullers([a, b], "auto", "cached") == ([], None)
    assert quorum.pullers([], "nixl", "cached") == ([], None)
    assert quorum.pullers([a], "nixl", "bypass_cpu") == ([a], None)  # (read from the trainer's send slots)
    sharded = agent()
    sharded.shard_spec, sharded.shard_key = {"w": [(0, 0, 2)]}, "tp0"  # (what a declared spec leaves)
    assert quorum.pullers([a, sharded], "nixl", "cached") == ([a, sharded], None)  # each pulls its class's pieces
    asked = agent()
    asked.pulls = True  # (a receiver that registered with transport nixl)
    assert quorum.pullers([a, asked], "auto", "cached") == ([asked], None)
    assert "pull, which reads a sharded version's pieces out of the cache only" in quorum.pullers(
        [asked, sharded], "collective", "bypass_cpu")[1]


def test_assignments_of_pushed_colocated_and_pulling_receivers() -> None:
    from ckpt_engine.server.decisions.assignments import pull_assignments, receive_assignments
    from ckpt_engine.server.decisions.receiver_classes import plan_lanes

    far, near = agent(host_id="other"), agent()
    quorum = {far.agent_id: 1, near.agent_id: 2}
    common = {"version": 5, "mode": "cached", "step": 3, "generation": 2, "world_size": 2, "owners": 1}
    out = receive_assignments([far], [near], quorum, plan_lanes([far, near], quorum, {near.agent_id}), "hub", common)
    assert [(r.agent_id, a.rank, a.transport, a.ipc_name, a.world_size) for r, a in out] == [
        (far.agent_id, 1, "collective", None, 2), (near.agent_id, 2, "ipc", "hub", 2)]
    offer = _offer(5, rank=0)
    [(who, pulled)] = pull_assignments(5, "cached", 3, {far.agent_id: 1}, offer)
    assert who == far.agent_id and pulled.transport == "nixl" and pulled.offer == offer and pulled.rank == 1


def _offer(version: int, *, rank: int, sources: int = 1, described: bool | None = None):
    from ckpt_engine.transport.messages import PullOffer
    source = {"agent": b"QQ==", "region": {"addr": 4096 * (rank + 1), "nbytes": 8, "mem": "DRAM"}, "offset": rank}
    descriptor = {"region": {"addr": 64, "nbytes": 8, "mem": "DRAM"}, "nbytes": 8, "digest": "0" * 16}
    return PullOffer(version=version, sources=[source] * sources,
                     descriptor=descriptor if (rank == 0 if described is None else described) else None)


@pytest.mark.parametrize("owners,rank,offer,offered,problem", [
    (1, 0, _offer(5, rank=0), set(), None),
    (2, 1, _offer(5, rank=1), {0}, None),
    (2, 1, None, set(), "carries no offer"),
    (2, 1, _offer(6, rank=1), set(), "offers version 6"),
    (2, 2, _offer(5, rank=2), set(), "owned by 2 rank(s)"),
    (2, 0, _offer(5, rank=0), {0}, "offered it already"),
    (2, 1, _offer(5, rank=1, sources=2), set(), "one source"),
    (2, 1, _offer(5, rank=1, described=True), set(), "only the lead"),
    (2, 0, _offer(5, rank=0, described=False), set(), "only the lead"),
])
def test_an_owner_rank_offers_its_own_share_once(owners, rank, offer, offered, problem) -> None:
    from ckpt_engine.server.decisions.assignments import offer_problem
    said = offer_problem(5, owners, rank, offer, offered)
    assert (said is None) if problem is None else (problem in said)


def test_the_owners_offers_join_in_rank_order_once_all_came() -> None:
    from ckpt_engine.server.decisions.assignments import joined_offer
    lead, second = _offer(5, rank=0), _offer(5, rank=1)
    assert joined_offer(5, 2, {0: lead}) is None
    joined = joined_offer(5, 2, {1: second, 0: lead})
    assert [s.offset for s in joined.sources] == [0, 1] and joined.descriptor == lead.descriptor


# ---- the commit rule -----------------------------------------------------------------------------------------
def report(ok=True, digest="d", reason=None, **kw) -> Report:
    return Report(agent_id="x", session="s" * 48, version=1, event="received", ok=ok, version_digest=digest,
                  reason=reason, **kw)


def done(digest="d", ok=True, reason=None, receivers=()) -> Report:
    return Report(agent_id="t", session="s" * 48, version=1, event="done", ok=ok, version_digest=digest,
                  reason=reason, receivers=list(receivers))


def _judge(reports, trainer=None, *, need=1, quorum_of=("a", "b"), engines=None, applied=None, owners=None,
           expected="d", stale=None, unoffered=()):
    members = {a: i + 1 for i, a in enumerate(quorum_of)}
    return judge(members, reports, trainer or done(), engines=engines or {}, applied=applied or {},
                 owner_failures=owners or {}, transports={}, expected=expected, stale=stale, need=need,
                 unoffered=unoffered)


COMMIT_CASES = [
    ("every receiver committed", {"a": report(), "b": report()}, {}, "committed", None),
    ("one of two, min_receivers 1", {"a": report(), "b": report(ok=False, reason="oom")}, {},
     "committed", "committed by 1 of 2 receivers; receiver 2: oom"),
    ("one of two, a framework needs both", {"a": report(), "b": report(ok=False, reason="oom")}, {"need": 2},
     "failed", "receiver 2: oom"),
    ("a digest that is not the version's", {"a": report(digest="x"), "b": report(digest="x")}, {}, "failed",
     "receiver 1: its digest x differs from the version's d; receiver 2: its digest x differs from the version's d"),
    ("silent receivers", {}, {}, "failed", "receiver 1: did not report its own outcome"),
    ("no digest from the trainer", {"a": report(), "b": report()}, {"expected": None}, "failed", None),
    ("a re-push whose copy changed", {"a": report(), "b": report()}, {"stale": "the copy changed"}, "failed",
     "the copy changed"),
]


@pytest.mark.parametrize(("name", "reports", "options", "status", "reason_part"), COMMIT_CASES,
                         ids=[c[0] for c in COMMIT_CASES])
def test_the_commit_rule(name: str, reports, options, status: str, reason_part) -> None:
    outcome = _judge(reports, **options)
    assert outcome.status == status, outcome
    if reason_part is not None:
        assert reason_part in outcome.reason, outcome.reason
    assert outcome.committed == ([a for a in ("a", "b") if outcome.entries[("a", "b").index(a)]["ok"]]
                                 if status == "committed" else [])


def test_an_engine_fails_together_and_a_driver_failure_fails_it() -> None:
    outcome = _judge({"a": report(), "b": report(ok=False, reason="x")}, engines={"e": ["a", "b"]})
    assert [e["ok"] for e in outcome.entries] == [False, False]
    assert "engine e: receiver 2 failed" in outcome.entries[0]["reason"]
    failed_apply = report(ok=False, reason="vLLM raised")
    outcome = _judge({"a": report(), "b": report()}, engines={"e": ["a", "b"]}, applied={"e": failed_apply})
    assert outcome.status == "failed" and "engine e driver: vLLM raised" in outcome.reason


def test_a_failure_reason_names_each_cause_once() -> None:
    why = "digest mismatch in 1 tensor(s): w"
    trainer = done(ok=False, reason=f"rank 2: {why}", receivers=[{"rank": 2, "ok": False, "reason": why}])
    outcome = _judge({"a": report(), "b": report(ok=False, reason=why)}, trainer, need=2)
    assert outcome.reason.count(why) == 1, outcome.reason
    aborted = done(ok=False, reason="owner rank(s) [1] could not prepare version 1; owner rank 1: stale")
    outcome = _judge({"a": report(ok=False, reason=f"sender aborted version 1: {aborted.reason}")}, aborted,
                     quorum_of=("a",), owners={1: "StaleCopy: stale"})
    assert outcome.reason.count("could not prepare") == 1 and "receiver 1: aborted by the sender" in outcome.reason
    assert "owner rank 1: StaleCopy: stale" in outcome.reason


def test_a_re_push_is_judged_by_its_recorded_digest() -> None:
    assert expected_digest(done("d"), None, None) == ("d", None)  # a new version: what the trainer sent
    assert expected_digest(done("d"), "d", 3) == ("d", None)
    expected, stale = expected_digest(done("e"), "d", 3)
    assert expected == "d" and "committed as d" in stale  # never digests recomputed from the cache
    # found by the outside attack: a re-push the trainer refused (nothing sent) committed on a receiver's word
    # (the source's digest is public): nothing sent, nothing committed
    refused = done(None, ok=False, reason="StaleCopy: refused, nothing sent")
    assert expected_digest(refused, "d", 3) == (None, None)
    outcome = _judge({"a": report(digest="d")}, refused, quorum_of=("a",), expected=None)
    assert outcome.status == "failed" and "StaleCopy" in outcome.reason and outcome.committed == []


def test_a_receiver_the_trainer_saw_absent_received_nothing_whatever_it_reports() -> None:
    trainer = done("d")
    trainer.absent_ranks = [2]
    outcome = _judge({"a": report(), "b": report()}, trainer, need=2)
    assert outcome.status == "failed" and outcome.entries[1]["reason"].startswith("it never joined")
    outcome = _judge({"a": report(), "b": report()}, trainer, need=1)
    assert outcome.status == "committed" and outcome.committed == ["a"]  # only the one that received is proven


# ---- catch-up and repair -------------------------------------------------------------------------------------
def test_a_torn_receiver_is_repaired_with_what_it_served_last_when_cached() -> None:
    torn = agent(serving=4)
    torn.model.last_served = 4
    torn.model.tore("oom")
    cached = {4: 4, 6: 6}.get
    assert repair_source(torn, 6, cached) == 4
    assert repair_source(torn, 6, {6: 6}.get) == 6  # its own is gone: the newest committed one
    assert repair_source(agent(), None, cached) is None


def test_a_catch_up_brings_the_largest_group_its_version() -> None:
    newcomers = [agent() for _ in range(2)]
    torn = agent(serving=4)
    torn.model.tore("oom")
    for a in (*newcomers, torn):
        a.model.catch_up_due = NOW - 1
    plan = plan_catch_up([*newcomers, torn, agent(serving=6)], NOW, 6, {4: 4, 6: 6}.get)
    assert plan.source == 6 and list(plan.receivers) == newcomers and plan.purpose == "catch_up"
    later = agent()
    later.model.catch_up_due = NOW + 5  # not due yet (it just registered)
    assert plan_catch_up([later], NOW, 6, {6: 6}.get) is None


def test_an_engine_s_workers_are_due_together() -> None:
    w1, w2 = (agent(engine="e", driven=True, members=2) for _ in range(2))
    w1.model.catch_up_due, w2.model.catch_up_due = NOW - 1, NOW + 3
    assert plan_catch_up([w1, w2], NOW, 6, {6: 6}.get) is None
    w2.model.catch_up_due = NOW - 1
    assert list(plan_catch_up([w1, w2], NOW, 6, {6: 6}.get).receivers) == [w1, w2]


def test_the_cache_keeps_what_receivers_serve_and_the_newest_committed() -> None:
    receivers = [agent(serving=4), agent(serving=9), agent()]
    receivers[0].model.last_served = 3
    source_of = {3: 3, 4: 4, 9: 2, 10: 10}.get  # 9 is a re-push of 2
    assert kept_for_repairs(receivers, 10, source_of) == [10, 4, 3, 2]
    assert len(kept_for_repairs([agent(serving=v) for v in range(1, 20)], 20, lambda v: v)) == MAX_KEPT
    assert kept_for_repairs(receivers, 10, source_of, limit=1) == [10]  # at most keep_versions: the newest first


def test_what_a_receiver_only_claims_pins_nothing() -> None:
    """Found by the outside attack: three raw registrations claiming versions 1, 2 and 4 made the trainer keep
    five versions with keep_versions 1."""
    claims = [agent(serving=v, proven=False) for v in (1, 2, 4)]
    assert kept_for_repairs(claims, 7, lambda v: v, limit=4) == [7]


# ---- the policies --------------------------------------------------------------------------------------------
def test_plain_and_framework_policies() -> None:
    assert policy_of(None) is PLAIN and policy_of("verl") is FRAMEWORK
    assert PLAIN.need(3, min_receivers=1) == 1 and PLAIN.need(3, min_receivers=5) == 3
    assert FRAMEWORK.need(3, min_receivers=1) == 3
    assert PLAIN.assigns and PLAIN.catches_up and not PLAIN.supersedes_open and not PLAIN.queues_rollbacks
    assert not FRAMEWORK.assigns and not FRAMEWORK.catches_up and FRAMEWORK.supersedes_open
    assert FRAMEWORK.queues_rollbacks


# ---- cadence --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sync_every,offers,took", [(1, 4, [True, True, True, True]),
                                                    (2, 5, [True, False, True, False, True]),
                                                    (3, 4, [True, False, False, True])])
def test_a_receiver_takes_every_nth_regular_version_offered(sync_every: int, offers: int, took: list[bool]) -> None:
    receiver = agent()
    receiver.sync_every = sync_every
    assert [bool(offer([receiver])) for _ in range(offers)] == took


def test_receivers_of_different_cadences_are_due_independently() -> None:
    every, second = agent(), agent()
    second.sync_every = 2
    assert [[r is second for r in offer([every, second])] for _ in range(3)] == [[False, True], [False], [False, True]]


def test_a_refused_sync_holds_catch_ups_for_two_rendezvous_bounds_and_a_margin() -> None:
    pause = CatchUpPause()
    assert not pause.holds(NOW)
    pause.sync_refused(NOW, connect_s=8.0)
    assert pause.holds(NOW + 20.9) and not pause.holds(NOW + 21.0)


def test_the_periodic_work_is_unhealthy_only_after_failing_for_a_while() -> None:
    from ckpt_engine.server.decisions.tick_health import FAILING_S, TickHealth

    health = TickHealth(100.0)
    assert health.problem(100.0) is None
    health.failed("OSError: disk", 100.0)
    assert health.problem(100.0 + FAILING_S / 2) is None  # one failure: logged and retried, still healthy
    health.failed("OSError: disk again", 101.0)  # the time since the last success counts, the last error is named
    problem = health.problem(100.0 + FAILING_S + 1)
    assert problem is not None and "disk again" in problem and f"{FAILING_S + 1:.0f}s" in problem
    health.succeeded(200.0)
    assert health.problem(201.0) is None


def test_a_stuck_or_mostly_failing_periodic_work_is_unhealthy() -> None:
    """Found by the outside attack: a tick that hung never reported a failure, and one failing 9 times in 10
    reset the clock at every success; /health said ok to both."""
    from ckpt_engine.server.decisions.tick_health import FAILING_S, TickHealth

    stuck = TickHealth(0.0)
    stuck.succeeded(1.0)  # then nothing: the tick hangs, or its thread is gone
    assert "not completed" in (stuck.problem(1.0 + FAILING_S) or "")
    flaky = TickHealth(0.0)
    for i in range(20):  # a tick every 0.5 s, 9 of every 10 failing
        (flaky.succeeded if i % 10 == 0 else lambda now: flaky.failed("boom", now))(i * 0.5)
    assert "failed 18 of its last 20" in (flaky.problem(9.6) or "")  # (its last success 4.6 s ago)
    healthy = TickHealth(0.0)
    for i in range(20):  # one failure in 20: fine
        (healthy.failed if i == 7 else lambda e, now: healthy.succeeded(now))("x", i * 0.5)
    assert healthy.problem(10.0) is None


@pytest.mark.parametrize(("current", "event", "moves"), [
    ("requested", "snapshotting", True), ("snapshotting", "transferring", True), ("verifying", "transferring", False),
    ("transferring", "transferring", False), ("committed", "verifying", False), ("failed", "snapshotting", False),
    ("requested", "done", False), (None, "verifying", False),
])
def test_a_trainer_stage_moves_a_version_forward_only(current, event, moves) -> None:
    from ckpt_engine.server.decisions.ending import advances

    assert advances(current, event) is moves


def test_a_version_waits_on_registered_joined_receivers_and_present_drivers_only() -> None:
    from ckpt_engine.server.decisions.ending import waiting_for

    quorum = {"a": 1, "b": 2, "c": 3, "gone": 4}
    waiting = waiting_for(quorum, reported={"a"}, absent_ranks={3}, registered={"a", "b", "c"},
                          apply_sent=["e1", "e2", "e3"], applied={"e1"}, engines_with_driver={"e1", "e2"})
    assert waiting == ["b", "e2"]  # c never joined, "gone" unregistered, e3's driver gone, e1 said


@pytest.mark.parametrize(("digest", "waiting", "since", "pull_s", "ready"), [
    (True, [], 0.0, 0.0, True), (True, ["b"], 1.0, 0.0, False), (True, ["b"], 30.0, 0.0, True),
    (False, ["b"], 0.0, 0.0, True),  # nothing can commit: no receiver is waited on
    (True, ["p"], 30.0, 500.0, False),  # a puller reads after the trainer is done: the rest of the version's time
    (True, ["p"], 500.0, 500.0, True),
    (True, ["p"], 30.0, 10.0, True),  # never less than an acknowledgement's time
    (True, ["b"], 30.0, 500.0, True),  # pushed receivers only: the acknowledgement time
])
def test_when_a_version_is_judged(digest, waiting, since, pull_s, ready) -> None:
    from ckpt_engine.server.decisions.ending import ready_to_judge

    assert ready_to_judge(digest, waiting, since, ack_s=30.0, pulling={"p"}, pull_s=pull_s) is ready


def test_whom_a_versions_end_benches() -> None:
    from ckpt_engine.server.decisions.ending import Benching, benchings

    got = benchings(9, heard_everyone=True, silent=["s"], unfit_classes=[(["t1", "t2"], "x" * 900), ([], "none")],
                    absent=["n"])
    assert got == [Benching(("s",), "did not report its outcome of version 9"),
                   Benching(("t1", "t2"), "its shard spec does not fit version 9: " + "x" * 500),
                   Benching(("n",), "did not join the sync group of version 9", unproven=True)]
    # without the trainer's digest nobody was waited on: silence is no fault
    assert benchings(9, heard_everyone=False, silent=["s"], unfit_classes=[], absent=[]) == []


def test_an_engine_is_told_to_apply_once_every_worker_staged_the_version() -> None:
    from ckpt_engine.server.decisions.ending import engine_to_apply

    engines = {"e": ["w1", "w2"]}
    assert engine_to_apply("e", engines, set(), {"w1": 4, "w2": 4}, 4)
    assert not engine_to_apply("e", engines, set(), {"w1": 4, "w2": 3}, 4)  # w2 staged an older one
    assert not engine_to_apply("e", engines, set(), {"w1": 4}, 4)  # w2 is gone
    assert not engine_to_apply("e", engines, {"e"}, {"w1": 4, "w2": 4}, 4)  # told already, or failed
    assert not engine_to_apply(None, engines, set(), {}, 4) and not engine_to_apply("x", engines, set(), {}, 4)


def test_a_failed_worker_fails_its_engine_once() -> None:
    from ckpt_engine.server.decisions.ending import to_discard

    engines = {"e": ["w1", "w2", "w3"]}
    assert to_discard("e", engines, set(), "w1", reported={"w1", "w3"}) == ["w2"]
    assert to_discard("e", engines, {"e"}, "w1", reported=set()) is None  # settled: nothing anew
    assert to_discard(None, engines, set(), "w1", reported=set()) is None


def test_pullers_of_a_sharded_version_have_no_seat_and_get_their_classs_descriptor() -> None:
    from ckpt_engine.server.decisions.assignments import pull_assignments
    from ckpt_engine.server.decisions.receiver_classes import plan_lanes

    pushed, pulled, whole = agent(host_id="x"), agent(host_id="y"), agent(host_id="z")
    for receiver in (pushed, pulled):
        receiver.shard_spec, receiver.shard_key = {"w": [[0, 0, 2]]}, "tp0"
    quorum = {pushed.agent_id: 1, pulled.agent_id: 2, whole.agent_id: 3}
    plan = plan_lanes([pushed, pulled, whole], quorum, (), {pulled.agent_id, whole.agent_id})
    assert [(lane.key, lane.ranks, lane.pullers) for lane in plan.lanes] == [("tp0", [1], [2]), ("whole", [], [3])]
    assert set(plan.seats) == {pushed.agent_id} and plan.keys[whole.agent_id] == "whole"
    offer = _offer(5, rank=0, described=False).model_copy(update={"classes": {
        "tp0": _offer(5, rank=0).descriptor, "whole": _offer(5, rank=0).descriptor.model_copy(update={"nbytes": 9})}})
    got = dict(pull_assignments(5, "cached", 1, {pulled.agent_id: 2, whole.agent_id: 3}, offer, plan.keys))
    assert got[pulled.agent_id].offer.descriptor.nbytes == 8 and got[whole.agent_id].offer.descriptor.nbytes == 9
    assert all(not a.offer.classes for a in got.values())  # each puller learns its own class's only


@pytest.mark.parametrize(("offered", "failed", "never"), [
    (False, True, {"p", "q"}), (True, True, set()), (False, False, set()), (True, False, set())])
def test_pullers_never_offered_the_version_are_not_waited_on(offered, failed, never) -> None:
    from ckpt_engine.server.decisions.ending import unoffered_pullers

    assert unoffered_pullers(("p", "q"), offered, failed) == never


def test_a_puller_never_offered_is_recorded_so_and_not_as_silent() -> None:
    outcome = _judge({"a": report()}, done(), quorum_of=("a", "p"), unoffered={"p"})
    entry = next(e for e in outcome.entries if e["agent_id"] == "p")
    assert entry["ok"] is False and "never offered" in entry["reason"] and entry["missing_report"] is False
    assert "p" not in outcome.silent


def test_an_owner_rank_failing_after_every_receiver_verified_is_said_in_a_committed_version() -> None:
    outcome = _judge({"a": report(), "b": report()}, owners={1: "its report failed"})
    assert outcome.status == "committed" and "owner rank 1 failed afterwards: its report failed" in outcome.reason
    assert _judge({"a": report(), "b": report()}).reason is None
