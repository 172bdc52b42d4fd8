"""Elastic join: a receiver that registers while the daemon runs, pushed (``transport: collective``) vs pulled
(``transport: nixl``).

The real daemon (:mod:`ckpt_engine.bench.daemon_e2e`'s harness) with one trainer agent and two rollout agents
commits a few versions; then a third rollout agent starts. Measured, per transport, side by side in one run:
- **join**: from the new receiver's registration (first seen in ``GET /receivers``) to the daemon's catch-up of
  it committed (first seen in ``GET /versions``), polled every 20 ms;
- **what the join costs the others**: the first regular version after the join ÷ the median of the regular
  versions after it (the same three receivers: what is left is the join's one-time cost). Pushed, that first
  version re-forms the sync group; pulled, nothing forms.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ckpt_engine.bench.common import MiB, Progress, auth_headers
from ckpt_engine.bench.daemon_e2e import _agent_entry, start_agents, start_daemon, wait_for_agents

_POLL_S = 0.02


def _until(check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(_POLL_S)
    raise RuntimeError(f"not within {timeout_s:.0f}s")


def _sync(client: Any) -> float:
    """One regular version, POST /sync to committed: its seconds (the daemon may be busy with a catch-up: then
    it is asked again)."""
    while True:
        t0 = time.perf_counter()
        reply = client.post("/sync", json={"wait": True, "timeout_s": 120})
        if reply.status_code == 409:
            time.sleep(0.05)
            continue
        if reply.status_code != 200:
            raise RuntimeError(f"version failed: {reply.status_code} {reply.text[:400]}")
        return time.perf_counter() - t0


def one_transport(transport: str, args: dict, versions: int, progress: Progress) -> dict:
    import httpx

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-join-") as tmp:
        daemon = start_daemon(Path(tmp), args["bucket_mib"], transport=transport)
        agents, joiner = None, None
        try:
            agents = start_agents(daemon.zmq, args, 2)
            wait_for_agents(daemon.url, 2, agents)
            with httpx.Client(base_url=daemon.url, headers=auth_headers(), timeout=150) as client:
                before = [_sync(client) for _ in range(versions + 1)][1:]  # (the first forms the groups)
                known = {a["agent_id"] for a in client.get("/receivers").json()["agents"]}
                ctx = mp.get_context("spawn")
                joiner = ctx.Process(target=_agent_entry, args=("rollout", 9, daemon.zmq, args, agents.stop,
                                                                agents.results), name="joiner", daemon=True)
                joiner.start()
                new = _until(lambda: [a["agent_id"] for a in client.get("/receivers").json()["agents"]
                                      if a["agent_id"] not in known and a["role"] == "receiver"], 120)[0]
                registered = time.perf_counter()
                _until(lambda: any(v["purpose"] == "catch_up" and v["status"] == "committed"
                                   and any(e["agent_id"] == new for e in v["receivers"])
                                   for v in client.get("/versions", params={"limit": 5}).json()["versions"]), 120)
                join_s = time.perf_counter() - registered
                after = [_sync(client) for _ in range(versions)]
        finally:
            if agents is not None:
                agents.close()
            if joiner is not None:
                joiner.join(30)
                if joiner.is_alive():
                    joiner.kill()
            daemon.stop()
    median_before = statistics.median(before)
    progress(f"  {transport}: join {join_s:.2f} s; first version after it {after[0]:.3f} s "
             f"(the ones after it: median {statistics.median(after[1:]):.3f} s; before: {median_before:.3f} s)")
    return {"transport": transport, "join_s": join_s, "before_s": before, "after_s": after,
            "first_after_over_before": after[0] / median_before}


def first_after_over_rest(row: dict) -> float:
    """The first regular version after the join ÷ the median of those after it (the same receivers)."""
    return row["after_s"][0] / statistics.median(row["after_s"][1:])


def run(opts: dict, progress: Progress) -> dict:
    from ckpt_engine.transport.nixl import nixl_missing

    why = nixl_missing()
    if why is not None:
        return {"skipped": why}
    args = {"mib": 16 if opts["quick"] else 64, "tensors": 100, "max_seconds": 600,
            "bucket_mib": opts["bucket_size"] / MiB}
    versions = 3 if opts["quick"] else 5
    rows = [one_transport(t, args, versions, progress) for t in ("collective", "nixl")]
    push, pull = rows
    return {"args": args, "versions": versions, "rows": rows, "join_pull_over_push": pull["join_s"] / push["join_s"]}


def render(result: dict, machine: dict) -> list[str]:
    if "skipped" in result:
        return [f"Not measured: {result['skipped']}.", ""]
    a = result["args"]
    lines = [f"Daemon, 1 trainer agent ({a['mib']} MiB model, {a['tensors']} tensors), 2 rollout agents, then a third "
             "that registers while the daemon runs; on this machine's loopback (no link limits). Join: from its "
             "registration to its catch-up committed. Cost to the others: the first regular version after the join "
             f"÷ the median of the {result['versions'] - 1} after it (the same three receivers).", "",
             "| Transport | join s | first version after ÷ the ones after it | regular version before / after, "
             "median s |",
             "|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['transport']} | {r['join_s']:.2f} | {first_after_over_rest(r):.2f} "
                     f"| {statistics.median(r['before_s']):.3f} / {statistics.median(r['after_s'][1:]):.3f} |")
    return lines + ["", f"Join, pulled ÷ pushed: {result['join_pull_over_push']:.2f}.", ""]


def target_measurements(result: dict) -> dict[str, list[tuple[str, float, str]]]:
    rows = {r["transport"]: r for r in result.get("rows", [])}
    if "nixl" not in rows:
        return {}
    return {"join": [("pulled ÷ pushed", result["join_pull_over_push"], "")],
            "cost": [(r["transport"], first_after_over_rest(r), "") for r in rows.values()]}
