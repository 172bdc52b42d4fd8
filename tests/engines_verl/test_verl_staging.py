"""What each staging gives verl's loader (issue 37), through the real verl 0.9.1 backend and a real daemon: with
``staging: auto`` and little memory to stage in (the deployment's ``staging_budget_mb``), auto streams, and the
version's record says so and why; a corrupted bucket under stream is refused when it arrives, after verl's
loader was handed the buckets before it: the workers are torn (listed in /status) until the next sync brings
a whole version. (Device and host staging hand verl nothing of a version that does not verify:
test_verl_backend.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl tests run in scripts/test-verl.sh's environment")

from ckpt_engine.plan.layout import plan_layout
from ckpt_engine.plan.tensors import spec_of
from ckpt_engine.server.launch import start_daemon, write_config
from tests.engines_verl.test_verl_backend import _check_delivered
from tests.engines_verl.verl_harness import BUCKET_SIZE, Cluster, model_weights

pytestmark = pytest.mark.multiproc


def test_auto_says_why_it_streams_and_a_bad_bucket_under_stream_tears_the_workers(tmp_path: Path) -> None:
    # 0.05 MiB to stage in (auto may take half of it): less than the version, so auto streams
    daemon = start_daemon(write_config(tmp_path, transport="collective", staging_budget_mb=0.05))
    cluster = None
    try:
        http = daemon.client()
        cluster = Cluster(1, 2, {"endpoint": daemon.zmq, "timeout_s": 60.0, "load_timeout_s": 60.0})
        sync = cluster.update_weights(1)
        version = sync["actors"][0]["metrics"]["ckpt_engine/version"]
        _check_delivered(sync, 1, version)
        record = http.get(f"/versions/{version}").json()
        assert record["status"] == "committed" and record["knobs"]["staging"]["value"] == "auto", record
        for entry in record["receivers"]:
            assert entry["staging"]["mode"] == "stream", entry
            assert "fits 50% of neither" in entry["staging"]["why"], entry  # auto's choice, with its reason

        layout = plan_layout([spec_of(n, t) for n, t in model_weights(2)], BUCKET_SIZE)
        before = sum(len(layout.buckets[k].slots) for k in (0, 1))  # the tensors of the buckets before bucket 2
        sync = cluster.update_weights(2, corrupt=(0, 2))
        for rollout in sync["rollouts"]:
            assert "failed part way" in rollout["raised"], rollout
            assert rollout["yielded"] == before, rollout  # verl's loader had those already
        failed = http.get("/versions", params={"limit": 1}).json()["versions"][0]
        assert failed["status"] == "failed" and all(e["torn"] for e in failed["receivers"]), failed
        assert sorted(http.get("/status").json()["torn"]) == sorted(e["agent_id"] for e in failed["receivers"])

        sync = cluster.update_weights(3)  # the next sync brings a whole version: the workers serve again
        version = sync["actors"][0]["metrics"]["ckpt_engine/version"]
        _check_delivered(sync, 3, version)
        assert http.get(f"/versions/{version}").json()["status"] == "committed"
        assert http.get("/status").json()["torn"] == []
    finally:
        if cluster is not None:
            cluster.close()
        daemon.stop()
