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
    assert lines[-1].split() == ["r1", "-", "e0", "serving", "v6", "1", "stream"]  # (in no version shown yet)


def test_a_receiver_is_named_by_its_rank_in_the_newest_version_it_was_in() -> None:
    """Issue 37: the page and status showed every receiver as "rank 0" (the rank it registered with), reasons
    said "rank 2" (its rank in the version's quorum): one name, "receiver N", N from the version."""
    older = {**RECORD, "id": 5, "status": "committed", "receivers": [{"rank": 1, "agent_id": "r1", "ok": True}]}
    newer = {**RECORD, "id": 6, "status": "committed", "receivers": [{"rank": 2, "agent_id": "r1", "ok": True}]}
    lines = status_lines({**STATUS, "in_flight": None}, AGENTS, [newer, older], now=101.0)
    assert lines[-2].split()[:3] == ["agent", "receiver", "engine"]
    assert lines[-1].split()[:3] == ["r1", "2", "(v6)"]


def test_a_degraded_daemon_says_so_first() -> None:
    assert "DEGRADED" in status_lines({**STATUS, "degraded": True}, [], [], 0)[0]


def test_version_lines_total_is_request_to_commit() -> None:
    """Issue 37: the total was the trainer's stages (533.7 ms for a version the log had at 2247 ms request->commit,
    which also counts the wait for a step boundary, the rendezvous and the receivers' reports)."""
    record = {**RECORD, "status": "committed", "committed_at": 102.247, "updated_at": 103.0,
              "stages": {"header": 0.5, "fill": 0.25, "verify": 9.0}}
    assert version_lines([record])[0].split()[6:8] == ["total", "s"]
    assert version_lines([record])[1].split()[6] == "2.247"
    assert version_lines([{**record, "status": "failed", "committed_at": None}])[1].split()[6] == "3.000"
    assert version_lines([RECORD])[1].split()[6] == "-"  # in flight: the progress line says how long so far


def test_what_agents_name_cannot_drive_the_terminal() -> None:
    """Found by the outside attack on issue 28: a host, device or reason with escape sequences retitled the
    window, wrote the clipboard (OSC 52) and erased a line to print a fake one."""
    hostile = "\x1b]0;PWNED\x07\x1b[31mRED\x1b]52;c;cHduZWQ=\x07\r\x1b[2Kfake\x9b"
    agents = [{**AGENTS[0], "host": hostile, "device": hostile},
              {**AGENTS[1], "torn": hostile, "last_staging": {"mode": "stream", "why": hostile}}]
    record = {**RECORD, "status": "failed", "reason": hostile}
    lines = status_lines(STATUS, agents, [record], now=101.0) + version_lines([record])
    assert not any(ch in line for line in lines for ch in "\x1b\x07\r\x9b")
    assert any("\\x1b]0;PWNED\\x07" in line for line in lines)


def test_the_lag_is_the_daemon_s_when_it_gives_one() -> None:
    """Found by the outside attack on issue 28: the CLI counted lag in the 50 versions it read, the page in 30,
    the metrics in 100 committed ones; GET /receivers now says it, and every view shows that."""
    far_behind = {**AGENTS[1], "serving": 1, "lag": 60}
    assert status_lines(STATUS, [AGENTS[0], far_behind], [RECORD], now=101.0)[-1].split()[5] == "60"


def test_a_watch_outlives_a_daemon_that_is_down_and_refuses_a_bad_interval() -> None:
    """Found by the outside attack on issue 28: a watch ended at the first failed read (a restarting daemon),
    and --interval nan or -1 crashed it after the first frame."""
    import subprocess
    import sys

    from tests.daemon_harness import ROOT, free_port

    cli = [sys.executable, "-m", "ckpt_engine.cli.main", "--url", f"http://127.0.0.1:{free_port()}"]
    down = subprocess.run([*cli, "status", "--watch", "--count", "2", "--interval", "0.1"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert down.returncode == 0 and down.stdout.count("daemon unreachable or refusing") == 2, down
    for bad in ("nan", "-1", "0"):
        refused = subprocess.run([*cli, "versions", "--watch", "--interval", bad], capture_output=True, text=True,
                                 timeout=60, cwd=ROOT)
        assert refused.returncode == 2 and "from 0.1 to 3600" in refused.stderr, refused


def test_a_named_credentials_file_that_does_not_exist_is_said_so(tmp_path) -> None:
    """(outside attack) `--credentials /missing.json status` answered only the daemon's bare 401."""
    import os
    import subprocess
    import sys

    missing = tmp_path / "nope.json"
    env = {k: v for k, v in os.environ.items() if k not in ("CKPT_ENGINE_TOKEN", "CKPT_ENGINE_CREDENTIALS")}
    done = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "--url", "http://127.0.0.1:9",
                           "--credentials", str(missing), "status"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode != 0 and f"credentials file {missing} (--credentials) does not exist" in done.stderr, done
