"""The controller (the shell around server/decisions/) driven through its own entries, with an in-memory
history and a clock the test moves: whole lifecycles in milliseconds. Real processes test the wiring and
real failures elsewhere; here are the rules as the controller applies them."""

from __future__ import annotations

import pytest

from ckpt_engine.config import parse_config
from ckpt_engine.control.messages import FrameworkSyncRequest, Poll, Register, Report, SyncRequest
from ckpt_engine.server.controller import Controller
from ckpt_engine.server.errors import Conflict, Forbidden, NotFound, Unavailable
from ckpt_engine.server.history import HistoryStore
from ckpt_engine.server.metrics import Metrics

TRAINER, ROLLOUT = {"trainer"}, {"rollout"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Daemon:
    """A controller and the agents a test registers with it (each: id, session)."""

    def __init__(self, **config) -> None:
        timeouts = {"connect_s": 5, "collective_s": 5, "ack_s": 5, "heartbeat_s": 10, "version_s": 60}
        self.clock = Clock()
        self.ctl = Controller(parse_config({"timeouts": timeouts, **config}), HistoryStore(":memory:"), Metrics(),
                              store_host="127.0.0.1", store_port=1, group_name="g", clock=self.clock)

    def register(self, role: str, **fields) -> dict:
        reply = self.ctl.register(Register(role=role, host="h", pid=1, device="cpu", **fields))
        return {"agent_id": reply.agent_id, "session": reply.session, "engine_key": reply.engine_key,
                "roles": TRAINER if role == "trainer" else ROLLOUT}

    def poll(self, agent: dict, **fields):
        message = Poll(agent_id=agent["agent_id"], session=agent["session"], wait_s=0, **fields)
        self.ctl.acknowledge(message, agent["roles"])
        assignment = self.ctl.poll(message, agent["roles"]).assignment
        if assignment is not None:  # acknowledged by the next poll
            self.ctl.acknowledge(Poll(agent_id=agent["agent_id"], session=agent["session"], wait_s=0,
                                      received=assignment.key()), agent["roles"])
        return assignment

    def work(self, agent: dict):
        """The next assignment that is not an eviction (the daemon asks the trainer ranks to drop a failed
        version from their caches when it ends)."""
        while (assignment := self.poll(agent)) is not None and assignment.kind == "evict":
            pass
        return assignment

    def report(self, agent: dict, version: int, event: str, **fields) -> None:
        self.ctl.report(Report(agent_id=agent["agent_id"], session=agent["session"], version=version, event=event,
                               **fields), agent["roles"])

    def record(self, version: int) -> dict:
        return self.ctl.history.get(version).to_dict()

    def state(self, agent: dict) -> dict:
        return next(a for a in self.ctl.agents_public() if a["agent_id"] == agent["agent_id"])

    def commit(self, trainer: dict, receivers: list[dict], version: int, digest: str = "d") -> None:
        self.report(trainer, version, "done", ok=True, version_digest=digest, cache_versions=[version])
        for receiver in receivers:
            self.report(receiver, version, "received", ok=True, version_digest=digest)

    def committed(self, trainer: dict, receivers: list[dict]) -> int:
        """A new version, assigned (every agent polls) and committed by ``receivers``; its id."""
        version = self.ctl.request_sync(SyncRequest()).id
        for agent in (trainer, *receivers):
            self.poll(agent)
        self.commit(trainer, receivers, version)
        return version

    def tick(self, seconds: float = 0.0) -> None:
        self.clock.now += seconds
        self.ctl.tick()


def test_a_version_commits_on_the_receivers_own_reports_and_proves_them() -> None:
    d = Daemon()
    trainer, rx = d.register("trainer"), d.register("receiver")
    version = d.ctl.request_sync(SyncRequest()).id
    send, receive = d.poll(trainer), d.poll(rx)
    assert (send.kind, receive.kind, receive.rank, send.keep) == ("send", "receive", 1, [])
    assert d.state(rx)["state"] == "new"
    d.commit(trainer, [rx], version)
    record = d.record(version)
    assert record["status"] == "committed" and record["cached"] and record["receivers"][0]["ok"]
    assert d.state(rx)["state"] == "serving" and d.state(rx)["serving"] == version
    # the next version keeps the committed one for repairs, and is sparse against it when asked
    second = d.ctl.request_sync(SyncRequest(sparse=True)).id
    assert d.poll(trainer).keep == [version] and d.ctl.flights.current.version == second


def test_a_newcomer_is_caught_up_alone_before_it_joins_regular_versions() -> None:
    d = Daemon()
    trainer, old = d.register("trainer"), d.register("receiver")
    first = d.committed(trainer, [old])
    d.poll(trainer, versions=[first])  # the trainer caches it
    newcomer = d.register("receiver")
    assert not d.state(newcomer)["joins_next"]
    d.tick(2.0)  # past its settle time: the cache brings it the newest committed version
    catch_up = d.ctl.flights.current
    assert catch_up is not None and catch_up.purpose == "catch_up" and list(catch_up.quorum) == [newcomer["agent_id"]]
    assert d.poll(trainer).source_version == first and d.poll(newcomer).kind == "receive"
    d.commit(trainer, [newcomer], catch_up.version)
    assert d.state(newcomer)["joins_next"] and d.state(newcomer)["state"] == "serving"


def test_a_torn_receiver_is_repaired_with_what_it_served_and_failed_versions_do_not_evict_it() -> None:
    d = Daemon()
    trainer, rx = d.register("trainer"), d.register("receiver")
    first = d.committed(trainer, [rx])
    for _ in range(2):  # two refused versions: it keeps serving the first
        version = d.ctl.request_sync(SyncRequest()).id
        assert d.work(trainer).keep == [first]
        d.poll(rx)
        d.report(trainer, version, "done", ok=True, version_digest="e", cache_versions=[first, version])
        d.report(rx, version, "received", ok=False, reason="refused", serving=first)
        assert d.record(version)["status"] == "failed"
    torn = d.ctl.request_sync(SyncRequest()).id
    d.poll(trainer), d.poll(rx)
    d.report(trainer, torn, "done", ok=True, version_digest="f", cache_versions=[first, torn])
    d.report(rx, torn, "received", ok=False, reason="apply failed part way", torn=True)
    assert d.state(rx)["state"] == "torn" and d.ctl.status()["torn"] == [rx["agent_id"]]
    d.tick()
    repair = d.ctl.flights.current
    assert repair.purpose == "repair" and d.work(trainer).source_version == first
    assert d.work(trainer) is None  # (acknowledged)


def test_a_silent_receiver_is_benched_and_one_absent_from_the_rendezvous_loses_its_proof() -> None:
    d = Daemon()
    trainer, rx, other = d.register("trainer"), d.register("receiver"), d.register("receiver")
    first = d.committed(trainer, [rx, other])
    second = d.ctl.request_sync(SyncRequest()).id
    d.poll(trainer), d.poll(rx), d.poll(other)
    d.report(rx, second, "received", ok=True, version_digest="e")
    d.report(trainer, second, "done", ok=True, version_digest="e", cache_versions=[first, second], absent_ranks=[2])
    # judged at once: one absent from the rendezvous received nothing, so there is no report of it to wait for
    assert d.record(second)["status"] == "committed"  # min_receivers 1
    assert d.state(other)["state"] == "unable" and not d.state(other)["proven"]
    assert "did not join" in d.state(other)["unable"]


def test_an_impostor_cannot_take_a_live_engine_out_but_a_restarted_worker_takes_its_silent_place() -> None:
    d = Daemon()
    trainer = d.register("trainer")
    driver = d.register("driver", engine="e", members=1)
    key = driver["engine_key"]
    with pytest.raises(Forbidden, match="engine_key"):  # a worker slot is the driver's to give
        d.register("receiver", engine="e", driven=True, members=1)
    worker = d.register("receiver", engine="e", driven=True, members=1, engine_key=key)
    with pytest.raises(Conflict) as refused:
        d.register("receiver", engine="e", driven=True, members=1, engine_key=key)
    assert worker["agent_id"] in refused.value.detail and refused.value.record["retry_after_s"] is not None
    d.clock.now += 6.0  # the worker fell silent (killed); its driver and the trainer poll on
    d.poll(driver), d.poll(trainer)
    restarted = d.register("receiver", engine="e", driven=True, members=1, engine_key=key)
    ids = [a["agent_id"] for a in d.ctl.agents_public()]
    assert restarted["agent_id"] in ids and worker["agent_id"] not in ids


def test_a_framework_sync_needs_every_worker_supersedes_an_abandoned_one_and_takes_a_queued_rollback() -> None:
    d = Daemon()
    trainer = d.register("trainer", framework="verl", trainer_ranks=1)
    workers = [d.register("receiver", framework="verl") for _ in range(2)]

    def open_sync(step: int) -> dict:
        return d.ctl.framework_sync(FrameworkSyncRequest(receivers=[w["agent_id"] for w in workers], step=step,
                                                         agent_id=trainer["agent_id"], session=trainer["session"]),
                                    TRAINER)

    first = open_sync(5)
    assert d.poll(workers[0]) is None  # nothing is assigned: the framework's groups carry it
    d.commit(trainer, workers, first["id"])
    assert d.record(first["id"])["status"] == "committed"
    abandoned = open_sync(6)["id"]
    second = open_sync(7)
    assert d.record(abandoned)["status"] == "interrupted" and second["id"] > abandoned
    d.report(trainer, second["id"], "done", ok=True, version_digest="e", cache_versions=[first["id"], second["id"]])
    d.report(workers[0], second["id"], "received", ok=True, version_digest="e")
    d.report(workers[1], second["id"], "received", ok=False, reason="load failed", torn=True)
    assert d.record(second["id"])["status"] == "failed"  # a framework needs every worker it named
    queued = d.ctl.push(first["id"])
    assert queued.status == "requested" and d.ctl.status()["queued_push"] == queued.id
    taken = open_sync(8)
    assert taken["id"] == queued.id and taken["source_version"] == first["id"] and taken["step"] == 8
    assert taken["expected_digest"] == "d" and first["id"] in taken["keep"]
    with pytest.raises(Conflict, match="in flight"):  # (and once it ended, the daemon still starts none itself)
        d.ctl.request_sync(SyncRequest())
    d.commit(trainer, workers, taken["id"])
    with pytest.raises(Conflict, match="driven by verl"):
        d.ctl.request_sync(SyncRequest())


def test_a_re_push_is_judged_by_the_digest_its_source_committed_with() -> None:
    d = Daemon()
    trainer, rx = d.register("trainer"), d.register("receiver")
    first = d.committed(trainer, [rx])
    pushed = d.ctl.push(first).id
    assignment = d.poll(trainer)
    assert assignment.source_version == first and assignment.expected_digest == "d"
    d.poll(rx)
    d.commit(trainer, [rx], pushed, digest="changed")
    record = d.record(pushed)
    assert record["status"] == "failed" and "committed as d" in record["reason"]


def test_no_receiver_and_a_silent_trainer_are_refused_with_a_record() -> None:
    d = Daemon()
    with pytest.raises(Unavailable, match="no trainer"):
        d.ctl.request_sync(SyncRequest())
    trainer = d.register("trainer")
    with pytest.raises(Unavailable, match="no receiver is registered"):
        d.ctl.request_sync(SyncRequest())
    rx = d.register("receiver")
    for _ in range(14):  # the trainer falls silent; the receiver polls on
        d.tick(0.5)
        d.poll(rx)
    with pytest.raises(Unavailable, match=f"trainer agent {trainer['agent_id']} has not been heard from"):
        d.ctl.request_sync(SyncRequest())
    assert [r.status for r in d.ctl.history.list()] == ["failed"] * 3
    for _ in range(8):  # the heartbeat expires: the trainer is gone, the receiver polling on stays
        d.tick(0.5)
        d.poll(rx)
    assert [a["role"] for a in d.ctl.agents_public()] == ["receiver"]


def test_a_version_past_its_limit_fails_naming_its_state() -> None:
    d = Daemon()
    trainer, rx = d.register("trainer"), d.register("receiver")
    version = d.ctl.request_sync(SyncRequest()).id
    d.report(trainer, version, "snapshotting", step=3)
    for _ in range(13):  # agents keep polling while the version hangs
        d.clock.now += 5.0
        d.poll(trainer), d.poll(rx)
        d.ctl.tick()
    record = d.record(version)
    assert record["status"] == "failed" and "timed out in state snapshotting after 60s" in record["reason"]
    assert record["step"] == 3


def test_a_re_push_the_trainer_did_not_send_commits_nothing_whatever_a_receiver_claims() -> None:
    """Found by the outside attack: the trainer refused a stale copy (nothing sent) and the re-push committed
    on one receiver's report of the source's digest, which any token can read in the history."""
    d = Daemon()
    trainer, rx = d.register("trainer"), d.register("receiver")
    first = d.committed(trainer, [rx])
    pushed = d.ctl.push(first).id
    d.poll(trainer), d.poll(rx)
    d.report(rx, pushed, "received", ok=True, version_digest=d.record(first)["version_digest"])
    d.report(trainer, pushed, "done", ok=False, reason="StaleCopy: refused, nothing sent", cache_versions=[])
    record = d.record(pushed)
    assert record["status"] == "failed" and "StaleCopy" in record["reason"], record


def _verl(d: Daemon) -> tuple[dict, list[dict]]:
    return d.register("trainer", framework="verl", trainer_ranks=1), [d.register("receiver", framework="verl")
                                                                      for _ in range(2)]


def _open(d: Daemon, trainer: dict, receivers: list[str], step: int = 1) -> dict:
    return d.ctl.framework_sync(FrameworkSyncRequest(receivers=receivers, step=step, agent_id=trainer["agent_id"],
                                                     session=trainer["session"]), TRAINER)


def test_a_refused_framework_sync_leaves_the_open_one_as_it_was() -> None:
    """Outside attack on issue 26: a second sync naming an unknown receiver (404) or failing its quorum (503)
    ended the open sync as interrupted."""
    d = Daemon(min_receivers=2)
    trainer, workers = _verl(d)
    ids = [w["agent_id"] for w in workers]
    opened = _open(d, trainer, ids)["id"]
    with pytest.raises(NotFound):
        _open(d, trainer, [ids[0], "nobody"])
    with pytest.raises(Unavailable):
        _open(d, trainer, [ids[0]])  # one receiver, two needed
    assert d.record(opened)["status"] == "requested" and d.ctl.flights.current.version == opened
    assert d.record(_open(d, trainer, ids)["id"])["status"] == "requested"  # a valid one supersedes it
    assert d.record(opened)["status"] == "interrupted"


def test_a_rollback_queued_for_a_framework_ends_when_its_trainer_leaves() -> None:
    """Outside attack on issue 26: the queued rollback stayed requested for the daemon's life after the verl
    job left and a plain trainer took over."""
    d = Daemon()
    trainer, workers = _verl(d)
    first = _open(d, trainer, [w["agent_id"] for w in workers])["id"]
    d.commit(trainer, workers, first)
    d.poll(trainer, versions=[first])
    queued = d.ctl.push(first)
    d.ctl.unregister(trainer["agent_id"], trainer["session"], TRAINER)
    record = d.record(queued.id)
    assert record["status"] == "cancelled" and "left before its next sync" in record["reason"]
    assert d.ctl.status()["queued_push"] is None


def test_only_a_driven_worker_of_the_quorum_stages_a_version() -> None:
    """Outside attack on issue 26: a plain receiver outside the quorum that reported ``staged`` stayed staged."""
    d = Daemon()
    trainer, member, outsider = d.register("trainer"), d.register("receiver"), None
    version = d.ctl.request_sync(SyncRequest()).id
    d.poll(trainer), d.poll(member)
    outsider = d.register("receiver")
    d.report(outsider, version, "staged")
    d.report(member, version, "staged")
    assert d.state(outsider)["staged"] is None and d.state(member)["staged"] is None
    d.commit(trainer, [member], version)
    d.tick(1000)
    assert d.state(outsider)["state"] != "staged"


def test_framework_only_fields_are_refused_on_a_plain_sync_and_steps_are_counts() -> None:
    """Outside attack on issue 26: the ZMQ sync silently ignored what HTTP refuses; ``step: true`` was step 1."""
    from pydantic import ValidationError

    from ckpt_engine.server.errors import BadRequest
    from ckpt_engine.server.operations import OPERATIONS

    d = Daemon()
    plain, rx = d.register("trainer"), d.register("receiver")
    sync = OPERATIONS["sync"]
    with pytest.raises(BadRequest, match="limit_s"):
        sync.run(d.ctl, sync.model.model_validate({"limit_s": 5}), TRAINER)
    for step in (True, -1):
        with pytest.raises(ValidationError):
            SyncRequest.model_validate({"step": step})
    with pytest.raises(Conflict, match="plain trainer"):
        _open(d, plain, [rx["agent_id"]])


@pytest.mark.parametrize("asked, default, expected", [
    ((None, None), (False, True), ("cached", True)),
    ((True, None), (False, True), ("bypass_cpu", False)),  # the deployment's sparse yields to bypass_cpu asked
    ((None, True), (True, False), ("cached", True)),  # and its bypass_cpu to sparse asked
    ((False, False), (True, True), ("cached", False)),
])
def test_a_deployment_default_yields_to_what_a_request_asks(asked, default, expected) -> None:
    from ckpt_engine.plan.modes import resolve

    assert resolve(*asked, default_bypass_cpu=default[0], default_sparse=default[1]) == expected


def test_asking_for_both_sparse_and_bypass_cpu_is_refused() -> None:
    from ckpt_engine.errors import ConfigError
    from ckpt_engine.plan.modes import resolve

    with pytest.raises(ConfigError, match="sparse"):
        resolve(True, True, default_bypass_cpu=False, default_sparse=False)


def test_polls_say_the_version_in_flight_and_an_owner_failing_late_is_said_in_its_version() -> None:
    d = Daemon()
    trainer = d.register("trainer", trainer_ranks=2)
    second_rank, rx = d.register("trainer", rank=1), d.register("receiver")
    version = d.ctl.request_sync(SyncRequest()).id
    asked = Poll(agent_id=trainer["agent_id"], session=trainer["session"], wait_s=0)
    assert d.ctl.poll(asked, trainer["roles"]).in_flight == version
    d.poll(trainer), d.poll(rx)
    d.commit(trainer, [rx], version)
    assert d.ctl.poll(asked, trainer["roles"]).in_flight is None and d.record(version)["reason"] is None
    d.report(second_rank, version, "done", ok=False, reason="its report failed")  # after the version ended
    record = d.record(version)
    assert record["status"] == "committed" and "owner rank 1 failed afterwards: its report failed" in record["reason"]
