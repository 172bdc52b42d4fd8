"""Elastic receivers against the real daemon: per-receiver cadence, rollback, late join (catch-up from the
cache), leave, and kill -9 of a receiver mid-transfer while the others commit."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import start_daemon, train_until_stopped, write_config
from tests.models import AwkwardModel, load_into, state_bytes
from tests.procs import start_processes

pytestmark = pytest.mark.multiproc


def changing_trainer(zmq: str, stop_file: str) -> dict:
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = AwkwardModel(seed=1)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.3).start()
    # every version differs from the one before
    train_until_stopped(agent, stop_file, on_version=lambda step: model.perturb(step, fraction=0.3))
    return {}


def receiver(zmq: str, stop_file: str, seed: int, sync_every: int = 1, load_delay_s: float = 0.0,
             marker: str | None = None) -> dict:
    """``marker``/``load_delay_s`` apply from the second version on (the first is the quick catch-up)."""
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    model = AwkwardModel(seed=seed)
    loads = {"n": 0}

    def load(payload) -> None:
        loads["n"] += 1
        if marker and loads["n"] > 1:
            Path(marker).touch()
            time.sleep(load_delay_s)
        load_into(model, payload.tensors, partial=payload.sparse)

    agent = RolloutAgent(load, zmq, poll_wait_s=0.3, sync_every=sync_every).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return {"versions": [r.version for r in agent.results if r.ok], "state": state_bytes(model)}


def agents_of(client: httpx.Client) -> list[dict]:
    return client.get("/receivers").json()["agents"]


def wait_until(predicate, timeout_s: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout_s}s")


def sync(client: httpx.Client) -> dict:
    return client.post("/sync", json={"wait": True, "timeout_s": 60}).json()


def start_trainer_and_two_receivers(daemon, stop: Path, sync_every: tuple[int, int] = (1, 1)):
    """The changing trainer and two receivers (seeds 5 and 6) against ``daemon``, until ``stop`` exists."""
    return start_processes([(changing_trainer, (daemon.zmq, str(stop))),
                            (receiver, (daemon.zmq, str(stop), 5, sync_every[0])),
                            (receiver, (daemon.zmq, str(stop), 6, sync_every[1]))])


def test_cadence_and_rollback_to_n_minus_2(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, keep_versions=4))
    stop = tmp_path / "stop"
    procs = start_trainer_and_two_receivers(daemon, stop, sync_every=(1, 2))
    try:
        with daemon.client() as client:
            wait_until(lambda: len(agents_of(client)) == 3, what="registration")
            ids = {a["agent_id"]: a["sync_every"] for a in agents_of(client) if a["role"] == "receiver"}
            every, second = next(a for a, n in ids.items() if n == 1), next(a for a, n in ids.items() if n == 2)
            versions = [sync(client) for _ in range(4)]
            assert [v["status"] for v in versions] == ["committed"] * 4
            takers = [sorted(r["agent_id"] for r in v["receivers"]) for v in versions]
            assert takers == [sorted([every, second]), [every], sorted([every, second]), [every]]
            assert len({v["version_digest"] for v in versions}) == 4  # every version differs

            target = versions[1]  # N-2 of N = versions[3]
            pushed = client.post(f"/versions/{target['id']}/push").json()["version"]
            wait_until(lambda: client.get(f"/versions/{pushed}").json()["status"] == "committed", what="rollback")
            rollback = client.get(f"/versions/{pushed}").json()
            assert rollback["source_version"] == target["id"]
            assert rollback["version_digest"] == target["version_digest"]
            assert sorted(r["agent_id"] for r in rollback["receivers"]) == sorted([every, second])  # all of them
            assert {r["version_digest"] for r in rollback["receivers"]} == {target["version_digest"]}
    finally:
        stop.touch()
        _, first, slow = procs.collect(120)
        daemon.stop()
    assert first["state"] == slow["state"]  # both hold version N-2's bytes exactly


def test_join_leave_and_kill9_mid_transfer(tmp_path: Path) -> None:
    # (the killed receiver's outcome is never said: the version waits for it until its heartbeat expires)
    daemon = start_daemon(write_config(tmp_path))
    stop_all, stop_first = tmp_path / "stop", tmp_path / "stop-first"
    marker = tmp_path / "loading"
    trainer = start_processes([(changing_trainer, (daemon.zmq, str(stop_all)))])
    first = start_processes([(receiver, (daemon.zmq, str(stop_first), 5))])
    late = victim = None
    try:
        with daemon.client() as client:
            wait_until(lambda: len(agents_of(client)) == 2, what="registration")
            v1 = sync(client)
            assert v1["status"] == "committed"

            late = start_processes([(receiver, (daemon.zmq, str(stop_all), 6))])  # joins during training
            wait_until(lambda: any(v["source_version"] == v1["id"] and v["status"] == "committed"
                                   for v in client.get("/versions").json()["versions"]), what="catch-up")
            catch_up = client.get("/versions/latest").json()
            assert len(catch_up["receivers"]) == 1 and catch_up["version_digest"] == v1["version_digest"]
            both = sync(client)
            assert both["status"] == "committed" and len(both["receivers"]) == 2

            stop_first.touch()  # the first receiver leaves during training
            first.collect(60)
            wait_until(lambda: len(agents_of(client)) == 2, what="unregister")
            alone = sync(client)
            assert alone["status"] == "committed" and len(alone["receivers"]) == 1

            victim = start_processes([(receiver, (daemon.zmq, str(stop_all), 7, 1, 30.0, str(marker)))])
            wait_until(lambda: len(agents_of(client)) == 3, what="victim registration")
            wait_until(lambda: all(a["versions"] for a in agents_of(client) if a["role"] == "receiver"),
                       what="victim catch-up")
            started = time.monotonic()
            version = client.post("/sync", json={}).json()["version"]
            wait_until(marker.exists, what="victim loading")
            os.kill(victim.procs[0].pid, signal.SIGKILL)
            wait_until(lambda: client.get(f"/versions/{version}").json()["status"] in ("committed", "failed"),
                       timeout_s=60, what="version end")
            record = client.get(f"/versions/{version}").json()
            assert record["status"] == "committed", record  # the survivor committed (min_receivers 1)
            assert sum(r["ok"] for r in record["receivers"]) == 1 and "committed by 1 of 2" in record["reason"]
            assert time.monotonic() - started < 55  # bounded by the configured timeouts (heartbeat, ack: 10 s, 30 s)
            wait_until(lambda: len(agents_of(client)) == 2, timeout_s=30, what="dead receiver dropped")
            after = sync(client)
            assert after.get("status") == "committed" and len(after["receivers"]) == 1, after
    finally:
        stop_all.touch()
        stop_first.touch()
        trainer.collect(60)
        if late is not None:
            late.collect(60)
        if victim is not None:
            victim.kill()
        daemon.stop()


def test_sparse_versions_through_the_daemon(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, sparse=True, keep_versions=3))
    stop = tmp_path / "stop"
    procs = start_trainer_and_two_receivers(daemon, stop, sync_every=(1, 2))
    try:
        with daemon.client() as client:
            wait_until(lambda: len(agents_of(client)) == 3, what="registration")
            first, second, third = (sync(client) for _ in range(3))
            # version 2 is cached as a delta of version 1: a rollback to it is assembled from both
            pushed = client.post(f"/versions/{second['id']}/push").json()["version"]
            wait_until(lambda: client.get(f"/versions/{pushed}").json()["status"] in ("committed", "failed"),
                       what="rollback")
            rollback = client.get(f"/versions/{pushed}").json()
    finally:
        stop.touch()
        _, every, slow = procs.collect(120)
        daemon.stop()
    assert first["status"] == second["status"] == third["status"] == "committed"
    assert first["tensors_skipped"] == 0  # nobody held a base yet: full
    assert second["tensors_skipped"] > 0 and second["bytes"] < 0.6 * first["bytes"]  # only the changes (30%)
    assert len(second["receivers"]) == 1  # the sync_every=2 receiver sat this one out
    # version 3: one receiver holds version 2, the other version 1 -> no common base -> full for both
    assert third["tensors_skipped"] == 0 and len(third["receivers"]) == 2
    assert {r["version_digest"] for r in third["receivers"]} == {third["version_digest"]}
    assert every["state"] == slow["state"]
    assert rollback["status"] == "committed" and rollback["source_version"] == second["id"], rollback
    assert {r["version_digest"] for r in rollback["receivers"]} == {second["version_digest"]}
