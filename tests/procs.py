"""Start real processes for multi-process tests and collect what each returns.

Results travel back to the test over a multiprocessing queue of the test harness itself (not the product's
wire); every wait is bounded and leftover processes are killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any


def _child(index: int, target: Callable[..., Any], args: tuple, results: mp.Queue, environ: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment now (a fork server keeps the one it started with)
    os.environ.update(environ)
    try:
        results.put((index, "ok", target(*args)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit, to the test
        results.put((index, "error", traceback.format_exc()))


# What every test process imports, loaded once by the fork server: a test's processes are forked from it, real
# processes each, without paying torch's and transformers' import (seconds each on 2 cores) every time.
_PRELOAD = ["torch", "torch.distributed", "transformers", "tests.tiny_lm", "tests.models",
            "ckpt_engine.workers.trainer_agent", "ckpt_engine.workers.rollout_agent",
            "ckpt_engine.server.daemon", "ckpt_engine.cli.main"]


def context() -> mp.context.BaseContext:
    """The multiprocessing context of the tests' processes: a fork server (single-threaded, no CUDA) that has
    imported the heavy modules once; spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class Running:
    """Processes started by :func:`start_processes`; :meth:`collect` waits for their results."""

    def __init__(self, jobs: list[tuple[Callable[..., Any], tuple]]) -> None:
        ctx = context()
        self._results = ctx.Queue()
        self.procs = [ctx.Process(target=_child, args=(i, fn, args, self._results, dict(os.environ)), daemon=True)
                      for i, (fn, args) in enumerate(jobs)]
        for proc in self.procs:
            proc.start()

    def collect(self, timeout_s: float) -> list[Any]:
        """Results in job order; AssertionError with the child's traceback when one fails or time runs out."""
        collected: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(collected) < len(self.procs):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"processes {sorted(set(range(len(self.procs))) - set(collected))} "
                                         f"did not finish within {timeout_s}s")
                try:
                    index, status, value = self._results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [i for i, p in enumerate(self.procs) if i not in collected and p.exitcode not in (None, 0)]
                    if dead:
                        raise AssertionError(f"process(es) {dead} died with exit codes "
                                             f"{[self.procs[i].exitcode for i in dead]} before reporting") from None
                    continue
                collected[index] = (status, value)
        finally:
            self.kill()
        errors = {i: v for i, (s, v) in collected.items() if s == "error"}
        if errors:
            raise AssertionError("\n".join(f"--- process {i} failed:\n{tb}" for i, tb in errors.items()))
        return [collected[i][1] for i in range(len(self.procs))]

    def kill(self) -> None:
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def start_processes(jobs: list[tuple[Callable[..., Any], tuple]]) -> Running:
    """Start each (target, args) in its own spawned process."""
    return Running(jobs)


def run_processes(jobs: list[tuple[Callable[..., Any], tuple]], timeout_s: float = 120.0) -> list[Any]:
    """Run each (target, args) in its own spawned process; return their results in order."""
    return Running(jobs).collect(timeout_s)


def shm_files(pid: int | None = None) -> set[str]:
    """Files in /dev/shm that process ``pid`` (default: this one) maps or holds open: only what the test's own
    processes made is checked, never the whole of /dev/shm (other users of the machine have files there).
    sem.mp-* are the test harness's own multiprocessing semaphores."""
    proc = f"/proc/{pid or os.getpid()}"
    found = set()
    with contextlib.suppress(OSError), open(f"{proc}/maps") as maps:
        found |= {line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"{proc}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{proc}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    found.add(target)
    return {f for f in found if not os.path.basename(f).startswith("sem.mp-")}
