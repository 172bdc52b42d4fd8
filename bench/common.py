"""Shared helpers of the benchmark suite: statistics, machine description, a bounded multi-process harness,
memory readings from /proc, and small formatting helpers. Nothing here measures anything by itself."""

from __future__ import annotations

import datetime as _dt
import multiprocessing as mp
import os
import platform
import queue
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ckpt_engine.server.launch import REPO, free_port  # noqa: F401 - one launcher for every daemon

HOST = "127.0.0.1"
MiB = 1 << 20
GiB = 1 << 30

Progress = Callable[[str], None]


def stats(values: Iterable[float]) -> dict[str, float]:
    vals = list(values)
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def device_timed(fn: Callable[[], object], rounds: int, device: Any, *, synced: bool = True) -> float:
    """Median seconds of ``fn`` over ``rounds`` after one warm-up, the device synchronised after each call: inside
    the timing, or (``synced=False``) after it, to time only what the host spends queueing the work."""
    def sync() -> None:
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    fn()
    sync()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        if synced:
            sync()
        samples.append(time.perf_counter() - start)
        sync()
    return statistics.median(samples)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, int(-(-q * len(ordered) // 100)))  # ceil(q/100 * n), at least 1
    return ordered[min(rank, len(ordered)) - 1]


def gbps(nbytes: int, seconds: dict[str, float]) -> dict[str, float]:
    """GB/s (1e9 B/s) for a time statistic: the slowest repetition gives the lowest rate."""
    return {"median": nbytes / seconds["median"] / 1e9, "min": nbytes / seconds["max"] / 1e9,
            "max": nbytes / seconds["min"] / 1e9}


def auth_headers() -> dict[str, str]:
    """The operator's bearer header for the daemon the suite started (its credentials file is exported)."""
    from ckpt_engine.control.auth import client_token

    token = client_token("operator")
    return {"Authorization": f"Bearer {token}"} if token else {}


def cuda_devices() -> int:
    """CUDA devices this process can use (0 without CUDA, or with a broken driver)."""
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver: no usable GPU
        return 0


def rotated_rounds(variants: tuple[str, ...], repeats: int, warmup: int) -> list[tuple[str, int]]:
    """(variant, round) for every round, order rotated each round; rounds < 0 are warm-up."""
    order = []
    for r in range(warmup + repeats):
        shift = r % len(variants)
        order += [(v, r - warmup) for v in variants[shift:] + variants[:shift]]
    return order


def usable_cores() -> int:
    """Cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = usable_cores()
    return {
        "cpu_model": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_bytes": meminfo().get("MemTotal"),
        "gpu": _gpu(torch),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "disk_tmp": _fs_of("/tmp"),
        "disk_shm": _fs_of("/dev/shm"),
    }


def _gpu(torch: Any) -> str | None:
    try:
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no driver: no GPU
        pass
    return None


def _fs_of(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        real = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) > len(best):
                best, kind = parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})"
    except OSError:
        pass
    return kind


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields:
                out[key] = int(fields[0]) * (1024 if len(fields) > 1 else 1)
    except OSError:
        pass
    return out


def proc_status() -> dict[str, int]:
    """Memory lines of /proc/self/status in bytes (VmRSS, VmHWM, RssAnon, RssFile, RssShmem)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")):
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    return out


class PeakSampler:
    """Polls /proc/self/status from a thread; ``window()`` resets the maxima, ``peak()`` reads them."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self._max: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hwm_resettable = self._reset_hwm()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = proc_status()
            with self._lock:
                for k, v in now.items():
                    if v > self._max.get(k, 0):
                        self._max[k] = v
            time.sleep(self.interval_s)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def window(self) -> dict[str, int]:
        """Start a new window; returns the current readings."""
        now = proc_status()
        with self._lock:
            self._max = dict(now)
        self._hwm_resettable = self._reset_hwm()
        return now

    def peak(self) -> dict[str, int]:
        now = proc_status()
        with self._lock:
            out = {k: max(v, now.get(k, 0)) for k, v in self._max.items()}
        if self._hwm_resettable:
            out["VmRSS"] = max(out.get("VmRSS", 0), now.get("VmHWM", 0))
        out["hwm_reset"] = int(self._hwm_resettable)
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1)


# ----------------------------------------------------------------------------------------------------------
# Bounded multi-process harness
# ----------------------------------------------------------------------------------------------------------


def _entry(target: Callable[..., Any], rank: int, results: mp.Queue, args: tuple) -> None:
    try:
        value = target(rank, results, *args)
        results.put(("result", rank, value))
    except BaseException:  # noqa: BLE001 - report everything to the parent, which stops the other processes
        results.put(("error", rank, traceback.format_exc()))


def run_processes(target: Callable[..., Any], args_by_rank: list[tuple], *, deadline_s: float,
                  progress: Progress = print, name: str = "bench") -> list[Any]:
    """Run ``target(rank, results_queue, *args)`` in one spawned process per entry of ``args_by_rank`` and
    return their return values by rank. A child may put ``("progress", rank, text)`` on the queue. Raises when
    a child fails, dies, or the whole run exceeds ``deadline_s``; every child is gone when this returns."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, r, results, a), name=f"{name}-rank{r}", daemon=True)
             for r, a in enumerate(args_by_rank)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(collected) < len(procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: did not finish within {deadline_s:.0f}s")
            try:
                kind, rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for r, p in enumerate(procs) if r not in collected and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{dead} died before reporting (exit codes "
                                       f"{[p.exitcode for p in procs]})") from None
                continue
            if kind == "progress":
                progress(value)
            elif kind == "error":
                raise RuntimeError(f"{name} rank {rank} failed:\n{value}")
            else:
                collected[rank] = value
    finally:
        for p in procs:
            p.join(timeout=15 if len(collected) == len(procs) else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [collected[r] for r in range(len(procs))]


def sync_group(rank: int, world: int, port: int, timeout_s: float, name: str):
    """A gloo SyncGroup on 127.0.0.1 (generation 0) for rank ``rank`` of ``world``."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.transport.group import SyncGroup, open_store

    return SyncGroup(open_store(HOST, port, timeout_s=timeout_s), name=name, generation=0, rank=rank,
                     world_size=world, device=detect_device("cpu"), timeout_s=timeout_s, bind_host=HOST)


def barrier(group: Any) -> None:
    import torch

    group.allgather(torch.zeros(1, dtype=torch.int64), "bench barrier")


def receive_versions(receiver: Any, count: int, *, before_each: Callable[[], None] | None = None,
                     timeout_s: float = 300.0) -> list[Any]:
    """A bench receiver's whole life: ``count`` versions on ``receiver`` (``before_each()`` before each; every
    one must be ok), then the sender's CLOSE (:func:`expect_close`). Their results."""
    results = []
    for _ in range(count):
        if before_each is not None:
            before_each()
        result = receiver.receive(timeout_s)
        if result is None or not result.ok:
            raise RuntimeError(f"receive failed: {result}")
        results.append(result)
    expect_close(receiver)
    return results


def expect_close(receiver: Any, timeout_s: float = 60.0) -> None:
    """The sender closed the group: ``receive`` returns None (a version instead is an error)."""
    if receiver.receive(timeout_s) is not None:
        raise RuntimeError("expected CLOSE")


def master_store(timeout_s: float = 60.0):
    from ckpt_engine.transport.group import open_store

    return open_store(HOST, 0, is_master=True, timeout_s=timeout_s)


# ----------------------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------------------


def fmt_s(s: dict[str, float], digits: int = 3) -> str:
    """``median (min–max)`` of a time statistic in seconds."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def fmt_ms(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median'] * 1e3:.{digits}f} ({s['min'] * 1e3:.{digits}f}–{s['max'] * 1e3:.{digits}f})"


def fmt_ratio(r: dict[str, float] | None, digits: int = 2, unit: str = "") -> str:
    if r is None:
        return "—"
    return f"{r['value']:.{digits}f}{unit} [{r['paired_min']:.{digits}f}–{r['paired_max']:.{digits}f}]"


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.0f} MiB" if nbytes >= 10 * MiB else f"{nbytes / MiB:.1f} MiB"


def paired_ratio(num: list[float], den: list[float]) -> dict[str, float] | None:
    """Ratio of medians, with the min–max of the per-round ratios (rounds ran back to back)."""
    if not num or not den:
        return None
    per_round = [a / b for a, b in zip(num, den) if b > 0]
    value = statistics.median(num) / statistics.median(den)
    return {"value": value, "paired_min": min(per_round) if per_round else value,
            "paired_max": max(per_round) if per_round else value}


def write_report(text: str, result: dict, out: str | None, json_path: str | None) -> None:
    """A standalone bench's ending: its markdown on stdout and in ``out``, its raw results in ``json_path``."""
    import json

    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
