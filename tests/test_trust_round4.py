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
from tests.daemon_harness import start_daemon, write_config
from tests.procs import start_processes
from tests.raw_agent import RawAgent
from tests.test_elastic import agents_of, wait_until
from tests.test_sharded_daemon import shapes_of, tp_receiver, tp_spec, trainer, whole_receiver
from tests.tiny_lm import tiny_llama

pytestmark = pytest.mark.multiproc
CONNECT_S = 15  # the tests' rendezvous timeout (server/launch.py TEST_TIMEOUTS)


class SilentMember:
    """A registration with a valid spec that keeps polling (so it looks alive) and never joins a group."""

    def __init__(self, daemon, spec: dict) -> None:
        self.agent = RawAgent(daemon, "receiver", shard_spec=spec)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.agent.poll(wait_s=0.2)
            except Exception:  # noqa: BLE001 - the daemon may be stopping
                self._stop.wait(0.2)

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


@pytest.mark.parametrize("mode", ["bypass_cpu", "cached"])
def test_a_class_member_that_never_joins_costs_only_itself(tmp_path: Path, mode: str) -> None:
    """bypass_cpu: every version failed, the trainer was held 15-108 s, and a healthy receiver at rank 1 of the
    quorum was benched for the silent member's rank 1 in its class group."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", bypass_cpu=mode == "bypass_cpu",
                                       min_receivers=1))
    stop, corrupt = tmp_path / "stop", tmp_path / "corrupt"
    procs = start_processes([(trainer, (daemon.zmq, str(stop), str(corrupt))),
                             (tp_receiver, (daemon.zmq, str(stop), 0)), (whole_receiver, (daemon.zmq, str(stop)))])
    silent = None
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 3, what="registration")
            if mode == "cached":
                assert post_sync(http)["status"] == "committed"  # (a cache for the catch-ups)
            silent = SilentMember(daemon, tp1_spec())
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
                                       min_receivers=1))
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
    daemon = start_daemon(write_config(tmp_path, transport="collective", bypass_cpu=True, min_receivers=1))
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

    daemon = start_daemon(write_config(tmp_path, transport="collective"))
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
