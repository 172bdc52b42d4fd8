"""Through the daemon: ``POST /sync {"wait": true}`` → every receiver verified, timed from the HTTP request
to the committed reply; plus the daemon/agent harness that :mod:`ckpt_engine.bench.control_plane` reuses.

The daemon is the real one (``ckpt-engine serve --config deploy/engine.yaml``, started by ckpt_engine/server/launch.py)
in a subprocess, with environment overrides: free 127.0.0.1 ports for HTTP and ZMQ, a temporary history file,
rendezvous port 0, the suite's bucket size, and ``transport: collective`` (every receiver on the gloo sync
group, like the library variants). Agents run in their own spawned processes: one ``TrainerAgent`` serving
a synthetic model (float32 tensors) whose loop calls ``agent.step(step)`` every millisecond, and two
``RolloutAgent``s with a no-op ``load``. Every process is bounded in time and stopped at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_engine.bench.common import MiB, Progress, auth_headers, fmt_s, stats
from ckpt_engine.server.launch import DaemonProcess, write_config
from ckpt_engine.server.launch import start_daemon as launch_daemon


def start_daemon(workdir: Path, bucket_mb: float, *, transport: str = "collective", timeout_s: float = 60
                 ) -> DaemonProcess:
    """The built-in defaults (deploy/engine.yaml lists them), with the suite's overrides (see the module doc)."""
    config = write_config(workdir, test_timeouts=False, bucket_size_mb=bucket_mb, transport=transport,
                          nixl_trust_receivers=transport == "nixl")  # (every process here is the bench's own)
    return launch_daemon(config, timeout_s=timeout_s, log_path=workdir / "daemon.log")


# ----------------------------------------------------------------------------------------------------------
# Agent processes
# ----------------------------------------------------------------------------------------------------------


def _agent_entry(kind: str, index: int, zmq: str, args: dict, stop: Any, results: Any) -> None:
    try:
        value = (_trainer_agent if kind == "trainer" else _rollout_agent)(zmq, args, stop)
        results.put(("result", f"{kind}{index}", value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which reports it
        results.put(("error", f"{kind}{index}", traceback.format_exc()))


def _trainer_agent(zmq: str, args: dict, stop: Any) -> dict:
    import logging

    import torch

    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    per = max(1, int(args["mib"] * MiB) // 4 // args["tensors"])
    named = NamedTensors({f"w{i}": torch.randn(per) for i in range(args["tensors"])})
    agent = TrainerAgent(lambda: named, zmq, poll_wait_s=0.2).start()
    step = served = 0
    deadline = time.monotonic() + args["max_seconds"]
    while not stop.is_set() and time.monotonic() < deadline:
        step += 1
        if agent.step(step) is not None:
            served += 1
        time.sleep(0.001)  # a (very fast) training step
    agent.wait_idle(60)
    agent.close()
    return {"steps": step, "served": served, "held": list(agent.held_seconds)}


def _rollout_agent(zmq: str, args: dict, stop: Any) -> dict:
    import logging

    import torch

    from ckpt_engine.workers.rollout_agent import RolloutAgent

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    agent = RolloutAgent(lambda payload: None, zmq, poll_wait_s=0.2).start()
    stop.wait(args["max_seconds"])
    agent.close()
    return {"received": len(agent.results), "ok": sum(1 for r in agent.results if r.ok)}


@dataclass
class Agents:
    procs: list
    stop: Any
    results: Any
    collected: dict = field(default_factory=dict)

    def check(self) -> None:
        """Raise if an agent reported an error or died."""
        self._drain(0.0)
        dead = [p.name for p in self.procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"agent process(es) {dead} died")

    def _drain(self, timeout_s: float) -> None:
        while True:
            try:
                kind, name, value = self.results.get(timeout=timeout_s) if timeout_s else self.results.get_nowait()
            except queue.Empty:
                return
            if kind == "error":
                raise RuntimeError(f"agent {name} failed:\n{value}")
            self.collected[name] = value

    def close(self, timeout_s: float = 90) -> dict:
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        try:
            while len(self.collected) < len(self.procs) and time.monotonic() < deadline:
                if all(p.exitcode is not None for p in self.procs):
                    self._drain(0.5)
                    break
                self._drain(0.5)
        finally:
            for p in self.procs:
                p.join(max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(5)
            self.results.close()
        return self.collected


def start_agents(zmq: str, args: dict, rollouts: int) -> Agents:
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    specs = [("rollout", i) for i in range(rollouts)] + [("trainer", 0)]
    procs = [ctx.Process(target=_agent_entry, args=(kind, i, zmq, args, stop, results), name=f"{kind}{i}",
                         daemon=True) for kind, i in specs]
    for p in procs:
        p.start()
    return Agents(procs, stop, results)


def wait_for_agents(url: str, receivers: int, agents: Agents, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agents.check()
        try:
            registered = httpx.get(f"{url}/receivers", timeout=5, headers=auth_headers()).json()["agents"]
            if sum(a["role"] == "receiver" for a in registered) >= receivers and \
                    any(a["role"] == "trainer" for a in registered):
                return
        except Exception:  # noqa: BLE001 - the daemon may not answer yet: ask again
            pass
        time.sleep(0.2)
    raise RuntimeError(f"agents did not register within {timeout_s:.0f}s")


# ----------------------------------------------------------------------------------------------------------
# Section: POST /sync -> every receiver verified
# ----------------------------------------------------------------------------------------------------------


def run(opts: dict, progress: Progress) -> dict:

    args = {"mib": 64 if opts["quick"] else 256, "tensors": 100, "max_seconds": 600}
    rollouts = 2
    modes = ("cached", "bypass")
    schedule = [(m, -1) for m in modes]
    for rep in range(opts["repeats"]):
        order = modes if rep % 2 == 0 else modes[::-1]
        schedule += [(m, rep) for m in order]
    records: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-daemon-") as tmp:
        daemon = start_daemon(Path(tmp), opts["bucket_size"] / MiB)
        agents = None
        try:
            agents = start_agents(daemon.zmq, args, rollouts)
            wait_for_agents(daemon.url, rollouts, agents)
            progress(f"  daemon {daemon.url}: 1 trainer agent ({args['mib']} MiB in {args['tensors']} tensors) + "
                     f"{rollouts} rollout agents registered")
            with daemon.client(timeout_s=300) as client:
                for mode, rep in schedule:
                    agents.check()
                    t0 = time.perf_counter()
                    reply = client.post("/sync", json={"wait": True, "bypass_cpu": mode == "bypass",
                                                       "timeout_s": 240})
                    seconds = time.perf_counter() - t0
                    body = reply.json()
                    ok_rx = [r for r in body.get("receivers", []) if r.get("ok")]
                    if reply.status_code != 200 or body.get("status") != "committed" or len(ok_rx) != rollouts:
                        raise RuntimeError(f"POST /sync ({mode}) -> {reply.status_code}: {str(body)[:600]}\n"
                                           f"{daemon.log_tail()}")
                    records.append({"mode": mode, "rep": rep, "seconds": seconds, "stages": body.get("stages", {}),
                                    "bytes": body.get("bytes"), "buckets": body.get("buckets"),
                                    "daemon_seconds": body["updated_at"] - body["created_at"]})
                    progress(f"  {mode:<6} {'warm-up' if rep < 0 else f'rep {rep + 1}'}  {seconds:.3f}s "
                             f"({body.get('bytes', 0) / MiB:.0f} MiB, {body.get('buckets')} buckets)")
        finally:
            agent_out = agents.close() if agents is not None else {}
            code = daemon.stop()
    measured = [r for r in records if r["rep"] >= 0]
    out: dict[str, Any] = {"args": args, "receivers": rollouts, "records": records, "agents": agent_out,
                           "daemon_exit": code, "wall_seconds": time.perf_counter() - started, "modes": {}}
    for mode in modes:
        recs = [r for r in measured if r["mode"] == mode]
        keys = sorted({k for r in recs for k in r["stages"]})
        out["modes"][mode] = {
            "seconds": stats(r["seconds"] for r in recs), "samples": [r["seconds"] for r in recs],
            "daemon_seconds": stats(r["daemon_seconds"] for r in recs),
            "stages_median": {k: stats(r["stages"].get(k, 0.0) for r in recs)["median"] for k in keys},
            "bytes": recs[0]["bytes"] if recs else None}
    return out


def render(result: dict, machine: dict, library_row: dict | None = None) -> list[str]:
    a = result["args"]
    lines = [
        f"`POST /sync {{\"wait\": true, \"bypass_cpu\": …}}` against the real daemon (`ckpt-engine serve --config "
        "deploy/engine.yaml`, transport forced to `collective`), timed from the HTTP request to the reply "
        f"with the committed record; 1 trainer agent ({a['mib']} MiB in {a['tensors']} float32 tensors, its loop "
        f"calls `agent.step()` every ~1 ms) and {result['receivers']} rollout agents (no-op `load`), each in its own "
        "process; the daemon is a fifth. The trainer agent plans its own layout (the daemon's alignment), so the "
        "bytes can differ slightly from the library's model. Warm-up round (sync-group rendezvous) not reported.",
        "",
        "| Mode | Request → committed reply, s median (min–max) | GB/s | daemon record created → committed, s "
        "| trainer held (`snapshot`/`held` stage), s |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in ("cached", "bypass"):
        e = result["modes"].get(mode)
        if not e or not e["seconds"]["n"]:
            continue
        held = e["stages_median"].get("snapshot" if mode == "cached" else "held")
        lines.append(f"| {mode} | {fmt_s(e['seconds'])} | {(e['bytes'] or 0) / e['seconds']['median'] / 1e9:.2f} "
                     f"| {e['daemon_seconds']['median']:.3f} | {held if held is None else f'{held:.3f}'} |")
    if library_row is not None:
        lines.append("")
        parts = []
        for mode in ("cached", "bypass"):
            lib = library_row["variants"].get(mode)
            e = result["modes"].get(mode)
            if lib and e and e["seconds"]["n"]:
                parts.append(f"{mode}: daemon {e['seconds']['median']:.3f} s vs library "
                             f"{lib['seconds']['median']:.3f} s "
                             f"(× {e['seconds']['median'] / lib['seconds']['median']:.2f})")
        if parts:
            lines.append(f"Against the library path on the same bytes ({library_row['name']}, side-by-side section, "
                         "measured earlier in this run, 2 receivers): " + "; ".join(parts) + ".")
    lines += ["", "Stage medians (s) from the committed records: "
              + "; ".join(f"**{m}** " + ", ".join(f"{k} {v:.3f}" for k, v in e["stages_median"].items())
                          for m, e in result["modes"].items() if e["stages_median"]), ""]
    return lines
