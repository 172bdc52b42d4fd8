"""The daemon for real: ``ckpt-engine serve`` in a subprocess on 127.0.0.1, agents in other processes,
syncs over gloo, history in SQLite."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from ckpt_engine.control.messages import TERMINAL
from ckpt_engine.device import detect_device
from tests.daemon_harness import ROOT, DaemonProcess, start_daemon, timeouts, train_until_stopped, write_config
from tests.models import AwkwardModel, load_into, state_bytes
from tests.procs import start_processes

pytestmark = pytest.mark.multiproc


def trainer_proc(zmq: str, stop_file: str) -> dict:
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = AwkwardModel(seed=1)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.5).start()
    train_until_stopped(agent, stop_file)  # the weights stay as they are: both modes give the same digest
    return {"state": state_bytes(model), "held": agent.held_seconds}


def receiver_proc(zmq: str, stop_file: str, seed: int, host_id: str | None = None) -> dict:
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    model = AwkwardModel(seed=seed)
    agent = RolloutAgent(lambda payload: load_into(model, payload.tensors), zmq, poll_wait_s=0.5,
                         host_id=host_id).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return {"state": state_bytes(model), "results": [(r.version, r.ok, r.version_digest) for r in agent.results]}


def wait_for_agents(client: httpx.Client, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(client.get("/receivers").json()["agents"]) == count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{count} agents did not register within {timeout_s}s")


@pytest.fixture()
def stop_file(tmp_path: Path) -> Path:
    return tmp_path / "stop"


def test_sync_push_evict_end_to_end(tmp_path: Path, stop_file: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml"))
    # transport auto: receiver 7 shares the trainer's host (shared memory), receiver 8 claims another host
    # (collective): one version reaches both ways.
    agents = start_processes([(trainer_proc, (daemon.zmq, str(stop_file))),
                              (receiver_proc, (daemon.zmq, str(stop_file), 7)),
                              (receiver_proc, (daemon.zmq, str(stop_file), 8, "another-host"))])
    try:
        with daemon.client() as client:
            wait_for_agents(client, 3)
            cached = client.post("/sync", json={"step": 11, "wait": True, "timeout_s": 60})
            assert cached.status_code == 200, cached.text
            first = cached.json()
            assert first["status"] == "committed" and first["mode"] == "cached" and first["cached"]
            assert first["step"] == 11 and first["buckets"] > 1 and first["bytes"] > 0
            assert {"snapshot", "fill", "broadcast", "load", "verify"} <= set(first["stages"])
            assert [r["version_digest"] for r in first["receivers"]] == [first["version_digest"]] * 2
            assert all(r["ok"] for r in first["receivers"])
            assert sorted(r["transport"] for r in first["receivers"]) == ["collective", "ipc"]

            bypass = client.post("/sync", json={"bypass_cpu": True, "wait": True}).json()
            assert bypass["status"] == "committed" and bypass["mode"] == "bypass_cpu" and not bypass["cached"]
            assert bypass["version_digest"] == first["version_digest"]  # same weights, same digest in both modes
            assert bypass["id"] > first["id"] and bypass["step"] is not None  # the step it was served at

            pushed = client.post(f"/versions/{first['id']}/push")
            assert pushed.status_code == 202 and pushed.json()["source_version"] == first["id"]
            again = _wait_terminal(client, pushed.json()["version"])
            assert again["status"] == "committed" and again["source_version"] == first["id"]
            assert again["version_digest"] == first["version_digest"]

            listed = client.get("/versions", params={"limit": 10}).json()["versions"]
            assert [v["id"] for v in listed] == [again["id"], bypass["id"], first["id"]]
            assert client.get("/versions/latest").json()["id"] == again["id"]
            metrics = client.get("/metrics").text
            assert 'ckpt_engine_versions_total{outcome="committed"} 3.0' in metrics

            evicted = client.delete(f"/versions/{first['id']}")
            assert evicted.status_code == 200 and evicted.json()["cached"] is False
            assert client.post(f"/versions/{first['id']}/push").status_code == 409
            assert client.get(f"/versions/{first['id']}").json()["status"] == "committed"  # history stays
    finally:
        stop_file.touch()
        results = agents.collect(120)
        assert daemon.stop() == 0
    trainer, rx1, rx2 = results
    for rx in (rx1, rx2):
        assert rx["state"] == trainer["state"]  # byte-identical to the trainer
        assert [ok for _, ok, _ in rx["results"]] == [True, True, True]


def _wait_terminal(client: httpx.Client, version: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = client.get(f"/versions/{version}").json()
        if record["status"] in TERMINAL:
            return record
        time.sleep(0.05)
    raise AssertionError(f"version {version} did not end in {timeout_s}s")


def test_bypass_cpu_from_deploy_yaml_with_env_overrides(tmp_path: Path, stop_file: Path) -> None:
    base = write_config(tmp_path, ROOT / "deploy" / "engine-bypass.yaml")
    daemon = start_daemon(base, env={"CKPT_ENGINE_TIMEOUTS__ACK_S": "25", "CKPT_ENGINE_TRANSPORT": "collective"})
    agents = start_processes([(trainer_proc, (daemon.zmq, str(stop_file))),
                              (receiver_proc, (daemon.zmq, str(stop_file), 3))])
    try:
        with daemon.client() as client:
            wait_for_agents(client, 2)
            record = client.post("/sync", json={"wait": True}).json()
            assert record["status"] == "committed" and record["mode"] == "bypass_cpu"
            assert record["receivers"][0]["version_digest"] == record["version_digest"]
            assert record["receivers"][0]["transport"] == "collective"  # forced by CKPT_ENGINE_TRANSPORT
            assert client.get("/status").json()["config"]["bypass_cpu"] is True
    finally:
        stop_file.touch()
        agents.collect(120)
        daemon.stop()


def test_restart_after_kill9_keeps_history_and_interrupts_the_in_flight_version(tmp_path: Path) -> None:
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    # (a short version_s: the receiver, assigned a version that never begins, waits at most that in close())
    config = write_config(tmp_path, timeouts=timeouts(connect_s=8, collective_s=8, ack_s=8, version_s=8))
    daemon = start_daemon(config)
    with daemon.client() as client:
        refused = client.post("/sync", json={"step": 1})
        assert refused.status_code == 503 and refused.json()["record"]["status"] == "failed"
        assert "no trainer agent" in refused.json()["detail"]
        # Real agents, but the trainer never reaches a step boundary: the next version stays in flight.
        device = detect_device("cpu")
        trainer = TrainerAgent(AwkwardModel(1), daemon.zmq, device=device, poll_wait_s=0.3).start()
        receiver = RolloutAgent(lambda payload: None, daemon.zmq, device=device, poll_wait_s=0.3).start()
        try:
            wait_for_agents(client, 2)
            in_flight = client.post("/sync", json={"step": 2}).json()["version"]
            busy = client.post("/sync", json={"step": 3})
            assert busy.status_code == 409 and str(in_flight) in busy.json()["detail"]
            assert busy.json()["record"]["in_flight"] == in_flight
            assert client.get("/status").json()["in_flight"] == in_flight

            assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
            daemon = start_daemon(config)
            with daemon.client() as fresh:
                assert fresh.get(f"/versions/{refused.json()['record']['id']}").json()["status"] == "failed"
                crashed = fresh.get(f"/versions/{in_flight}").json()
                assert crashed["status"] == "interrupted" and "may hold it" in crashed["reason"]
                wait_for_agents(fresh, 2)  # the agents noticed and registered again
                later = fresh.post("/sync", json={"step": 4})
                assert later.json()["version"] > in_flight
        finally:
            trainer.close()
            receiver.close()
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> DaemonProcess:
    directory = tmp_path_factory.mktemp("guarded")
    daemon = start_daemon(write_config(directory, auth_token="s3cret-token-for-tests", min_receivers=1))
    yield daemon
    assert daemon.stop() == 0


@pytest.mark.parametrize("method, path, kwargs, status", [
    ("post", "/sync", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422),
    ("post", "/sync", {"json": {"step": "eleven"}}, 422),
    ("post", "/sync", {"json": {"wait": True, "colour": "red"}}, 422),
    ("post", "/sync", {"json": {"sparse": True, "bypass_cpu": True}}, 400),
    ("post", "/sync", {"json": {"timeout_s": -1}}, 422),
    ("get", "/versions/987654", {}, 404),
    ("get", "/versions/abc", {}, 422),
    ("get", "/versions", {"params": {"limit": 0}}, 422),
    ("get", "/versions", {"params": {"status": "exploded"}}, 422),
    ("post", "/versions/987654/push", {}, 404),
    ("delete", "/versions/987654", {}, 404),
    ("post", "/sync", {"content": b"{" + b" " * (70 << 10) + b"}",
                       "headers": {"content-type": "application/json"}}, 413),
])
def test_bad_input_gets_the_right_4xx_as_json(guarded: DaemonProcess, method: str, path: str, kwargs: dict,
                                              status: int) -> None:
    with guarded.client() as client:
        response = getattr(client, method)(path, **kwargs)
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error", "detail"}


def test_token_is_required_except_for_health(guarded: DaemonProcess) -> None:
    with guarded.client() as client:
        before = _unauthorized(client)
    with guarded.client(token=None) as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/status").status_code == 401
        assert anonymous.post("/sync", json={}).status_code == 401
    with guarded.client(token="wrong-token-wrong-token") as wrong:
        assert wrong.get("/versions").status_code == 401
    with guarded.client() as client:
        assert client.get("/status").json()["config"]["auth"] is True
        # issue 37: an HTTP 401 is a refusal as a ZMQ 'unauthorized' is (docs/daemon.md, the metrics)
        assert _unauthorized(client) == before + 3


def _unauthorized(client: httpx.Client) -> float:
    series = 'ckpt_engine_refused_total{reason="unauthorized"} '
    return sum(float(line.split()[-1]) for line in client.get("/metrics").text.splitlines() if line.startswith(series))


def test_sync_without_agents_is_recorded_and_not_cached(guarded: DaemonProcess) -> None:
    with guarded.client() as client:
        refused = client.post("/sync", json={"step": 5})
        assert refused.status_code == 503
        record = refused.json()["record"]
        assert client.get(f"/versions/{record['id']}").json()["reason"] == record["reason"]
        assert client.post(f"/versions/{record['id']}/push").status_code == 409


def test_garbage_zmq_frames_get_error_replies_and_the_daemon_stays_up(guarded: DaemonProcess) -> None:
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(guarded.zmq)

    def ask(raw: bytes) -> dict | None:
        sock.send(raw)
        if not sock.poll(5000):
            return None
        reply = sock.recv()
        return json.loads(reply) if reply[:1] == b"{" else msgpack.unpackb(reply, raw=False)

    try:
        assert ask(b"\xc1\x00garbage")["error"] == "bad frame"
        assert ask(msgpack.packb([1, 2, 3]))["error"] == "bad frame"
        assert ask(msgpack.packb({"id": 1, "type": 7}))["error"] == "bad request"
        assert ask(msgpack.packb({"id": 2, "type": "launch_missiles",
                                  "token": guarded.token}))["error"] == "bad request"
        assert ask(msgpack.packb({"id": 3, "type": "status"}))["error"] == "unauthorized"
        unknown = ask(msgpack.packb({"id": 4, "type": "poll", "body": {"agent_id": "nobody", "session": "s" * 32},
                                      "token": guarded.token}))
        assert unknown["ok"] is False and "unregistered agent" in unknown["detail"]
        bad_register = ask(msgpack.packb({"id": 5, "type": "register", "body": {"role": "pirate"}}))
        assert bad_register["ok"] is False
        status = ask(b'{"id": 6, "type": "status", "token": "s3cret-token-for-tests"}')  # JSON in, JSON out
        assert status["ok"] is True and status["id"] == 6 and "in_flight" in status["body"]
    finally:
        sock.close()
    with guarded.client() as client:
        assert client.get("/health").status_code == 200


def flaky_trainer_proc(zmq: str, stop_file: str) -> dict:
    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = AwkwardModel(seed=1)
    calls = {"n": 0}

    def tensors():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost while snapshotting")
        return named_tensors_of(model)

    train_until_stopped(TrainerAgent(tensors, zmq, poll_wait_s=0.3).start(), stop_file)
    return {}


def test_a_failed_snapshot_releases_the_receivers_at_once(tmp_path: Path, stop_file: Path) -> None:
    daemon = start_daemon(write_config(tmp_path))
    agents = start_processes([(flaky_trainer_proc, (daemon.zmq, str(stop_file))),
                              (receiver_proc, (daemon.zmq, str(stop_file), 4))])
    try:
        with daemon.client() as client:
            wait_for_agents(client, 2)
            started = time.monotonic()
            failed = client.post("/sync", json={"wait": True}).json()
            assert failed["status"] == "failed" and "device lost while snapshotting" in failed["reason"]
            ok = client.post("/sync", json={"wait": True}).json()  # the receiver is free again at once
            assert ok["status"] == "committed", ok
            assert time.monotonic() - started < 30  # far below the receivers' version timeout (60 s here)
    finally:
        stop_file.touch()
        results = agents.collect(120)
        daemon.stop()
    assert [ok for _, ok, _ in results[1]["results"]] == [False, True]


@pytest.mark.parametrize("body", [{"wait": True, "timeout_s": 2}, {"wait": True, "timeout_s": 2.0}])
def test_one_sync_body_waits_the_same_over_zmq_and_http(tmp_path: Path, body: dict) -> None:
    """The request model parses both planes' bodies alike (strictly: 1 and "true" are no bool there, see
    tests/test_strict_types.py), and what it parsed decides how long each waits (found by the outside review
    of issue 16: ZMQ read the raw body)."""
    import time

    from tests.raw_agent import RawAgent

    daemon = start_daemon(write_config(tmp_path))
    trainer, receiver = RawAgent(daemon, "trainer"), RawAgent(daemon, "receiver")  # they never answer
    try:
        started = time.monotonic()
        record = trainer.client.request("sync", body, timeout_s=20)
        zmq_waited = time.monotonic() - started
        assert record["status"] not in TERMINAL and 1.5 < zmq_waited < 15, (record, zmq_waited)
        trainer.poll()
        receiver.poll()
        trainer.report(record["id"], "done", ok=False, reason="test")  # end it
        with daemon.client() as http:
            deadline = time.monotonic() + 20
            while http.get(f"/versions/{record['id']}").json()["status"] not in TERMINAL:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            started = time.monotonic()
            reply = http.post("/sync", json=body)
            http_waited = time.monotonic() - started
        assert reply.status_code == 504 and 1.5 < http_waited < 15, (reply.text, http_waited)
    finally:
        trainer.close()
        receiver.close()
        daemon.stop()
