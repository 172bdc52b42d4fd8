"""The daemon's side of a framework-driven job (verl, ``framework: verl``), against the real daemon, with
agents speaking the protocol by hand: what the verl backend (tests/engines_verl, in verl's own environment)
asks of it, and what a token holder might try. The backend itself runs in scripts/test-verl.sh."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckpt_engine.control.client import ControlClient, ControlReplyError
from tests.daemon_harness import silent_after, start_daemon, timeouts, write_config
from tests.raw_agent import RawAgent
from tests.test_elastic import wait_until

pytestmark = pytest.mark.multiproc
# the agents here are the test's own (RawAgent): they are heard only when the test polls with them, so a heartbeat
# they meet whatever the test does in between; a version waits 3 s for a worker's missing outcome
_QUICK = timeouts(ack_s=3, heartbeat_s=30)


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


def _open(trainer: RawAgent, workers: list[RawAgent], **body) -> dict:
    return trainer.request("sync", {**trainer.identity, "receivers": [w.agent_id for w in workers], **body})


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
        trainer.request("sync", {**trainer.identity, "receivers": ["0123456789abcdef"]})
    other = RawAgent(daemon, "receiver")  # a receiver that is not the framework's
    # a trainer-token holder claiming a rank of the live job that it does not have, or one that is not verl's
    with pytest.raises(ControlReplyError, match="not a rank of the registered trainer job"):
        RawAgent(daemon, "trainer", rank=1, framework="verl")
    with pytest.raises(ControlReplyError, match="registered and alive"):
        RawAgent(daemon, "trainer", rank=0)
    impostor = RawAgent(daemon, "receiver", framework="verl")  # a framework agent that is not its rank 0
    try:
        with pytest.raises(ControlReplyError, match="is not a verl receiver"):
            _open(trainer, [other])
        with pytest.raises(ControlReplyError, match="twice"):
            _open(trainer, [workers[0], workers[0]])
        with pytest.raises(ControlReplyError, match="cannot be combined with bypass_cpu"):
            _open(trainer, workers, sparse=True, knobs={"bypass_cpu": True})
        with pytest.raises(ControlReplyError, match="keep_versions"):  # as the deployment's own YAML is checked
            _open(trainer, workers, knobs={"keep_versions": 0})
        with pytest.raises(ControlReplyError, match="step: Input should be greater than or equal to 0"):
            _open(trainer, workers, step=-5)
        with pytest.raises(ControlReplyError, match="names the trainer agent"):  # the token alone is not enough
            trainer.request("sync", {"receivers": [w.agent_id for w in workers]})
        with pytest.raises(ControlReplyError, match=r"not the framework trainer rank 0|forbidden|role"):
            _open(impostor, workers)
        with pytest.raises(ControlReplyError, match=r"invalid|at least 1"):
            _open(trainer, [])
        with pytest.raises(ControlReplyError, match=r"forbidden|not allowed|role|token"):  # a rollout token cannot
            _open(workers[0], workers)
        assert other.poll() is None and workers[0].poll() is None  # no catch-ups, no versions of their own
    finally:
        other.close()
        impostor.close()
    assert daemon.client().get("/status").json()["in_flight"] is None  # nothing refused was left open


def test_only_the_framework_s_rank_0_opens_its_syncs(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_QUICK))
    lead = RawAgent(daemon, "trainer", framework="verl", trainer_ranks=2)
    other_rank = RawAgent(daemon, "trainer", rank=1, framework="verl")
    worker = RawAgent(daemon, "receiver", framework="verl")
    try:
        with pytest.raises(ControlReplyError, match="not the framework trainer rank 0"):
            _open(other_rank, [worker])
        assert _open(lead, [worker])["owners"] == 2
    finally:
        for agent in (lead, other_rank, worker):
            agent.close()
        daemon.stop()


def test_a_sync_abandoned_before_its_end_does_not_block_the_next(job) -> None:
    """verl runs one sync at a time: one still open when the next opens was abandoned (verl failed elsewhere,
    or the reply that opened it was lost). It fails at once, instead of refusing syncs until its time limit."""
    daemon, trainer, workers = job
    orphan = _open(trainer, workers)["id"]
    fresh = _open(trainer, workers)["id"]
    assert fresh > orphan
    gone = _record(daemon, orphan)  # (its outcome is unknown: its reports may still be on the way)
    assert gone["status"] == "interrupted" and "superseded" in gone["reason"], gone
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
    with pytest.raises(ControlReplyError):  # a sync refused before it opened leaves the rollback queued
        trainer.request("sync", {**trainer.identity, "receivers": ["0123456789abcdef"]})
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


def test_only_committed_versions_can_be_pushed(job) -> None:
    daemon, trainer, workers = job
    failed = _open(trainer, workers)["id"]
    trainer.report(failed, "done", ok=True, version_digest="d1", cache_versions=[failed])
    for worker in workers:
        worker.report(failed, "received", ok=False, reason="digest mismatch in 1 tensor(s): w")
    assert _record(daemon, failed)["status"] == "failed"
    refused = daemon.client().post(f"/versions/{failed}/push")
    assert refused.status_code == 409 and "only a committed version" in refused.text


def test_a_framework_version_gets_the_time_limit_its_framework_asked_for(job) -> None:
    daemon, trainer, workers = job
    version = _open(trainer, workers, limit_s=1.0)["id"]
    deadline = time.monotonic() + 15
    while _record(daemon, version)["status"] != "failed" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "timed out" in _record(daemon, version)["reason"] and "after 1s" in _record(daemon, version)["reason"]


def test_a_restarted_job_s_rank_0_replaces_the_old_one_once_it_is_silent(tmp_path: Path) -> None:
    """verl's rank 0 registers once per process: a new one is a restarted job, and the old registration (its
    process gone, its heartbeat not yet expired) must not stay the trainer the daemon listens to."""
    heartbeat_s = 10.0  # (the workers polling below stay alive on a loaded machine too)
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=timeouts(heartbeat_s=heartbeat_s)))
    trainer = RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)
    workers = [RawAgent(daemon, "receiver", framework="verl") for _ in range(2)]
    restarted = None
    try:
        orphan = _open(trainer, workers)["id"]
        # past the old rank 0's window (half a heartbeat: its polls do not wait), workers alive
        deadline = time.monotonic() + silent_after(heartbeat_s, 0.0) + 0.5
        while time.monotonic() < deadline:
            for worker in workers:
                worker.poll()
            time.sleep(0.3)
        restarted = RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)
        assert _record(daemon, orphan)["status"] == "failed"
        with pytest.raises(ControlReplyError, match="unregistered agent"):
            _open(trainer, workers)
        version = _open(restarted, workers)["id"]
        _commit(restarted, workers, version)
        assert _record(daemon, version)["status"] == "committed"
    finally:
        for agent in (trainer, *workers, *([restarted] if restarted else [])):
            agent.close()
        daemon.stop()


def test_a_second_live_job_s_rank_0_is_refused_and_the_live_job_goes_on(job) -> None:
    """Found by the second outside round: two live verl jobs on one daemon replaced each other's rank 0 in a
    loop (every sync of both failed), and one ``register`` with the trainer token failed a live job's sync."""
    daemon, trainer, workers = job
    version = _open(trainer, workers)["id"]
    with pytest.raises(ControlReplyError, match=r"registered and alive.*one daemon serves one verl job") as refused:
        RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1, pid=os.getpid() + 1)
    assert refused.value.error == "conflict" and trainer.agent_id in str(refused.value)
    _commit(trainer, workers, version)  # the live job's sync was not touched
    assert _record(daemon, version)["status"] == "committed"
    # host and pid are the registrant's say: claiming the live one's does not get an impostor in either
    with pytest.raises(ControlReplyError, match="registered and alive"):
        RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)
    # nor does a plain trainer rank 0 (it would become the trainer the daemon listens to once the job restarts)
    with pytest.raises(ControlReplyError, match="a verl job's trainer rank 0 is registered and alive"):
        RawAgent(daemon, "trainer", trainer_ranks=1)


def test_a_verl_job_s_rank_0_is_refused_while_a_plain_trainer_is_served(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_QUICK))
    plain = RawAgent(daemon, "trainer", trainer_ranks=1)
    try:
        with pytest.raises(ControlReplyError, match=r"not a framework's.*registered and alive"):
            RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)
    finally:
        plain.close()
        daemon.stop()


def test_a_version_being_sent_again_cannot_be_evicted_and_a_leaving_one_is_not_queued(job) -> None:
    """Found by the second outside round: an evict landing after verl's sync took a queued rollback, before
    the ranks read it from their caches, failed verl's update_weights."""
    daemon, trainer, workers = job
    http = daemon.client()
    first = _open(trainer, workers)["id"]
    _commit(trainer, workers, first)
    queued = http.post(f"/versions/{first}/push").json()["version"]
    push = _open(trainer, workers)
    assert push["id"] == queued and push["source_version"] == first
    refused = http.delete(f"/versions/{first}")
    assert refused.status_code == 409 and f"version {queued}" in refused.json()["detail"], refused.text
    _commit(trainer, workers, queued, cache=[first])
    assert _record(daemon, queued)["status"] == "committed"
    # an eviction asked for but not yet confirmed by the ranks: the next sync sends new weights, not it
    again = http.post(f"/versions/{first}/push").json()["version"]
    operator = ControlClient(daemon.zmq, timeout_s=5, token=daemon.tokens()["operator"])
    try:
        operator.request("evict", {"version": first})  # (over ZMQ: asked, not waited for)
    finally:
        operator.close()
    sync = _open(trainer, workers)
    assert sync["source_version"] is None and sync["id"] != again, sync
    dropped = _record(daemon, again)
    assert dropped["status"] == "failed" and "no longer in the trainer's cache" in dropped["reason"], dropped


def test_an_agent_registered_again_after_a_daemon_restart_stays_registered(tmp_path: Path) -> None:
    """After a restart the agents register again; their first poll comes at once, not after the backoff their
    failed polls grew while the daemon was down (up to 12.5 s: past a short heartbeat, they expired again and
    again)."""
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    # (the heartbeat is the subject: shorter than the backoff the failed polls grow)
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=timeouts(heartbeat_s=3)))
    agent = RolloutAgent(lambda payload: None, daemon.zmq).start()
    try:
        daemon.stop()
        time.sleep(14)  # polls fail meanwhile: their backoff grows to its maximum
        daemon = start_daemon(daemon.config_path)
        wait_until(lambda: daemon.client().get("/receivers").json()["agents"], 30, "the agent to register again")
        seen = []
        for _ in range(16):  # about 2.5 heartbeats: the same registration throughout, never expired again
            seen.append([a["agent_id"] for a in daemon.client().get("/receivers").json()["agents"]])
            time.sleep(0.5)
        assert len(seen[0]) == 1 and all(ids == seen[0] for ids in seen), seen
        assert "missed heartbeats" not in daemon.log(), daemon.log_tail()
    finally:
        agent.close()
        daemon.stop()


def test_an_agent_replaced_while_its_poll_waits_does_not_stop_the_control_plane(job) -> None:
    """Found by the second outside round: a poll parked for an agent that is then replaced (or leaves) was
    answered with an error that ended the ZMQ loop, and the daemon answered no one after that."""
    import threading

    daemon, trainer, workers = job
    answered: list[object] = []
    waiting = threading.Thread(target=lambda: answered.append(trainer.poll(wait_s=10.0)), daemon=True)
    sent = time.monotonic()
    waiting.start()
    # parked on the daemon once it heard the poll (its wait is far longer than what follows takes)
    wait_until(lambda: next(a for a in daemon.client().get("/receivers").json()["agents"]
                            if a["agent_id"] == trainer.agent_id)["seconds_since_seen"] < time.monotonic() - sent,
               30, "the poll to arrive")
    other = ControlClient(daemon.zmq, timeout_s=5, token=daemon.tokens()["trainer"])  # (the first is waiting)
    try:
        other.request("unregister", trainer.identity)  # it leaves while its poll waits
    finally:
        other.close()
    waiting.join(30)
    assert answered == [None]  # an empty answer, not a dead loop
    restarted = RawAgent(daemon, "trainer", framework="verl", trainer_ranks=1)  # the control plane still answers
    try:
        version = _open(restarted, workers)["id"]
        _commit(restarted, workers, version)
        assert _record(daemon, version)["status"] == "committed"
    finally:
        restarted.close()



def test_a_rollback_whose_sync_was_abandoned_before_it_started_stays_queued(job) -> None:
    """Found by the third outside round: a stalled daemon answered, once it ran again, a sync opening verl had
    given up on; that version took the queued rollback, the next sync superseded it, and the rollback was lost
    (verl's next sync sent new weights)."""
    daemon, trainer, workers = job
    http = daemon.client()
    first = _open(trainer, workers)["id"]
    _commit(trainer, workers, first)
    queued = http.post(f"/versions/{first}/push").json()["version"]
    assert _open(trainer, workers)["id"] == queued  # taken by a sync whose rank 0 never heard the reply
    again = _open(trainer, workers)  # verl's next sync: the rollback is what it sends (as a version of its own)
    assert again["id"] > queued and again["source_version"] == first and again["purpose"] == "push", again
    abandoned = _record(daemon, queued)
    assert abandoned["status"] == "interrupted" and f"queued again as version {again['id']}" in abandoned["reason"]
    _commit(trainer, workers, again["id"], cache=[first])
    assert _record(daemon, again["id"])["status"] == "committed"
    # one that had started (rank 0 reported its first stage) is not sent again: it may have arrived (found by
    # the fourth outside round: a delivered rollback whose reports came after the next sync's opening)
    second = http.post(f"/versions/{first}/push").json()["version"]
    assert _open(trainer, workers)["id"] == second
    trainer.report(second, "snapshotting", step=7)
    workers[0].report(second, "received", ok=True, version_digest="d1")
    fresh = _open(trainer, workers)
    assert fresh["source_version"] is None and fresh["id"] > second, fresh
    superseded = _record(daemon, second)
    assert superseded["status"] == "interrupted" and "reports still on the way" in superseded["reason"], superseded
