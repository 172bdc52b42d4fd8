"""The fault-trial invariants (trials/checks.py), on hand-made evidence: each check must catch what it
exists for, and pass what is fine."""

from __future__ import annotations

from ckpt_engine.trials.checks import Limits, applied_violations, history_violations, read_jsonl, wait_violations

LIMITS = Limits(version_s=20, trainer_exit_s=8, margin_s=5)


def record(status: str, reason: str | None = None, took: float = 1.0, digest: str | None = None) -> dict:
    return {"status": status, "reason": reason, "created_at": 100.0, "updated_at": 100.0 + took,
            "version_digest": digest}


def test_a_receiver_whose_weights_differ_from_the_manifest_is_caught() -> None:
    applied = [{"receiver": 0, "version": 3, "manifest_digest": "aa", "model_digest": "aa"},
               {"receiver": 1, "version": 3, "manifest_digest": "aa", "model_digest": "bb"}]
    problems = applied_violations(applied, {3: record("committed", digest="aa")})
    assert len(problems) == 1 and "receiver 1" in problems[0] and "bb" in problems[0]


def test_a_manifest_that_differs_from_the_history_is_caught() -> None:
    applied = [{"receiver": 0, "version": 4, "manifest_digest": "cc", "model_digest": "cc"}]
    assert applied_violations(applied, {4: record("committed", digest="dd")})
    # a failed version has no digest in history: the manifest check alone applies
    assert applied_violations(applied, {4: record("failed", "trainer died")}) == []


def test_history_needs_terminal_states_reasons_and_bounded_durations() -> None:
    history = {1: record("committed"), 2: record("failed", "x"), 3: record("transferring"),
               4: record("failed"), 5: record("cancelled", "no receiver is due", took=26.0)}
    problems = history_violations(history, LIMITS)
    assert len(problems) == 3
    assert "version 3 is still 'transferring'" in problems[0]
    assert "version 4 is failed without a reason" in problems[1]
    assert "version 5 took 26.0s" in problems[2]


def test_survivor_waits_past_their_timeout_are_caught() -> None:
    assert wait_violations([("trainer1 exit", 12.9)], LIMITS) == []
    assert wait_violations([("trainer1 exit", 13.1)], LIMITS) == ["trainer1 exit took 13.1s (limit 13.0s)"]


def test_a_log_line_cut_by_kill_9_is_ignored_but_garbage_elsewhere_is_not() -> None:
    text = '{"version": 1}\nnot json\n{"version": 2}\n{"versi'
    entries = read_jsonl(text)
    assert [e.get("version") for e in entries] == [1, None, 2]
    assert applied_violations(entries, {})  # the garbage line counts as a violation
