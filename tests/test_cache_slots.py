"""A failed version never costs a committed one its place in the trainer's cache (issue 37, item 4), with the
real daemon, a trainer and a receiver, each a process of its own: with ``keep_versions: 3``, three committed
versions, then one the receiver refuses; the oldest committed version can still be pushed, and the failed one
is gone from the cache."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.daemon_harness import start_daemon, write_config
from tests.procs import start_processes
from tests.test_elastic import agents_of, changing_trainer, sync, wait_until

pytestmark = pytest.mark.multiproc


def refusing_receiver(zmq: str, stop_file: str, armed: str) -> dict:
    """Takes every version, except one while ``armed`` exists: that one it refuses (ApplyRefused: nothing of it
    reaches the model, which keeps the version it served), removing the file."""
    from ckpt_engine.errors import ApplyRefused
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from tests.models import AwkwardModel, load_into, state_bytes

    model = AwkwardModel(seed=5)

    def load(payload) -> None:
        if os.path.exists(armed):
            os.unlink(armed)
            raise ApplyRefused(f"injected: version {payload.version} refused")
        load_into(model, payload.tensors, partial=payload.sparse)

    agent = RolloutAgent(load, zmq, poll_wait_s=0.3).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return {"state": state_bytes(model)}


def test_a_failed_version_costs_no_committed_version_its_place(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, keep_versions=3))
    stop, armed = tmp_path / "stop", tmp_path / "armed"
    procs = start_processes([(changing_trainer, (daemon.zmq, str(stop))),
                             (refusing_receiver, (daemon.zmq, str(stop), str(armed)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="registration")
            # (the receiver's first version may be a catch-up the daemon starts itself: wait for the quiet)
            wait_until(lambda: http.get("/status").json().get("in_flight") is None, what="no version in flight")
            committed = [sync(http) for _ in range(3)]
            assert [v["status"] for v in committed] == ["committed"] * 3, committed
            armed.touch()
            failed = sync(http)
            assert failed["status"] == "failed", failed
            assert not armed.exists()

            def cached() -> list[int]:
                return sorted(v["id"] for v in http.get("/versions", params={"limit": 50}).json()["versions"]
                              if v["cached"])

            # the failed version leaves the cache; the three committed ones keep their places
            wait_until(lambda: cached() == [v["id"] for v in committed], timeout_s=60,
                       what=f"the cache holding exactly the committed versions (it holds {cached()})")
            oldest = committed[0]
            reply = http.post(f"/versions/{oldest['id']}/push")
            assert reply.status_code == 202, reply.text
            pushed = reply.json()["version"]
            wait_until(lambda: http.get(f"/versions/{pushed}").json()["status"] in ("committed", "failed"),
                       what="the push's end")
            record = http.get(f"/versions/{pushed}").json()
            assert record["status"] == "committed", record
            assert record["version_digest"] == oldest["version_digest"]

            # a new version after all that: the cache goes back to the newest keep_versions committed ones
            newest = sync(http)
            assert newest["status"] == "committed", newest
            wait_until(lambda: len(cached()) == 3 and newest["id"] in cached(), timeout_s=60,
                       what=f"three cached versions with the newest (it holds {cached()})")
    finally:
        stop.touch()
        procs.collect(120)
        daemon.stop()
