"""Load: the reliability requirement "200 requests/s of mixed reads for 60 s while syncs run: no errors, p99
recorded; syncs unaffected", measured on the real daemon (see :mod:`ckpt_engine.bench.daemon_e2e`) with one trainer
agent (a synthetic model of 16 MiB) and two rollout agents, each in its own process.

- Phase A (baseline): versions back to back (``POST /sync {"wait": true}``, the next one as soon as the reply
  comes), no other HTTP traffic; run for a fixed time before phase B and again after it, so drift of the
  machine during the run shows as a difference between the two halves.
- Phase B (under load): the same sync loop in a thread, while :func:`bench.control_plane.open_loop` schedules
  ``rate`` requests/s of reads for ``duration`` s: a fixed weighted mix (:data:`MIX`) of GET /versions,
  GET /versions/{id} (ids of versions committed earlier in the run), GET /status, GET /receivers,
  GET /metrics and GET /health. The syncs are the writes; the load is reads only.

A sync's duration is the daemon's own record: ``committed_at - created_at``, with its stages. Every request's
latency, status and lateness (how late the generator sent it) is kept. The generator runs in this process on
the same cores as the daemon and the agents: on a small machine it competes with them for CPU.

    python -m ckpt_engine.bench.load_bench [--duration 60] [--rate 200] [--json PATH]
    ckpt-engine bench --only load            (the suite's section; --quick: 10 s)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_engine.bench.common import MiB, Progress, auth_headers, machine_info, percentile, stats
from ckpt_engine.bench.control_plane import Request, open_loop
from ckpt_engine.bench.daemon_e2e import start_agents, start_daemon, wait_for_agents

RATE = 200.0  # requests per second
DURATION_S = 60.0
BASELINE_S = 10.0  # phase A, on each side of phase B
WORKERS = 8
ROLLOUTS = 2
MODEL = {"mib": 16, "tensors": 32, "max_seconds": 900}
SYNC_TIMEOUT_S = 60.0

# Requests per 20 of each read: what rollout engines (GET /versions, /versions/{id}) and a dashboard or
# Prometheus scraper (/status, /receivers, /metrics, /health) would ask for.
MIX: dict[str, int] = {
    "GET /versions": 5,
    "GET /versions/{id}": 5,
    "GET /status": 4,
    "GET /receivers": 2,
    "GET /metrics": 2,
    "GET /health": 2,
}


def _slots(mix: dict[str, int]) -> list[str]:
    """One cycle of the mix, each kind spread evenly over it (not in runs), so any window has the mix."""
    placed = [((j + 0.5) / weight, kind) for kind, weight in mix.items() for j in range(weight)]
    return [kind for _, kind in sorted(placed)]


def reads(known_ids: list[int], mix: dict[str, int] = MIX) -> Callable[[int], tuple[str, Request]]:
    """The generator's request picker. ``known_ids`` (committed versions) grows while the run goes on."""
    slots = _slots(mix)

    def pick(i: int) -> tuple[str, Request]:
        kind = slots[i % len(slots)]
        if kind == "GET /versions/{id}":
            version = known_ids[(i * 7919) % len(known_ids)]  # a scattered, existing id
            return kind, lambda client: client.get(f"/versions/{version}")
        path = kind.split(" ", 1)[1]
        return kind, lambda client: client.get(path)

    return pick


# ----------------------------------------------------------------------------------------------------------
# Syncs
# ----------------------------------------------------------------------------------------------------------


def _sync_once(client: Any) -> dict:
    """One version, request to committed reply; the duration and stages come from the daemon's record."""
    start = time.time()
    try:
        reply = client.post("/sync", json={"wait": True, "timeout_s": SYNC_TIMEOUT_S})
        body, http = reply.json(), reply.status_code
    except Exception as exc:  # noqa: BLE001 - a refused connection or a timeout is an outcome too
        return {"http": f"error: {type(exc).__name__}: {exc}", "status": None, "start": start, "end": time.time()}
    record = body if "status" in body else body.get("record") or {}
    out = {"id": record.get("id"), "http": http, "status": record.get("status"), "start": start, "end": time.time(),
           "reason": record.get("reason") or body.get("detail")}
    if out["status"] == "committed":
        out.update(seconds=record["committed_at"] - record["created_at"], stages=record.get("stages", {}),
                   bytes=record.get("bytes"))
    return out


def _run_syncs(url: str, keep_going: Callable[[], bool], known_ids: list[int], out: list[dict]) -> None:
    """Versions back to back while ``keep_going()``; appends each outcome to ``out`` as it ends."""
    import httpx

    with httpx.Client(base_url=url, timeout=SYNC_TIMEOUT_S + 30, headers=auth_headers()) as client:
        while keep_going():
            record = _sync_once(client)
            out.append(record)
            if record["status"] == "committed":
                known_ids.append(record["id"])
            else:
                time.sleep(0.5)  # do not spin on a daemon that refuses


def _for_seconds(seconds: float) -> Callable[[], bool]:
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() < deadline


def _sync_summary(records: list[dict]) -> dict:
    committed = [r for r in records if r["status"] == "committed"]
    seconds = [r["seconds"] for r in committed]
    keys = sorted({k for r in committed for k in r["stages"]})
    return {"runs": len(records), "committed": len(committed), "failed": len(records) - len(committed),
            "seconds": stats(seconds), "p90": percentile(seconds, 90),
            "client_seconds": stats(r["end"] - r["start"] for r in committed),
            "stages_median": {k: statistics.median(r["stages"].get(k, 0.0) for r in committed) for k in keys},
            "problems": [r for r in records if r["status"] != "committed"][:5]}


# ----------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------


def _ok(status: int | str) -> bool:
    return isinstance(status, int) and 200 <= status < 300


def _latency_summary(samples: list[dict]) -> dict:
    """Latency percentiles of the answered 2xx requests; everything else counts as an error."""
    ok = [s["latency"] for s in samples if _ok(s["status"])]
    return {"n": len(samples), "errors": len(samples) - len(ok), "p50": percentile(ok, 50),
            "p95": percentile(ok, 95), "p99": percentile(ok, 99), "max": max(ok) if ok else float("nan")}


def _request_summary(samples: list[dict], rate: float, duration_s: float) -> dict:
    span = max((s["t"] + s["latency"] for s in samples), default=float("nan"))
    late = [s["late"] for s in samples]
    statuses: dict[str, int] = {}
    for s in samples:
        key = f"{s['kind']} {s['status']}"
        statuses[key] = statuses.get(key, 0) + 1
    return {"scheduled": int(rate * duration_s), "requests": len(samples), "span_s": span,
            "achieved_rate": len(samples) / span if span > 0 else None,
            "late_p50": percentile(late, 50), "late_p99": percentile(late, 99), "late_max": max(late, default=0.0),
            "errors": sum(not _ok(s["status"]) for s in samples), "statuses": statuses,
            "overall": _latency_summary(samples),
            "endpoints": {kind: _latency_summary([s for s in samples if s["kind"] == kind]) for kind in MIX}}


# ----------------------------------------------------------------------------------------------------------
# CPU accounting: on a small shared machine, who used the cores explains the latencies
# ----------------------------------------------------------------------------------------------------------


def _ticks(pid: int | str) -> int:
    """utime + stime of one process (clock ticks; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _machine_busy_ticks() -> int:
    """Busy ticks of all CPUs together (/proc/stat: everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values[:8]) - values[3] - values[4]


def _cpu_snapshot(groups: dict[str, list[int | str]]) -> dict[str, float]:
    snap = {name: float(sum(_ticks(pid) for pid in pids)) for name, pids in groups.items()}
    snap["machine"] = float(_machine_busy_ticks())
    snap["t"] = time.monotonic()
    return snap


def _cpu_use(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Cores used between two snapshots, per process group; "others": the machine's busy time not ours, i.e.
    whatever else runs on this machine (other people's tests, say)."""
    hz, wall = os.sysconf("SC_CLK_TCK"), after["t"] - before["t"]
    use = {k: (after[k] - before[k]) / hz / wall for k in before if k != "t"}
    use["others"] = max(0.0, use["machine"] - sum(v for k, v in use.items() if k != "machine"))
    return use


# ----------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------


def _baseline(url: str, seconds: float, known_ids: list[int], agents: Any) -> list[dict]:
    out: list[dict] = []
    _run_syncs(url, _for_seconds(seconds), known_ids, out)
    agents.check()
    return out


def _under_load(url: str, rate: float, duration_s: float, workers: int, known_ids: list[int],
                agents: Any) -> tuple[list[dict], list[dict]]:
    """Phase B: the sync loop in a thread for as long as the generator runs. Returns (samples, syncs); a sync
    still running when the load stopped is marked ``in_window: False``."""
    stop = threading.Event()
    syncs: list[dict] = []
    thread = threading.Thread(target=_run_syncs, args=(url, lambda: not stop.is_set(), known_ids, syncs),
                              daemon=True)
    thread.start()
    samples = open_loop(url, rate, duration_s, reads(known_ids), workers)
    load_end = time.time()
    stop.set()
    thread.join(SYNC_TIMEOUT_S + 60)
    for record in syncs:
        record["in_window"] = record["end"] <= load_end
    agents.check()
    return samples, syncs


def measure(duration_s: float = DURATION_S, rate: float = RATE, baseline_s: float = BASELINE_S,
            bucket_size: int = 64 * MiB, workers: int = WORKERS, progress: Progress = print) -> dict:
    started = time.perf_counter()
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-load-") as tmp:
        daemon = start_daemon(Path(tmp), bucket_size / MiB)
        agents = None
        try:
            agents = start_agents(daemon.zmq, MODEL, ROLLOUTS)
            wait_for_agents(daemon.url, ROLLOUTS, agents)
            known_ids: list[int] = []
            warm: list[dict] = []  # first version: the sync group's rendezvous, not reported
            _run_syncs(daemon.url, lambda: not warm, known_ids, warm)
            if warm[0]["status"] != "committed":
                raise RuntimeError(f"first version failed: {warm[0]}\n{daemon.log_tail()}")
            progress(f"  daemon {daemon.url}: 1 trainer agent ({MODEL['mib']} MiB in {MODEL['tensors']} tensors) "
                     f"+ {ROLLOUTS} rollout agents; phase A {baseline_s:.0f} s, B {duration_s:.0f} s at "
                     f"{rate:.0f} req/s, A again {baseline_s:.0f} s")
            groups: dict[str, list[int | str]] = {"daemon": [daemon.proc.pid], "agents": [p.pid for p in agents.procs],
                                                  "bench": ["self"]}
            snaps = [_cpu_snapshot(groups)]
            before = _baseline(daemon.url, baseline_s, known_ids, agents)
            snaps.append(_cpu_snapshot(groups))
            progress(f"  A (before): {_line(_sync_summary(before))}")
            samples, during = _under_load(daemon.url, rate, duration_s, workers, known_ids, agents)
            snaps.append(_cpu_snapshot(groups))
            req = _request_summary(samples, rate, duration_s)
            progress(f"  B: {req['requests']} requests, achieved {req['achieved_rate']:.1f}/s, "
                     f"{req['errors']} errors, p99 {req['overall']['p99'] * 1e3:.1f} ms; syncs "
                     f"{_line(_sync_summary([r for r in during if r['in_window']]))}")
            after = _baseline(daemon.url, baseline_s, known_ids, agents)
            snaps.append(_cpu_snapshot(groups))
            progress(f"  A (after): {_line(_sync_summary(after))}")
        finally:
            agent_out = agents.close() if agents is not None else {}
            code = daemon.stop()
    in_window = [r for r in during if r["in_window"]]
    syncs = {"A": _sync_summary(before + after), "A_before": _sync_summary(before), "A_after": _sync_summary(after),
             "B": _sync_summary(in_window), "B_all": _sync_summary(during)}
    return {
        "date_utc": date, "rate": rate, "duration_s": duration_s, "baseline_s": baseline_s, "workers": workers,
        "mix": MIX, "model": MODEL, "receivers": ROLLOUTS, **req, "syncs": syncs,
        "sync_ratio": {"median": _ratio(syncs["B"]["seconds"]["median"], syncs["A"]["seconds"]["median"]),
                       "p90": _ratio(syncs["B"]["p90"], syncs["A"]["p90"])},
        "cpu_cores": {phase: _cpu_use(a, b) for phase, a, b in zip(("A_before", "B", "A_after"), snaps, snaps[1:])},
        "agents": agent_out, "daemon_exit": code,
        "wall_seconds": time.perf_counter() - started,
        "sync_records": {"A_before": before, "B": during, "A_after": after}, "samples": samples,
    }


def _ratio(num: float, den: float) -> float | None:
    return None if math.isnan(num) or math.isnan(den) or not den else num / den


def _line(summary: dict) -> str:
    return (f"{summary['committed']}/{summary['runs']} committed, median {summary['seconds']['median']:.3f} s, "
            f"p90 {summary['p90']:.3f} s")


def passed(result: dict) -> bool:
    """The requirement: no request errors, every sync committed (how much slower they got is reported)."""
    return result["errors"] == 0 and all(result["syncs"][k]["failed"] == 0 for k in ("A", "B_all"))


def run(opts: dict, progress: Progress) -> dict:
    """The suite's section: 60 s at 200 requests/s (--quick: 10 s, 5 s of baseline on each side)."""
    quick = opts["quick"]
    return measure(duration_s=10.0 if quick else DURATION_S, baseline_s=5.0 if quick else BASELINE_S,
                   bucket_size=opts["bucket_size"], progress=progress)


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{x * 1e3:.1f}"


def _x(r: float | None) -> str:
    return "—" if r is None else f"×{r:.2f}"


def _sync_row(label: str, s: dict) -> str:
    sec = s["seconds"]
    if not sec["n"]:
        return f"| {label} | {s['committed']} / {s['runs']} | — | — | — |"
    return (f"| {label} | {s['committed']} / {s['runs']} | {sec['median']:.3f} | {s['p90']:.3f} "
            f"| {sec['min']:.3f}–{sec['max']:.3f} |")


def _cpu_table(cpu: dict[str, dict[str, float]], cores: Any) -> list[str]:
    """Who used the CPU in each phase: the daemon, the agents, this process (generator + sync loop), and
    everything else on the machine, which inflates latencies and sync times alike when it is busy."""
    lines = [f"CPU used, in cores (of {cores}), from /proc:", "",
             "| Phase | daemon | agents | generator + sync loop | others on the machine | machine busy |",
             "|---|---:|---:|---:|---:|---:|"]
    for phase, label in (("A_before", "A, before"), ("B", "B, under load"), ("A_after", "A, after")):
        c = cpu.get(phase)
        if c:
            lines.append(f"| {label} | {c['daemon']:.2f} | {c['agents']:.2f} | {c['bench']:.2f} | {c['others']:.2f} "
                         f"| {c['machine']:.2f} |")
    return [*lines, ""]


def render(result: dict, machine: dict) -> list[str]:
    r, syncs, m = result, result["syncs"], result["model"]
    total = sum(r["mix"].values())
    mix = ", ".join(f"{k} {w}/{total}" for k, w in r["mix"].items())
    cores = machine.get("usable_cores", "?")
    lines = [
        ("Requirement (docs/reliability.md, *Load*): 200 requests/s of mixed reads for 60 s while syncs run: no "
         "errors, p99 recorded; syncs unaffected."),
        "",
        (f"Real daemon (transport `collective`) with 1 trainer agent ({m['mib']} MiB in {m['tensors']} float32 "
         f"tensors, loop calling `agent.step()` every ~1 ms) and {r['receivers']} rollout agents, each in its own "
         f"process. **Phase A** (baseline): versions back to back (`POST /sync {{\"wait\": true}}`), no other "
         f"traffic, {r['baseline_s']:.0f} s before and {r['baseline_s']:.0f} s after phase B. **Phase B**: the "
         f"same sync loop in one thread while an open-loop generator schedules {r['rate']:.0f} reads/s for "
         f"{r['duration_s']:.0f} s from {r['workers']} threads (keep-alive clients), mix {mix}. Sync duration "
         "= the daemon's record, `committed_at - created_at`. The generator, the sync loop, the daemon and the "
         f"{r['receivers'] + 1} agents share the machine's {cores} cores: the load generator itself competes with "
         "the daemon and the agents for CPU."
         + (f" Measured {r['date_utc']} by `{r['command']}`." if r.get("command") else "")),
        "",
        (f"Requests: {r['requests']} of {r['scheduled']} scheduled, answered in {r['span_s']:.1f} s: achieved "
         f"**{r['achieved_rate']:.1f} requests/s**; **errors (non-2xx or no answer): {r['errors']}**. Generator "
         f"lateness (a request sent after its due time) p50 {_ms(r['late_p50'])} ms, p99 {_ms(r['late_p99'])} ms, "
         f"max {_ms(r['late_max'])} ms."),
        "",
        "| Endpoint | Requests | Errors | p50 ms | p95 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, e in [("**all**", r["overall"]), *r["endpoints"].items()]:
        lines.append(f"| {kind} | {e['n']} | {e['errors']} | {_ms(e['p50'])} | {_ms(e['p95'])} | {_ms(e['p99'])} "
                     f"| {_ms(e['max'])} |")
    b_extra = syncs["B_all"]["runs"] - syncs["B"]["runs"]
    lines += [
        "",
        "| Syncs | Committed / run | median s | p90 s | min–max s |",
        "|---|---:|---:|---:|---:|",
        _sync_row("A: no HTTP load (before + after)", syncs["A"]),
        _sync_row("A, before phase B", syncs["A_before"]),
        _sync_row("A, after phase B", syncs["A_after"]),
        _sync_row(f"B: under {r['rate']:.0f} reads/s", syncs["B"]),
        "",
        f"Sync duration under load ÷ without: median **{_x(r['sync_ratio']['median'])}**, p90 "
        f"{_x(r['sync_ratio']['p90'])}."
        + (f" Phase B also ran {b_extra} version(s) that ended after the load stopped (committed: "
           f"{syncs['B_all']['committed']} of {syncs['B_all']['runs']} in phase B in all), not in its figures."
           if b_extra else ""),
        "",
        "Stage medians (s): " + "; ".join(
            f"**{label}** " + ", ".join(f"{k} {v:.3f}" for k, v in syncs[key]["stages_median"].items())
            for label, key in (("A", "A"), ("B", "B")) if syncs[key]["stages_median"]) + ".",
        "",
        *_cpu_table(r["cpu_cores"], cores),
        f"No errors and every sync committed: **{'MET' if passed(r) else 'MISSED'}**.",
        "",
    ]
    return lines


# ----------------------------------------------------------------------------------------------------------
# Standalone
# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m ckpt_engine.bench.load_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=DURATION_S, help="seconds of load in phase B (default 60)")
    p.add_argument("--rate", type=float, default=RATE, help="reads per second in phase B (default 200)")
    p.add_argument("--baseline", type=float, default=BASELINE_S,
                   help="seconds of phase A before and again after phase B (default 10)")
    p.add_argument("--workers", type=int, default=WORKERS, help="generator threads (default 8)")
    p.add_argument("--bucket-mib", type=float, default=64, help="bucket size in MiB (default 64)")
    p.add_argument("--json", metavar="PATH", help="write every figure (with each request and sync) as JSON")
    args = p.parse_args(argv)
    command = " ".join(["python -m ckpt_engine.bench.load_bench", *map(shlex.quote, argv)])
    machine = machine_info()
    result = measure(args.duration, args.rate, args.baseline, int(args.bucket_mib * MiB), args.workers)
    result["command"] = command
    print("\n" + "\n".join(render(result, machine)), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": command, "machine": machine, "result": result},
                                              indent=1, default=str))
        print(f"wrote {args.json}", flush=True)
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
