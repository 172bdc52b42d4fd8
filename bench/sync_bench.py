"""Weight-sync benchmark: ckpt-engine against the raw collective and a per-tensor broadcast loop.

One command measures everything side by side::

    python -m bench.sync_bench            # full run (~5-8 minutes on 2 cores), writes docs/benchmarks.md
    python -m bench.sync_bench --quick    # ~1-2 minutes, smaller model, fewer repeats
    python -m bench.sync_bench --json results.json --out /tmp/bench.md

Three real processes (1 sender, 2 receivers, spawned) share one gloo sync group on 127.0.0.1. For every
model configuration (fixed total bytes split into N float32 tensors) four variants run, round-robin
interleaved across repetitions so that machine noise hits all of them alike:

- ``cached``:     ``Publisher.publish(..., bypass_cpu=False)`` until ``transfer.result()`` reports every
                  receiver verified and acknowledged (``ok``). Trainer held = publish() returning.
- ``bypass``:     the same with ``bypass_cpu=True``; trainer held = ``params_released.wait()`` returning.
- ``raw``:        one ``group.broadcast`` + ``group.wait`` of a single uint8 buffer of ``layout.total_bytes``.
- ``per_tensor``: one broadcast + wait per tensor (the ``update_weights_from_distributed`` pattern),
                  receivers receive into preallocated tensors of the same shape and dtype.

All ranks follow one schedule computed by the parent, so every process issues the same collectives in the
same order. Every figure written out is measured during the run; nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import multiprocessing as mp
import os
import platform
import queue
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
GROUP_NAME = "bench"
WORLD = 3
MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "benchmarks.md"

VARIANTS = ("cached", "bypass", "raw", "per_tensor")
VARIANT_LABEL = {
    "cached": "(a) ckpt-engine cached",
    "bypass": "(a') ckpt-engine bypass_cpu",
    "raw": "(b) raw single broadcast",
    "per_tensor": "(c) per-tensor broadcast loop",
}

# Targets: (key, description, comparison, threshold)
TARGETS = (
    ("throughput_ratio", "raw time / cached time-to-verified (throughput ratio)", ">=", 0.9),
    ("speedup_vs_per_tensor", "per-tensor loop time / cached time-to-verified, at ~20k tensors", ">=", 20.0),
    ("bypass_over_cached", "bypass time-to-verified / cached time-to-verified", "<=", 0.8),
    ("held_cached_over_bypass", "cached trainer-held / bypass trainer-held", "<=", 0.25),
)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_tensors: int
    rows: int  # every tensor is float32 [rows, 64]: 256 bytes per row, so the layout has no padding
    cols: int
    requested_bytes: int

    @property
    def tensor_bytes(self) -> int:
        return self.rows * self.cols * 4

    @property
    def payload_bytes(self) -> int:
        return self.tensor_bytes * self.num_tensors


@dataclass(frozen=True)
class Step:
    config: int
    variant: str
    rep: int  # -1: warm-up (not reported)


def make_config(total_bytes: int, num_tensors: int, cols: int = 64) -> ModelConfig:
    rows = max(1, total_bytes // 4 // num_tensors // cols)
    return ModelConfig(f"{total_bytes / MiB:g} MiB x {num_tensors}", num_tensors, rows, cols, total_bytes)


def build_schedule(num_configs: int, repeats: int, warmup: int) -> list[Step]:
    """Per configuration: warm-up rounds, then ``repeats`` rounds of all variants, rotating the order each round
    so that no variant always runs first (after the barrier) or right after the same neighbour."""
    steps: list[Step] = []
    for c in range(num_configs):
        for w in range(warmup):
            steps.extend(Step(c, v, -1) for v in VARIANTS)
        for rep in range(repeats):
            shift = rep % len(VARIANTS)
            order = VARIANTS[shift:] + VARIANTS[:shift]
            steps.extend(Step(c, v, rep) for v in order)
    return steps


# ----------------------------------------------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------------------------------------------


def _child(rank: int, port: int, configs: list[ModelConfig], schedule: list[Step], bucket_size: int,
           timeout_s: float, results: "mp.Queue") -> None:
    try:
        import torch

        torch.set_num_threads(1)
        logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        from ckpt_engine.device import detect_device
        from ckpt_engine.group import SyncGroup, open_store

        group = SyncGroup(open_store(HOST, port, timeout_s=timeout_s), name=GROUP_NAME, generation=0, rank=rank,
                          world_size=WORLD, device=detect_device("cpu"), timeout_s=timeout_s, bind_host=HOST)
        if rank == 0:
            out = _sender(group, configs, schedule, bucket_size, results)
        else:
            out = _receiver(group, configs, schedule, timeout_s)
        results.put(("result", rank, out))
    except BaseException:  # report everything to the parent, which stops the other processes
        results.put(("error", rank, traceback.format_exc()))


def _barrier(group: Any) -> None:
    import torch

    group.allgather(torch.zeros(1, dtype=torch.int64), "bench barrier")


def _make_model(config: ModelConfig, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(config.rows, config.cols, generator=gen)
            for i in range(config.num_tensors)}


def _sender(group: Any, configs: list[ModelConfig], schedule: list[Step], bucket_size: int,
            results: "mp.Queue") -> dict:
    import torch

    from ckpt_engine.layout import plan_layout
    from ckpt_engine.publisher import Publisher
    from ckpt_engine.tensors import NamedTensors, specs_of

    publisher = Publisher(group, bucket_size=bucket_size, keep_versions=1)
    records: list[dict] = []
    layouts: dict[int, dict] = {}
    version = 0
    current = -1
    tensors: dict = {}
    names: list[str] = []
    raw_buf = None
    run_started = time.perf_counter()
    for index, step in enumerate(schedule):
        config = configs[step.config]
        if step.config != current:
            tensors, raw_buf = {}, None
            gc.collect()
            tensors = _make_model(config, seed=step.config + 1)
            names = list(tensors)
            layout = plan_layout(specs_of(tensors), bucket_size)
            if layout.total_bytes != config.payload_bytes:
                raise AssertionError(f"layout has {layout.total_bytes} bytes, model {config.payload_bytes}")
            layouts[step.config] = {"buckets": len(layout.buckets), "total_bytes": layout.total_bytes,
                                    "max_bucket_bytes": layout.max_bucket_bytes}
            raw_buf = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8)
            current = step.config
        # A new version every time: change one tensor slightly (outside the timed region).
        tensors[names[index % len(names)]].add_(1.0)
        named = NamedTensors(tensors)
        gc.collect()
        _barrier(group)
        record: dict[str, Any] = {"config": step.config, "variant": step.variant, "rep": step.rep}
        if step.variant in ("cached", "bypass"):
            version += 1
            bypass = step.variant == "bypass"
            t0 = time.perf_counter()
            transfer = publisher.publish(version, named, bypass_cpu=bypass)
            if bypass:
                transfer.params_released.wait()
                held = time.perf_counter() - t0
            else:
                held = time.perf_counter() - t0
                if not transfer.params_released.is_set():
                    raise AssertionError("cached publish() returned before params_released was set")
            res = transfer.result(timeout_s=600)
            seconds = time.perf_counter() - t0
            if not res.ok:
                raise RuntimeError(f"version {version} ({step.variant}) failed: {res.reason}")
            if len(res.receivers) != WORLD - 1 or not all(a.ok for a in res.receivers):
                raise RuntimeError(f"version {version}: not every receiver acknowledged ok: {res.receivers}")
            if res.bytes_sent != config.payload_bytes:
                raise RuntimeError(f"version {version}: sent {res.bytes_sent} bytes, expected {config.payload_bytes}")
            record.update(seconds=seconds, held=held, version=version, stages=dict(res.seconds),
                          receiver_stages={str(a.rank): dict(a.seconds) for a in res.receivers})
        elif step.variant == "raw":
            t0 = time.perf_counter()
            work = group.broadcast(raw_buf, src=0)
            group.wait(work, "raw")
            seconds = time.perf_counter() - t0
            _barrier(group)  # receivers enter after their own wait: all bytes have landed
            record.update(seconds=seconds, confirmed=time.perf_counter() - t0)
        elif step.variant == "per_tensor":
            t0 = time.perf_counter()
            for name in names:
                group.wait(group.broadcast(tensors[name], src=0), "per-tensor")
            seconds = time.perf_counter() - t0
            _barrier(group)
            record.update(seconds=seconds, confirmed=time.perf_counter() - t0)
        else:
            raise ValueError(step.variant)
        records.append(record)
        held_text = f"  held {record['held']:.3f}s" if "held" in record else ""
        rep_text = "warm-up" if step.rep < 0 else f"rep {step.rep + 1}"
        results.put(("progress", 0,
                     f"[{index + 1:3d}/{len(schedule)}] {time.perf_counter() - run_started:6.1f}s  "
                     f"{config.name:<17} {step.variant:<10} {rep_text:<7}  {record['seconds']:.3f}s{held_text}"))
    publisher.close()
    return {"records": records, "layouts": layouts}


def _receiver(group: Any, configs: list[ModelConfig], schedule: list[Step], timeout_s: float) -> dict:
    import torch

    from ckpt_engine.receiver import Receiver

    loads: list[int] = []
    receiver = Receiver(group, load=lambda payload: loads.append(payload.version))
    records: list[dict] = []
    current = -1
    raw_buf = None
    targets: list = []
    for step in schedule:
        config = configs[step.config]
        if step.config != current:
            raw_buf, targets = None, []
            gc.collect()
            raw_buf = torch.empty(config.payload_bytes, dtype=torch.uint8)
            targets = [torch.empty(config.rows, config.cols) for _ in range(config.num_tensors)]
            current = step.config
        gc.collect()
        _barrier(group)
        if step.variant in ("cached", "bypass"):
            res = receiver.receive(begin_timeout_s=timeout_s)
            if res is None or not res.ok or not res.loaded:
                raise RuntimeError(f"rank {group.rank}: {step.variant} receive failed: {res}")
            records.append({"config": step.config, "variant": step.variant, "rep": step.rep,
                            "version": res.version, "seconds": dict(res.seconds)})
        elif step.variant == "raw":
            group.wait(group.broadcast(raw_buf, src=0), "raw")
            _barrier(group)
        elif step.variant == "per_tensor":
            for t in targets:
                group.wait(group.broadcast(t, src=0), "per-tensor")
            _barrier(group)
    closed = receiver.receive(begin_timeout_s=timeout_s)
    if closed is not None:
        raise RuntimeError(f"rank {group.rank}: expected CLOSE at the end, got {closed}")
    return {"records": records, "loads": len(loads)}


# ----------------------------------------------------------------------------------------------------------
# Parent: run, aggregate, report
# ----------------------------------------------------------------------------------------------------------


def run_children(configs: list[ModelConfig], schedule: list[Step], bucket_size: int, timeout_s: float,
                 deadline_s: float) -> list[dict]:
    from ckpt_engine.group import open_store

    store = open_store(HOST, 0, is_master=True, timeout_s=timeout_s)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, store.port, configs, schedule, bucket_size, timeout_s, results),
                         name=f"bench-rank{r}", daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    collected: dict[int, dict] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(collected) < WORLD:
            if time.monotonic() > deadline:
                raise RuntimeError(f"benchmark did not finish within {deadline_s:.0f}s")
            try:
                kind, rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for r, p in enumerate(procs) if r not in collected and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{dead} died before reporting (exit codes "
                                       f"{[p.exitcode for p in procs]})") from None
                continue
            if kind == "progress":
                print(value, flush=True)
            elif kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            else:
                collected[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(collected) == WORLD else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [collected[r] for r in range(WORLD)]


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def aggregate(configs: list[ModelConfig], sender: dict, receivers: list[dict]) -> dict:
    records = [r for r in sender["records"] if r["rep"] >= 0]
    by_cv: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        by_cv.setdefault((r["config"], r["variant"]), []).append(r)
    rx_by_cv: dict[tuple[int, str], list[dict]] = {}
    for rx in receivers:
        for r in rx["records"]:
            if r["rep"] >= 0:
                rx_by_cv.setdefault((r["config"], r["variant"]), []).append(r["seconds"])
    rows = []
    for c, config in enumerate(configs):
        row: dict[str, Any] = {"config": c, "name": config.name, "num_tensors": config.num_tensors,
                               "tensor_shape": [config.rows, config.cols], "bytes": config.payload_bytes,
                               "layout": sender["layouts"][c], "variants": {}, "ratios": {}}
        per_rep: dict[str, dict[int, dict]] = {}
        for v in VARIANTS:
            recs = by_cv.get((c, v), [])
            if not recs:
                continue
            entry: dict[str, Any] = {"seconds": _stats([r["seconds"] for r in recs]),
                                     "samples": [r["seconds"] for r in recs]}
            sec = entry["seconds"]  # slowest repetition -> lowest GB/s
            entry["gbps"] = {"median": config.payload_bytes / sec["median"] / 1e9,
                             "min": config.payload_bytes / sec["max"] / 1e9,
                             "max": config.payload_bytes / sec["min"] / 1e9}
            if "held" in recs[0]:
                entry["held"] = _stats([r["held"] for r in recs])
                entry["held_samples"] = [r["held"] for r in recs]
            if "confirmed" in recs[0]:
                entry["confirmed"] = _stats([r["confirmed"] for r in recs])
            if "stages" in recs[0]:
                for r in recs:  # time TransferResult.seconds does not attribute to a named stage
                    r["stages"]["other"] = r["stages"].get("total", 0.0) - sum(
                        v for k, v in r["stages"].items() if k not in ("total", "other"))
                keys = sorted({k for r in recs for k in r["stages"]})
                entry["sender_stages_median"] = {k: statistics.median(r["stages"].get(k, 0.0) for r in recs)
                                                 for k in keys}
            rx_stages = rx_by_cv.get((c, v))
            if rx_stages:
                keys = sorted({k for s in rx_stages for k in s})
                entry["receiver_stages_median"] = {k: statistics.median(s.get(k, 0.0) for s in rx_stages)
                                                   for k in keys}
            row["variants"][v] = entry
            per_rep[v] = {r["rep"]: r for r in recs}

        def med(v: str, field: str = "seconds") -> float | None:
            e = row["variants"].get(v)
            return None if e is None or field not in e else e[field]["median"]

        def paired(num: str, den: str, nf: str = "seconds", df: str = "seconds") -> list[float]:
            reps = sorted(set(per_rep.get(num, {})) & set(per_rep.get(den, {})))
            return [per_rep[num][k][nf] / per_rep[den][k][df] for k in reps]

        def ratio(key: str, num: str, den: str, nf: str = "seconds", df: str = "seconds") -> None:
            a, b = med(num, nf), med(den, df)
            if a is None or b is None:
                return
            pr = paired(num, den, nf, df)
            row["ratios"][key] = {"value": a / b, "paired_min": min(pr), "paired_max": max(pr),
                                  "definition": f"median {num}.{nf} / median {den}.{df}"}

        ratio("throughput_ratio", "raw", "cached")
        ratio("throughput_ratio_bypass", "raw", "bypass")
        ratio("speedup_vs_per_tensor", "per_tensor", "cached")
        ratio("speedup_bypass_vs_per_tensor", "per_tensor", "bypass")
        ratio("bypass_over_cached", "bypass", "cached")
        ratio("held_cached_over_bypass", "cached", "bypass", "held", "held")
        rows.append(row)

    targets = []
    big = max(range(len(configs)), key=lambda i: configs[i].num_tensors)
    for key, text, op, threshold in TARGETS:
        for row in rows:
            if key == "speedup_vs_per_tensor" and row["config"] != big:
                continue
            r = row["ratios"].get(key)
            if r is None:
                continue
            met = r["value"] >= threshold if op == ">=" else r["value"] <= threshold
            targets.append({"target": key, "description": text, "op": op, "threshold": threshold,
                            "config": row["name"], "measured": r["value"], "paired_min": r["paired_min"],
                            "paired_max": r["paired_max"], "met": met})
    return {"rows": rows, "targets": targets}


def machine_info() -> dict:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_model": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_bytes": mem,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def _fmt_s(stats: dict[str, float]) -> tuple[str, str]:
    return f"{stats['median']:.3f}", f"{stats['min']:.3f}–{stats['max']:.3f}"


def render_markdown(report: dict) -> str:
    m = report["machine"]
    s = report["settings"]
    agg = report["results"]
    lines: list[str] = []
    add = lines.append
    add("# Weight-sync benchmark")
    add("")
    add(f"Generated by `bench/sync_bench.py` on {m['date_utc']} "
        f"({'quick' if s['quick'] else 'full'} run, {report['wall_seconds']:.0f} s wall). "
        "Every number below was measured in that run; re-running the command regenerates this file.")
    add("")
    add("## Command")
    add("")
    add("```")
    add(report["command"])
    add("```")
    add("")
    add("(run from the repository root)")
    add("")
    add("## Machine")
    add("")
    mem = f"{m['memory_bytes'] / (1 << 30):.1f} GiB" if m["memory_bytes"] else "unknown"
    add(f"- CPU: {m['cpu_model']} — {m['logical_cores']} logical cores ({m['usable_cores']} usable), {mem} RAM, no GPU")
    add(f"- torch {m['torch']} (gloo backend), Python {m['python']}")
    add(f"- OS: {m['platform']}")
    add(f"- Date: {m['date_utc']}")
    add("")
    add("## Setup")
    add("")
    add(f"- 3 spawned processes: 1 sender (rank 0) + 2 receivers (ranks 1, 2), one gloo sync group on "
        f"127.0.0.1 (`SyncGroup`, generation 0) used by every variant; `torch.set_num_threads(1)` in each. "
        f"The three processes share the machine's {m['usable_cores']} usable core(s): loopback copies, "
        "digests and verification all compete for the same CPUs.")
    add(f"- Models: float32 tensors of shape [rows, 64]; bucket size {s['bucket_size'] // MiB} MiB, "
        f"`Publisher(..., keep_versions=1)`, default digest (xxh3-64 on CPU), receivers verify every tensor; "
        f"`load` is a no-op that records the version.")
    add(f"- {s['repeats']} measured repetitions per variant (after {s['warmup']} warm-up round), interleaved "
        "round-robin: each round runs all four variants of a configuration back to back, the order rotated "
        "every round. A barrier (8-byte allgather) precedes every measured operation; one tensor is changed "
        "(`add_(1)`) before each, so every publish is a new version.")
    add("- Tables give the median over repetitions and the min–max range. GB/s = model bytes / time (1 GB = 1e9 B). "
        "Ratios are ratios of medians; the range in brackets is the min–max of the same ratio computed per "
        "round (variants of one round ran back to back).")
    add("")
    add("Variants (all timed on the sender, rank 0):")
    add("")
    add("- **(a) cached**: `publisher.publish(v, named)` → `transfer.result()` returns with `ok` and both "
        "receivers acknowledged (they received, verified all digests and called `load`). *Held*: until "
        "`publish()` returns (snapshot done; `params_released` is set).")
    add("- **(a') bypass**: the same with `bypass_cpu=True`. *Held*: until `transfer.params_released.wait()` returns.")
    add("- **(b) raw**: `group.wait(group.broadcast(buf), \"raw\")` of one uint8 buffer of `layout.total_bytes` "
        "on the same group; receivers post the matching broadcast into their own buffer.")
    add("- **(c) per-tensor**: for each tensor one `group.broadcast` + `group.wait` on the same group; receivers "
        "receive into preallocated tensors of the same shape/dtype (the `update_weights_from_distributed` pattern).")
    add("")
    add("For (b) and (c) the time stops when the sender's last wait returns. The *confirmed* column adds a "
        "barrier that receivers enter after their own last wait (i.e. all bytes landed everywhere); it is "
        "reported for reference, the ratios use the plain figure as specified.")
    add("")
    add("## Results")
    add("")
    add("| Model | Variant | Time median (s) | min–max (s) | GB/s median (min–max) | Trainer held median (s) | held min–max (s) | confirmed median (s) |")
    add("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in agg["rows"]:
        model = f"{row['bytes'] / MiB:.1f} MiB, {row['num_tensors']:,} × {row['tensor_shape'][0]}×{row['tensor_shape'][1]} fp32"
        for v in VARIANTS:
            e = row["variants"].get(v)
            if e is None:
                continue
            med, rng = _fmt_s(e["seconds"])
            g = e["gbps"]
            gb = f"{g['median']:.2f} ({g['min']:.2f}–{g['max']:.2f})"
            held = _fmt_s(e["held"]) if "held" in e else ("—", "—")
            conf = f"{e['confirmed']['median']:.3f}" if "confirmed" in e else "—"
            add(f"| {model} | {VARIANT_LABEL[v]} | {med} | {rng} | {gb} | {held[0]} | {held[1]} | {conf} |")
    add("")
    notes = report.get("size_notes") or []
    for note in notes:
        add(f"Note: {note}")
        add("")
    add("## Ratios")
    add("")
    add("| Model | raw / cached (throughput ratio) | raw / bypass | per-tensor / cached (speedup) | per-tensor / bypass | bypass / cached time-to-verified | cached held / bypass held |")
    add("|---|---:|---:|---:|---:|---:|---:|")
    for row in agg["rows"]:
        def cell(key: str, fmt: str) -> str:
            r = row["ratios"].get(key)
            if r is None:
                return "—"
            return f"{format(r['value'], fmt)} [{format(r['paired_min'], fmt)}–{format(r['paired_max'], fmt)}]"
        add(f"| {row['name']} | {cell('throughput_ratio', '.3f')} | {cell('throughput_ratio_bypass', '.3f')} | "
            f"{cell('speedup_vs_per_tensor', '.2f')}× | {cell('speedup_bypass_vs_per_tensor', '.2f')}× | "
            f"{cell('bypass_over_cached', '.3f')} | {cell('held_cached_over_bypass', '.3f')} |")
    add("")
    add("## Targets")
    add("")
    add("| Target | Model | Measured (per-round range) | Status |")
    add("|---|---|---:|---|")
    for t in agg["targets"]:
        unit = "×" if t["target"] == "speedup_vs_per_tensor" else ""
        add(f"| {t['description']} {t['op']} {t['threshold']:g}{unit} | {t['config']} | "
            f"{t['measured']:.3f}{unit} ({t['paired_min']:.3f}–{t['paired_max']:.3f}) | "
            f"**{'MET' if t['met'] else 'MISSED'}** |")
    met = sum(t["met"] for t in agg["targets"])
    add("")
    add(f"{met} of {len(agg['targets'])} target checks met.")
    add("")
    add("## Where the time goes (medians, seconds)")
    add("")
    add("Sender stages come from `TransferResult.seconds` (`fill` = copying live tensors into send buckets, "
        "`digest` = xxh3 of every tensor, `broadcast` = waiting on bucket broadcasts, `ack` = acknowledgement "
        "allgather, `header` = version header frames, `control` = per-bucket header frames and the END trailer; on "
        "gloo a blocking bucket-header frame waits behind the previous bucket's data broadcast, so wire time lands "
        "there too). `snapshot` = trainer held in cached mode (the cache copy inside `publish()`). `other` = sender "
        "total minus the named stages (per repetition, then median): bookkeeping. Receiver stages come from the "
        "receivers' acknowledgements (both receivers pooled).")
    add("")
    stage_keys = ["header", "fill", "digest", "broadcast", "control", "ack", "total"]
    add("| Model | Mode | snapshot/held | " + " | ".join(f"sender {k}" for k in stage_keys[:-1])
        + " | sender other | sender total | recv | verify | load | receiver total |")
    add("|---|---|" + "---:|" * (2 + len(stage_keys) + 4))
    for row in agg["rows"]:
        for v in ("cached", "bypass"):
            e = row["variants"].get(v)
            if e is None:
                continue
            ss = e.get("sender_stages_median", {})
            rs = e.get("receiver_stages_median", {})
            cells = [f"{ss.get(k, 0.0):.3f}" for k in (*stage_keys[:-1], "other", "total")]
            rcells = [f"{rs.get(k, 0.0):.3f}" for k in ("recv", "verify", "load", "total")]
            add(f"| {row['name']} | {v} | {e['held']['median']:.3f} | " + " | ".join(cells) + " | "
                + " | ".join(rcells) + " |")
    add("")
    add("Raw per-repetition samples of every variant are in the JSON output (`--json PATH`).")
    add("")
    add("Why targets are missed on this machine, and what was changed because of them: "
        "[performance-notes.md](performance-notes.md). The same-host (shared memory) path has its own "
        "benchmark: [benchmarks-ipc.md](benchmarks-ipc.md) (`python -m bench.ipc_bench`).")
    add("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sync_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller models and 3 repeats (~1-2 minutes)")
    p.add_argument("--json", metavar="PATH", help="also write every measured figure as JSON")
    p.add_argument("--out", metavar="PATH", default=None, help=f"markdown report (default {DEFAULT_OUT.relative_to(REPO)})")
    p.add_argument("--repeats", type=int, default=None, help="measured repetitions per variant (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="unreported warm-up rounds per configuration (default 1)")
    p.add_argument("--mib", type=float, default=None, help="model size in MiB for ~100 and ~2,000 tensors "
                   "(default 256, quick 64)")
    p.add_argument("--mib-20k", type=float, default=None, help="model size in MiB for ~20,000 tensors "
                   "(default 256, quick 64)")
    p.add_argument("--tensors", type=str, default="100,2000,20000", help="tensor counts (comma separated)")
    p.add_argument("--bucket-mib", type=float, default=64, help="publisher bucket size in MiB (default 64)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-collective timeout in seconds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else argv
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    mib = args.mib if args.mib is not None else (64 if args.quick else 256)
    mib_20k = args.mib_20k if args.mib_20k is not None else (64 if args.quick else 256)
    counts = [int(x) for x in args.tensors.split(",") if x.strip()]
    configs = [make_config(int((mib_20k if n >= 10000 else mib) * MiB), n) for n in counts]
    size_notes = []
    if any(n >= 10000 for n in counts) and mib_20k != mib:
        size_notes.append(f"the ~20,000-tensor model is {mib_20k:g} MiB (the others {mib:g} MiB) to bound the "
                          "per-tensor loop's run time; all variants within a row use the same bytes.")
    schedule = build_schedule(len(configs), repeats, args.warmup)
    bucket_size = int(args.bucket_mib * MiB)
    out_path = Path(args.out) if args.out else DEFAULT_OUT
    command = shlex.join([sys.executable, "-m", "bench.sync_bench", *argv_used])

    print(f"command: {command}", flush=True)
    for c in configs:
        print(f"config {c.name}: {c.num_tensors} x float32[{c.rows}, {c.cols}] = {c.payload_bytes:,} bytes", flush=True)
    print(f"{len(schedule)} operations ({repeats} repeats + {args.warmup} warm-up per variant), "
          f"bucket {bucket_size:,} bytes", flush=True)
    started = time.perf_counter()
    sender, *receivers = run_children(configs, schedule, bucket_size, args.timeout, deadline_s=3600)
    wall = time.perf_counter() - started
    for r, rx in enumerate(receivers, start=1):
        expected = sum(1 for s in schedule if s.variant in ("cached", "bypass"))
        if rx["loads"] != expected:
            raise RuntimeError(f"receiver {r} loaded {rx['loads']} versions, expected {expected}")
    results = aggregate(configs, sender, receivers)
    report = {
        "command": command,
        "machine": machine_info(),
        "settings": {"quick": args.quick, "repeats": repeats, "warmup": args.warmup, "bucket_size": bucket_size,
                     "mib": mib, "mib_20k": mib_20k, "tensor_counts": counts, "world_size": WORLD,
                     "timeout_s": args.timeout},
        "configs": [asdict(c) | {"payload_bytes": c.payload_bytes} for c in configs],
        "size_notes": size_notes,
        "wall_seconds": wall,
        "results": results,
        "raw": {"sender": sender, "receivers": receivers},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(render_markdown(report))
    print(f"\nwrote {out_path}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}", flush=True)
    print(f"total wall time {wall:.1f}s\n", flush=True)
    for t in results["targets"]:
        print(f"{'MET   ' if t['met'] else 'MISSED'} {t['description']} {t['op']} {t['threshold']:g} "
              f"[{t['config']}]: {t['measured']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
