"""The daemon's side of a framework-driven job (verl, ``framework: verl``), against the real daemon, with
agents speaking the protocol by hand: what the verl backend (tests/engines_verl, in verl's own environment)
asks of it, and what a token holder might try. The backend itself runs in scripts/test-verl.sh."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.control.client import ControlReplyError
from tests.daemon_harness import start_daemon, write_config
from tests.raw_agent import RawAgent

pytestmark = pytest.mark.multiproc
_QUICK = {"connect_s": 4, "collective_s": 4, "ack_s": 3, "heartbeat_s": 30, "version_s": 60}


@pytest.fixture
def job(tmp_path: Path):
    """A daemon with a verl job registered: actor rank 0 (trainer) and two rollout workers."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_QUICK))
    trainer = RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)
    workers = [RawAgent(daemon, "receiver", framework="verl") for _ in range(2)]
    yield daemon, trainer, workers
    for agent in (trainer, *workers):
        agent.close()
    daemon.stop()


def _open(trainer: RawAgent, workers: list[RawAgent]) -> dict:
    return trainer.request("sync", {"receivers": [w.agent_id for w in workers]})


def _commit(trainer: RawAgent, workers: list[RawAgent], version: int, digest: str = "d1",
            cache: list[int] | None = None) -> None:
    trainer.report(version, "snapshotting", step=7)
    trainer.report(version, "done", ok=True, version_digest=digest, cache_versions=cache or [version])
    for worker in workers:
        worker.report(version, "received", ok=True, version_digest=digest)


def _record(daemon, version: int) -> dict:
    return daemon.client().get(f"/versions/{version}").json()


def test_a_framework_sync_is_a_version_judged_by_every_worker_it_named(job) -> None:
    daemon, trainer, workers = job
    record = _open(trainer, workers)
    assert record["purpose"] == "sync" and [r["agent_id"] for r in record["receivers"]] == [w.agent_id for w in
                                                                                              workers]
    assert workers[0].poll() is None  # nothing is assigned: the framework's own groups carry it
    _commit(trainer, workers, record["id"])
    done = _record(daemon, record["id"])
    assert done["status"] == "committed" and done["step"] == 7 and done["cached"], done
    # one worker failing fails a framework's version (verl needs every worker it named)
    second = _open(trainer, workers)["id"]
    trainer.report(second, "done", ok=True, version_digest="d2", cache_versions=[record["id"], second])
    workers[0].report(second, "received", ok=True, version_digest="d2")
    workers[1].report(second, "received", ok=False, reason="load failed part way", torn=True)
    failed = _record(daemon, second)
    assert failed["status"] == "failed" and "part way" in failed["reason"], failed


def test_the_daemon_does_not_start_a_framework_job_s_versions_and_refuses_hostile_quorums(job) -> None:
    daemon, trainer, workers = job
    http = daemon.client()
    plain = http.post("/sync", json={})
    assert plain.status_code == 409 and "verl" in plain.json()["detail"]
    assert http.post("/sync", json={"receivers": [workers[0].agent_id]}).status_code == 422  # not on HTTP
    with pytest.raises(ControlReplyError, match="not registered"):
        trainer.request("sync", {"receivers": ["0123456789abcdef"]})
    other = RawAgent(daemon, "receiver")  # a receiver that is not the framework's
    try:
        with pytest.raises(ControlReplyError, match="is not a verl receiver"):
            trainer.request("sync", {"receivers": [other.agent_id]})
        with pytest.raises(ControlReplyError, match="twice"):
            trainer.request("sync", {"receivers": [workers[0].agent_id] * 2})
        with pytest.raises(ControlReplyError, match="sparse"):
            trainer.request("sync", {"receivers": [workers[0].agent_id], "sparse": True})
        with pytest.raises(ControlReplyError, match="forbidden|not allowed|role"):  # a rollout token cannot
            workers[0].request("sync", {"receivers": [workers[0].agent_id]})
        assert other.poll() is None and workers[0].poll() is None  # no catch-ups, no versions of their own
    finally:
        other.close()
    assert daemon.client().get("/status").json()["in_flight"] is None  # nothing refused was left open


def test_a_sync_abandoned_before_its_end_does_not_block_the_next(job) -> None:
    """verl runs one sync at a time: one still open when the next opens was abandoned (verl failed elsewhere,
    or the reply that opened it was lost). It fails at once, instead of refusing syncs until its time limit."""
    daemon, trainer, workers = job
    orphan = _open(trainer, workers)["id"]
    fresh = _open(trainer, workers)["id"]
    assert fresh > orphan
    gone = _record(daemon, orphan)
    assert gone["status"] == "failed" and "superseded" in gone["reason"], gone
    _commit(trainer, workers, fresh)
    assert _record(daemon, fresh)["status"] == "committed"


def test_a_rollback_is_queued_for_the_framework_s_next_sync(job) -> None:
    daemon, trainer, workers = job
    http = daemon.client()
    first = _open(trainer, workers)["id"]
    _commit(trainer, workers, first)
    queued = http.post(f"/versions/{first}/push").json()["version"]
    assert _record(daemon, queued)["status"] == "requested"
    assert http.get("/status").json()["queued_push"] == queued
    again = http.post(f"/versions/{first}/push").json()["version"]  # a newer push replaces the queued one
    replaced = _record(daemon, queued)
    assert replaced["status"] == "cancelled" and str(again) in replaced["reason"], replaced
    sync = _open(trainer, workers)  # the framework's next sync sends it
    assert sync["id"] == again and sync["source_version"] == first and sync["purpose"] == "push"
    _commit(trainer, workers, again, cache=[first])  # (a re-push adds nothing to the cache)
    assert _record(daemon, again)["status"] == "committed"
    assert http.get("/status").json()["queued_push"] is None
    # a queued push the daemon cannot deliver any more ends truthfully: the daemon stopping cancels it
    last = http.post(f"/versions/{first}/push").json()["version"]
    daemon.stop()
    restarted = start_daemon(daemon.config_path)
    try:
        stopped = restarted.client().get(f"/versions/{last}").json()
        assert stopped["status"] == "cancelled" and "stopped" in stopped["reason"], stopped
    finally:
        restarted.stop()
