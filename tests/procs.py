"""Start real processes for multi-process tests and collect what each returns.

Results travel back to the test over a multiprocessing queue of the test harness itself (not the product's
wire); every wait is bounded and leftover processes are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any, Callable


def _child(index: int, target: Callable[..., Any], args: tuple, results: "mp.Queue") -> None:
    try:
        results.put((index, "ok", target(*args)))
    except BaseException:  # report everything, including SystemExit, to the test
        results.put((index, "error", traceback.format_exc()))


def run_processes(jobs: list[tuple[Callable[..., Any], tuple]], timeout_s: float = 120.0) -> list[Any]:
    """Run each (target, args) in its own spawned process; return their results in order.

    Raises AssertionError with the child's traceback when one fails, or when the time runs out.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(i, fn, args, results), daemon=True) for i, (fn, args) in enumerate(jobs)]
    for proc in procs:
        proc.start()
    collected: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"processes {sorted(set(range(len(procs))) - set(collected))} "
                                     f"did not finish within {timeout_s}s")
            try:
                index, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in collected and p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"process(es) {dead} died with exit codes "
                                         f"{[procs[i].exitcode for i in dead]} before reporting")
                continue
            collected[index] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    errors = {i: v for i, (s, v) in collected.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"--- process {i} failed:\n{tb}" for i, tb in errors.items()))
    return [collected[i][1] for i in range(len(procs))]
