"""A framework's knobs against the deployment's (issue 37), against the real daemon with agents speaking the
protocol by hand (the verl backend itself, through verl: tests/engines_verl, scripts/test-verl.sh):

- a knob the framework leaves unset takes the deployment's value (deploy/engine-bypass.yaml's bypass_cpu: true
  makes a verl sync bypass_cpu), one it sets wins, logged once, and the version's record says which and why;
- a framework's failed version never costs a committed one its place in the trainer ranks' caches: the daemon
  asks them to drop it as it ends, and the oldest committed one only once a newer one committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.config import EngineConfig, parse_config
from ckpt_engine.config.knobs import settle
from tests.daemon_harness import ROOT, start_daemon, timeouts, write_config
from tests.raw_agent import RawAgent
from tests.test_elastic import wait_until

pytestmark = pytest.mark.multiproc
_QUICK = timeouts(ack_s=3, heartbeat_s=30)


def _open(trainer: RawAgent, workers: list[RawAgent], **body) -> dict:
    return trainer.request("sync", {**trainer.identity, "receivers": [w.agent_id for w in workers], **body})


def _end(trainer: RawAgent, workers: list[RawAgent], version: int, cache: list[int], ok: bool = True) -> None:
    trainer.report(version, "done", ok=True, version_digest=f"d{version}", cache_versions=cache)
    for worker in workers:
        worker.report(version, "received", ok=ok, version_digest=f"d{version}" if ok else None,
                      reason=None if ok else "refused")


def test_the_rule_as_a_table() -> None:
    yaml = parse_config({"bypass_cpu": True, "keep_versions": 3, "staging": "host"})
    unset = settle({}, yaml)
    assert (unset.mode, unset.keep_versions, unset.staging, unset.sparse) == ("bypass_cpu", 3, "host", False)
    assert unset.record["bypass_cpu"] == {"value": True, "from": "deployment"}
    assert unset.record["bucket_size_mb"] == {"value": 512.0, "from": "default"} and not unset.overrides
    mine = settle({"bypass_cpu": False, "keep_versions": 3, "staging": "stream"}, yaml)
    assert (mine.mode, mine.staging) == ("cached", "stream")
    assert mine.record["bypass_cpu"] == {"value": False, "from": "verl", "deployment": True}
    assert mine.record["keep_versions"] == {"value": 3, "from": "verl"}  # the same value: no override
    assert [line.split(" overrides")[0] for line in mine.overrides] == ["verl's bypass_cpu=False",
                                                                       "verl's staging='stream'"]
    # a deployment default yields to what the framework asks (as for a POST /sync), and says so
    sparse = settle({"sparse": True}, yaml)
    assert (sparse.mode, sparse.sparse) == ("cached", True) and "yields" in sparse.record["bypass_cpu"]["note"]
    alone = settle({}, EngineConfig())  # no daemon: the same defaults
    assert (alone.mode, alone.keep_versions, alone.bucket_size_mb) == ("cached", 2, 512.0)


def test_unset_knobs_take_the_deployment_s_and_set_ones_win_logged_once(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine-bypass.yaml", transport="collective",
                                       timeouts=_QUICK, keep_versions=3))
    trainer = RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)
    workers = [RawAgent(daemon, "receiver", framework="verl") for _ in range(2)]
    try:
        http = daemon.client()
        assert http.get("/status").json()  # (the daemon is up)
        opened = _open(trainer, workers)  # verl set nothing
        assert opened["mode"] == "bypass_cpu" and opened["knobs"]["bypass_cpu"] is True
        assert opened["knobs"]["keep_versions"] == 3 and opened["knobs"]["bucket_size_mb"] == 0.0625
        _end(trainer, workers, opened["id"], [])
        record = http.get(f"/versions/{opened['id']}").json()
        assert record["status"] == "committed" and record["mode"] == "bypass_cpu", record
        assert record["knobs"]["bypass_cpu"] == {"value": True, "from": "deployment"}, record["knobs"]
        for _ in range(2):  # verl sets bypass_cpu: false and keep_versions: 1; the same override twice
            mine = _open(trainer, workers, knobs={"bypass_cpu": False, "keep_versions": 1})
            assert mine["mode"] == "cached" and mine["knobs"]["keep_versions"] == 1
            assert len(mine["knobs"]["overrides"]) == 2, mine["knobs"]
            # (it names where verl users set it: their engine_kwargs' ckpt_engine section; outside attack)
            assert all("unset it in engine_kwargs.ckpt_engine " in line for line in mine["knobs"]["overrides"])
            _end(trainer, workers, mine["id"], [mine["id"]])
        record = http.get(f"/versions/{mine['id']}").json()
        assert record["knobs"]["bypass_cpu"] == {"value": False, "from": "verl", "deployment": True}
        assert record["knobs"]["keep_versions"] == {"value": 1, "from": "verl", "deployment": 3}
        logged = daemon.log_path.read_text()
        assert logged.count("verl's bypass_cpu=False overrides the deployment's bypass_cpu=True") == 1, logged
    finally:
        for agent in (trainer, *workers):
            agent.close()
        daemon.stop()


def test_a_failed_framework_version_is_dropped_and_costs_no_committed_one_its_place(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_QUICK, keep_versions=2))
    trainer = RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)
    workers = [RawAgent(daemon, "receiver", framework="verl")]
    try:
        http = daemon.client()
        first = _open(trainer, workers)["id"]
        _end(trainer, workers, first, [first])
        second = _open(trainer, workers)["id"]
        _end(trainer, workers, second, [first, second])
        assert trainer.poll() is None  # two committed, keep_versions 2: nothing to drop
        failed = _open(trainer, workers)["id"]
        _end(trainer, workers, failed, [first, second, failed], ok=False)
        assert http.get(f"/versions/{failed}").json()["status"] == "failed"
        drop = trainer.poll()
        assert drop is not None and (drop["kind"], drop["version"]) == ("evict", failed), drop
        trainer.poll(received=f"evict:{failed}")
        trainer.report(failed, "evicted", cache_versions=[first, second])
        assert http.get(f"/versions/{first}").json()["cached"]  # the oldest committed one kept its place
        newest = _open(trainer, workers)["id"]
        _end(trainer, workers, newest, [first, second, newest])
        drop = trainer.poll()
        assert drop is not None and (drop["kind"], drop["version"]) == ("evict", first), drop
        trainer.poll(received=f"evict:{first}")
        trainer.report(first, "evicted", cache_versions=[second, newest])
        wait_until(lambda: [v["id"] for v in http.get("/versions").json()["versions"] if v["cached"]]
                   == [newest, second], 30, "the newest two committed versions cached")
    finally:
        for agent in (trainer, *workers):
            agent.close()
        daemon.stop()


def test_a_framework_bucket_below_the_alignment_is_refused_as_the_deployment_s_would_be() -> None:
    """(outside attack) verl's bucket_size_mb 0.0001 made 256-byte buckets; the same in the YAML is refused."""
    import pytest

    from ckpt_engine.config import EngineConfig
    from ckpt_engine.config.knobs import settle
    from ckpt_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"engine_kwargs.ckpt_engine.bucket_size_mb: .* less than the deployment"):
        settle({"bucket_size_mb": 0.0001}, EngineConfig())
