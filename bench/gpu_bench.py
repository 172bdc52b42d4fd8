"""GPU data paths (CUDA), each against the raw copy it is made of, measured side by side on one machine.

    ckpt-engine bench --only gpu [--quick] [--out PATH] [--json PATH]

Without CUDA the section measures nothing and says so. With it (spawned processes; cuda:0 unless said):

- ``snapshot``: ``VersionCache.snapshot`` of device tensors into pinned host memory (what cached mode holds the
  trainer for) vs one pinned ``copy_`` of the same bytes from a flat device buffer; the host-to-device copy
  is timed too. The faster of the two directions is the PCIe rate below. Goal: ≥ 0.8 of the pinned copy, also
  with 4,000 tensors (small tensors are packed on the device and cross PCIe span by span).
- ``fill``: bypass_cpu's fill of every bucket from the live device tensors into the device send slots vs one
  device ``copy_`` of the same bytes. Goal: ≥ 0.5 of the device copy, also with 4,000 tensors.

Every size runs a model of 100 tensors and one of 4,000 (quick: 256 MiB × 100, 64 MiB × 4,000; full: 1 GiB ×
100, 64 MiB × 4,000 and 256 MiB × 10,000).
- ``digest``: torch-block64 of every bucket on the device, one call per bucket as the sender makes them (the
  compiled form, the default on CUDA, and eager torch ops) vs the same device ``copy_`` and vs the PCIe rate:
  hashing must never bound a PCIe-fed pipeline. And on models of 500 large and of 20,000 small tensors (quick:
  256 MiB, full: 1 GiB) vs an int64 read-and-reduce of the same bytes (the read floor). Goal (issue 36): ≥ 1,000
  GB/s and ≥ 25 % of the read floor on both.
- ``ipc``: two processes on one GPU, a trainer publishing to a colocated receiver over CUDA IPC (received,
  verified, acknowledged), cached and bypass_cpu: time-to-verified and trainer-held, vs a device ``copy_``
  of the same bytes in the trainer process.
- ``nccl`` (2 GPUs or more): sender on cuda:0, receiver on cuda:1, cached and bypass_cpu vs one raw NCCL
  broadcast of the same bytes.

Variants of a group run round-robin interleaved (the order rotates every round), after warm-up rounds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from ckpt_engine.bench.common import (
    MiB,
    Progress,
    cuda_devices,
    fmt_s,
    gbps,
    master_store,
    mib,
    paired_ratio,
    rotated_rounds,
    run_processes,
    stats,
)
from ckpt_engine.config import EngineConfig
from ckpt_engine.plan.modes import mode_of

GOAL_COPY = 0.8  # a copy path's throughput ÷ its raw copy
GOAL_SNAPSHOT = 0.8  # cached snapshot ÷ one pinned copy of the same bytes, at 100 and at 4,000 tensors (issue 36)
GOAL_FILL = 0.5  # bypass_cpu fill ÷ one device copy of the same bytes, at 100 and at 4,000 tensors (issue 36)
GOAL_DIGEST_OVER_PCIE = 2.0
DEFAULT_BUCKET_MIB = int(EngineConfig.model_fields["bucket_size_mb"].default)
GOAL_DIGEST_GBPS = 1000.0  # the device digest, GB/s, on 500 large and on 20,000 small tensors (issue 36)
GOAL_DIGEST_OVER_READ = 0.25  # the device digest's rate ÷ an int64 read-and-reduce of the same bytes (issue 36)
DIGEST_VARIANTS = ("read", "d2d_copy", "digest", "digest_eager")
SEED_BYPASS_CLAIM = 0.76  # the seed's claim on Ascend: bypass_cpu cuts sync time by ~24 %

LOCAL_VARIANTS = ("snapshot", "snapshot_unstaged", "d2h_copy", "h2d_copy", "fill", "d2d_copy", "digest",
                  "digest_eager")
# (cached, bypass_cpu, raw, cached with the send after the whole snapshot)
PAIR_VARIANTS = {"ipc": ("ipc_cached", "ipc_bypass", "d2d_copy", "ipc_cached_serial"),
                 "nccl": ("nccl_cached", "nccl_bypass", "nccl_raw", "nccl_cached_serial")}
LABEL = {
    "snapshot": "cached snapshot: device → pinned cache (VersionCache.snapshot)",
    "snapshot_unstaged": "cached snapshot, small tensors not packed on the device first (staged=False)",
    "d2h_copy": "raw: one pinned copy_, device → host",
    "h2d_copy": "raw: one pinned copy_, host → device",
    "fill": "bypass_cpu fill: live tensors → device send slots",
    "d2d_copy": "raw: one device copy_ (D2D)",
    "digest": "torch-block64 of every bucket on the device (the default: compiled on CUDA)",
    "digest_eager": "torch-block64 with eager torch ops only (not compiled)",
    "read": "raw: int64 read-and-reduce of the same bytes (read floor)",
    "ipc_cached": "CUDA IPC to a colocated receiver, cached",
    "ipc_bypass": "CUDA IPC to a colocated receiver, bypass_cpu",
    "nccl_cached": "NCCL, cuda:0 → cuda:1, cached",
    "nccl_bypass": "NCCL, cuda:0 → cuda:1, bypass_cpu",
    "nccl_raw": "raw: one NCCL broadcast of the same bytes",
    "ipc_cached_serial": "CUDA IPC, cached, send after the whole snapshot",
    "nccl_cached_serial": "NCCL, cached, send after the whole snapshot",
}


def _rows(mib_total: int, count: int) -> int:
    return max(1, mib_total * MiB // 4 // count // 64)


def _model(mib_total: int, count: int, device: Any) -> dict:
    """float32 tensors of [rows, 64] (256-byte rows: no layout padding), random, on ``device``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(7)
    rows = _rows(mib_total, count)
    return {f"layer{i}.weight": torch.randn(rows, 64, generator=gen, device=device) for i in range(count)}


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


# ---- one process: copies and digests ---------------------------------------------------------------------


def _local_child(rank: int, results: Any, args: dict) -> dict:
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.hashing import device_digest_kernel

    torch.cuda.set_device(0)
    device = detect_device("cuda", index=0)
    out: dict[str, Any] = {"devices": _devices(), "kernel": device_digest_kernel(device.torch_device), "configs": []}
    for mib_total, count in args["local"]:
        results.put(("progress", 0, f"  local: {mib_total} MiB in {count:,} tensors"))
        out["configs"].append(_local_config(mib_total, count, device, args, out["kernel"] == "compiled"))
    out["digest"] = []
    for mib_total, count, bucket_mib in args.get("digest", []):
        results.put(("progress", 0, f"  digest: {mib_total} MiB in {count:,} tensors, {bucket_mib} MiB buckets"))
        out["digest"].append(_digest_config(mib_total, count, bucket_mib, device, args, out["kernel"] == "compiled"))
    return out


def _devices() -> dict:
    import torch

    info = {"count": torch.cuda.device_count(), "names": [torch.cuda.get_device_name(i)
                                                           for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001 - no NCCL in this build
        info["nccl"] = f"unavailable ({exc})"
    return info


def _local_config(mib_total: int, count: int, device: Any, args: dict, compiled: bool) -> dict:
    import torch

    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import fill_bucket, specs_of
    from ckpt_engine.send.cache import VersionCache

    tensors = _model(mib_total, count, device.torch_device)
    layout = plan_layout(specs_of(tensors), args["bucket_size"])
    nbytes = layout.total_bytes
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device).random_(0, 256)
    flat_dst = torch.empty_like(flat)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    caches = {True: VersionCache(device, keep_versions=1), False: VersionCache(device, keep_versions=1, staged=False)}
    slots = [torch.empty(layout.max_bucket_bytes, dtype=torch.uint8, device=device.torch_device) for _ in range(2)]
    version = [0]

    def snapshot(staged: bool = True) -> None:
        version[0] += 1
        caches[staged].snapshot(version[0], layout, tensors, check=False)

    def fill() -> None:
        for bucket in layout.buckets:
            fill_bucket(slots[bucket.index % 2], bucket.slots, tensors, bucket.nbytes)

    digest = _digester(layout, flat)
    ops: dict[str, Callable[[], Any]] = {
        "snapshot": snapshot, "snapshot_unstaged": lambda: snapshot(False),
        "d2h_copy": lambda: pinned.copy_(flat, non_blocking=True),
        "h2d_copy": lambda: flat_dst.copy_(pinned, non_blocking=True), "fill": fill,
        "d2d_copy": lambda: flat_dst.copy_(flat), "digest": digest(False), "digest_eager": digest(True)}
    variants = tuple(v for v in LOCAL_VARIANTS if v != "digest_eager" or compiled)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for variant, rnd in rotated_rounds(variants, args["repeats"], args["warmup"]):
        seconds = _timed(ops[variant])
        if rnd >= 0:
            samples[variant].append(seconds)
    return {"name": f"{mib_total} MiB × {count:,}", "bytes": nbytes, "tensors": count,
            "buckets": len(layout.buckets), "samples": samples}


def _digester(layout: Any, flat: Any) -> Callable[[bool], Callable[[], None]]:
    """digest(eager)(): torch-block64 of every bucket of ``flat`` (one call per bucket, as the sender makes
    them), the default implementation or eager torch ops; one host sync at the end."""
    import os

    import torch

    from ckpt_engine.plan.hashing import KERNEL_ENV, block64_bucket_digests

    def digest(eager: bool) -> Callable[[], None]:
        def run() -> None:
            previous = os.environ.pop(KERNEL_ENV, None)
            if eager:
                os.environ[KERNEL_ENV] = "eager"
            try:
                parts = [block64_bucket_digests(b, flat[b.flat_offset : b.flat_offset + b.nbytes], layout.digest)
                         for b in layout.buckets]
                torch.cat(parts).cpu()
            finally:
                os.environ.pop(KERNEL_ENV, None)
                if previous is not None:
                    os.environ[KERNEL_ENV] = previous
        return run

    return digest


def _digest_config(mib_total: int, count: int, bucket_mib: int, device: Any, args: dict, compiled: bool) -> dict:
    """The digest alone on a model of ``count`` float32 tensors in buckets of ``bucket_mib`` (only its layout: the
    bytes are random) vs the read floor and a device copy of the same bytes."""
    import torch

    from ckpt_engine.plan.layout import TensorSpec, plan_layout

    rows = _rows(mib_total, count)
    layout = plan_layout([TensorSpec(f"layer{i}.weight", "float32", (rows, 64)) for i in range(count)],
                         bucket_mib << 20)
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device.torch_device).random_(0, 256)
    flat_dst = torch.empty_like(flat)
    digest = _digester(layout, flat)
    ops: dict[str, Callable[[], Any]] = {"read": lambda: flat.view(torch.int64).sum(),
                                         "d2d_copy": lambda: flat_dst.copy_(flat), "digest": digest(False),
                                         "digest_eager": digest(True)}
    variants = tuple(v for v in DIGEST_VARIANTS if v != "digest_eager" or compiled)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for variant, rnd in rotated_rounds(variants, args["repeats"], args["warmup"]):
        seconds = _timed(ops[variant])
        if rnd >= 0:
            samples[variant].append(seconds)
    return {"name": f"{mib_total} MiB × {count:,} in {bucket_mib} MiB buckets", "bytes": layout.total_bytes,
            "tensors": count, "buckets": len(layout.buckets), "bucket_mib": bucket_mib, "samples": samples}


# ---- two processes: CUDA IPC on one GPU, NCCL on two ---------------------------------------------------


def _pair_child(rank: int, results: Any, kind: str, port: int, hub: str, args: dict) -> dict | None:
    import torch

    index = rank if kind == "nccl" else 0
    torch.cuda.set_device(index)
    schedule = rotated_rounds(PAIR_VARIANTS[kind], args["repeats"], args["warmup"])
    if rank == 0:
        return _pair_sender(kind, port, hub, args, schedule, results)
    _pair_receiver(kind, port, hub, args, schedule)
    return None


def _sync_group(port: int, rank: int, device: Any, timeout_s: float) -> Any:
    from ckpt_engine.transport.group import SyncGroup, open_store

    return SyncGroup(open_store("127.0.0.1", port, timeout_s=timeout_s), name="gpu-bench", generation=0,
                     rank=rank, world_size=2, device=device, timeout_s=timeout_s)


def _pair_sender(kind: str, port: int, hub: str, args: dict, schedule: list, results: Any) -> dict:
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Publisher

    device = detect_device("cuda", index=0)
    tensors = _model(args["pair_mib"], args["pair_tensors"], device.torch_device)
    names = list(tensors)
    if kind == "ipc":
        publisher = Publisher(device=device, bucket_size=args["bucket_size"], ipc_hub_name=hub, keep_versions=1,
                              timeout_s=args["timeout_s"])
        publisher.attach(None, ipc_peers={"bench": 1})
        group = None
    else:
        group = _sync_group(port, 0, device, args["timeout_s"])
        publisher = Publisher(group, bucket_size=args["bucket_size"], keep_versions=1)
    nbytes = publisher.layout_for(NamedTensors(tensors)).total_bytes
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device).random_(0, 256)
    raw_dst = torch.empty_like(raw)
    records = []
    for i, (variant, rnd) in enumerate(schedule):
        tensors[names[i % len(names)]].add_(1.0)  # a new version every time (not timed)
        _sync()
        t0 = time.perf_counter()
        held = None
        if variant == "d2d_copy":
            raw_dst.copy_(raw)
            _sync()
        elif variant == "nccl_raw":
            group.wait(group.broadcast(raw), "raw broadcast")  # type: ignore[union-attr]
        else:
            publisher.overlap_snapshot = False if variant.endswith("_serial") else None  # None: the default
            transfer = publisher.publish(i + 1, NamedTensors(tensors), mode=mode_of(variant.endswith("bypass")))
            transfer.params_released.wait()
            held = time.perf_counter() - t0
            result = transfer.result(600)
            if not result.ok or not result.receivers or not all(a.ok for a in result.receivers):
                raise RuntimeError(f"{variant}: {result.reason} {result.receivers}")
        seconds = time.perf_counter() - t0
        records.append({"variant": variant, "round": rnd, "seconds": seconds, "held": held})
        results.put(("progress", 0, f"  {kind}: {variant:<12} {'warm-up' if rnd < 0 else f'round {rnd + 1}'} "
                                    f"{seconds:.4f}s"))
    publisher.close()
    return {"bytes": nbytes, "records": records}


def _pair_receiver(kind: str, port: int, hub: str, args: dict, schedule: list) -> None:
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.collective import Receiver
    from ckpt_engine.receive.colocated import IpcReceiver

    device = detect_device("cuda", index=torch.cuda.current_device())
    if kind == "ipc":
        receiver: Any = IpcReceiver(hub, "bench", 1, lambda payload: None, device=device, timeout_s=args["timeout_s"])
    else:
        group = _sync_group(port, 1, device, args["timeout_s"])
        receiver = Receiver(group, lambda payload: None)
    raw = None
    for variant, _ in schedule:
        if variant == "d2d_copy":
            continue
        if variant == "nccl_raw":
            if raw is None:
                raw = torch.empty(_pair_bytes(args), dtype=torch.uint8, device=device.torch_device)
            group.wait(group.broadcast(raw), "raw broadcast")
            continue
        result = receiver.receive(600)
        if result is None or not result.ok:
            raise RuntimeError(f"{variant}: {result}")
    if kind == "ipc":
        receiver.close()
    elif receiver.receive(args["timeout_s"]) is not None:  # the sender's close of the group
        raise RuntimeError("expected the sender to close the sync group")


def _pair_bytes(args: dict) -> int:
    from ckpt_engine.plan.layout import TensorSpec, plan_layout

    rows, count = _rows(args["pair_mib"], args["pair_tensors"]), args["pair_tensors"]
    specs = [TensorSpec(f"layer{i}.weight", "float32", (rows, 64)) for i in range(count)]
    return plan_layout(specs, args["bucket_size"]).total_bytes


# ---- the section -------------------------------------------------------------------------------------------


def run(opts: dict, progress: Progress) -> dict:
    gpus = cuda_devices()
    if gpus < 1:
        return {"skipped": "no CUDA device in this process (torch.cuda.is_available() is False): nothing measured"}
    quick = opts["quick"]
    args = {"local": [(256, 100), (64, 4000)] if quick else [(1024, 100), (64, 4000), (256, 10000)],
            # at the deployment's default bucket size, and at the suite's (smaller: each call's fixed cost shows)
            "digest": [(1024, 500, DEFAULT_BUCKET_MIB), (1024, 20000, DEFAULT_BUCKET_MIB),
                       (256, 500, opts["bucket_size"] >> 20)],
            "pair_mib": 256 if quick else 1024, "pair_tensors": 100, "bucket_size": opts["bucket_size"],
            "repeats": opts["repeats"], "warmup": opts["warmup"], "timeout_s": opts["timeout_s"]}
    started = time.perf_counter()
    (local,) = run_processes(_local_child, [(args,)], deadline_s=300, progress=progress, name="gpu-local")
    out: dict[str, Any] = {"args": args, "devices": local["devices"], "kernel": local["kernel"],
                           "local": [_local_summary(c) for c in local["configs"]],
                           "digest": [_digest_summary(c) for c in local.get("digest", [])]}
    out["ipc"] = _pair("ipc", args, progress)
    out["nccl"] = _pair("nccl", args, progress) if gpus >= 2 else {"skipped": f"needs 2 GPUs, found {gpus}"}
    out["wall_seconds"] = time.perf_counter() - started
    return out


def _pair(kind: str, args: dict, progress: Progress) -> dict:
    progress(f"  {kind}: {args['pair_mib']} MiB in {args['pair_tensors']} tensors")
    store = master_store(args["timeout_s"])
    hub = f"ckpt-gpu-bench-{uuid.uuid4().hex[:8]}"
    sender, _ = run_processes(_pair_child, [(kind, store.port, hub, args)] * 2, deadline_s=300, progress=progress,
                              name=f"gpu-{kind}")
    del store
    return _pair_summary(kind, sender)


def _local_summary(config: dict) -> dict:
    s = config["samples"]
    entry = dict(config)
    entry["variants"] = {v: {"seconds": stats(x), "gbps": gbps(config["bytes"], stats(x))} for v, x in s.items() if x}
    med = {v: e["seconds"]["median"] for v, e in entry["variants"].items()}
    pcie = max(config["bytes"] / med["d2h_copy"], config["bytes"] / med["h2d_copy"]) / 1e9
    entry["pcie_gbps"] = pcie
    entry["ratios"] = {
        "snapshot_vs_d2h": paired_ratio(s["d2h_copy"], s["snapshot"]),
        "snapshot_unstaged_vs_d2h": paired_ratio(s["d2h_copy"], s["snapshot_unstaged"]),
        "fill_vs_d2d": paired_ratio(s["d2d_copy"], s["fill"]),
        "digest_vs_d2d": paired_ratio(s["d2d_copy"], s["digest"]),
    }
    entry["digest_over_pcie"] = entry["variants"]["digest"]["gbps"]["median"] / pcie
    if "digest_eager" in entry["variants"]:
        entry["digest_eager_over_pcie"] = entry["variants"]["digest_eager"]["gbps"]["median"] / pcie
    return entry


def _digest_summary(config: dict) -> dict:
    s = config["samples"]
    entry = dict(config)
    entry["variants"] = {v: {"seconds": stats(x), "gbps": gbps(config["bytes"], stats(x))} for v, x in s.items() if x}
    entry["ratios"] = {"digest_vs_read": paired_ratio(s["read"], s["digest"]),
                       "digest_vs_d2d": paired_ratio(s["d2d_copy"], s["digest"])}
    if "digest_eager" in s:
        entry["ratios"]["digest_eager_vs_read"] = paired_ratio(s["read"], s["digest_eager"])
    return entry


def _pair_summary(kind: str, sender: dict) -> dict:
    records = [r for r in sender["records"] if r["round"] >= 0]
    by = {v: [r for r in records if r["variant"] == v] for v in PAIR_VARIANTS[kind]}
    variants = {}
    for v, recs in by.items():
        entry: dict[str, Any] = {"seconds": stats(r["seconds"] for r in recs),
                                 "samples": [r["seconds"] for r in recs]}
        entry["gbps"] = gbps(sender["bytes"], entry["seconds"])
        if recs and recs[0]["held"] is not None:
            entry["held"] = stats(r["held"] for r in recs)
        variants[v] = entry
    cached, bypass, raw, serial = PAIR_VARIANTS[kind]
    seconds = {v: [r["seconds"] for r in recs] for v, recs in by.items()}
    held = {v: [r["held"] for r in recs] for v, recs in by.items() if v != raw}
    return {"bytes": sender["bytes"], "variants": variants, "ratios": {
        "raw_over_cached": paired_ratio(seconds[raw], seconds[cached]),
        "raw_over_bypass": paired_ratio(seconds[raw], seconds[bypass]),
        "bypass_over_cached": paired_ratio(seconds[bypass], seconds[cached]),
        "serial_over_cached": paired_ratio(seconds[serial], seconds[cached]),
        "held_cached_over_serial": paired_ratio(held[cached], held[serial]),
        "held_cached_over_bypass": paired_ratio(held[cached], held[bypass])}}


# ---- targets and report ----------------------------------------------------------------------------------


def target_measurements(result: dict) -> dict[str, list[tuple[str, float, str]]]:
    """Per target key: (where, value, per-round range) for the suite's target table."""
    if "skipped" in result:
        return {}

    def rng(r: dict) -> str:
        return f"[{r['paired_min']:.3f}–{r['paired_max']:.3f}]"

    out: dict[str, list[tuple[str, float, str]]] = {"snapshot": [], "fill": [], "digest": [], "ipc": [],
                                                    "digest_gbps": [], "digest_read": []}
    for c in result["local"]:
        snapshot, fill = c["ratios"]["snapshot_vs_d2h"], c["ratios"]["fill_vs_d2d"]
        out["snapshot"].append((c["name"], snapshot["value"], rng(snapshot)))
        out["fill"].append((c["name"], fill["value"], rng(fill)))
        out["digest"].append((f"{c['name']} ({result['kernel']})", c["digest_over_pcie"],
                              f"{c['variants']['digest']['gbps']['median']:.1f} vs {c['pcie_gbps']:.1f} GB/s"))
    for c in result.get("digest", []):
        if c.get("bucket_mib", DEFAULT_BUCKET_MIB) != DEFAULT_BUCKET_MIB:  # (the goals are at the default size)
            continue
        where, read, rate = f"{c['name']} ({result['kernel']})", c["ratios"]["digest_vs_read"], c["variants"]["digest"]
        spread = f"[{rate['gbps']['min']:.0f}–{rate['gbps']['max']:.0f}]"
        out["digest_gbps"].append((where, rate["gbps"]["median"], spread))
        out["digest_read"].append((where, read["value"], rng(read)))
    ipc, size = result["ipc"]["ratios"], mib(result["ipc"]["bytes"])
    out["ipc"] = [(f"{size} {mode}", ipc[key]["value"], rng(ipc[key]))
                  for mode, key in (("bypass_cpu", "raw_over_bypass"), ("cached", "raw_over_cached"))]
    return out


def render(result: dict, machine: dict) -> list[str]:
    if "skipped" in result:
        return [f"Not measured here: {result['skipped']}. Run `scripts/gpu-check.sh OUTDIR` on a CUDA machine "
                "(see *GPU check* below).", ""]
    d, a = result["devices"], result["args"]
    lines = [f"GPUs: {d['count']} × {', '.join(sorted(set(d['names'])))}; torch {d['torch']}, CUDA {d['cuda']}, "
             f"NCCL {d['nccl']}. Digest kernel: **{result['kernel']}**. Bucket size {a['bucket_size'] / MiB:g} MiB; "
             f"{a['repeats']} measured rounds after {a['warmup']} warm-up round(s), variants interleaved; "
             "median (min–max); every time ends with the device synchronized.", ""]
    for c in result["local"]:
        lines += [f"**One process, {c['name']} float32 tensors** ({mib(c['bytes'])}, {c['buckets']} buckets)", "",
                  "| Variant | Time s, median (min–max) | GB/s |", "|---|---:|---:|"]
        for v, e in c["variants"].items():
            lines.append(f"| {LABEL[v]} | {fmt_s(e['seconds'], 4)} | {e['gbps']['median']:.1f} |")
        r = c["ratios"]
        lines += ["", f"Snapshot ÷ pinned copy: **{r['snapshot_vs_d2h']['value']:.2f}** (goal ≥ {GOAL_SNAPSHOT:g}; "
                  f"without packing small tensors on the device: {r['snapshot_unstaged_vs_d2h']['value']:.2f}); "
                  f"fill ÷ device copy: **{r['fill_vs_d2d']['value']:.2f}** (goal ≥ {GOAL_FILL:g}); "
                  f"digest ÷ device copy: {r['digest_vs_d2d']['value']:.2f}; "
                  f"digest throughput ÷ PCIe rate ({c['pcie_gbps']:.1f} GB/s): **{c['digest_over_pcie']:.2f}**"
                  + (f" (torch ops only: {c['digest_eager_over_pcie']:.2f})" if "digest_eager_over_pcie" in c else "")
                  + ".", ""]
    for c in result.get("digest", []):
        lines += [f"**Device digest, {c['name']} float32 tensors** ({mib(c['bytes'])}, {c['buckets']} buckets)", "",
                  "| Variant | Time s, median (min–max) | GB/s |", "|---|---:|---:|"]
        for v, e in c["variants"].items():
            lines.append(f"| {LABEL[v]} | {fmt_s(e['seconds'], 5)} | {e['gbps']['median']:.0f} |")
        r = c["ratios"]
        lines += ["", f"Digest: **{c['variants']['digest']['gbps']['median']:.0f} GB/s** (goal ≥ "
                  f"{GOAL_DIGEST_GBPS:,.0f}); ÷ read floor: **{r['digest_vs_read']['value']:.2f}** (goal ≥ "
                  f"{GOAL_DIGEST_OVER_READ:g})" + (f"; eager torch ops ÷ read floor: "
                                                   f"{r['digest_eager_vs_read']['value']:.2f}"
                                                   if "digest_eager_vs_read" in r else "") + ".", ""]
    for kind, title in (("ipc", "Two processes on cuda:0: trainer → colocated receiver over CUDA IPC"),
                        ("nccl", "NCCL sync group: sender on cuda:0 → receiver on cuda:1")):
        p = result[kind]
        if "skipped" in p:
            lines += [f"**{title}**: not measured ({p['skipped']}).", ""]
            continue
        lines += [f"**{title}** ({mib(p['bytes'])} in {a['pair_tensors']} tensors; ckpt-engine variants end when the "
                  "receiver has verified every tensor and acknowledged)", "",
                  "| Variant | Time s, median (min–max) | GB/s | Trainer held s |", "|---|---:|---:|---:|"]
        for v, e in p["variants"].items():
            held = fmt_s(e["held"], 4) if "held" in e else "—"
            lines.append(f"| {LABEL[v]} | {fmt_s(e['seconds'], 4)} | {e['gbps']['median']:.1f} | {held} |")
        r = p["ratios"]
        lines += ["", f"bypass_cpu ÷ cached time-to-verified: **{r['bypass_over_cached']['value']:.2f}** (the seed "
                  f"claims ~{SEED_BYPASS_CLAIM:.2f} on Ascend); cached ÷ bypass_cpu trainer-held: "
                  f"{r['held_cached_over_bypass']['value']:.2f}; raw ÷ cached: {r['raw_over_cached']['value']:.2f}; "
                  f"raw ÷ bypass_cpu: {r['raw_over_bypass']['value']:.2f}; cached, send after the whole snapshot ÷ "
                  f"overlapped: **{r['serial_over_cached']['value']:.2f}** (trainer held, overlapped ÷ after the "
                  f"snapshot: {r['held_cached_over_serial']['value']:.2f}).", ""]
    return lines
