"""Side-by-side weight-sync comparison on one gloo sync group, and the multi-process engine that the
model-size / receiver-count curves (:mod:`ckpt_engine.bench.curves`) reuse.

Spawned processes (1 sender + N receivers) share one gloo sync group on 127.0.0.1. For every model
configuration (fixed total bytes split into float32 tensors) the variants below run round-robin
interleaved across repetitions (the order rotates every round), so machine noise hits all of them alike:

- ``cached``:     ``Publisher.publish(..., mode="cached")`` until ``transfer.result()`` reports every
                  receiver verified and acknowledged (``ok``). Trainer held = publish() returning.
- ``bypass``:     the same with ``mode="bypass_cpu"``; trainer held = ``params_released.wait()`` returning.
- ``raw``:        one ``group.broadcast`` + ``group.wait`` of a single uint8 buffer of ``layout.total_bytes``.
- ``per_tensor``: one broadcast + wait per tensor (the ``update_weights_from_distributed`` pattern),
                  receivers receive into preallocated tensors of the same shape and dtype.
- ``memcpy``:     one ``copy_`` of the same bytes inside the sender (single thread): the local-memory limit.
- ``disk_local`` / ``disk_shm``: safetensors save on the sender, ``load_file`` + copy on every receiver
                  (:mod:`ckpt_engine.bench.disk_bench`), on the local disk and on /dev/shm.

All ranks follow one schedule computed by the parent, so every process issues the same collectives in the
same order. Standalone: ``ckpt-engine bench --only side_by_side --out PATH`` runs this section alone (its report goes to
bench/results/ unless ``--out`` is given).
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from ckpt_engine.bench import disk_bench
from ckpt_engine.bench.common import (
    MiB,
    Progress,
    barrier,
    fmt_ratio,
    fmt_s,
    gbps,
    master_store,
    mib,
    paired_ratio,
    run_processes,
    stats,
    sync_group,
    usable_cores,
)
from ckpt_engine.plan.modes import mode_of

GROUP_NAME = "bench"
ALL_VARIANTS = ("cached", "cached_overlap", "bypass", "raw", "per_tensor", "memcpy", "disk_local", "disk_shm")
CURVE_VARIANTS = ("cached", "bypass", "raw", "per_tensor")
# MoE scale (Kimi-K2 has ~69k expert weights): the per-tensor loop would take minutes a round there
MOE_COUNTS = (100_000,)
MOE_VARIANTS = ("cached", "bypass", "raw")
VARIANT_LABEL = {
    "cached": "ckpt-engine e2e, cached",
    "cached_overlap": "ckpt-engine e2e, cached, send overlapping the snapshot (overlap_snapshot=True)",
    "bypass": "ckpt-engine e2e, bypass_cpu",
    "raw": "raw single broadcast (gloo)",
    "per_tensor": "per-tensor broadcast loop",
    "memcpy": "memcpy of the same bytes (1 thread)",
    "disk_local": "safetensors via local disk (/tmp)",
    "disk_shm": "safetensors via /dev/shm",
}

# (key, numerator variant, denominator variant, numerator field, denominator field, meaning)
RATIOS = (
    ("raw_over_cached", "raw", "cached", "seconds", "seconds", "cached throughput ÷ raw broadcast throughput"),
    ("raw_over_bypass", "raw", "bypass", "seconds", "seconds", "bypass throughput ÷ raw broadcast throughput"),
    ("memcpy_over_cached", "memcpy", "cached", "seconds", "seconds", "cached throughput ÷ memcpy throughput"),
    ("per_tensor_over_cached", "per_tensor", "cached", "seconds", "seconds", "cached speedup over per-tensor loop"),
    ("per_tensor_over_bypass", "per_tensor", "bypass", "seconds", "seconds", "bypass speedup over per-tensor loop"),
    ("disk_local_over_cached", "disk_local", "cached", "seconds", "seconds", "cached speedup over safetensors disk"),
    ("disk_shm_over_cached", "disk_shm", "cached", "seconds", "seconds", "cached speedup over safetensors shm"),
    ("cached_over_overlap", "cached", "cached_overlap", "seconds", "seconds",
     "cached time-to-verified: send after the snapshot ÷ overlapped with it"),
    ("held_overlap_over_cached", "cached_overlap", "cached", "held", "held",
     "cached trainer-held: overlapped ÷ send after the snapshot"),
    ("cpu_bound_over_cached", "cached", "cached", "cpu_bound", "seconds", "cached: its CPU bound ÷ its time"),
    ("cpu_bound_over_raw", "raw", "raw", "cpu_bound", "seconds", "raw: its CPU bound ÷ its time"),
    ("bypass_over_cached", "bypass", "cached", "seconds", "seconds", "bypass time-to-verified ÷ cached"),
    ("held_cached_over_bypass", "cached", "bypass", "held", "held", "cached trainer-held ÷ bypass trainer-held"),
)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_tensors: int
    rows: int  # every tensor is float32 [rows, cols]; cols=64 gives 256-byte rows, so the layout has no padding
    cols: int
    requested_bytes: int
    variants: tuple[str, ...] = ALL_VARIANTS
    flat: bool = False  # tensors are views of one flat buffer, which the raw broadcast and memcpy reuse

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


def make_config(total_bytes: int, num_tensors: int, variants: tuple[str, ...] = ALL_VARIANTS, *,
                flat: bool = False, cols: int = 64) -> ModelConfig:
    rows = max(1, total_bytes // 4 // num_tensors // cols)
    if flat and any(v.startswith("disk") for v in variants):
        raise ValueError("safetensors refuses tensors that share storage: disk variants need flat=False")
    return ModelConfig(f"{total_bytes / MiB:g} MiB × {num_tensors:,}", num_tensors, rows, cols, total_bytes,
                       tuple(variants), flat)


def build_schedule(configs: list[ModelConfig], repeats: int, warmup: int) -> list[Step]:
    """Per configuration: warm-up rounds, then ``repeats`` rounds of all its variants, rotating the order each
    round so that no variant always runs first or right after the same neighbour. The per-tensor loop skips
    warm-up at >= 10,000 tensors (10+ s per round, and nothing in it needs warming)."""
    steps: list[Step] = []
    for c, config in enumerate(configs):
        variants = config.variants
        for _ in range(warmup):
            steps.extend(Step(c, v, -1) for v in variants
                         if not (v == "per_tensor" and config.num_tensors >= 10000))
        for rep in range(repeats):
            shift = rep % len(variants)
            order = variants[shift:] + variants[:shift]
            steps.extend(Step(c, v, rep) for v in order)
    return steps


# ----------------------------------------------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------------------------------------------


def _child(rank: int, results: Any, world: int, port: int, configs: list[ModelConfig], schedule: list[Step],
           bucket_size: int, timeout_s: float, dirs: dict[str, str]) -> dict:
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    group = sync_group(rank, world, port, timeout_s, GROUP_NAME)
    if rank == 0:
        return _sender(group, world, configs, schedule, bucket_size, dirs, results)
    return _receiver(group, configs, schedule, timeout_s, dirs)


def _make_model(config: ModelConfig, seed: int) -> tuple[dict, Any]:
    """The model's tensors (and, for flat configs, the flat float32 buffer they are views of). Random bytes
    are generated in 16 MiB blocks and tiled with small offsets: fast even at 4 GiB, and every tensor differs."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    per = config.rows * config.cols
    if config.flat:
        flat = torch.empty(per * config.num_tensors)
        block = torch.randn(min(flat.numel(), 4 << 20), generator=gen)
        for i, start in enumerate(range(0, flat.numel(), block.numel())):
            chunk = flat[start : start + block.numel()]
            torch.add(block[: chunk.numel()], float(i), out=chunk)
        tensors = {f"layer{i}.weight": flat[i * per : (i + 1) * per].view(config.rows, config.cols)
                   for i in range(config.num_tensors)}
        return tensors, flat
    return {f"layer{i}.weight": torch.randn(config.rows, config.cols, generator=gen)
            for i in range(config.num_tensors)}, None


def _sender(group: Any, world: int, configs: list[ModelConfig], schedule: list[Step], bucket_size: int,
            dirs: dict[str, str], results: Any) -> dict:
    import torch

    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import NamedTensors, specs_of
    from ckpt_engine.send.publisher import Publisher

    publisher = Publisher(group, bucket_size=bucket_size, keep_versions=1)
    records: list[dict] = []
    layouts: dict[int, dict] = {}
    version = 0
    current = -1
    tensors: dict = {}
    names: list[str] = []
    raw_buf = copy_dst = flat = None
    run_started = time.perf_counter()
    for index, step in enumerate(schedule):
        config = configs[step.config]
        if step.config != current:
            tensors, raw_buf, copy_dst, flat = {}, None, None, None
            gc.collect()
            tensors, flat = _make_model(config, seed=step.config + 1)
            names = list(tensors)
            layout = plan_layout(specs_of(tensors), bucket_size)
            if layout.total_bytes != config.payload_bytes:
                raise AssertionError(f"layout has {layout.total_bytes} bytes, model {config.payload_bytes}")
            layouts[step.config] = {"buckets": len(layout.buckets), "total_bytes": layout.total_bytes,
                                    "max_bucket_bytes": layout.max_bucket_bytes}
            if {"raw", "memcpy"} & set(config.variants):
                raw_buf = flat.view(torch.uint8) if flat is not None else \
                    torch.empty(layout.total_bytes, dtype=torch.uint8).random_(0, 256)
            if "memcpy" in config.variants:
                if raw_buf is None:
                    raise RuntimeError("the memcpy variant needs the raw buffer")
                copy_dst = torch.empty_like(raw_buf).fill_(0)
            current = step.config
        # A new version every time: change one tensor slightly (outside the timed region).
        tensors[names[index % len(names)]].add_(1.0)
        named = NamedTensors(tensors)
        gc.collect()
        barrier(group)
        record: dict[str, Any] = {"config": step.config, "variant": step.variant, "rep": step.rep}
        cpu0 = time.process_time()
        if step.variant in ("cached", "cached_overlap", "bypass"):
            version += 1
            bypass = step.variant == "bypass"
            publisher.overlap_snapshot = True if step.variant == "cached_overlap" else None  # None: the default
            t0 = time.perf_counter()
            transfer = publisher.publish(version, named, mode=mode_of(bypass))
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
            if len(res.receivers) != world - 1 or not all(a.ok for a in res.receivers):
                raise RuntimeError(f"version {version}: not every receiver acknowledged ok: {res.receivers}")
            if res.bytes_sent != config.payload_bytes:
                raise RuntimeError(f"version {version}: sent {res.bytes_sent} bytes, expected {config.payload_bytes}")
            record.update(seconds=seconds, held=held, version=version, stages=dict(res.seconds),
                          receiver_stages={str(a.rank): dict(a.seconds) for a in res.receivers})
        elif step.variant == "raw":
            t0 = time.perf_counter()
            group.wait(group.broadcast(raw_buf, src=0), "raw")
            seconds = time.perf_counter() - t0
            barrier(group)  # receivers enter after their own wait: all bytes have landed
            record.update(seconds=seconds, confirmed=time.perf_counter() - t0)
        elif step.variant == "per_tensor":
            t0 = time.perf_counter()
            for name in names:
                group.wait(group.broadcast(tensors[name], src=0), "per-tensor")
            seconds = time.perf_counter() - t0
            barrier(group)
            record.update(seconds=seconds, confirmed=time.perf_counter() - t0)
        elif step.variant == "memcpy":
            if copy_dst is None or raw_buf is None:
                raise RuntimeError("the memcpy variant runs without its buffers")
            t0 = time.perf_counter()
            copy_dst.copy_(raw_buf)
            record.update(seconds=time.perf_counter() - t0)
        elif step.variant in disk_bench.DISK_VARIANTS:
            path = f"{dirs[step.variant]}/model.safetensors"
            try:
                t0 = time.perf_counter()
                save_s = disk_bench.save(tensors, path, durable=step.variant == "disk_local")
                barrier(group)  # the file is complete: receivers load it now
                barrier(group)  # every receiver has loaded and copied
                seconds = time.perf_counter() - t0
            finally:
                disk_bench.remove(path)
            record.update(seconds=seconds, save=save_s)
        else:
            raise ValueError(step.variant)
        record["cpu"] = time.process_time() - cpu0
        records.append(record)
        held_text = f"  held {record['held']:.3f}s" if "held" in record else ""
        rep_text = "warm-up" if step.rep < 0 else f"rep {step.rep + 1}"
        results.put(("progress", 0,
                     f"  [{index + 1:3d}/{len(schedule)}] {time.perf_counter() - run_started:6.1f}s  "
                     f"{config.name:<18} {step.variant:<10} {rep_text:<7}  {record['seconds']:.3f}s{held_text}"))
    publisher.close()
    return {"records": records, "layouts": layouts}


def _receiver(group: Any, configs: list[ModelConfig], schedule: list[Step], timeout_s: float,
              dirs: dict[str, str]) -> dict:
    import torch

    from ckpt_engine.receive.collective import Receiver

    loads: list[int] = []
    receiver = Receiver(group, load=lambda payload: loads.append(payload.version))
    records: list[dict] = []
    current = -1
    raw_buf = None
    targets: dict = {}
    for step in schedule:
        config = configs[step.config]
        if step.config != current:
            raw_buf, targets = None, {}
            gc.collect()
            if "raw" in config.variants:
                raw_buf = torch.empty(config.payload_bytes, dtype=torch.uint8)
            if {"per_tensor", *disk_bench.DISK_VARIANTS} & set(config.variants):
                targets = {f"layer{i}.weight": torch.empty(config.rows, config.cols)
                           for i in range(config.num_tensors)}
            current = step.config
        gc.collect()
        barrier(group)
        record: dict[str, Any] = {"config": step.config, "variant": step.variant, "rep": step.rep}
        cpu0 = time.process_time()
        if step.variant in ("cached", "cached_overlap", "bypass"):
            res = receiver.receive(begin_timeout_s=timeout_s)
            if res is None or not res.ok or not res.loaded:
                raise RuntimeError(f"rank {group.rank}: {step.variant} receive failed: {res}")
            record.update(version=res.version, seconds=dict(res.seconds))
        elif step.variant == "raw":
            group.wait(group.broadcast(raw_buf, src=0), "raw")
            barrier(group)
        elif step.variant == "per_tensor":
            for t in targets.values():
                group.wait(group.broadcast(t, src=0), "per-tensor")
            barrier(group)
        elif step.variant in disk_bench.DISK_VARIANTS:
            barrier(group)  # the sender's file is complete
            record["load"] = disk_bench.load_into(f"{dirs[step.variant]}/model.safetensors", targets)
            barrier(group)
        record["cpu"] = time.process_time() - cpu0
        records.append(record)
    closed = receiver.receive(begin_timeout_s=timeout_s)
    if closed is not None:
        raise RuntimeError(f"rank {group.rank}: expected CLOSE at the end, got {closed}")
    return {"records": records, "loads": len(loads)}


def run_engine(world: int, configs: list[ModelConfig], repeats: int, warmup: int, bucket_size: int,
               timeout_s: float, progress: Progress, deadline_s: float = 1800) -> dict:
    """Run ``configs`` on ``world`` processes (rank 0 sends) and return the aggregated rows."""
    schedule = build_schedule(configs, repeats, warmup)
    needs_disk = any(v.startswith("disk") for c in configs for v in c.variants)
    dirs = disk_bench.make_dirs() if needs_disk else {}
    store = master_store(timeout_s)
    progress(f"  {world} processes (1 sender + {world - 1} receivers), {len(schedule)} operations")
    started = time.perf_counter()
    try:
        outs = run_processes(_child, [(world, store.port, configs, schedule, bucket_size, timeout_s, dirs)
                                      for _ in range(world)], deadline_s=deadline_s, progress=progress,
                             name=f"sync-w{world}")
    finally:
        disk_bench.remove_dirs(dirs)
        del store
    sender, *receivers = outs
    expected = sum(1 for s in schedule if s.variant in ("cached", "cached_overlap", "bypass"))
    for r, rx in enumerate(receivers, start=1):
        if rx["loads"] != expected:
            raise RuntimeError(f"receiver {r} loaded {rx['loads']} versions, expected {expected}")
    return {"world": world, "configs": [asdict(c) | {"payload_bytes": c.payload_bytes} for c in configs],
            "repeats": repeats, "warmup": warmup, "bucket_size": bucket_size,
            "wall_seconds": time.perf_counter() - started,
            "cores": usable_cores(), "rows": aggregate(configs, sender, receivers, usable_cores())}


def aggregate(configs: list[ModelConfig], sender: dict, receivers: list[dict], cores: int = 1) -> list[dict]:
    records = [r for r in sender["records"] if r["rep"] >= 0]
    by_cv: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        by_cv.setdefault((r["config"], r["variant"]), []).append(r)
    rx_by_cv: dict[tuple[int, str], list[dict]] = {}
    for rx in receivers:
        for r in rx["records"]:
            if r["rep"] >= 0:
                rx_by_cv.setdefault((r["config"], r["variant"]), []).append(r)
    rows = []
    for c, config in enumerate(configs):
        row: dict[str, Any] = {"config": c, "name": config.name, "num_tensors": config.num_tensors,
                               "tensor_shape": [config.rows, config.cols], "bytes": config.payload_bytes,
                               "layout": sender["layouts"][c], "variants": {}, "ratios": {}}
        for v in config.variants:
            recs = sorted(by_cv.get((c, v), []), key=lambda r: r["rep"])
            if not recs:
                continue
            entry: dict[str, Any] = {"seconds": stats(r["seconds"] for r in recs),
                                     "samples": [r["seconds"] for r in recs], "reps": [r["rep"] for r in recs]}
            entry["gbps"] = gbps(config.payload_bytes, entry["seconds"])
            rx_cpu: dict[int, float] = {}
            for r in rx_by_cv.get((c, v), []):
                rx_cpu[r["rep"]] = rx_cpu.get(r["rep"], 0.0) + r.get("cpu", 0.0)
            # every process's CPU seconds in the operation; ÷ cores: the shortest time the machine allows for it
            entry["cpu_samples"] = [r.get("cpu", 0.0) + rx_cpu.get(r["rep"], 0.0) for r in recs]
            entry["cpu"] = stats(entry["cpu_samples"])
            entry["cpu_bound_samples"] = [cpu / cores for cpu in entry["cpu_samples"]]
            entry["cpu_bound"] = stats(entry["cpu_bound_samples"])
            if "held" in recs[0]:
                entry["held"] = stats(r["held"] for r in recs)
                entry["held_samples"] = [r["held"] for r in recs]
            if "confirmed" in recs[0]:
                entry["confirmed"] = stats(r["confirmed"] for r in recs)
            if "save" in recs[0]:
                entry["save"] = stats(r["save"] for r in recs)
            if "stages" in recs[0]:
                for r in recs:  # time TransferResult.seconds does not attribute to a named stage
                    r["stages"]["other"] = r["stages"].get("total", 0.0) - sum(
                        val for k, val in r["stages"].items() if k not in ("total", "other"))
                keys = sorted({k for r in recs for k in r["stages"]})
                entry["sender_stages_median"] = {k: statistics.median(r["stages"].get(k, 0.0) for r in recs)
                                                 for k in keys}
            rx_records = rx_by_cv.get((c, v), [])
            rx_stages = [r["seconds"] for r in rx_records if isinstance(r.get("seconds"), dict)]
            if rx_stages:
                keys = sorted({k for s in rx_stages for k in s})
                entry["receiver_stages_median"] = {k: statistics.median(s.get(k, 0.0) for s in rx_stages)
                                                   for k in keys}
            loads = [r["load"] for r in rx_records if "load" in r]
            if loads:
                entry["receiver_load"] = stats(loads)
            row["variants"][v] = entry
        for key, num, den, nf, df, meaning in RATIOS:
            a, b = row["variants"].get(num), row["variants"].get(den)
            if a is None or b is None or (nf == "held" and ("held" not in a or "held" not in b)):
                continue
            common = sorted(set(a["reps"]) & set(b["reps"]))

            def pick(e: dict, f: str, common: list[int] = common) -> list[float]:
                values = e["samples"] if f == "seconds" else e[f"{f}_samples"]
                return [values[e["reps"].index(k)] for k in common]
            r = paired_ratio(pick(a, nf), pick(b, df))
            if r is not None:
                # value: ratio of the full medians (not only of the paired rounds)
                r["value"] = a[nf]["median"] / b[df]["median"]
                row["ratios"][key] = r | {"meaning": meaning}
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------
# Side-by-side section
# ----------------------------------------------------------------------------------------------------------


def plan(opts: dict) -> dict:
    quick = opts["quick"]
    size = int((64 if quick else 256) * MiB)
    full = (100, 2000, 20000)  # every variant
    extra = () if quick else (500, 5000)  # tensor-count curve points: fewer variants
    counts = sorted(set(full) | set(extra) | set(MOE_COUNTS))
    configs = [make_config(size, n, ALL_VARIANTS if n in full else MOE_VARIANTS if n in MOE_COUNTS
                           else CURVE_VARIANTS) for n in counts]
    return {"configs": configs, "repeats": opts["repeats"], "warmup": opts["warmup"]}


def tensor_slopes(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Seconds per added tensor at fixed bytes (least squares over the rows' medians), for every variant that ran
    at three or more tensor counts, and for each stage of the cached and bypass_cpu sends (sender and receiver):
    where the per-tensor cost goes."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        n = row["num_tensors"]
        for v, e in row["variants"].items():
            series.setdefault(v, []).append((n, e["seconds"]["median"]))
            for side in ("sender", "receiver"):
                for stage, value in e.get(f"{side}_stages_median", {}).items():
                    series.setdefault(f"{v} {side} {stage}", []).append((n, value))
    out: dict[str, dict[str, float]] = {}
    for key, points in series.items():
        if len(points) >= 3:
            out[key] = {"slope_s": _slope(points), "points": len(points)}
    return out


def _slope(points: list[tuple[int, float]]) -> float:
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


def run(opts: dict, progress: Progress) -> dict:
    p = plan(opts)
    for c in p["configs"]:
        progress(f"  config {c.name}: {c.num_tensors} × float32[{c.rows}, {c.cols}] = {c.payload_bytes:,} bytes, "
                 f"variants {', '.join(c.variants)}")
    result = run_engine(3, p["configs"], p["repeats"], p["warmup"], opts["bucket_size"], opts["timeout_s"], progress)
    result["slopes"] = tensor_slopes(result["rows"])
    return result


def headline_row(result: dict) -> dict | None:
    """The row every variant ran on with the fewest tensors (the side-by-side headline)."""
    rows = [r for r in result["rows"] if set(ALL_VARIANTS) <= set(r["variants"])]
    return min(rows, key=lambda r: r["num_tensors"]) if rows else None


def render(result: dict, machine: dict) -> list[str]:
    lines: list[str] = []
    add = lines.append
    world = result["world"]
    add(f"Setup: {world} spawned processes (1 sender, {world - 1} receivers) on one gloo sync group on 127.0.0.1, "
        f"`torch.set_num_threads(1)` in each; they share the machine's {machine['usable_cores']} cores. "
        f"Models: float32 tensors of shape [rows, 64] (no layout padding); bucket size "
        f"{result['bucket_size'] // MiB} MiB; `Publisher(..., keep_versions=1)`; receivers verify every tensor "
        "(xxh3-64) and call a no-op `load`. "
        f"{result['repeats']} measured rounds after {result['warmup']} warm-up round(s) per model; in every round "
        "all variants of the model run back to back, the order rotated each round, each after a barrier "
        "(8-byte allgather); one tensor changes before every operation, so every publish is a new version.")
    add("")
    add("Variants, all timed on the sender (rank 0):")
    add("")
    add("- **ckpt-engine e2e cached**: `publish(v, named)` → `transfer.result()` returns `ok` with every receiver "
        "acknowledged (received, verified every digest, `load` called). *Trainer held*: until `publish()` returns.")
    add("- **ckpt-engine e2e bypass_cpu**: the same with `mode=\"bypass_cpu\"`; *held* until `params_released` is set.")
    add("- **raw single broadcast**: one `group.broadcast` + `wait` of a uint8 buffer of the same bytes on the same "
        "group (the limit of the transport). **per-tensor loop**: one broadcast + wait per tensor into preallocated "
        "tensors. For both, the time stops when the sender's wait returns; *confirmed* adds a barrier the "
        "receivers enter after their own wait (all bytes landed).")
    add("- **memcpy**: one `copy_` of the same bytes in the sender process (one thread): the local-memory limit.")
    add("- **safetensors via local disk / via /dev/shm**: `save_file` of all tensors on the sender, then every "
        "receiver `load_file`s it and copies each tensor into its own tensors; from save start until the last "
        f"receiver has copied. Local disk = {machine.get('disk_tmp', '?')}: the sender `fsync`s the file and drops "
        "it from the page cache (`posix_fadvise(DONTNEED)`, that file only), so receivers read it from the "
        f"device. /dev/shm = {machine.get('disk_shm', '?')} (memory: the best case for a file handoff on one "
        "host). Files are deleted after every repetition.")
    add("")
    add("Times: median (min–max) over the measured rounds; GB/s = model bytes / time (1 GB = 1e9 B).")
    add("")
    add("| Model | Variant | Time s, median (min–max) | GB/s median (min–max) | Trainer held s | confirmed s |")
    add("|---|---|---:|---:|---:|---:|")
    for row in result["rows"]:
        model = f"{mib(row['bytes'])}, {row['num_tensors']:,} × {row['tensor_shape'][0]}×{row['tensor_shape'][1]}"
        for v in ALL_VARIANTS:
            e = row["variants"].get(v)
            if e is None:
                continue
            g = e["gbps"]
            held = fmt_s(e["held"]) if "held" in e else "—"
            conf = f"{e['confirmed']['median']:.3f}" if "confirmed" in e else "—"
            add(f"| {model} | {VARIANT_LABEL[v]} | {fmt_s(e['seconds'])} | {g['median']:.2f} "
                f"({g['min']:.2f}–{g['max']:.2f}) | {held} | {conf} |")
    add("")
    add("Ratios (ratio of medians; in brackets the min–max of the same ratio per round). *Throughput ratio* "
        "X ÷ Y = time(Y) / time(X); *speedup* = time(alternative) / time(ckpt-engine).")
    add("")
    add("| Model | cached ÷ raw (throughput) | bypass ÷ raw | cached ÷ memcpy | speedup vs per-tensor (cached) "
        "| vs per-tensor (bypass) | speedup vs safetensors local disk | vs safetensors /dev/shm "
        "| bypass ÷ cached time | cached held ÷ bypass held |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["rows"]:
        r = row["ratios"]
        add(f"| {row['name']} | {fmt_ratio(r.get('raw_over_cached'), 3)} | {fmt_ratio(r.get('raw_over_bypass'), 3)} "
            f"| {fmt_ratio(r.get('memcpy_over_cached'), 3)} | {fmt_ratio(r.get('per_tensor_over_cached'), 1, '×')} "
            f"| {fmt_ratio(r.get('per_tensor_over_bypass'), 1, '×')} "
            f"| {fmt_ratio(r.get('disk_local_over_cached'), 2, '×')} "
            f"| {fmt_ratio(r.get('disk_shm_over_cached'), 2, '×')} "
            f"| {fmt_ratio(r.get('bypass_over_cached'), 3)} | {fmt_ratio(r.get('held_cached_over_bypass'), 3)} |")
    add("")
    lines += render_overlap(result)
    disk_rows = [row for row in result["rows"] if "disk_local" in row["variants"]]
    if disk_rows:
        add("Safetensors round trip split (medians, s): the sender's `save_file` (local disk: + fsync + "
            "dropping the file's cached pages), and one receiver's `load_file` + copy (both receivers pooled; "
            "they read concurrently).")
        add("")
        add("| Model | local disk: save | local disk: load + copy | /dev/shm: save | /dev/shm: load + copy |")
        add("|---|---:|---:|---:|---:|")
        for row in disk_rows:
            cells = []
            for v in disk_bench.DISK_VARIANTS:
                e = row["variants"].get(v, {})
                cells += [f"{e['save']['median']:.3f}" if "save" in e else "—",
                          f"{e['receiver_load']['median']:.3f}" if "receiver_load" in e else "—"]
            add(f"| {row['name']} | " + " | ".join(cells) + " |")
        add("")
    add("Where ckpt-engine's time goes (medians, s). Sender stages from `TransferResult.seconds`: `fill` = copying "
        "tensors into send buckets, `digest` = xxh3 of every tensor, `broadcast` = waiting on bucket broadcasts, "
        "`control` = per-bucket header frames and the END trailer (on gloo a blocking header frame waits behind "
        "the previous bucket's data, so wire time lands there too), `ack` = acknowledgement allgather, "
        "`other` = total minus the named stages. Receiver stages from the acknowledgements (receivers pooled).")
    add("")
    keys = ["header", "fill", "digest", "broadcast", "control", "ack", "other", "total"]
    add("| Model | Mode | held | " + " | ".join(f"sender {k}" for k in keys)
        + " | recv | verify | load | receiver total |")
    add("|---|---|" + "---:|" * (1 + len(keys) + 4))
    for row in result["rows"]:
        for v in ("cached", "cached_overlap", "bypass"):
            e = row["variants"].get(v)
            if e is None:
                continue
            ss, rs = e.get("sender_stages_median", {}), e.get("receiver_stages_median", {})
            add(f"| {row['name']} | {v} | {e['held']['median']:.3f} | "
                + " | ".join(f"{ss.get(k, 0.0):.3f}" for k in keys) + " | "
                + " | ".join(f"{rs.get(k, 0.0):.3f}" for k in ("recv", "verify", "load", "total")) + " |")
    add("")
    lines += render_slopes(result)
    return lines


def render_overlap(result: dict) -> list[str]:
    """Cached with the send after the snapshot (the default where the snapshot is a host memcpy) vs overlapping
    it, time and trainer-held, and how close every variant runs to the time its CPU work alone needs on these
    cores (the processes share them)."""
    rows = [row for row in result["rows"] if "cached_overlap" in row["variants"]]
    if not rows:
        return []
    cores = result.get("cores", 1)
    lines = [(f"Cached mode with the send after the whole snapshot (the default for a CPU trainer) vs overlapping "
              f"it (`Publisher(overlap_snapshot=True)`: bucket k leaves once it is cached; the default for GPU/NPU "
              f"trainers, whose snapshot is a device→host copy), time to verified and trainer held; and the CPU "
              f"bound: every process's CPU seconds in the operation (`time.process_time()`, all threads, sender "
              f"and receivers summed) ÷ the {cores} usable cores, the shortest time the operation could take here "
              f"if nothing else ran. Medians, s; ratios as above."), "",
             ("| Model | cached (after snapshot) | cached, overlapped | after ÷ overlapped | held: after / overlapped "
              "| raw broadcast | per-tensor loop | CPU s: cached / raw / per-tensor | CPU bound: cached / raw "
              "| cached time ÷ its CPU bound | raw time ÷ its CPU bound |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        v, r = row["variants"], row["ratios"]
        lines.append(f"| {row['name']} | {_median(v.get('cached'))} | {_median(v.get('cached_overlap'))} "
                     f"| {fmt_ratio(r.get('cached_over_overlap'), 3)} "
                     f"| {_median(v.get('cached'), 'held')} / {_median(v.get('cached_overlap'), 'held')} "
                     f"| {_median(v.get('raw'))} "
                     f"| {_median(v.get('per_tensor'))} | {_median(v.get('cached'), 'cpu')} / "
                     f"{_median(v.get('raw'), 'cpu')} / {_median(v.get('per_tensor'), 'cpu')} "
                     f"| {_median(v.get('cached'), 'cpu_bound')} / {_median(v.get('raw'), 'cpu_bound')} "
                     f"| {_inverse(r.get('cpu_bound_over_cached'))} | {_inverse(r.get('cpu_bound_over_raw'))} |")
    lines.append("")
    return lines


def _median(entry: dict | None, field: str = "seconds") -> str:
    return f"{entry[field]['median']:.3f}" if entry and field in entry else "—"


def _inverse(ratio: dict | None) -> str:
    return f"{1 / ratio['value']:.2f}" if ratio else "—"


def render_slopes(result: dict) -> list[str]:
    slopes = result.get("slopes") or {}
    if not slopes:
        return []
    counts = ", ".join(f"{row['num_tensors']:,}" for row in result["rows"])
    lines = [f"Per-tensor cost: time per added tensor at fixed bytes, µs (least-squares slope of the medians over "
             f"the tensor counts {counts}). Whole operations first, then the stages of the ckpt-engine sends "
             "(sender, and receivers pooled) that grow with the tensor count by 0.05 µs or more.", "",
             "| What | µs per tensor | counts |", "|---|---:|---:|"]
    whole = [k for k in ("cached", "bypass", "raw", "per_tensor") if k in slopes]
    stages = sorted((k for k in slopes if k not in whole and k.split()[-1] != "total"
                     and abs(slopes[k]["slope_s"]) >= 0.05e-6), key=lambda k: -slopes[k]["slope_s"])
    for key in [*whole, *stages]:
        label = VARIANT_LABEL.get(key, key)
        lines.append(f"| {label} | {slopes[key]['slope_s'] * 1e6:.2f} | {slopes[key]['points']} |")
    lines.append("")
    return lines
