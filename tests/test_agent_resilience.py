"""Agents against a daemon that stalls, dies or restarts (regressions found by the fault trials): the
training loop never waits on the control plane, outcomes survive a lost connection, and an agent is back
registered soon after the daemon restarts."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import yaml

from ckpt_engine.trials.proxy import Proxy
from ckpt_engine.workers.rollout_agent import RolloutAgent
from tests.daemon_harness import TrainerLoop, start_daemon, sync_when_idle, timeouts, write_config
from tests.raw_agent import RawAgent
from tests.test_elastic import wait_until


def test_reports_do_not_block_while_the_daemon_is_stalled(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path))
    agent = RolloutAgent(lambda payload: None, daemon.zmq, poll_wait_s=0.2).start()
    try:
        daemon.proc.send_signal(signal.SIGSTOP)
        started = time.perf_counter()
        for version in range(1, 6):  # before the fix each of these waited for a reply, up to 10 s
            agent.report(version, "received", ok=False, reason="test")
        assert time.perf_counter() - started < 5  # (queued at once: a bound for a loaded machine)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        agent.close()
        daemon.stop()


def test_an_agent_registers_again_soon_after_a_daemon_restart(tmp_path: Path) -> None:
    config = write_config(tmp_path, timeouts=_SHORT)
    daemon = start_daemon(config)
    agent = _patient_agent(daemon.zmq)
    try:
        first = agent.agent_id
        # a lost poll is noticed after wait + heartbeat/2 (1.2 s), not after the request timeout (60 s here)
        restarted = _kill_and_restart(daemon, config, agents=1, within_s=_REQUEST_S / 3)
        assert agent.agent_id != first
        restarted.stop()
    finally:
        agent.close()


def test_a_report_stuck_on_the_dead_daemon_delays_neither_registering_nor_later_reports(tmp_path: Path) -> None:
    # Found by the kill_daemon trials: a report sent to the dead daemon only gives up after the 10 s request
    # timeout. Registering again waited behind it (the daemon saw no trainer for that long), and so did every
    # later report, such as the outcome of the first version after the restart.
    config = write_config(tmp_path, timeouts=_SHORT)
    daemon = start_daemon(config)
    agent = _patient_agent(daemon.zmq)
    try:
        first = agent.agent_id
        daemon.proc.send_signal(signal.SIGSTOP)  # takes the report, never answers it
        agent.report(1, "evicted")
        time.sleep(0.5)
        restarted = _kill_and_restart(daemon, config, agents=1, within_s=_REQUEST_S / 3)
        assert agent.agent_id != first
        agent.report(1, "evicted")
        assert agent.flush_reports(_REQUEST_S / 3), "a report for the new daemon waited behind one for the dead daemon"
        restarted.stop()
    finally:
        agent.close()


def test_same_host_path_survives_a_daemon_restart(tmp_path: Path) -> None:
    """After a restart every agent registers under a new id: the trainer must keep serving colocated
    receivers from the hub it already has, and receivers must say hello again under their new id."""
    from tests.test_elastic import agents_of, start_trainer_and_two_receivers, sync, wait_until

    config = write_config(tmp_path, transport="ipc")
    daemon = start_daemon(config)
    stop = tmp_path / "stop"
    procs = start_trainer_and_two_receivers(daemon, stop)
    try:
        with daemon.client() as client:
            wait_until(lambda: len(agents_of(client)) == 3, what="registration")
            before = sync(client)
        daemon.stop(signal.SIGKILL)
        daemon = start_daemon(config)
        with daemon.client() as client:
            wait_until(lambda: len(agents_of(client)) == 3, timeout_s=60, what="registration after the restart")
            # what they hold is a claim to the new daemon until a version of their own proves it (a catch-up)
            wait_until(lambda: all(a["proven"] for a in agents_of(client) if a["role"] == "receiver"), timeout_s=60,
                       what="the receivers' catch-up after the restart")
            after = sync(client)
    finally:
        stop.touch()
        _, first, second = procs.collect(120)
        daemon.stop()
    assert before["status"] == "committed" and {r["transport"] for r in before["receivers"]} == {"ipc"}
    assert after["status"] == "committed", after
    assert {r["transport"] for r in after["receivers"]} == {"ipc"} and len(after["receivers"]) == 2
    assert first["state"] == second["state"]


def test_an_assignment_is_sent_again_until_a_poll_acknowledges_it(tmp_path: Path) -> None:
    """A poll reply can be lost with a connection, or arrive after the agent gave up on the request: the
    daemon keeps the assignment until the agent's next poll names it as received."""
    daemon = start_daemon(write_config(tmp_path, transport="collective"))
    trainer, receiver = RawAgent(daemon, "trainer"), RawAgent(daemon, "receiver")
    try:
        with daemon.client() as http:
            version = http.post("/sync", json={}).json()["version"]
        first = receiver.poll(0.2)
        assert first is not None and first["kind"] == "receive" and first["version"] == version
        assert receiver.poll(0.2) == first  # its reply "was lost": the next poll gets it again
        assert receiver.poll(0.2, received=f"receive:{version}") is None  # acknowledged: not sent a third time
        assert trainer.poll()["kind"] == "send"
    finally:
        trainer.close()
        receiver.close()
        daemon.stop()


def test_a_stalled_daemon_does_not_drop_the_agents_it_did_not_hear(tmp_path: Path) -> None:
    # (4 s: the agent, in this process, has seconds to poll again once the daemon runs, on a loaded machine too)
    daemon = start_daemon(write_config(tmp_path, timeouts=timeouts(heartbeat_s=4)))
    agent = RolloutAgent(lambda payload: None, daemon.zmq, poll_wait_s=0.2).start()
    try:
        first = agent.agent_id
        daemon.proc.send_signal(signal.SIGSTOP)
        time.sleep(5.0)  # longer than the heartbeat: the daemon, not the agent, was silent
        daemon.proc.send_signal(signal.SIGCONT)
        time.sleep(2.0)
        with daemon.client() as http:
            assert [a["agent_id"] for a in http.get("/receivers").json()["agents"]] == [first]
        assert agent.agent_id == first
        assert "did not run for" in daemon.log()
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        agent.close()
        daemon.stop()


def test_a_receiver_whose_outcome_is_unknown_gets_a_full_version(tmp_path: Path) -> None:
    """A version that failed without the receiver's report (e.g. the trainer was expired while its send went
    on) may still be applied by it: the next version is full, not sparse on a guessed base, until the
    receiver reports that outcome."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", sparse=True))
    trainer, receiver = RawAgent(daemon, "trainer"), RawAgent(daemon, "receiver")

    def next_send(http, holds: list[int]) -> dict:
        receiver.poll(versions=holds)
        version = http.post("/sync", json={}).json()["version"]
        send = trainer.poll()
        assert send["version"] == version
        trainer.report(version, "done", ok=False, reason="test: the trainer gave up", receivers=[])
        return send

    try:
        with daemon.client() as http:
            first = next_send(http, [])
            # the receiver says it holds version 1 now, but never reported how version 1 ended for it
            assert next_send(http, [first["version"]])["sparse_base"] is None
            receiver.report(first["version"], "received", ok=True)
            receiver.report(first["version"] + 1, "received", ok=False, reason="test", serving=first["version"])
            assert next_send(http, [first["version"]])["sparse_base"] == first["version"]
    finally:
        trainer.close()
        receiver.close()
        daemon.stop()


def test_agents_skip_versions_superseded_before_they_started() -> None:
    """The daemon has one version in flight, so a queued older version has already ended there: serving or
    waiting for it would only make the agent miss the newer one (found by the fault trials)."""
    from ckpt_engine.control.messages import Assignment
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    trainer = TrainerAgent(lambda: NamedTensors({}), "tcp://127.0.0.1:9")  # never started: no daemon needed
    receiver = RolloutAgent(lambda payload: None, "tcp://127.0.0.1:9")
    try:
        for version in (10, 11):
            trainer._pending.append(Assignment(kind="send", version=version))
            receiver._work.put(Assignment(kind="receive", version=version))
        assert trainer._next_due().version == 11 and not trainer._pending
        older = receiver._work.get()
        assert receiver._superseded(older)
        assert not receiver._superseded(receiver._work.get())
    finally:
        trainer._client.close()
        receiver._client.close()


def test_a_version_assigned_before_a_daemon_restart_does_not_hold_the_receivers(tmp_path: Path) -> None:
    """Found by the kill_daemon trials: the daemon died right after assigning a version the trainer never
    got. A colocated receiver waited for that version's begin for up to ``version_s`` and so missed the
    first version of the restarted daemon ("did not connect within 5s"). The wait now ends once the agent
    has registered again, and versions from before the restart are skipped."""
    config = write_config(tmp_path, transport="ipc")
    daemon = start_daemon(config)
    proxy = Proxy("127.0.0.1", int(daemon.zmq.rsplit(":", 1)[1]))  # the trainer's connection, to be cut
    trainer, receiver = _in_process_agents(proxy.endpoint, daemon.zmq)
    try:
        with daemon.client() as client:
            _wait_registered(client, 2)
            proxy.drop(3.0)  # the trainer never gets the next assignment...
            old = _request_sync(client)
        # ...while the receiver got its own and waits for the version to begin
        wait_until(lambda: receiver._receiving == old, 30, "the receiver to wait for the version")
        daemon = _kill_and_restart(daemon, config, agents=2)
        with daemon.client() as client:
            new = _request_sync(client)
            record = _train_until_terminal(trainer, client, new)
        assert new > old
        assert record["status"] == "committed", record
        assert [r["transport"] for r in record["receivers"]] == ["ipc"]
        daemon.stop()
    finally:
        trainer.close()
        receiver.close()
        proxy.close()


def test_the_first_version_after_a_daemon_restart_builds_its_groups_afresh(tmp_path: Path) -> None:
    """Found by the chaos run of 2026-11-27 (kill_daemon): the restarted daemon numbered its first group
    generation as the old one had, so the trainer and receivers kept their old group, whose rendezvous store
    died with the old daemon; the sender could not ring its receivers and the version failed. Groups belong to
    the registration they were built under."""
    config = write_config(tmp_path, transport="collective")
    daemon = start_daemon(config)
    trainer, receiver = _in_process_agents(daemon.zmq, daemon.zmq)
    try:
        with daemon.client() as client:
            _wait_registered(client, 2)
            record = _train_until_terminal(trainer, client, _request_sync(client))
        assert record["status"] == "committed", (record["reason"], record["receivers"])
        daemon = _kill_and_restart(daemon, config, agents=2)
        with daemon.client() as client:  # the receiver is new here: first a version of its own (a catch-up)
            first = _train_until_terminal(trainer, client, 2)  # (the restarted daemon's first version)
            assert first["status"] == "committed" and first["purpose"] == "catch_up", first
            record = _train_until_terminal(trainer, client, _request_sync(client))
        assert record["status"] == "committed", (record["reason"], record["receivers"])
        daemon.stop()
    finally:
        trainer.close()
        receiver.close()


def test_a_daemon_that_lost_its_history_is_not_confused_by_versions_of_the_old_one(tmp_path: Path) -> None:
    """A daemon restarted without its history (here in memory) numbers its versions after the ones the trainer
    holds, with a warning (an operator's logs never show one id for two versions). Versions carry the id of the
    history that numbered them: the agents' version 1 is not the new history's, so they drop it (the trainer's
    cache would otherwise say "already cached")."""
    config = write_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["store"]["history_path"] = ":memory:"
    config.write_text(yaml.safe_dump(data))
    daemon = start_daemon(config)
    trainer, receiver = _in_process_agents(daemon.zmq, daemon.zmq)
    first_history = trainer.history_id
    try:
        ids = []
        for restart in (False, True):
            if restart:
                daemon = _kill_and_restart(daemon, config, agents=2)
            with daemon.client() as client:
                _wait_registered(client, 2)
                ids.append(_request_sync(client))
                record = _train_until_terminal(trainer, client, ids[-1])
            assert record["status"] == "committed", (record["reason"], record["receivers"])
        assert ids == [1, 2] and [r.version for r in receiver.results if r.ok] == [1, 2]
        assert trainer.versions_held() == [2] and trainer.history_id != first_history
        assert "new versions are numbered from 2" in daemon.log_path.read_text()
        daemon.stop()
    finally:
        trainer.close()
        receiver.close()


# The two tests of how soon agents notice a restarted daemon: a lost poll is given up on after its wait and half a
# heartbeat (1.2 s here), far below the agents' request timeout (_REQUEST_S), which their registering again or their
# reports must not wait out.
_SHORT = timeouts(heartbeat_s=2)
_REQUEST_S = 60.0


def _patient_agent(endpoint: str) -> RolloutAgent:
    """A receiver agent whose requests wait _REQUEST_S for their reply (a RolloutAgent takes the default, 10 s)."""
    agent = RolloutAgent(lambda payload: None, endpoint, poll_wait_s=0.2)
    agent.request_timeout_s = agent._client.timeout_s = _REQUEST_S
    return agent.start()


def _in_process_agents(trainer_endpoint: str, receiver_endpoint: str):
    import torch

    from ckpt_engine.workers.trainer_agent import TrainerAgent

    trainer = TrainerAgent(torch.nn.Linear(64, 64), trainer_endpoint, poll_wait_s=0.2).start()
    receiver = RolloutAgent(lambda payload: None, receiver_endpoint, poll_wait_s=0.2).start()
    return trainer, receiver


def _wait_registered(client: httpx.Client, agents: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while len(client.get("/receivers").json()["agents"]) < agents:
        assert time.monotonic() < deadline, "agents did not register"
        time.sleep(0.1)


def _kill_and_restart(daemon, config: Path, agents: int, within_s: float = 60):
    """kill -9 the daemon, start it again on the same config, and wait (``within_s`` at most) until ``agents``
    agents have registered again; the new daemon."""
    daemon.stop(signal.SIGKILL)
    restarted = start_daemon(config)
    with restarted.client() as client:
        _wait_registered(client, agents, timeout_s=within_s)
    return restarted


def _request_sync(client: httpx.Client) -> int:
    reply = client.post("/sync", json={})
    assert reply.status_code == 202, reply.text
    return reply.json()["version"]


def _train_until_terminal(trainer, client: httpx.Client, version: int, timeout_s: float = 60) -> dict:
    """Step the trainer (a training loop's step boundaries) until ``version`` has ended; its record."""
    import threading

    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set():
            trainer.step(step := step + 1)
            time.sleep(0.05)

    loop = threading.Thread(target=train, daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + timeout_s
        while (record := client.get(f"/versions/{version}").json()).get("status") not in ("committed", "failed"):
            assert time.monotonic() < deadline, record  # (a version the daemon starts itself may not exist yet)
            time.sleep(0.1)
        return record
    finally:
        stop.set()
        loop.join(30)


def test_a_colocated_receiver_dropped_for_one_slow_load_receives_again(tmp_path: Path) -> None:
    """One load that outlasts ack_s gets the receiver dropped by the trainer's hub; the next version must reach
    it over a new connection (found by the outside attack on issue 14: it never received again)."""
    import torch

    from ckpt_engine.plan.tensors import NamedTensors

    daemon = start_daemon(write_config(tmp_path, transport="ipc", timeouts=timeouts(ack_s=3)))
    tensors = {"w": torch.zeros(1000)}
    trainer = TrainerLoop(daemon.zmq, lambda: NamedTensors(dict(tensors)))
    loads: list[float] = []

    def load(payload) -> None:
        loads.append(float(payload.tensors["w"][0]))
        if len(loads) == 2:
            time.sleep(6)  # one slow apply, longer than ack_s

    rollout = RolloutAgent(load, daemon.zmq, poll_wait_s=0.2).start()
    try:
        with daemon.client() as http:
            deadline = time.monotonic() + 30
            while not [a for a in http.get("/receivers").json()["agents"] if a["role"] == "receiver"]:
                assert time.monotonic() < deadline, "the receiver did not register"
                time.sleep(0.2)
            outcomes = []
            for value in (1.0, 2.0, 3.0, 4.0):
                tensors["w"] = torch.full((1000,), value)
                outcomes.append(sync_when_idle(http)["status"])
                if value == 2.0:  # the slow load ends
                    wait_until(lambda: len(rollout.results) == 2, 60, "the slow load to end")
    finally:
        rollout.close()
        trainer.close()
        daemon.stop()
    assert outcomes[0] == "committed" and outcomes[1] == "failed", outcomes
    assert outcomes[2:] == ["committed", "committed"], outcomes
    assert loads[-1] == 4.0
