"""Control plane under load: the real daemon (see :mod:`ckpt_engine.bench.daemon_e2e`) with one trainer agent (a small
synthetic model) and one rollout agent registered, and a bounded open-loop load generator on 127.0.0.1:
requests are scheduled at a fixed rate for a fixed time; 9 of every 10 are ``GET /versions`` (the default 50
newest records), 1 is ``POST /sync`` (no wait). A POST is accepted (202) when no version is in flight, else
refused with 409; both are counted, the accept latency is taken over the 202s. Worker threads each hold one
keep-alive ``httpx.Client``; latency is from sending the request to having the whole response. The generator
stops by itself at the end of its window and waits for the last version to end.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_engine.bench.common import MiB, Progress, auth_headers, percentile, stats
from ckpt_engine.bench.daemon_e2e import start_agents, start_daemon, wait_for_agents

RATE = 200.0  # requests per second
POST_EVERY = 10
WORKERS = 8


Request = Callable[[Any], Any]  # (httpx.Client) -> httpx.Response
Pick = Callable[[int], tuple[str, Request]]  # request index -> (kind, request)


def open_loop(url: str, rate: float, duration_s: float, pick: Pick, workers: int = WORKERS) -> list[dict]:
    """Bounded open-loop load: request ``i`` is due at ``i / rate`` s, whatever happened to the ones before it;
    ``workers`` threads (one keep-alive client each) take the next index, sleep until it is due and send
    ``pick(i)``. Each sample: kind, status (an int, or "error: <exception>"), latency (send to whole
    response), lateness (start after due: the generator falling behind) and t (start, s since the schedule
    began)."""
    import httpx

    total = int(rate * duration_s)
    lock = threading.Lock()
    counter = iter(range(total))
    out: list[dict] = []
    t_start = time.perf_counter() + 0.2

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=10, headers=auth_headers()) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                due = t_start + i / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                kind, request = pick(i)
                t0 = time.perf_counter()
                try:
                    reply = request(client)
                    _ = reply.content
                    status: int | str = reply.status_code
                except Exception as exc:  # noqa: BLE001 - a timeout or refused connection is a result too
                    status = f"error: {type(exc).__name__}"
                t1 = time.perf_counter()
                with lock:
                    out.append({"i": i, "kind": kind, "status": status, "latency": t1 - t0,
                                "late": max(0.0, t0 - due), "t": t0 - t_start})

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 60)
    return out


def _pick_versions_or_post(i: int) -> tuple[str, Request]:
    """9 of every 10 requests GET /versions, 1 POST /sync (no wait)."""
    if i % POST_EVERY == POST_EVERY // 2:
        return "post_sync", lambda client: client.post("/sync", json={"step": i})
    return "get_versions", lambda client: client.get("/versions")


def _generate(url: str, rate: float, duration_s: float) -> list[dict]:
    return open_loop(url, rate, duration_s, _pick_versions_or_post)


def _unloaded(client: Any, gets: int = 100, posts: int = 10) -> dict:
    """Sequential requests with nothing else going on: each POST after the previous version ended."""
    get_lat, post_lat = [], []
    for _ in range(gets):
        t0 = time.perf_counter()
        reply = client.get("/versions")
        _ = reply.content
        if reply.status_code == 200:
            get_lat.append(time.perf_counter() - t0)
    for i in range(posts):
        t0 = time.perf_counter()
        reply = client.post("/sync", json={"step": 10**6 + i})
        if reply.status_code == 202:
            post_lat.append(time.perf_counter() - t0)
        deadline = time.monotonic() + 30
        while client.get("/status").json().get("in_flight") is not None and time.monotonic() < deadline:
            time.sleep(0.02)
    return {"get_versions": {"n": len(get_lat), "p50": percentile(get_lat, 50), "p99": percentile(get_lat, 99)},
            "post_accepted": {"n": len(post_lat), "p50": percentile(post_lat, 50), "p99": percentile(post_lat, 99)}}


def run(opts: dict, progress: Progress) -> dict:

    duration = 3.0 if opts["quick"] else 10.0
    args = {"mib": 1, "tensors": 10, "max_seconds": 600}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-control-") as tmp:
        daemon = start_daemon(Path(tmp), opts["bucket_size"] / MiB)
        agents = None
        try:
            agents = start_agents(daemon.zmq, args, 1)
            wait_for_agents(daemon.url, 1, agents)
            with daemon.client(timeout_s=60) as client:  # one version first: groups are up
                first = client.post("/sync", json={"wait": True, "timeout_s": 60})
                if first.status_code != 200:
                    raise RuntimeError(f"first version failed: {first.status_code} {first.text[:400]}")
            progress(f"  daemon {daemon.url}: {RATE:.0f} req/s for {duration:.0f} s "
                     f"({POST_EVERY - 1}/{POST_EVERY} GET /versions, 1/{POST_EVERY} POST /sync)")
            samples = _generate(daemon.url, RATE, duration)
            agents.check()
            with daemon.client(timeout_s=30) as client:  # let the last version end
                deadline = time.monotonic() + 60
                while client.get("/status").json().get("in_flight") is not None and time.monotonic() < deadline:
                    time.sleep(0.1)
                unloaded = _unloaded(client)
                history = client.get("/versions", params={"limit": 1000}).json()["versions"]
        finally:
            agent_out = agents.close() if agents is not None else {}
            code = daemon.stop()
    gets = [s for s in samples if s["kind"] == "get_versions"]
    posts = [s for s in samples if s["kind"] == "post_sync"]
    get_ok = [s["latency"] for s in gets if s["status"] == 200]
    accepted = [s["latency"] for s in posts if s["status"] == 202]
    refused = [s["latency"] for s in posts if s["status"] == 409]
    span = max(s["t"] + s["latency"] for s in samples) if samples else float("nan")
    statuses: dict[str, int] = {}
    for s in samples:
        key = f"{s['kind']} {s['status']}"
        statuses[key] = statuses.get(key, 0) + 1
    committed = sum(1 for v in history if v["status"] == "committed")
    return {
        "rate": RATE, "duration_s": duration, "workers": WORKERS, "requests": len(samples), "span_s": span,
        "achieved_rate": len(samples) / span if span == span and span > 0 else None,
        "statuses": statuses,
        "get_versions": {"n": len(get_ok), "p50": percentile(get_ok, 50), "p99": percentile(get_ok, 99),
                         "max": max(get_ok) if get_ok else None},
        "post_accepted": {"n": len(accepted), "p50": percentile(accepted, 50), "p99": percentile(accepted, 99)},
        "post_refused": {"n": len(refused), "p50": percentile(refused, 50)},
        "unloaded": unloaded,
        "lateness": stats(s["late"] for s in samples),
        "late_p99": percentile([s["late"] for s in samples], 99),
        "history_versions": len(history), "committed_versions": committed,
        "agents": agent_out, "daemon_exit": code, "wall_seconds": time.perf_counter() - started,
        "samples": samples,
    }


def render(result: dict, machine: dict) -> list[str]:
    g, a, r, u = result["get_versions"], result["post_accepted"], result["post_refused"], result["unloaded"]

    def ms(x: float | None) -> str:
        return "—" if x is None or x != x else f"{x * 1e3:.1f}"

    lines = [
        f"Daemon with 1 trainer agent (1 MiB model, loop calling `agent.step()` every ~1 ms) and 1 rollout agent; "
        f"load generator: {result['rate']:.0f} requests/s scheduled for {result['duration_s']:.0f} s "
        f"({result['requests']} requests, achieved {result['achieved_rate']:.0f}/s) from {result['workers']} "
        "threads in the suite's process, on the same cores as the daemon and the agents. "
        f"Requests started late by p99 {result['late_p99'] * 1e3:.1f} ms (scheduler lag of the generator).",
        "",
        "| Request | Count | p50 ms | p99 ms |",
        "|---|---:|---:|---:|",
        f"| GET /versions → 200 | {g['n']} | {ms(g['p50'])} | {ms(g['p99'])} |",
        f"| POST /sync → 202 accepted | {a['n']} | {ms(a['p50'])} | {ms(a['p99'])} |",
        f"| POST /sync → 409 (a version in flight) | {r['n']} | {ms(r['p50'])} | — |",
        f"| *unloaded:* GET /versions, sequential | {u['get_versions']['n']} | {ms(u['get_versions']['p50'])} "
        f"| {ms(u['get_versions']['p99'])} |",
        f"| *unloaded:* POST /sync → 202, each after the previous version ended | {u['post_accepted']['n']} "
        f"| {ms(u['post_accepted']['p50'])} | {ms(u['post_accepted']['p99'])} |",
        "",
        "The unloaded rows were taken right after the load phase (so the history holds at least 50 versions and "
        "every GET /versions returns 50 records, as under load), one request at a time from one client.",
        "",
        "Status counts: " + ", ".join(f"{k}: {v}" for k, v in sorted(result["statuses"].items()))
        + f". Versions committed during the run (incl. one before it): {result['committed_versions']} of "
          f"{result['history_versions']} in the history.",
        "",
    ]
    return lines
