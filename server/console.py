"""What ``ckpt-engine status`` and ``ckpt-engine versions`` print (pure: the JSON of GET /status, /versions
and /receivers in, lines out), with the progress line of the version in flight."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ckpt_engine.control.messages import TERMINAL
from ckpt_engine.server.decisions.views import quorum_ranks, receiver_rows

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(lines: Iterable[str]) -> list[str]:
    """``lines`` with every control character written as ``\\xNN``: agents name hosts, devices and reasons,
    and a terminal would obey an escape sequence in them (retitle, clipboard, erase and fake a line)."""
    return [_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line) for line in lines]


def progress_line(status: Mapping[str, Any], records: Sequence[Mapping[str, Any]], now: float) -> str:
    """The version in flight, its state, how long it has run and the stages done so far; else that none is."""
    flight = status.get("in_flight")
    record = next((r for r in records if r["id"] == flight), None)
    if flight is None or record is None:
        queued = status.get("queued_push")
        return f"re-push of v{queued} waits for the framework's next sync" if queued is not None else \
            "no version in flight"
    done = ", ".join(f"{k} {_ms(v)}" for k, v in record["stages"].items())
    return printable([f">> v{record['id']} {record['status']} ({record.get('purpose', 'sync')}), "
                      f"{now - record['created_at']:.1f} s so far" + (f": {done}" if done else "")])[0]


def total_seconds(record: Mapping[str, Any]) -> float | None:
    """request->commit: from the request to the version's end (its commit; for one that failed, its last
    update), what the demo's log and the page's "total" say too; None while it is in flight."""
    end = record.get("committed_at")
    if end is None and record["status"] in TERMINAL:
        end = record.get("updated_at")
    return end - record["created_at"] if end is not None else None


def version_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [f"{'id':>5} {'step':>6} {'mode':<10} {'status':<12} {'from':>5} {'MiB':>8} {'total s':>8} {'rx':>4} "
             f"{'cached':>6}  digest / reason"]
    for r in records:
        ok_rx = sum(1 for x in r["receivers"] if x.get("ok"))
        source = r.get("source_version")
        step = r["step"] if r["step"] is not None else "-"
        lines.append(f"{r['id']:>5} {step:>6} {r['mode']:<10} {r['status']:<12} "
                     f"{source if source is not None else '-':>5} {r['bytes'] / (1 << 20):>8.2f} "
                     f"{_seconds(total_seconds(r)):>8} {ok_rx:>4} {'yes' if r['cached'] else 'no':>6}  "
                     f"{r['version_digest'] or ''}{'  ' + r['reason'] if r['reason'] else ''}")
    return printable(lines)


def status_lines(status: Mapping[str, Any], agents: Sequence[Mapping[str, Any]],
                 records: Sequence[Mapping[str, Any]], now: float) -> list[str]:
    """The daemon, its trainer ranks, its receivers (state, version, lag, staging, last error) and its cache."""
    health = "DEGRADED: the history cannot be written" if status["degraded"] else "ok"
    counts = ", ".join(f"{k} {v}" for k, v in status["versions"].items()) or "none yet"
    lines = [f"ckpt-engine {status['version']}  history {status['history_id'][:8]}  {health}  versions: {counts}",
             progress_line(status, records, now), "", "trainer ranks:"]
    trainers = sorted((a for a in agents if a["role"] == "trainer"), key=lambda a: a["rank"])
    lines += [f"  rank {a['rank']:<3} {a['agent_id']}  {a['host']}:{a['pid']}  {a['device']}  holds "
              f"{' '.join(f'v{v}' for v in a['versions']) or '-'}" for a in trainers] or ["  none registered"]
    kept = set(status.get("cache_kept_for_repairs") or ())
    cache = " ".join(f"v{v}{'*' if v in kept else ''}" for v in sorted(status["cache_versions"], reverse=True))
    lines += [f"cache: {cache or 'empty'}" + ("  (* kept for repairs)" if kept else ""), "",
              f"{'agent':<18} {'receiver':<10} {'engine':<10} {'state':<8} {'serving':>7} {'lag':>4}  {'staging':<8} "
              "last error"]
    staging = {a["agent_id"]: (a.get("last_staging") or {}).get("mode") or "-" for a in agents}
    seats = quorum_ranks(records)  # the N of "receiver N" (reasons, ckpt-engine version) in its newest version
    for row in receiver_rows(agents, records):
        seat = seats.get(row.agent_id)
        lines.append(f"{row.agent_id:<18} {f'{seat[0]} (v{seat[1]})' if seat else '-':<10} {row.engine or '-':<10} "
                     f"{row.state:<8} "
                     f"{'v' + str(row.serving) if row.serving is not None else '-':>7} "
                     f"{row.lag if row.lag is not None else '-':>4}  {staging[row.agent_id]:<8} {row.last_error or ''}")
    return printable(lines)


def _seconds(seconds: float | None) -> str:
    return f"{seconds:.3f}" if seconds is not None else "-"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


__all__ = ["printable", "progress_line", "status_lines", "total_seconds", "version_lines"]
