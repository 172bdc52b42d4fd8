"""A network-bound cluster on this machine: full vs sharded delivery over rate-limited links.

    ckpt-engine bench --only netns                                    (a section of the suite; as root)
    python -m ckpt_engine.bench.netns_bench [--rate-mbit 300] [--mib 48] [--rounds 3] [--json PATH]

The 2 cores hide how well the wire is used: on loopback the CPU is the bottleneck. Here every process (the
trainer, each receiver) runs in a network namespace of its own, joined to the others through a bridge in a hub
namespace by a veth link rate-limited with ``tc`` (tbf, both directions), so the links are the bottleneck and
the CPU is not. Only addresses inside the namespaces this bench creates are used (10.213.0.0/24); every
namespace is removed when it ends, whatever happens. Without root or iproute2 it says why and measures nothing.

Scenarios (fresh processes each; rounds interleaved within a scenario), a Llama-style model (fused-able q/k/v,
gate/up/down, embeddings, norms) of ``--mib`` float32:

- ``full, R receivers``: one sync group, every receiver gets the whole model (today's delivery);
- ``sharded, TP=R``: receiver r is TP rank r of R, its own class and its own sync group, getting only its
  ranges; the trainer sends every class at once, through the path the trainer agent uses for a daemon's
  sharded version (``Publisher.publish(..., sharded=True)`` with a lane per class: send/class_senders.py);
- ``full, R receivers, K owners``: K trainer ranks, each in a namespace (and on a link) of its own, each owning
  1/K of every version (plan/owners.py) and sending it on its own sync group with the receivers;
- ``raw``: one broadcast of the model's bytes on the full group (the wire's own limit).

Time: from the first publish to every receiver verified (cached mode, snapshot included; one bypass_cpu row). Goals
(issue 30): sharded ÷ full ≤ 1/TP × 1.2; 4 owners ÷ 1 owner ≤ 0.35.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Any

from ckpt_engine.bench.netns_cluster import (
    MiB,
    cannot_run,
    cluster,
    finish,
    group_at,
    llama_model,
    model_shapes,
    tp_spec,
)
from ckpt_engine.transport.nixl import nixl_missing


# ---- the cluster ---------------------------------------------------------------------------------------------
# ---- the processes -------------------------------------------------------------------------------------------
def _publisher_and_route(cfg: dict, store: tuple[str, int], named: Any) -> tuple[Any, Any, dict]:
    """Owner ``cfg['owner']``'s publisher, its route, and publish's options: a lane per class (sharded), or its
    own group with the receivers (and the owners' group, with several owners)."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.shards import spec_key
    from ckpt_engine.ranks import QuorumRank
    from ckpt_engine.send.class_senders import Lane
    from ckpt_engine.send.publisher import Ownership, Publisher, Route
    from ckpt_engine.transport.group import owner_part

    size, timeout = cfg["bucket_mib"] * MiB, cfg["timeout_s"]
    owner, owners = cfg.get("owner", 0), cfg.get("owners", 1)
    if cfg["sharded"]:  # a lane per class: this owner's group with the class's receiver, the class's owners' group
        tp = len(cfg["groups"])
        lanes = tuple(Lane(spec_key(tp_spec(named, r, tp)), tp_spec(named, r, tp),
                           group_at(cfg["addr"], store, f"g{r}", 0, 2, timeout, part=owner_part(owner)),
                           (QuorumRank(1),),
                           group_at(cfg["addr"], store, f"g{r}", owner, owners, timeout, part="owners/")
                           if owners > 1 else None) for r in range(tp))
        route = Route(None, {}, None, lanes)
        return (Publisher(device=detect_device("cpu"), bucket_size=size, keep_versions=1), route,
                {"sharded": True, "ownership": Ownership(owner, owners)})
    group = group_at(cfg["addr"], store, "g0", 0, 1 + cfg["groups"][0], timeout, part=owner_part(owner))
    owners_group = group_at(cfg["addr"], store, "g0", owner, owners, timeout, part="owners/") if owners > 1 else None
    route = Route(group, {}, owners_group)
    return Publisher(group, bucket_size=size, keep_versions=1), route, {"ownership": Ownership(owner, owners)}


def run_sender(cfg: dict) -> dict:
    """A trainer rank (owner 0 hosts the store): one publisher, on the route of its scenario."""
    import torch

    from ckpt_engine.plan.tensors import specs_of
    from ckpt_engine.transport.group import open_store

    if cfg.get("owner", 0) == 0:
        master = open_store(cfg["addr"], 0, is_master=True, timeout_s=cfg["timeout_s"])
        print(json.dumps({"port": master.port}), flush=True)
        store = (cfg["addr"], master.port)
    else:
        store = (cfg["store_addr"], cfg["port"])
    named = llama_model(cfg["mib"], cfg["tp_max"])
    pub, route, options = _publisher_and_route(cfg, store, named)
    specs = specs_of(named.tensors)
    raw = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8) if cfg["raw"] else None
    times, raw_times, sent = [], [], []
    for version in range(1, cfg["rounds"] + 2):  # the first is a warm-up
        named.tensors[next(iter(named.tensors))].add_(1.0)
        t0 = time.perf_counter()
        result = pub.publish(version, named, route=lambda: route, mode=cfg.get("mode", "cached"),
                             **options).result(timeout_s=cfg["timeout_s"] * 4)
        elapsed = time.perf_counter() - t0
        if not result.ok:
            raise RuntimeError(f"version {version}: {result.reason}")
        if version > 1:
            times.append(elapsed)
            sent.append(result.bytes_sent)
        if raw is not None:
            group = route.group
            t0 = time.perf_counter()
            group.wait(group.broadcast(raw, src=0), "raw")
            if version > 1:
                raw_times.append(time.perf_counter() - t0)
    pub.close()
    return {"seconds": times, "raw_seconds": raw_times, "bytes_sent": sent, "model_bytes": sum(s.nbytes for s in specs)}


def run_receiver(cfg: dict) -> dict:
    import torch

    from ckpt_engine.receive.collective import Receiver
    from ckpt_engine.transport.group import owner_part

    store = (cfg["store_addr"], cfg["port"])
    groups = [group_at(cfg["addr"], store, f"g{cfg['group']}", cfg["rank"], cfg["world"], cfg["timeout_s"],
                     part=owner_part(owner)) for owner in range(cfg.get("owners", 1))]  # one per owner
    group = groups[0]
    receiver = Receiver(groups, lambda payload: None)
    received = []
    raw = None
    for _ in range(1, cfg["rounds"] + 2):
        result = receiver.receive(cfg["timeout_s"] * 4)
        if result is None or not result.ok:
            raise RuntimeError(f"receive failed: {result}")
        received.append(result.bytes_received)
        if cfg["raw"]:
            if raw is None:
                raw = torch.empty(cfg["model_bytes"], dtype=torch.uint8)
            group.wait(group.broadcast(raw, src=0), "raw")
    receiver.receive(cfg["timeout_s"])  # the sender's close
    return {"bytes_received": received[1:]}


# ---- one scenario --------------------------------------------------------------------------------------------
def scenario(name: str, receivers: int, sharded: bool, args: dict, owners: int = 1, mode: str = "cached") -> dict:
    groups = [1] * receivers if sharded else [receivers]
    with cluster(owners + receivers, args["rate_mbit"]) as nodes:
        base = {"mib": args["mib"], "tp_max": 4, "rounds": args["rounds"], "bucket_mib": args["bucket_mib"],
                "timeout_s": args["timeout"], "sharded": sharded, "owners": owners, "mode": mode,
                "raw": not sharded and owners == 1 and args["raw"] and mode == "cached"}
        (lead_ns, lead_addr), trainers = nodes[0], nodes[1:owners]
        senders = [_spawn(lead_ns, "sender", base | {"addr": lead_addr, "groups": groups})]
        try:
            port = json.loads(senders[0].stdout.readline())["port"]  # type: ignore[union-attr]
            where = {"store_addr": lead_addr, "port": port}
            senders += [_spawn(ns, "sender", base | where | {"addr": addr, "groups": groups, "owner": o})
                        for o, (ns, addr) in enumerate(trainers, start=1)]
            model_bytes = _model_bytes(args["mib"])
            procs = []
            for r, (ns, addr) in enumerate(nodes[owners:]):
                group, rank = (r, 1) if sharded else (0, r + 1)
                procs.append(_spawn(ns, "receiver", base | where | {
                    "addr": addr, "group": group, "rank": rank, "world": 1 + groups[group],
                    "model_bytes": model_bytes}))
            outs = [finish(p, args["timeout"] * 8) for p in procs]
            finished = [finish(s, args["timeout"] * 8) for s in senders]
            sent = finished[0]  # the lead's: until every ack
        finally:
            for sender in senders:
                sender.kill()
    return {"name": name, "receivers": receivers, "sharded": sharded, "owners": owners, "mode": mode, **sent,
            "received": [o["bytes_received"] for o in outs]}


def _model_bytes(mib: int) -> int:
    return sum(4 * math.prod(shape) for shape in model_shapes(mib, 4).values())


def _spawn(ns: str, role: str, cfg: dict) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "ckpt_engine.bench.netns_bench",
                             "--role", role, "--config", json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- the bench -----------------------------------------------------------------------------------------------
def run(opts: dict, progress: Any = print) -> dict:
    """The suite's entry: quick runs a smaller model for fewer rounds."""
    args = {"rate_mbit": 300, "mib": 16 if opts.get("quick") else 48, "bucket_mib": 8,
            "rounds": 2 if opts.get("quick") else 3, "tp": [2, 4], "owners": [1, 2, 4], "raw": True,
            "timeout": 60.0} | opts.get("netns", {})
    why = cannot_run()
    if why is not None:
        return {"skipped": why}
    results = []
    for receivers in args["tp"]:
        progress(f"  {receivers} receivers: full, then sharded")
        results.append(scenario(f"full, {receivers} receivers", receivers, False, args))
        results.append(scenario(f"sharded, TP={receivers}", receivers, True, args))
    receivers = max(args["tp"])
    progress(f"  sharded, TP={receivers}, bypass_cpu (cut from the live tensors: no snapshot)")
    results.append(scenario(f"sharded, TP={receivers}, bypass_cpu", receivers, True, args, mode="bypass_cpu"))
    for owners in args["owners"]:
        if owners > 1:
            progress(f"  {receivers} receivers, {owners} trainer ranks owning shares")
            results.append(scenario(f"full, {receivers} receivers, {owners} owners", receivers, False, args, owners))
    if max(args["owners"]) > 1:
        owners = max(args["owners"])
        progress(f"  sharded, TP={receivers}, {owners} trainer ranks owning shares")
        results.append(scenario(f"sharded, TP={receivers}, {owners} owners", receivers, True, args, owners))
    if args.get("pull", True) and nixl_missing() is None:
        from ckpt_engine.bench import netns_pull

        for receivers in args["tp"]:
            progress(f"  {receivers} receivers pulling over NIXL (UCX over TCP on their links): full, then sharded")
            results.append(netns_pull.scenario(f"full, {receivers} receivers, pulled (nixl)", receivers, args))
            results.append(netns_pull.scenario(f"sharded, TP={receivers}, pulled (nixl)", receivers, args,
                                               sharded=True))
        receivers, owners = max(args["tp"]), max(args["owners"])
        if owners > 1:
            progress(f"  {receivers} receivers pulling from {owners} trainer ranks: full, then sharded")
            results.append(netns_pull.scenario(f"full, {receivers} receivers, {owners} owners, pulled (nixl)",
                                               receivers, args, owners=owners))
            results.append(netns_pull.scenario(f"sharded, TP={receivers}, {owners} owners, pulled (nixl)",
                                               receivers, args, sharded=True, owners=owners))
    by = {(r["receivers"], r["sharded"], r["owners"]): r for r in results
          if r.get("mode", "cached") == "cached" and not r.get("pull")}
    for r in results:
        r["median_s"] = statistics.median(r["seconds"])
        if r["raw_seconds"]:
            r["raw_median_s"] = statistics.median(r["raw_seconds"])
        r["received_fraction"] = max(statistics.median(x) for x in r["received"]) / r["model_bytes"]
        if r.get("stages"):  # (pulled rows: the lead owner's snapshot and digests, its offer, the pulls)
            r["stage_medians"] = {k: statistics.median(s[k] for s in r["stages"]) for k in r["stages"][0]}
        if r.get("pull"):  # ÷ the same delivery pushed (receivers, sharded or not, owners)
            r["over_push"] = r["median_s"] / by[(r["receivers"], r["sharded"], r["owners"])]["median_s"]
            r["over_full_push"] = r["median_s"] / by[(r["receivers"], False, 1)]["median_s"]
            r["goal"] = 1.0
        elif r["sharded"]:
            r["over_full"] = r["median_s"] / by[(r["receivers"], False, 1)]["median_s"]
            r["goal"] = 1.2 / r["receivers"]
        elif r["owners"] > 1:
            r["over_one_owner"] = r["median_s"] / by[(r["receivers"], False, 1)]["median_s"]
            r["goal"] = 0.35 if r["owners"] == 4 else None
    return {"args": args, "results": results}


def render(result: dict, machine: dict | None = None) -> list[str]:
    if "skipped" in result:
        return [f"Not measured: {result['skipped']}.", ""]
    a = result["args"]
    lines = [f"Links: {a['rate_mbit']} Mbit/s each way per process (tbf), one bridge; model {a['mib']} MiB float32, "
             f"buckets of {a['bucket_mib']} MiB; {a['rounds']} rounds after a warm-up; time from the first publish to "
             "every receiver verified (cached: snapshot included), median.", "",
             "| Scenario | time s | raw broadcast s | largest receiver's bytes ÷ model | ÷ full push, 1 owner | "
             "pulled ÷ the same pushed | goal |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["results"]:
        raw = f"{r['raw_median_s']:.2f}" if "raw_median_s" in r else "—"
        ratio = r.get("over_full", r.get("over_one_owner", r.get("over_full_push")))
        over = f"{ratio:.3f}" if ratio is not None else "—"
        pulled = f"{r['over_push']:.3f}" if "over_push" in r else "—"
        goal = f"≤ {r['goal']:.2f}" if r.get("goal") else "—"
        lines.append(f"| {r['name']} | {r['median_s']:.2f} | {raw} | {r['received_fraction']:.3f} | {over} | {pulled} "
                     f"| {goal} |")
    staged = [r for r in result["results"] if r.get("stage_medians")]
    if staged:
        lines += ["", "Pulled rows, where the time goes (the lead owner's view, medians, s): the snapshot, the offer "
                  "(made as soon as the snapshot is cached), the digests (each owner's send digests its pieces and "
                  "posts them on its board for the pullers, while they already read: transport/digest_board.py), "
                  "the pulls (from the offer to every receiver verified); and CPU seconds a version costs the lead "
                  "owner's process and the busiest puller's (NIXL driven by a thread of ours at 0.5 ms while reads "
                  "may come, 2 ms when idle: transport/nixl.py).",
                  "", "| Scenario | snapshot | offer | digests (in the pulls) | pulls | owner CPU s | puller CPU s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['name']} | {m['snapshot']:.3f} | {m['offer']:.3f} | {m['digests']:.3f} | {m['pulls']:.2f} | "
                  f"{m['owner_cpu']:.2f} | {m['puller_cpu']:.2f} |" for r in staged for m in (r["stage_medians"],)]
    return lines + ["", "Sharded rows: each receiver is TP rank r of R and its own class; the trainer sends every "
                    "class at once, each on its own sync group, cut from its cached version as the trainer agent does "
                    "for a daemon's sharded version (`Publisher.publish(..., sharded=True)`, send/class_senders.py: "
                    "the version's identity digest of the full tensors included). Owner rows: K trainer ranks, each on "
                    "its own link, each sending its 1/K of every version on its own sync group with the receivers "
                    "(sharded with K owners: each owner sends every class the pieces of the tensors it owns). The "
                    "bypass_cpu row: no cache, every class cut from the live tensors as each bucket is read "
                    "(send/fanout.py), the identity hashed on the way. Pulled rows (`transport: nixl`, "
                    "bench/netns_pull.py): every receiver reads the owners' cached shares over NIXL (UCX over TCP on "
                    "its link) after their offers, each verifying every bucket (sharded: exactly its pieces, row "
                    "ranges cut out of the owners' shares by the reads, column ranges read whole from what each "
                    "owner's send kept of them: send/kept_pieces.py); their goal (≤ 1.00) is on ÷ the push row of "
                    "the same "
                    "delivery (receivers, sharded or not, owners); the sharded pull from 4 owners ÷ the full push "
                    "from one owner has its own goal (≤ 0.1, see Targets).", ""]


def target_measurements(result: dict) -> dict[str, list[tuple[str, float, str]]]:
    """Per target: (where, value, note) for the suite's table."""
    if "skipped" in result:
        return {}
    out: dict[str, list[tuple[str, float, str]]] = {"time": [], "bytes": [], "owners": [], "pull": [],
                                                   "pull_owners": []}
    for r in result["results"]:
        if r.get("pull"):
            out["pull"].append((r["name"].removesuffix(", pulled (nixl)"), r["over_push"], ""))
            if r["sharded"] and r["owners"] > 1:
                out["pull_owners"].append((f"TP={r['receivers']}, {r['owners']} owners", r["over_full_push"],
                                           "(÷ full push, 1 owner)"))
            continue
        if r["owners"] == 4 and not r["sharded"]:
            out["owners"].append((f"{r['receivers']} receivers", r["over_one_owner"], ""))
        if r["sharded"] and r.get("mode", "cached") == "cached":
            tp = r["receivers"]
            where = f"TP={tp}" + (f", {r['owners']} owners" if r["owners"] > 1 else "")
            out["time"].append((where, r["over_full"] * tp, f"(sharded ÷ full {r['over_full']:.3f})"))
            out["bytes"].append((where, r["received_fraction"] - 1 / tp,
                                 f"({r['received_fraction']:.3f} of the model)"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("sender", "receiver"))
    p.add_argument("--config")
    p.add_argument("--rate-mbit", type=int, default=300)
    p.add_argument("--mib", type=int, default=48)
    p.add_argument("--bucket-mib", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--owners", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--raw", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.role:
        cfg = json.loads(args.config)
        print(json.dumps(run_sender(cfg) if args.role == "sender" else run_receiver(cfg)), flush=True)
        return 0
    result = run({"netns": {k: v for k, v in vars(args).items() if k not in ("role", "config", "json")}})
    print("\n".join(render(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
