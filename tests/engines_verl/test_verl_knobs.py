"""verl's knobs and the daemon's deployment (issue 37), through the real verl 0.9.1 backend and a real daemon:

- started from ``deploy/engine-bypass.yaml``, a verl job that sets none of the knobs runs its syncs bypass_cpu,
  with the daemon's bucket size (verl's default update_weights_bucket_megabytes counts as unset) and staging,
  and every version's record says where each value came from;
- a knob verl sets wins over the deployment's (the record keeps both); keep_versions left unset is the
  daemon's, and a failed sync costs none of the committed versions it keeps its place: the oldest is pushed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl tests run in scripts/test-verl.sh's environment")

from ckpt_engine.server.launch import REPO, start_daemon, write_config
from tests.engines_verl.test_verl_backend import _check_delivered, _first_bucket_of
from tests.engines_verl.verl_harness import BUCKET_SIZE, Cluster, fingerprint, model_weights

pytestmark = pytest.mark.multiproc
BYPASS_YAML = REPO / "deploy" / "engine-bypass.yaml"
VERL_DEFAULT_BUCKET = 2048 << 20  # what verl passes when update_weights_bucket_megabytes is left unset


def _delivered(cluster: Cluster, http, steps: int) -> tuple[dict, int, dict]:
    """verl's sync of ``steps`` (checked delivered to its rollouts): the sync, its version and the record."""
    sync = cluster.update_weights(steps)
    assert "metrics" in sync["actors"][0], sync
    version = sync["actors"][0]["metrics"]["ckpt_engine/version"]
    _check_delivered(sync, steps, version)
    return sync, version, _record(http, version)


def _record(http, version: int) -> dict:
    response = http.get(f"/versions/{version}")
    assert response.status_code == 200, response.text
    return response.json()


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s}s")
        time.sleep(0.2)


def test_a_verl_job_that_sets_no_knob_takes_the_deployment_s_bypass_cpu(tmp_path: Path) -> None:
    # (write_config keeps the YAML's knobs and puts the test's small bucket in: 0.0625 MiB = BUCKET_SIZE)
    daemon = start_daemon(write_config(tmp_path, BYPASS_YAML, transport="collective", staging="host"))
    cluster = None
    try:
        http = daemon.client()
        assert http.get("/status").json()["config"]["bypass_cpu"] is True
        cluster = Cluster(2, 2, {"endpoint": daemon.zmq, "_bucket_size": VERL_DEFAULT_BUCKET, "timeout_s": 60.0,
                                 "load_timeout_s": 60.0})
        for steps in (1, 2):
            sync, _version, record = _delivered(cluster, http, steps)
            assert record["status"] == "committed" and record["mode"] == "bypass_cpu", record
            knobs = record["knobs"]
            assert knobs["bypass_cpu"] == {"value": True, "from": "deployment"}, knobs
            assert knobs["bucket_size_mb"] == {"value": BUCKET_SIZE / (1 << 20), "from": "deployment"}, knobs
            assert knobs["staging"] == {"value": "host", "from": "deployment"}, knobs
            assert {r["staging"]["mode"] for r in record["receivers"]} == {"host"}, record["receivers"]
            assert all("staging is host" in r["staging"]["why"] for r in record["receivers"]), record["receivers"]
            # the daemon's 64 KiB buckets, not verl's 2 GiB: several, so both actor ranks own and send some
            assert record["buckets"] > 2 and all(a["metrics"][f"ckpt_engine/bytes_sent_rank{rank}"] > 0
                                                 for rank, a in enumerate(sync["actors"])), record
            assert not record["cached"]  # bypass_cpu: no host copy
    finally:
        if cluster is not None:
            cluster.close()
        daemon.stop()


def test_a_knob_verl_sets_wins_and_a_failed_sync_costs_no_committed_version_its_place(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, BYPASS_YAML, transport="collective", keep_versions=3))
    cluster = None
    try:
        http = daemon.client()
        cluster = Cluster(1, 2, {"endpoint": daemon.zmq, "bypass_cpu": False, "timeout_s": 60.0,
                                 "load_timeout_s": 60.0})
        committed = []
        for steps in (1, 2, 3):
            _, version, record = _delivered(cluster, http, steps)
            assert record["status"] == "committed" and record["mode"] == "cached", record
            assert record["knobs"]["bypass_cpu"] == {"value": False, "from": "verl", "deployment": True}
            assert record["knobs"]["keep_versions"] == {"value": 3, "from": "deployment"}
            committed.append(version)

        bucket, tensor = _first_bucket_of(0, 1, 4)
        sync = cluster.update_weights(4, corrupt=(0, bucket))
        assert all("raised" in r and tensor in r["raised"] for r in sync["rollouts"]), sync["rollouts"]
        failed = http.get("/versions", params={"limit": 1}).json()["versions"][0]
        assert failed["status"] == "failed", failed

        def cached() -> list[int]:
            return sorted(v["id"] for v in http.get("/versions", params={"limit": 20}).json()["versions"]
                          if v["cached"])

        # the failed version leaves the actor's cache; the three committed ones keep their places
        _wait(lambda: cached() == committed, 60, "the cache holding exactly the committed versions")
        push = http.post(f"/versions/{committed[0]}/push")
        assert push.status_code == 202, push.text
        sync = cluster.update_weights(5)
        for rollout in sync["rollouts"]:
            assert rollout.get("received") == fingerprint(model_weights(1)), rollout
        record = _record(http, push.json()["version"])
        assert record["status"] == "committed", record
        assert record["version_digest"] == _record(http, committed[0])["version_digest"]
    finally:
        if cluster is not None:
            cluster.close()
        daemon.stop()
