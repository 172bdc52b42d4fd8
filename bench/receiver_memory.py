"""Receiver memory: how much a receiving process grows while it receives a version, relative to the bucket
size; then, per receiver staging (device / host / stream), receiver and trainer memory and time per staging
(bench/staging_bench.py, run and rendered as part of this section).

The first part runs three processes: a sender; a collective receiver (rank 1 of a 2-rank gloo group); a colocated
shared-memory receiver (``IpcReceiver``, no group). Each receiver holds its own copy of the model, and its
``load`` copies the verified tensors into it, as a rollout engine would.

Each receiver samples /proc/self/status every millisecond from a thread (VmRSS, RssAnon, RssShmem) and also
resets and reads the kernel's high-water mark (VmHWM, via /proc/self/clear_refs) around every version.
*Baseline* = RSS after the receiver allocated its model, before the first version. *Extra* = peak during a
version minus that baseline (first version) or minus the RSS just before the version (later ones).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ckpt_engine.bench import staging_bench
from ckpt_engine.bench.common import (
    MiB,
    PeakSampler,
    Progress,
    expect_close,
    master_store,
    proc_status,
    run_processes,
    stats,
    sync_group,
)
from ckpt_engine.plan.modes import MODES

REPEATS = 3  # versions per transport and mode


def _model(args: dict):
    import torch

    per = args["mib"] * MiB // 4 // args["tensors"]
    return {f"t{i}": torch.randn(per) for i in range(args["tensors"])}


def _child(rank: int, results: Any, port: int, hub: str, args: dict) -> dict | None:
    import torch

    torch.set_num_threads(1)
    if rank == 0:
        _sender(port, hub, args, results)
        return None
    return _receiver(rank, port, hub, args)


def _sender(port: int, hub: str, args: dict, results: Any) -> None:
    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Publisher

    device = detect_device("cpu")
    group = sync_group(0, 2, port, args["timeout_s"], "mem-bench")
    tensors = _model(args)
    named = NamedTensors(tensors)
    bucket = args["bucket_mib"] * MiB
    gloo = Publisher(group, bucket_size=bucket, keep_versions=1)
    ipc = Publisher(device=device, bucket_size=bucket, ipc_hub_name=hub, keep_versions=1, timeout_s=args["timeout_s"])
    ipc.attach(None, ipc_peers={"mem": 1})
    version = 0
    for transport, publisher in (("collective", gloo), ("ipc", ipc)):
        for mode in MODES:
            for _ in range(REPEATS):
                version += 1
                tensors["t0"].add_(1)
                time.sleep(0.05)  # let the receiver take its pre-version reading
                result = publisher.publish(version, named, mode=mode).result(300)
                if not result.ok or not all(a.ok for a in result.receivers):
                    raise RuntimeError(f"{transport} {mode} version {version}: {result.reason}")
                results.put(("progress", 0, f"  {transport:<10} {mode:<6} version {version} ok"))
    gloo.close()
    ipc.close()


def _receiver(rank: int, port: int, hub: str, args: dict) -> dict:
    import gc

    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.collective import Receiver
    from ckpt_engine.receive.colocated import IpcReceiver

    own = _model(args)  # this receiver's model, which every version is copied into

    def load(payload) -> None:
        for name, tensor in payload.tensors.items():
            own[name].copy_(tensor)

    receiver: Receiver | IpcReceiver
    if rank == 1:
        receiver = Receiver(sync_group(1, 2, port, args["timeout_s"], "mem-bench"), load)
    else:
        receiver = IpcReceiver(hub, "mem", 1, load, device=detect_device("cpu"), timeout_s=args["timeout_s"])
    gc.collect()
    sampler = PeakSampler()
    time.sleep(0.2)
    baseline = proc_status()
    versions = []
    for mode in MODES:
        for _ in range(REPEATS):
            before = sampler.window()
            result = receiver.receive(300)
            peak = sampler.peak()
            after = proc_status()
            if result is None or not result.ok:
                raise RuntimeError(f"rank {rank}: {mode} receive failed: {result}")
            versions.append({"mode": mode, "before": before, "peak": peak, "after": after})
    if isinstance(receiver, IpcReceiver):
        receiver.close()
    else:
        expect_close(receiver)
    sampler.close()
    return {"transport": "collective" if rank == 1 else "ipc", "baseline": baseline, "versions": versions}


def run(opts: dict, progress: Progress) -> dict:
    args = {"mib": 64 if opts["quick"] else 256, "tensors": 100, "bucket_mib": 16 if opts["quick"] else 64,
            "timeout_s": opts["timeout_s"]}
    store = master_store(args["timeout_s"])
    hub = f"ckpt-mem-bench-{uuid.uuid4().hex[:8]}"
    progress(f"  {args['mib']} MiB model in {args['tensors']} tensors, bucket {args['bucket_mib']} MiB")
    _, collective, ipc = run_processes(_child, [(store.port, hub, args)] * 3, deadline_s=600, progress=progress,
                                       name="memory")
    del store
    bucket = args["bucket_mib"] * MiB
    rows = []
    for rx in (collective, ipc):
        base = rx["baseline"]
        for mode in MODES:
            vs = [v for v in rx["versions"] if v["mode"] == mode]
            first_of_all = rx["versions"][0] is vs[0]
            extra = [v["peak"]["VmRSS"] - v["before"]["VmRSS"] for v in vs]
            anon = [v["peak"].get("RssAnon", 0) - v["before"].get("RssAnon", 0) for v in vs]
            shmem = [v["peak"].get("RssShmem", 0) - v["before"].get("RssShmem", 0) for v in vs]
            first = vs[0]
            later = vs[1:] if first_of_all else vs
            rows.append({
                "transport": rx["transport"], "mode": mode, "baseline_rss": base["VmRSS"],
                "first_sync": first_of_all,
                "first_extra": first["peak"]["VmRSS"] - base["VmRSS"],
                "first_extra_anon": first["peak"].get("RssAnon", 0) - base.get("RssAnon", 0),
                "first_extra_shmem": first["peak"].get("RssShmem", 0) - base.get("RssShmem", 0),
                "extra": stats(extra), "extra_anon": stats(anon), "extra_shmem": stats(shmem),
                "later_extra": stats(v["peak"]["VmRSS"] - v["before"]["VmRSS"] for v in later),
                "retained_after": vs[-1]["after"]["VmRSS"] - base["VmRSS"],
                "retained_anon_after": vs[-1]["after"].get("RssAnon", 0) - base.get("RssAnon", 0),
                "hwm_reset": all(v["peak"].get("hwm_reset") for v in vs),
            })
    out = {"args": args, "bucket_size": bucket, "model_bytes": args["mib"] * MiB, "rows": rows, "repeats": REPEATS}
    out["staging"] = staging_bench.run(opts, progress)
    return out


def render(result: dict, machine: dict) -> list[str]:
    a, bucket = result["args"], result["bucket_size"]
    lines = [
        f"Model {a['mib']} MiB in {a['tensors']} float32 tensors, bucket {a['bucket_mib']} MiB "
        f"(the model is {result['model_bytes'] / bucket:.0f} buckets). Each receiver process holds its own "
        "copy of the model and `load` copies every verified tensor into it. Order per receiver: "
        f"{result['repeats']} cached versions, then {result['repeats']} bypass_cpu versions. "
        "Peaks from a 1 ms /proc/self/status sampler"
        + (" and the kernel's VmHWM (reset before every version)" if all(r["hwm_reset"] for r in result["rows"])
           else " (VmHWM could not be reset here)") + ". MiB = 2^20 bytes.",
        "",
        "| Receiver | Mode | RSS baseline MiB | first version of the process: peak − baseline, MiB (anon / "
        "shared) | other versions: peak − RSS just before, MiB median (max) | worst extra ÷ bucket | RSS retained "
        "after the last version, anon MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        first = (f"{r['first_extra'] / MiB:.0f} ({r['first_extra_anon'] / MiB:.0f} / "
                 f"{r['first_extra_shmem'] / MiB:.0f})"
                 if r["first_sync"] else "—")
        later = r["later_extra"]
        worst = max(r["first_extra"] if r["first_sync"] else 0, later["max"] if later["n"] else 0)
        lines.append(
            f"| {'collective (gloo)' if r['transport'] == 'collective' else 'same-host shared memory'} | {r['mode']} "
            f"| {r['baseline_rss'] / MiB:.0f} | {first} | "
            + (f"{later['median'] / MiB:.0f} ({later['max'] / MiB:.0f})" if later["n"] else "—")
            + f" | {worst / bucket:.2f} | {r['retained_anon_after'] / MiB:.0f} |")
    lines += [
        "",
        "*worst extra ÷ bucket* = the larger of the two extra figures ÷ the bucket size. Where a receiver holds a "
        "version depends on its staging (`ckpt_engine/receive/staging.py`: device, host, stream, or auto, which "
        "picks by free memory per version): these receivers are built with the defaults, which stage the whole "
        "version on the device (host memory here) before `load` sees any of it, so their first version allocates "
        "a staging buffer of the model's size, kept and reused: about model size ÷ bucket size. A streaming "
        "receiver holds a few buckets instead (next table). The colocated receiver in cached mode reads the "
        "sender's shared cache buffer in place: it maps the sender's memory (counted as shared RSS) instead of "
        "allocating staging of its own; its first bypass_cpu version then allocates its own staging (model size) "
        "and maps the sender's two bucket slots (2 × bucket, shared).",
        "",
    ]
    if "staging" in result:
        lines += staging_bench.render(result["staging"], machine)
    return lines
