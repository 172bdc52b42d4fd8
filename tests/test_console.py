"""What ``ckpt-engine status`` and ``versions`` print (server/console.py), from records as the API returns them."""

from __future__ import annotations

import pytest
from ckpt_engine.server.console import progress_line, status_lines, version_lines

RECORD = {"id": 7, "step": 70, "mode": "cached", "status": "transferring", "purpose": "sync", "source_version": None,
          "created_at": 100.0, "bytes": 1 << 20, "stages": {"snapshot": 0.012}, "receivers": [], "cached": True,
          "version_digest": None, "reason": None}
STATUS = {"version": "0.1.0", "history_id": "abcdef0123", "degraded": False, "versions": {"committed": 6},
          "in_flight": 7, "queued_push": None, "cache_versions": [5, 6], "cache_kept_for_repairs": [5]}
AGENTS = [{"agent_id": "t0", "role": "trainer", "rank": 0, "host": "h", "pid": 1, "device": "cpu", "versions": [5, 6]},
          {"agent_id": "r1", "role": "receiver", "state": "serving", "serving": 6, "engine": "e0",
           "last_staging": {"mode": "stream", "why": "asked", "pause_s": 0.01}}]


@pytest.mark.parametrize("status, now, expected", [
    (STATUS, 102.5, ">> v7 transferring (sync), 2.5 s so far: snapshot 12.0 ms"),
    ({**STATUS, "in_flight": None}, 0, "no version in flight"),
    ({**STATUS, "in_flight": None, "queued_push": 4}, 0, "re-push of v4 waits for the framework's next sync"),
])
def test_progress_line(status: dict, now: float, expected: str) -> None:
    assert progress_line(status, [RECORD], now) == expected


def test_status_shows_trainer_ranks_cache_and_receivers_with_lag_and_staging() -> None:
    committed = {**RECORD, "id": 8, "status": "committed"}
    lines = status_lines(STATUS, AGENTS, [committed, RECORD], now=101.0)
    assert lines[0].startswith("ckpt-engine 0.1.0  history abcdef01  ok")
    assert "  rank 0   t0  h:1  cpu  holds v5 v6" in lines
    assert "cache: v6 v5*  (* kept for repairs)" in lines
    assert lines[-1].split() == ["r1", "e0", "serving", "v6", "1", "stream"]


def test_a_degraded_daemon_says_so_first() -> None:
    assert "DEGRADED" in status_lines({**STATUS, "degraded": True}, [], [], 0)[0]


def test_version_lines_total_is_the_trainers_stages_without_a_total() -> None:
    record = {**RECORD, "stages": {"header": 0.5, "fill": 0.25, "verify": 9.0}}
    assert version_lines([record])[1].split()[6] == "0.750"
