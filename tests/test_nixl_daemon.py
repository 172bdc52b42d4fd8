"""The ``nixl`` transport through the daemon (``transport: nixl``): the trainer agent offers each cached version
through the control plane, every receiver pulls it over NIXL (UCX over TCP/shared memory here), verifies and
loads it, and reports its own outcome. No sync group is formed for pullers: a receiver that joins later pulls the
newest committed version (its catch-up) while nothing else changes; a rollback pulls the cached version again.
bypass_cpu is refused with a reason (pulls read the cache)."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_harness import ROOT, start_daemon, sync_when_idle, write_config
from tests.models import AwkwardModel, load_into, state_bytes
from tests.procs import start_processes

pytestmark = pytest.mark.multiproc
if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("NIXL has no wheel for this platform", allow_module_level=True)


def trainer_proc(zmq: str, stop_file: str) -> dict:
    """Changes its weights after every version it serves; returns the bytes each version held."""
    import torch

    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = AwkwardModel(seed=1)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.2).start()
    states: dict[int, bytes] = {}  # by version
    step = 0
    while not os.path.exists(stop_file):
        step += 1
        served = agent.step(step)
        if served is not None:
            states[served] = state_bytes(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
        time.sleep(0.01)
    agent.wait_idle(30)
    held = agent.pulls.held
    agent.close()
    return {"states": states, "held_at_end": held}


def receiver_proc(zmq: str, stop_file: str, seed: int, host_id: str | None) -> dict:
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    model = AwkwardModel(seed=seed)
    agent = RolloutAgent(lambda payload: load_into(model, payload.tensors), zmq, poll_wait_s=0.2,
                         host_id=host_id).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return {"state": state_bytes(model), "results": [(r.version, r.ok, r.reason) for r in agent.results]}


def _wait_for(check, timeout_s: float = 90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s}s")


def _ended(record: dict) -> dict | None:
    return record if record["status"] in ("committed", "failed", "cancelled", "interrupted") else None


def test_receivers_pull_cached_versions_through_the_daemon(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop"
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", transport="nixl"))
    agents = start_processes([(trainer_proc, (daemon.zmq, str(stop_file))),
                              (receiver_proc, (daemon.zmq, str(stop_file), 7, None)),
                              (receiver_proc, (daemon.zmq, str(stop_file), 8, "another-host"))])
    joiner = None
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 3)
            first = sync_when_idle(client, {"step": 1})
            assert first["status"] == "committed", first
            assert [r["transport"] for r in first["receivers"]] == ["nixl", "nixl"]
            assert [r["version_digest"] for r in first["receivers"]] == [first["version_digest"]] * 2
            second = sync_when_idle(client, {"step": 2})
            assert second["status"] == "committed" and second["version_digest"] != first["version_digest"]

            bypass = client.post("/sync", json={"bypass_cpu": True, "wait": True, "timeout_s": 60})
            assert bypass.status_code == 503 and "nixl" in bypass.json()["detail"], bypass.text

            # A receiver joins: it pulls the newest committed version; nobody else takes part.
            joiner = start_processes([(receiver_proc, (daemon.zmq, str(stop_file), 9, "a-third-host"))])
            caught = _wait_for(lambda: next((v for v in client.get("/versions").json()["versions"]
                                             if v["purpose"] == "catch_up" and v["status"] == "committed"), None))
            assert caught["source_version"] == second["id"] and len(caught["receivers"]) == 1
            assert caught["receivers"][0]["transport"] == "nixl"
            assert caught["version_digest"] == second["version_digest"]

            pushed = client.post(f"/versions/{first['id']}/push")  # rollback: pulled from the cache again
            assert pushed.status_code == 202, pushed.text
            again = _wait_for(lambda: _ended(client.get(f"/versions/{pushed.json()['version']}").json()))
            assert again["status"] == "committed", again
            assert again["version_digest"] == first["version_digest"] and len(again["receivers"]) == 3
    finally:
        stop_file.touch()
        results = agents.collect(120)
        joined = joiner.collect(120) if joiner is not None else []
        assert daemon.stop() == 0
    trainer, *receivers = results + joined
    first_state = trainer["states"][first["id"]]
    for rx in receivers:  # every receiver holds version 1's bytes again, exactly
        assert rx["state"] == first_state
        assert all(ok for _, ok, _ in rx["results"]), rx["results"]
    assert trainer["held_at_end"] == [again["id"]]  # older offers were released as the daemon moved on

