"""Same-host path: a colocated receiver mapping the sender's shared memory (``Publisher(...,
ipc_hub_name=...)`` + ``IpcReceiver``), against memcpy of the same bytes and against the gloo collective on
loopback, measured side by side in one run.

Two processes: the sender (two publishers: one with an IPC hub and no group, one on a 2-rank gloo group) and
one receiver process holding both a colocated receiver (in a thread) and a collective receiver. Variants run
round-robin interleaved; memcpy (one ``copy_`` of the same bytes, one thread) is taken in the sender right
after every operation. Standalone: ``ckpt-engine bench --only ipc --out PATH`` runs this section alone (its report goes
to bench/results/ unless ``--out`` is given).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from ckpt_engine.bench.common import MiB, Progress, fmt_s, gbps, master_store, run_processes, stats, sync_group
from ckpt_engine.plan.modes import mode_of

VARIANTS = ("ipc_cached", "ipc_bypass", "gloo_cached", "gloo_raw")
LABEL = {
    "ipc_cached": "same-host shared memory, cached",
    "ipc_bypass": "same-host shared memory, bypass_cpu",
    "gloo_cached": "gloo collective on loopback, cached",
    "gloo_raw": "raw gloo broadcast of one buffer",
    "memcpy": "memcpy of the same bytes (1 thread)",
}


def _schedule(repeats: int, warmup: int) -> list[tuple[str, int]]:
    order = []
    for r in range(warmup + repeats):  # the first ``warmup`` rounds are not reported
        rotated = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        order += [(v, r - warmup) for v in rotated]
    return order


def _model(args: dict):
    import torch

    per = args["mib"] * MiB // 4 // args["tensors"]
    gen = torch.Generator().manual_seed(5)
    return {f"t{i}": torch.randn(per, generator=gen) for i in range(args["tensors"])}


def _child(rank: int, results: Any, port: int, hub: str, args: dict) -> dict | None:
    import torch

    torch.set_num_threads(1)
    if rank == 0:
        return _sender(port, hub, args, results)
    _receivers(port, hub, args)
    return None


def _sender(port: int, hub: str, args: dict, results: Any) -> dict:
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Publisher

    device = detect_device("cpu")
    group = sync_group(0, 2, port, args["timeout_s"], "ipc-bench")
    tensors = _model(args)
    named = NamedTensors(tensors)
    bucket = int(args["bucket_mib"] * MiB)
    ipc = Publisher(device=device, bucket_size=bucket, ipc_hub_name=hub, keep_versions=1, timeout_s=args["timeout_s"])
    ipc.attach(None, ipc_peers={"bench": 1})
    gloo = Publisher(group, bucket_size=bucket, keep_versions=1)
    nbytes = gloo.layout_for(named).total_bytes
    raw = torch.empty(nbytes, dtype=torch.uint8)
    src, dst = torch.empty_like(raw).random_(0, 255), torch.empty_like(raw).fill_(0)
    records: list[dict] = []
    started = time.perf_counter()
    for version, (variant, rep) in enumerate(_schedule(args["repeats"], args["warmup"]), start=1):
        tensors["t0"].add_(1)
        t0 = time.perf_counter()
        if variant == "gloo_raw":
            group.wait(group.broadcast(raw), "raw")
            held = None
        else:
            publisher = ipc if variant.startswith("ipc") else gloo
            transfer = publisher.publish(version, named, mode=mode_of(variant.endswith("bypass")))
            transfer.params_released.wait()
            held = time.perf_counter() - t0
            result = transfer.result(300)
            if not result.ok or not result.receivers or not all(a.ok for a in result.receivers):
                raise RuntimeError(f"{variant}: {result.reason} {result.receivers}")
        elapsed = time.perf_counter() - t0
        t1 = time.perf_counter()
        dst.copy_(src)
        copy_s = time.perf_counter() - t1
        records.append({"variant": variant, "rep": rep, "seconds": elapsed, "held": held, "memcpy": copy_s})
        results.put(("progress", 0, f"  {time.perf_counter() - started:6.1f}s  {variant:<12} "
                                    f"{'warm-up' if rep < 0 else f'rep {rep + 1}'}  {elapsed:.3f}s"))
    gloo.close()
    ipc.close()
    return {"records": records, "bytes": nbytes}


def _receivers(port: int, hub: str, args: dict) -> None:
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.collective import Receiver
    from ckpt_engine.receive.colocated import IpcReceiver

    device = detect_device("cpu")
    group = sync_group(1, 2, port, args["timeout_s"], "ipc-bench")
    remote = Receiver(group, lambda payload: None)
    colocated = IpcReceiver(hub, "bench", 1, lambda payload: None, device=device, timeout_s=args["timeout_s"])
    schedule = _schedule(args["repeats"], args["warmup"])
    ipc_items = sum(1 for v, _ in schedule if v.startswith("ipc"))
    failures: list[str] = []

    def colocated_loop() -> None:  # the colocated receiver runs beside the collective one, as in its own process
        for _ in range(ipc_items):
            res = colocated.receive(300)
            if res is None or not res.ok:
                failures.append(str(res))

    worker = threading.Thread(target=colocated_loop, daemon=True)
    worker.start()
    raw = None
    for variant, _ in schedule:
        if variant == "gloo_raw":
            if raw is None:
                raw = torch.empty(_layout_bytes(args), dtype=torch.uint8)
            group.wait(group.broadcast(raw), "raw")
        elif variant.startswith("gloo"):
            res = remote.receive(300)
            if res is None or not res.ok:
                failures.append(str(res))
    worker.join(300)
    colocated.close()
    if failures:
        raise RuntimeError(f"receive failures: {failures}")


def _layout_bytes(args: dict) -> int:
    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import specs_of

    return plan_layout(specs_of(_model(args)), int(args["bucket_mib"] * MiB)).total_bytes


def run(opts: dict, progress: Progress) -> dict:
    args = {"mib": 64 if opts["quick"] else 256, "tensors": 100, "bucket_mib": 16 if opts["quick"] else 32,
            "repeats": opts["repeats"], "warmup": opts["warmup"], "timeout_s": opts["timeout_s"]}
    store = master_store(args["timeout_s"])
    hub = f"ckpt-ipc-bench-{uuid.uuid4().hex[:8]}"
    progress(f"  {args['mib']} MiB in {args['tensors']} tensors, buckets of {args['bucket_mib']} MiB, "
             f"{args['repeats']} rounds")
    started = time.perf_counter()
    sender, _ = run_processes(_child, [(store.port, hub, args)] * 2, deadline_s=900, progress=progress,
                              name="ipc")
    del store
    records = [r for r in sender["records"] if r["rep"] >= 0]
    nbytes = sender["bytes"]
    out: dict[str, Any] = {"args": args, "bytes": nbytes, "wall_seconds": time.perf_counter() - started,
                           "variants": {}, "ratios": {}}
    for v in VARIANTS:
        recs = sorted((r for r in records if r["variant"] == v), key=lambda r: r["rep"])
        entry = {"seconds": stats(r["seconds"] for r in recs), "samples": [r["seconds"] for r in recs]}
        if recs and recs[0]["held"] is not None:
            entry["held"] = stats(r["held"] for r in recs)
        out["variants"][v] = entry
    memcpy = [r["memcpy"] for r in records]
    out["variants"]["memcpy"] = {"seconds": stats(memcpy), "samples": memcpy}
    for e in out["variants"].values():
        s = e["seconds"]
        e["gbps"] = gbps(nbytes, s)
    med = {k: e["seconds"]["median"] for k, e in out["variants"].items()}

    def per_round(num: str, den: str) -> list[float]:
        a = {r["rep"]: r for r in records if r["variant"] == num}
        b = {r["rep"]: r for r in records if r["variant"] == den}
        return [a[k]["seconds"] / b[k]["seconds"] for k in sorted(set(a) & set(b))]

    def memcpy_round(variant: str) -> list[float]:  # memcpy taken right after the same operation
        return [r["memcpy"] / r["seconds"] for r in records if r["variant"] == variant]

    for key, num, den, rounds in (
            ("ipc_cached_vs_memcpy", "memcpy", "ipc_cached", memcpy_round("ipc_cached")),
            ("ipc_bypass_vs_memcpy", "memcpy", "ipc_bypass", memcpy_round("ipc_bypass")),
            ("ipc_cached_speedup_vs_gloo_cached", "gloo_cached", "ipc_cached", per_round("gloo_cached", "ipc_cached")),
            ("ipc_cached_speedup_vs_gloo_raw", "gloo_raw", "ipc_cached", per_round("gloo_raw", "ipc_cached"))):
        out["ratios"][key] = {"value": med[num] / med[den], "paired_min": min(rounds), "paired_max": max(rounds)}
    return out


def render(result: dict, machine: dict) -> list[str]:
    a = result["args"]
    lines = [
        f"Model: {a['mib']} MiB in {a['tensors']} float32 tensors ({result['bytes'] / MiB:.1f} MiB on the wire), "
        f"buckets of {a['bucket_mib']} MiB. Two processes: the sender, and a receiver process holding a colocated "
        "receiver (`IpcReceiver`, in a thread) and a collective receiver (`Receiver` on a 2-rank gloo group). Every "
        "ckpt-engine variant ends when the receiver has verified (xxh3 of every tensor), called a no-op `load` and "
        "acknowledged the whole version. memcpy = one `copy_` of the same bytes in the sender right after each "
        f"operation. {a['repeats']} rounds after {a['warmup']} warm-up round(s), variants interleaved; "
        "median (min–max).",
        "",
        "| Variant | Time s, median (min–max) | GB/s | Trainer held s |",
        "|---|---:|---:|---:|",
    ]
    for key in (*VARIANTS, "memcpy"):
        e = result["variants"][key]
        held = fmt_s(e["held"]) if "held" in e else "—"
        lines.append(f"| {LABEL[key]} | {fmt_s(e['seconds'])} | {e['gbps']['median']:.2f} | {held} |")
    r = result["ratios"]
    lines += ["", "| Ratio (of medians; per-round range) | Value |", "|---|---:|"]
    names = {"ipc_cached_vs_memcpy": "shared-memory cached throughput ÷ memcpy throughput",
             "ipc_bypass_vs_memcpy": "shared-memory bypass_cpu throughput ÷ memcpy throughput",
             "ipc_cached_speedup_vs_gloo_cached": "speedup of shared-memory cached over gloo cached",
             "ipc_cached_speedup_vs_gloo_raw": "speedup of shared-memory cached over a raw gloo broadcast"}
    for key, label in names.items():
        x = r[key]
        lines.append(f"| {label} | {x['value']:.2f} ({x['paired_min']:.2f}–{x['paired_max']:.2f}) |")
    lines += ["", "In cached mode the receiver reads the sender's shared cache buffer in place (no copy); what "
              "remains is hashing every byte twice (sender digest, receiver verify) plus per-version round trips. "
              "bypass_cpu fills double-buffered shared slots and the receiver copies each into its staging "
              "buffer before verifying.", ""]
    return lines
