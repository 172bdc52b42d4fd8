"""Owner-sharded versions against the trainer rank count (issue 17): the same model published by 1, 2 and 4
trainer ranks that each own, cache and send a share of every version, to 2 receivers.

Every trainer rank holds the whole model (as after the gathers of a sharded model: the gathers are the
trainer's own collective and are not timed here) and calls ``publish`` with its ``Ownership``; each rank has
its own sync group with the receivers (``owner_part``) and the ranks share an owners group, as the trainer agent
sets them up. Per rank count: warm-up, then rounds of one cached and one bypass_cpu version (order alternating).

Measured per version: *held* = the slowest rank's ``publish`` return (cached: its snapshot of its share;
bypass_cpu: ``params_released``, all its buckets read), *e2e* = until rank 0's ``result()`` (every receiver
verified the whole version), and each rank's host cache (``cache.bytes_held()``) after a cached version.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from ckpt_engine.bench.common import (
    HOST,
    MiB,
    Progress,
    barrier,
    fmt_ratio,
    fmt_s,
    master_store,
    mib,
    paired_ratio,
    run_processes,
    stats,
)
from ckpt_engine.plan.modes import Mode

GROUP_NAME = "bench-owners"
RANKS = (1, 2, 4)
RECEIVERS = 2
MODES: tuple[Mode, ...] = ("cached", "bypass_cpu")


def _groups(rank: int, ranks: int, port: int, timeout_s: float) -> tuple[list[Any], Any]:
    """(this process's sync groups, the owners group or None). Owners: rank < ranks; then the receivers."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.transport.group import SyncGroup, open_store, owner_part

    store = open_store(HOST, port, timeout_s=timeout_s)
    device = detect_device("cpu")

    def group(part: str, member: int, world: int) -> SyncGroup:
        return SyncGroup(store, name=GROUP_NAME, generation=ranks, rank=member, world_size=world, device=device,
                         timeout_s=timeout_s, bind_host=HOST, part=part)

    if rank >= ranks:
        return [group(owner_part(o), 1 + rank - ranks, 1 + RECEIVERS) for o in range(ranks)], None
    mine = group(owner_part(rank), 0, 1 + RECEIVERS)
    return [mine], (group("owners/", rank, ranks) if ranks > 1 else None)


def _model(num_tensors: int, total_bytes: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(17)
    rows = max(1, total_bytes // 4 // num_tensors // 64)
    return {f"layer{i}.weight": torch.randn(rows, 64, generator=gen) for i in range(num_tensors)}


def _child(rank: int, results: Any, ranks: int, port: int, args: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    groups, owners_group = _groups(rank, ranks, port, args["timeout_s"])
    if rank >= ranks:
        return _receiver(groups, args)
    return _owner(rank, ranks, groups[0], owners_group, args, results)


def _schedule(args: dict) -> list[tuple[int, Mode]]:
    """(round, mode) in order; round -1 is the warm-up; the mode order alternates every round."""
    steps = [(-1, m) for m in MODES]
    for r in range(args["repeats"]):
        steps += [(r, m) for m in (MODES if r % 2 == 0 else MODES[::-1])]
    return steps


def _owner(rank: int, ranks: int, group: Any, owners_group: Any, args: dict, results: Any) -> dict:
    from ckpt_engine.bench.common import proc_status
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Ownership, Publisher

    tensors = _model(args["tensors"], args["bytes"])
    names = list(tensors)
    publisher = Publisher(group, bucket_size=args["bucket_size"], keep_versions=1)
    publisher.attach(group, {}, owners_group)
    mine = Ownership(rank, ranks)
    records = []
    for version, (rep, mode) in enumerate(_schedule(args), start=1):
        tensors[names[version % len(names)]].add_(1.0)  # every version differs
        gc.collect()
        barrier(group)
        t0 = time.perf_counter()
        transfer = publisher.publish(version, NamedTensors(tensors), mode=mode, ownership=mine)
        transfer.params_released.wait()
        held = time.perf_counter() - t0
        res = transfer.result(timeout_s=600)
        e2e = time.perf_counter() - t0
        if not res.ok:
            raise RuntimeError(f"rank {rank}: version {version} ({mode}) failed: {res.reason}")
        records.append({"rep": rep, "mode": mode, "held": held, "e2e": e2e,
                        "cache_bytes": publisher.cache.bytes_held if mode == "cached" else None})
        if rank == 0:
            results.put(("progress", 0, f"  {ranks} rank(s) v{version} {mode:<10} held {held:.3f}s e2e {e2e:.3f}s"))
    publisher.close()
    return {"records": records, "rss_hwm": proc_status().get("VmHWM", 0)}


def _receiver(groups: list[Any], args: dict) -> dict:
    from ckpt_engine.receive.collective import Receiver

    receiver = Receiver(groups, load=lambda payload: None)
    loaded = 0
    for _ in _schedule(args):
        for g in groups:  # one barrier per owner group: every process is past the previous version
            barrier(g)
        res = receiver.receive(begin_timeout_s=args["timeout_s"])
        if res is None or not res.ok or not res.loaded:
            raise RuntimeError(f"receiver: version failed: {res}")
        loaded += 1
    closed = receiver.receive(begin_timeout_s=args["timeout_s"])  # the owners close their groups
    if closed is not None:
        raise RuntimeError(f"receiver: expected CLOSE at the end, got {closed}")
    return {"loaded": loaded}


def run(opts: dict, progress: Progress) -> dict:
    quick = opts["quick"]
    args = {"bytes": (64 if quick else 256) * MiB, "tensors": 400, "repeats": opts["repeats"],
            "timeout_s": opts["timeout_s"]}
    args["bucket_size"] = args["bytes"] // 16  # 16 buckets: 4 ranks own 4 each
    per_ranks: dict[str, Any] = {}
    for ranks in RANKS:
        store = master_store(opts["timeout_s"])
        progress(f"  {ranks} trainer rank(s) + {RECEIVERS} receivers, {args['tensors']} tensors, "
                 f"{mib(args['bytes'])}, buckets of {mib(args['bucket_size'])}")
        try:
            outs = run_processes(_child, [(ranks, store.port, args) for _ in range(ranks + RECEIVERS)],
                                 deadline_s=900, progress=progress, name=f"owners-{ranks}")
        finally:
            del store
        per_ranks[str(ranks)] = _aggregate(outs[:ranks])
    return {"args": args, "ranks": per_ranks, "ratios": _ratios(per_ranks)}


def _aggregate(owners: list[dict]) -> dict:
    """Per mode: held (the slowest rank per version), e2e (rank 0), and each rank's cache bytes."""
    out: dict[str, Any] = {}
    for mode in MODES:
        per_version = list(zip(*[[r for r in o["records"] if r["mode"] == mode and r["rep"] >= 0] for o in owners]))
        held = [max(r["held"] for r in v) for v in per_version]
        out[mode] = {"held": stats(held), "held_samples": held,
                     "e2e": stats(v[0]["e2e"] for v in per_version)}
    cached = [[r["cache_bytes"] for r in o["records"] if r["mode"] == "cached" and r["rep"] >= 0] for o in owners]
    out["cache_bytes_per_rank"] = [max(c) for c in cached]
    out["rss_hwm_per_rank"] = [o["rss_hwm"] for o in owners]
    return out


def _ratios(per_ranks: dict) -> dict:
    one = per_ranks["1"]
    out: dict[str, Any] = {}
    for ranks, r in per_ranks.items():
        if ranks == "1":
            continue
        for mode in MODES:
            ratio = paired_ratio(r[mode]["held_samples"], one[mode]["held_samples"])
            if ratio is not None:
                out[f"held_{mode}_{ranks}_over_1"] = ratio
        out[f"cache_{ranks}_over_1"] = {"value": max(r["cache_bytes_per_rank"]) / max(one["cache_bytes_per_rank"])}
    return out


def render(result: dict, machine: dict) -> list[str]:
    a = result["args"]
    lines = [
        f"Model: {mib(a['bytes'])} in {a['tensors']} float32 tensors, buckets of {mib(a['bucket_size'])} "
        f"(16 buckets), `keep_versions=1`, {RECEIVERS} receivers. 1, 2 and 4 trainer ranks each hold the whole "
        "model (as after the gathers of a sharded model; the gathers are not timed) and publish every version "
        "with their `Ownership`: each rank snapshots (cached) or reads (bypass_cpu) only the buckets it owns and "
        "sends them on its own sync group; rank 0 leads (header, trailer, acknowledgements). "
        f"{a['repeats']} rounds after a warm-up, one cached and one bypass_cpu version a round. *Held* = the "
        "slowest rank's `publish` until its tensors are free (cached: snapshot of its share; bypass_cpu: all its "
        "buckets read); *e2e* = until every receiver verified the version; *cache* = the largest rank's host "
        f"cache after a cached version. Every process shares the machine's {machine['usable_cores']} cores.",
        "",
        "| Trainer ranks | cached held s | bypass_cpu held s | cached e2e s | bypass_cpu e2e s "
        "| host cache per rank | process peak RSS per rank |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks, r in result["ranks"].items():
        lines.append(f"| {ranks} | {fmt_s(r['cached']['held'])} | {fmt_s(r['bypass_cpu']['held'])} "
                     f"| {fmt_s(r['cached']['e2e'])} | {fmt_s(r['bypass_cpu']['e2e'])} "
                     f"| {', '.join(mib(b) for b in r['cache_bytes_per_rank'])} "
                     f"| {', '.join(mib(b) for b in r['rss_hwm_per_rank'])} |")
    lines += ["", "Ratios against one rank (ratio of medians; per-round min–max in brackets):", "",
              "| Trainer ranks | cached held ÷ 1 rank | bypass_cpu held ÷ 1 rank | cache per rank ÷ 1 rank |",
              "|---:|---:|---:|---:|"]
    ratios = result["ratios"]
    for ranks in result["ranks"]:
        if ranks == "1":
            continue
        lines.append(f"| {ranks} | {fmt_ratio(ratios.get(f'held_cached_{ranks}_over_1'), 3)} "
                     f"| {fmt_ratio(ratios.get(f'held_bypass_cpu_{ranks}_over_1'), 3)} "
                     f"| {ratios[f'cache_{ranks}_over_1']['value']:.3f} |")
    lines.append("")
    return lines

