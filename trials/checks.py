"""The invariants of a fault trial, as pure functions over what the trial collected (unit-tested without
processes in tests/test_chaos_checks.py).

- Receivers never apply a torn or wrong version: the digest a receiver computes from its own weights right
  after ``load`` equals the manifest's, and equals the history's digest of that version when it has one.
- Nothing waits past its timeout: every version reaches a terminal state within its deadline, and a process
  that must give up (a trainer rank whose peer died) does so within its own timeout plus a margin.
- History has every version with a terminal state, and a reason for each one that did not commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckpt_engine.control.messages import TERMINAL


@dataclass(frozen=True)
class Limits:
    version_s: float  # a version must end within this after it was requested
    trainer_exit_s: float  # a trainer rank whose peer died must exit within this
    margin_s: float


def applied_violations(applied: Iterable[dict], history: dict[int, dict]) -> list[str]:
    """``applied``: the receivers' log lines ``{receiver, version, manifest_digest, model_digest}``."""
    out = []
    for entry in applied:
        who, version = entry.get("receiver"), entry.get("version")
        if entry.get("model_digest") != entry.get("manifest_digest"):
            out.append(f"receiver {who} applied version {version}: weights digest {entry.get('model_digest')} "
                       f"!= manifest {entry.get('manifest_digest')}")
        recorded = history.get(version, {}).get("version_digest") if isinstance(version, int) else None
        if recorded is not None and recorded != entry.get("manifest_digest"):
            out.append(f"receiver {who} applied version {version} with digest {entry.get('manifest_digest')}, "
                       f"history says {recorded}")
    return out


def history_violations(history: dict[int, dict], limits: Limits) -> list[str]:
    out = []
    for version, record in sorted(history.items()):
        status = record.get("status")
        if status not in TERMINAL:
            out.append(f"version {version} is still {status!r}")
            continue
        if status != "committed" and not record.get("reason"):
            out.append(f"version {version} is {status} without a reason")
        took = float(record.get("updated_at", 0)) - float(record.get("created_at", 0))
        if took > limits.version_s + limits.margin_s:
            out.append(f"version {version} took {took:.1f}s to end (limit {limits.version_s + limits.margin_s:.1f}s)")
    return out


def storage_violations(applied: Iterable[dict], history: dict[int, dict]) -> list[str]:
    """With a storage fault and nothing else wrong: a version some receiver applied is recorded committed
    (the outcome was kept in memory and written once the file could be; never rewritten failed)."""
    out = []
    for version in sorted({v for e in applied if isinstance(v := e.get("version"), int)}):
        record = history.get(version)
        if record is not None and record.get("status") != "committed":
            out.append(f"version {version} was applied but is recorded {record.get('status')}: "
                       f"{record.get('reason')}")
    return out


def wait_violations(waits: Iterable[tuple[str, float]], limits: Limits) -> list[str]:
    """``waits``: (what, seconds) of survivors that had to give up, e.g. ("trainer rank 1 exit", 9.2)."""
    bound = limits.trainer_exit_s + limits.margin_s
    return [f"{what} took {seconds:.1f}s (limit {bound:.1f}s)" for what, seconds in waits if seconds > bound]


def read_jsonl(text: str) -> list[dict]:
    """Lines of a JSON-lines log; a last line cut short by kill -9 is ignored, any other bad line is kept
    as a violation marker so it cannot hide a problem."""
    import json

    lines = text.splitlines()
    out = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if index != len(lines) - 1:
                out.append({"receiver": "?", "version": None, "model_digest": "unparseable log line",
                            "manifest_digest": line[:80]})
    return out
