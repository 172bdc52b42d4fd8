"""Round 4 of the outside attack (issue 35), on the live path (real processes, gloo):

- a member of a class that never joins its group (an attacker's registration that polls but never joins, or a
  TP rank SIGKILLed just before a sync) costs only itself, in bypass_cpu as in cached mode: its class is sent
  nothing, the others commit, it alone is benched (never a healthy receiver at the same rank of another group),
  and the trainer is held no longer than the rendezvous timeout;
- a flood of registrations with distinct specs that never take part does not stop versions;
- one worker of an engine refusing a version fails its engine at once: the others drop what they staged.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from ckpt_engine.plan.shards import spec_to_wire
from tests.daemon_harness import start_daemon, timeouts, write_config
from tests.procs import start_processes
from tests.raw_agent import RawAgent
from tests.test_elastic import agents_of, wait_until
from tests.test_sharded_daemon import shapes_of, tp_receiver, tp_spec, trainer, whole_receiver
from tests.tiny_lm import tiny_llama

pytestmark = pytest.mark.multiproc
# A member that never comes costs its version the rendezvous timeout: the tests here wait it out once each
CONNECT_S = 15
_ABSENT = timeouts(connect_s=CONNECT_S)


class SilentMember:
    """A registration (with a valid spec, when given) that keeps polling (so it looks alive) and never joins a
    group. ``announce``: it leaves its member key in each group's store prefix, as a member that came would,
    and still never starts gloo. ``host_id``: where it claims to run (the trainer's: a colocated receiver that
    never connects to the same-host hub)."""

    def __init__(self, daemon, spec: dict | None = None, *, announce: bool = False, host_id: str | None = None) -> None:
        self.agent = RawAgent(daemon, "receiver", **({"shard_spec": spec} if spec else {}),
                              **({"host_id": host_id} if host_id else {}))
        self.announce = announce
        self._stores: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        received = None
        while not self._stop.is_set():
            try:
                got = self.agent.poll(wait_s=0.2, **({"received": received} if received else {}))
            except Exception:  # noqa: BLE001 - the daemon may be stopping
                self._stop.wait(0.2)
                continue
            received = f"{got['kind']}:{got['version']}" if got else None
            if got and got["kind"] == "receive" and self.announce and got.get("transport") != "ipc":
                self._announce(got)

    def _announce(self, assignment: dict) -> None:
        import json

        import torch.distributed as dist

        from ckpt_engine.transport.group import open_store, store_prefix

        reply = self.agent.reply
        store = open_store(reply["store_host"], reply["store_port"], timeout_s=10)
        prefixed = dist.PrefixStore(store_prefix(reply["group_name"], assignment["generation"])
                                    + assignment.get("part", ""), store)
        prefixed.set(f"ckpt-member/{assignment['rank']}", json.dumps({"host": "x", "pid": 1}).encode())
        self._stores.append(store)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.agent.close()


def tp1_spec() -> dict:
    return spec_to_wire(tp_spec(shapes_of(tiny_llama(seed=0)), 1))


def post_sync(http, **body) -> dict:
    return http.post("/sync", json={"wait": True, "timeout_s": 120, **body}, timeout=150).json()


def state_of(http, agent_id: str) -> dict:
    return next(a for a in agents_of(http) if a["agent_id"] == agent_id)


def check_only_the_absent_one_failed(http, record: dict, absent_id: str, why: str = "never joined") -> None:
    assert record["status"] == "committed", record
    entries = {e["agent_id"]: e for e in record["receivers"]}
    assert not entries[absent_id]["ok"] and why in entries[absent_id]["reason"], entries
    assert all(e["ok"] for a, e in entries.items() if a != absent_id), entries
    held = record["stages"].get("held", record["stages"].get("snapshot", 0.0))
    assert held < CONNECT_S + 15, record["stages"]  # the rendezvous timeout, not a collective's or the version's


@pytest.mark.parametrize(("mode", "announce"), [("bypass_cpu", False), ("cached", False), ("bypass_cpu", True)])
def test_a_class_member_that_never_joins_costs_only_itself(tmp_path: Path, mode: str, announce: bool) -> None:
    """bypass_cpu: every version failed, the trainer was held 15-108 s, and a healthy receiver at rank 1 of the
    quorum was benched for the silent member's rank 1 in its class group. ``announce`` (the second outside
    attack): it says it came (its member key) and never starts gloo: named by gloo's own rendezvous keys."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", bypass_cpu=mode == "bypass_cpu",
                                       min_receivers=1, timeouts=_ABSENT))
    stop, corrupt = tmp_path / "stop", tmp_path / "corrupt"
    procs = start_processes([(trainer, (daemon.zmq, str(stop), str(corrupt))),
                             (tp_receiver, (daemon.zmq, str(stop), 0)), (whole_receiver, (daemon.zmq, str(stop)))])
    silent = None
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 3, what="registration")
            if mode == "cached":
                assert post_sync(http)["status"] == "committed"  # (a cache for the catch-ups)
            silent = SilentMember(daemon, tp1_spec(), announce=announce)
            healthy = [a["agent_id"] for a in agents_of(http) if a["role"] == "receiver"
                       and a["agent_id"] != silent.agent.agent_id]
            if mode == "bypass_cpu":  # no cache, no catch-up: it joins the next version
                check_only_the_absent_one_failed(http, post_sync(http), silent.agent.agent_id)
            else:  # its catch-up fails, alone
                wait_until(lambda: state_of(http, silent.agent.agent_id)["state"] == "unable", 120,
                           "the silent member benched after its catch-up")
            assert "did not join" in state_of(http, silent.agent.agent_id)["unable"]
            for _ in range(2):
                record = post_sync(http)
                assert record["status"] == "committed" and not record["reason"], record
                assert {e["agent_id"] for e in record["receivers"]} == set(healthy), record
            assert all(state_of(http, a)["state"] == "serving" for a in healthy)  # nobody healthy benched
    finally:
        stop.touch()
        if silent is not None:
            silent.close()
        procs.collect(120)


@pytest.mark.parametrize("mode", ["bypass_cpu", "cached"])
def test_a_tp_rank_killed_just_before_a_sync_costs_only_itself(tmp_path: Path, mode: str) -> None:
    """A class's only receiver SIGKILLed just before a sync: the others applied the version, so it commits
    (bypass_cpu recorded it failed: 'class ...: ... is gone')."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", bypass_cpu=mode == "bypass_cpu",
                                       min_receivers=1, timeouts=_ABSENT))
    stop, corrupt = tmp_path / "stop", tmp_path / "corrupt"
    procs = start_processes([(trainer, (daemon.zmq, str(stop), str(corrupt))),
                             (tp_receiver, (daemon.zmq, str(stop), 0)), (whole_receiver, (daemon.zmq, str(stop)))])
    doomed = start_processes([(tp_receiver, (daemon.zmq, str(stop), 1))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 4, what="registration")
            first = post_sync(http)
            assert first["status"] == "committed" and len(first["receivers"]) == 3, first
            victim = next(a for a in agents_of(http) if a["pid"] == doomed.procs[0].pid)["agent_id"]
            doomed.procs[0].kill()
            doomed.procs[0].join(10)
            record = post_sync(http)
            if any(e["agent_id"] == victim for e in record["receivers"]):  # (it may have expired first)
                check_only_the_absent_one_failed(http, record, victim, "")  # (its group was up: it is gone)
            else:
                assert record["status"] == "committed", record
            after = post_sync(http)
            assert after["status"] == "committed" and victim not in [e["agent_id"] for e in after["receivers"]]
    finally:
        stop.touch()
        procs.collect(120)


def test_a_flood_of_silent_specs_costs_each_at_most_one_version(tmp_path: Path) -> None:
    """Registrations with distinct valid specs that poll and never join (the attack took 257: every sync was a
    503 for as long as they polled; decisions keep at most MAX_CLASSES classes, proven ones first: see
    test_shard_classes). Here 12: one version pays the rendezvous timeout, the flood is benched, the next
    versions go to the real receivers only."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", bypass_cpu=True, min_receivers=1,
                                       timeouts=_ABSENT))
    stop, corrupt = tmp_path / "stop", tmp_path / "corrupt"
    procs = start_processes([(trainer, (daemon.zmq, str(stop), str(corrupt))),
                             (tp_receiver, (daemon.zmq, str(stop), 0)), (whole_receiver, (daemon.zmq, str(stop)))])
    flood: list[SilentMember] = []
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 3, what="registration")
            real = {a["agent_id"] for a in agents_of(http) if a["role"] == "receiver"}
            flood = [SilentMember(daemon, {"model.embed_tokens.weight": [[0, row, 1]]}) for row in range(12)]
            first = post_sync(http)
            assert first["status"] == "committed", first
            assert {e["agent_id"] for e in first["receivers"] if e["ok"]} == real, first
            for member in flood:
                assert state_of(http, member.agent.agent_id)["state"] == "unable"
            for _ in range(2):
                record = post_sync(http)
                assert record["status"] == "committed" and {e["agent_id"] for e in record["receivers"]} == real
    finally:
        stop.touch()
        for member in flood:
            member.close()
        procs.collect(120)


def refusing_engine(zmq: str, stop_file: str, refuse: str) -> dict:
    """Two workers of one engine with a driver; worker 1 refuses a version while ``refuse`` exists (as vLLM's
    worker refuses a class whose digest does not match), worker 0 verifies and stages it."""
    from ckpt_engine.errors import ApplyRefused
    from ckpt_engine.workers.driver import EngineDriver
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from ckpt_engine.workers.staged import StagedVersion

    def check(index: int):
        def refuse_when_armed(payload) -> None:
            if index == 1 and os.path.exists(refuse):
                raise ApplyRefused(f"worker 1 refuses version {payload.version}")
        return refuse_when_armed

    staged = []
    for index in range(2):
        holder: dict = {}
        stage = StagedVersion(on_staged=lambda v, h=holder: h["agent"].report(v, "staged"), take_timeout_s=45,
                              apply_timeout_s=60, check=check(index))
        holder["agent"] = RolloutAgent(stage.load, zmq, poll_wait_s=0.2, engine="e0", driven=True, members=2,
                                       discard=stage.discard)
        staged.append((stage, holder["agent"]))

    class Control:
        def pause(self) -> None:
            pass

        def apply(self, version: int) -> None:
            for stage, _ in staged:
                stage.take(version, 30)
                stage.finish(version)

        def abandon(self) -> None:
            pass

        def resume(self) -> None:
            pass

    driver = EngineDriver(Control(), zmq, engine="e0", poll_wait_s=0.2).start()
    for _, agent in staged:
        agent.engine_key = driver.engine_key
        agent.start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    for _, agent in staged:
        agent.close()
    driver.close()
    return {"version": driver.version}


def test_one_worker_refusing_fails_its_engine_at_once(tmp_path: Path) -> None:
    """(the version stayed in flight for the workers' take timeout, and the healthy worker's entry read
    'verified but not applied within 60s (is the engine's driver running?)')"""
    from tests.test_torn_repair import versions_trainer

    # (the refused version still ends only when the refusing worker's exchange of acknowledgements times out: the
    # other worker waits for the driver meanwhile, so that collective is waited out)
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=timeouts(collective_s=15)))
    stop, refuse = tmp_path / "stop", tmp_path / "refuse"
    procs = start_processes([(versions_trainer, (daemon.zmq, str(stop))),
                             (refusing_engine, (daemon.zmq, str(stop), str(refuse)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 4, what="trainer, 2 workers and a driver")
            assert post_sync(http)["status"] == "committed"
            refuse.touch()
            failed = post_sync(http)
            assert failed["status"] == "failed", failed
            reasons = sorted(e["reason"] for e in failed["receivers"])
            assert any("worker 1 refuses" in r for r in reasons), reasons
            assert not any("not applied within" in r for r in reasons), reasons  # not at its take timeout
            assert any("failed it" in r for r in reasons), reasons  # the other worker dropped it at once
            refuse.unlink()
            assert post_sync(http)["status"] == "committed"
    finally:
        stop.touch()
        procs.collect(120)


def test_the_first_sparse_version_after_a_rollback_sends_only_what_changed(tmp_path: Path) -> None:
    """(finding 7: said to go whole; every receiver holds the rollback, so only the changes since it go out)"""
    from tests.test_elastic import start_trainer_and_two_receivers, sync

    daemon = start_daemon(write_config(tmp_path, sparse=True, keep_versions=3))
    stop = tmp_path / "stop"
    procs = start_trainer_and_two_receivers(daemon, stop)
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 3, what="registration")
            first, second = sync(http), sync(http)
            pushed = http.post(f"/versions/{first['id']}/push").json()["version"]
            wait_until(lambda: http.get(f"/versions/{pushed}").json()["status"] in ("committed", "failed"),
                       what="the rollback")
            after = sync(http)
    finally:
        stop.touch()
        procs.collect(120)
    assert second["tensors_skipped"] > 0
    assert after["status"] == "committed" and after["tensors_skipped"] > 0, after
    assert after["bytes"] < first["bytes"], (after["bytes"], first["bytes"])


@pytest.mark.parametrize("where", ["announcing", "colocated"])
def test_plain_bypass_versions_survive_absent_newcomers_registering_again_and_again(tmp_path: Path,
                                                                                      where: str) -> None:
    """(the second outside attack) A plain version has one group: a newcomer that never joins costs that
    version. It was never benched when it announced itself without starting gloo (healthy receivers were,
    stuck in their gloo connect), a colocated one that never connected to the hub made the trainer's report
    invalid (rank -1), and registering afresh before each sync failed every version. Now: it is named and
    benched, and newcomers wait out a gate after a miss, so the next versions go to the receivers that proved
    themselves."""
    from tests.test_elastic import receiver as plain_receiver
    from tests.test_torn_repair import versions_trainer

    daemon = start_daemon(write_config(tmp_path, transport="auto" if where == "colocated" else "collective",
                                       bypass_cpu=True, min_receivers=1, timeouts=_ABSENT))
    stop = tmp_path / "stop"
    procs = start_processes([(versions_trainer, (daemon.zmq, str(stop))),
                             (plain_receiver, (daemon.zmq, str(stop), 5))])
    members: list[SilentMember] = []
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="registration")
            healthy = next(a["agent_id"] for a in agents_of(http) if a["role"] == "receiver")
            trainer_host = next(a["host_id"] for a in agents_of(http) if a["role"] == "trainer")
            assert post_sync(http)["status"] == "committed"
            records = []
            for _ in range(3):  # a fresh registration before every sync
                members.append(SilentMember(daemon, announce=where == "announcing",
                                            host_id=trainer_host if where == "colocated" else None))
                records.append(post_sync(http))
            first = records[0]
            entry = next(e for e in first["receivers"] if e["agent_id"] == members[0].agent.agent_id)
            assert not entry["ok"] and "never joined" in entry["reason"], first
            assert state_of(http, members[0].agent.agent_id)["state"] == "unable"
            for record in records[1:]:  # newcomers are held back: these go to the proven receiver
                assert record["status"] == "committed", record
                assert [e["agent_id"] for e in record["receivers"]] == [healthy], record
            assert state_of(http, healthy)["state"] == "serving"
            assert http.get("/status").json()["newcomers_held_for_s"] > 0
    finally:
        stop.touch()
        for member in members:
            member.close()
        procs.collect(120)


# ---- the second outside attack's findings as tables -------------------------------------------------------
def test_a_long_reason_is_cut_not_refused_and_a_class_flood_names_a_few() -> None:
    """80 silent classes made the trainer's reason longer than a report takes: the daemon refused the report,
    and every version ran out its time limit with nobody benched."""
    import time as clock

    from ckpt_engine.control.messages import Report
    from ckpt_engine.plan.layout import TensorSpec, plan_layout
    from ckpt_engine.send.class_senders import Lane, _failed, _merged

    report = Report(agent_id="a", session="s" * 16, version=3, event="done", ok=False, reason="x" * 50_000)
    assert len(report.reason) == 20_000 and report.reason.endswith("...")
    lanes = [Lane(f"k{i}", {}, None, (i + 1,)) for i in range(80)]
    results = {lane.key: _failed(3, "why " * 100, clock.perf_counter()) for lane in lanes}
    layout = plan_layout([TensorSpec("w", "float32", (4,))], 1 << 20)
    merged = _merged(3, "identity", lanes, results, clock.perf_counter(), layout)
    assert merged.reason.count("class k") == 8 and "and 72 more classes failed" in merged.reason
    assert len(merged.reason) < 20_000 and len(merged.classes) == 80


def test_newcomers_wait_out_a_gate_after_one_missed_a_version() -> None:
    from ckpt_engine.server.decisions.newcomers import NewcomerGate

    gate = NewcomerGate()
    assert gate.admits(0.0)
    first = gate.missed(100.0, "receiver x never joined version 4")
    assert not gate.admits(100.0) and gate.admits(100.0 + first + 0.01)
    second = gate.missed(200.0, "again")
    assert second > first and gate.public(200.0)["newcomers_held_because"] == "again"  # longer each time
    gate.proved()
    assert gate.missed(300.0, "after one proved itself") < second


def test_a_discard_told_before_staging_holds_for_that_version_only() -> None:
    """(a daemon that lost its history numbers versions afresh: an old discard must not refuse a new version)"""
    from ckpt_engine.errors import ApplyRefused
    from ckpt_engine.workers.staged import StagedVersion

    class Payload:
        def __init__(self, version: int) -> None:
            self.version = version

    staged = StagedVersion(on_staged=lambda v: None, take_timeout_s=0.2, apply_timeout_s=1)
    staged.discard(5, "worker 1 failed it")
    with pytest.raises(ApplyRefused, match="worker 1 failed it"):
        staged.load(Payload(5))
    time.sleep(0.3)  # past its lifetime (the take timeout): version 5 of another history is not refused for it
    with pytest.raises(ApplyRefused, match="not applied within"):  # (nobody takes it: refused at the take timeout)
        staged.load(Payload(5))


# ---- the third outside attack (after the fixes above) ------------------------------------------------------
class FalseAddressMember(SilentMember):
    """A registration that, in each group it is assigned, publishes its member key and a gloo address of its own
    under its rank (the store takes any member's word), then never starts gloo: ``garbage`` bytes, or the
    trainer's address with the port of a socket it holds that accepts and never speaks (``listener``)."""

    def __init__(self, daemon, mode: str) -> None:
        import socket

        self.mode = mode
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self._held: list = []
        threading.Thread(target=self._accept, daemon=True).start()
        super().__init__(daemon, announce=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._held.append(conn)  # accepted, never answered

    def _announce(self, assignment: dict) -> None:
        import datetime
        import json

        import torch.distributed as dist

        from ckpt_engine.transport.group import open_store, store_prefix

        reply = self.agent.reply
        store = open_store(reply["store_host"], reply["store_port"], timeout_s=60)
        self._stores.append(store)
        prefixed = dist.PrefixStore(store_prefix(reply["group_name"], assignment["generation"])
                                    + assignment.get("part", ""), store)
        rank = assignment["rank"]
        prefixed.set(f"ckpt-member/{rank}", json.dumps({"host": "x", "pid": 1}).encode())
        if self.mode == "garbage":
            prefixed.set(f"0/{rank}", b"garbage")
            return
        prefixed.wait(["0/0"], datetime.timedelta(seconds=60))
        address = bytearray(prefixed.get("0/0"))
        address[20:22] = self.listener.getsockname()[1].to_bytes(2, "big")  # (sockaddr_in6 at 18: its port)
        prefixed.set(f"0/{rank}", bytes(address))

    def close(self) -> None:
        super().close()
        self.listener.close()


@pytest.mark.parametrize("mode", ["garbage", "listener"])
def test_a_false_gloo_address_costs_its_publisher_not_a_proven_receiver(tmp_path: Path, mode: str) -> None:
    """(the third outside attack) A newcomer publishing a false gloo address under its own rank made every
    version fail (garbage: at once, nobody named) or made the proven receiver look absent (listener: it was
    benched) while the publisher stayed new. The store cannot tell who lies, so a group that did not form is laid
    at the receivers that never proved themselves first."""
    from tests.test_elastic import receiver as plain_receiver
    from tests.test_torn_repair import versions_trainer

    daemon = start_daemon(write_config(tmp_path, transport="collective", bypass_cpu=True, min_receivers=1,
                                       timeouts=timeouts(connect_s=CONNECT_S)))
    stop = tmp_path / "stop"
    procs = start_processes([(versions_trainer, (daemon.zmq, str(stop))),
                             (plain_receiver, (daemon.zmq, str(stop), 6))])
    member = None
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="registration")
            healthy = next(a["agent_id"] for a in agents_of(http) if a["role"] == "receiver")
            assert post_sync(http)["status"] == "committed"
            member = FalseAddressMember(daemon, mode)
            wait_until(lambda: len(agents_of(http)) == 3, what="the attacker's registration")
            records = [post_sync(http) for _ in range(3)]
            attacker = state_of(http, member.agent.agent_id)
            assert attacker["unable"] is not None, (attacker, records)  # benched (maybe out again by now)
            mine = state_of(http, healthy)
            assert mine["unable"] is None and mine["proven"], (mine, records)  # never benched
            assert records[-1]["status"] == "committed", records  # the attacker is out: versions go on
    finally:
        stop.touch()
        if member is not None:
            member.close()
        procs.collect(120)


def test_a_group_that_did_not_form_is_laid_at_the_unproven_first() -> None:
    from ckpt_engine.server.decisions.newcomers import blamed_for_rendezvous

    proven = {"p1", "p2"}
    assert blamed_for_rendezvous(["n1"], ["p1", "n1"], proven) == ["n1"]  # named and new: only it
    assert blamed_for_rendezvous(["p1", "n1"], ["p1", "n1"], proven) == ["n1"]  # a proven one named beside it
    assert blamed_for_rendezvous(["p1"], ["p1", "n1", "n2"], proven) == ["n1", "n2"]  # a false address's work
    assert blamed_for_rendezvous([], ["p1", "n1"], proven) == ["n1"]  # nobody named: the unproven
    assert blamed_for_rendezvous(["p1"], ["p1", "p2"], proven) == ["p1"]  # only proven ones there: whom it names
    assert blamed_for_rendezvous([], ["p1", "p2"], proven) == []


def test_one_newcomer_joins_a_regular_version_at_a_time_fresh_ones_first() -> None:
    """(the third outside attack) Silent registrations whose bench ran out came back into every version beside
    a legitimate receiver that had restarted, failing it each time, while the gate grew."""
    from ckpt_engine.server.decisions.quorum import few_newcomers
    from tests.test_decisions import agent

    proven = agent(serving=1)
    old_attacker, restarted, fresh = agent(proven=False), agent(proven=False), agent(proven=False)
    old_attacker.model.unable = "did not join the sync group of version 3"  # benched before, out again
    assert few_newcomers([proven, old_attacker, restarted, fresh], 1) == [proven, restarted]
    assert few_newcomers([proven, old_attacker, restarted, fresh], 3) == [proven, restarted, fresh]
    assert few_newcomers([old_attacker, restarted], 1) == [old_attacker, restarted]  # nobody proven: all join
    workers = [agent(proven=False, engine="e", driven=True, members=2) for _ in range(2)]
    late = agent(proven=False)
    assert few_newcomers([proven, *workers, late], 1) == [proven, *workers]  # an engine's workers: one newcomer


def test_an_agent_cuts_its_reasons_before_sending() -> None:
    """(the third outside attack) A 10 MB reason made a frame the daemon drops with its connection: the agent
    was then dropped as silent. An engine's traceback can be that long."""
    from ckpt_engine.control.messages import clip_reasons

    body = clip_reasons({"reason": "x" * 10_000_000, "unable": "u" * 5000,
                         "receivers": [{"rank": 1, "reason": "r" * 30_000}],
                         "classes": [{"key": "k", "reason": None}], "version": 3})
    assert len(body["reason"]) == 20_000 and len(body["unable"]) == 2000
    assert len(body["receivers"][0]["reason"]) == 20_000 and body["classes"] == [{"key": "k", "reason": None}]
    assert body["version"] == 3
