"""The colocated pull: a rollout process on the trainer's own device pulls each version over NIXL, beside our
same-host IPC path, the same model bytes interleaved in one run.

    python -m ckpt_engine.bench.nixl_colocated [--mib 1024] [--tensors 500] [--out PATH] [--json PATH]

Two processes on one device (cuda:0 when there is one, else the CPU): the trainer (owner) holds the model and
two publishers; the rollout process holds an ``IpcReceiver`` and a puller. Variants, rotated every round:

- ``ipc_cached`` / ``ipc_bypass``: ``Publisher.publish`` over same-host IPC (CUDA IPC on a GPU) to the
  ``IpcReceiver``, until it has verified and acknowledged (as ``anchor_bench`` times ours);
- ``nixl_cached``: the version is snapshotted into the pinned cache and offered at once (as the trainer agent
  offers a new whole cached version: workers/pull_server.py); the puller reads it from the pinned cache into its
  device staging, verifies every bucket against the digests the send posted, and reports;
- ``nixl_bypass``: the send copies the device tensors into the rank's device send slots, digesting them, and the
  slots are offered once it ended; the puller reads them device to device (UCX ``cuda_ipc`` on one GPU).

Time: from the publish to the rollout process holding the verified version (each side hands it to a no-op).
UCX picks its transports itself (``UCX_TLS`` unset), as a deployment that names none would. On the CPU this
measures shared memory against UCX's loopback transports, which is not what the section is for: it runs there so
the suite can check that it works. Needs NIXL (``nixl-cu12`` / ``nixl-cu13``; see scripts/gpu-wheels.sh --nixl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ckpt_engine.bench.common import (
    MiB,
    Progress,
    cuda_devices,
    device_timed,
    fmt_s,
    gbps,
    master_store,
    mib,
    paired_ratio,
    rotated_rounds,
    run_processes,
    stats,
    write_report,
)

VARIANTS = ("ipc_cached", "ipc_bypass", "nixl_cached", "nixl_bypass")
LABEL = {"ipc_cached": "same-host IPC, cached", "ipc_bypass": "same-host IPC, bypass_cpu",
         "nixl_cached": "NIXL pull, cached (pinned cache → device)",
         "nixl_bypass": "NIXL pull, bypass_cpu (device send slots → device)"}
COLS = 256  # bf16 rows of 512 bytes, as anchor_bench's model
WAIT_S = 300.0


def _model(nbytes: int, count: int, device: Any) -> dict:
    import torch

    rows = max(1, nbytes // 2 // count // COLS)
    gen = torch.Generator(device=device).manual_seed(11)
    return {f"layer{i}.weight": torch.randn(rows, COLS, generator=gen, device=device).to(torch.bfloat16)
            for i in range(count)}


def _store(port: int, timeout_s: float) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _child(rank: int, results: Any, port: int, hub: str, args: dict) -> dict | None:
    if rank == 0:
        return _trainer(results, port, hub, args)
    _rollout(port, hub, args)
    return None


def _device() -> Any:
    from ckpt_engine.device import detect_device

    return detect_device("cuda", index=0) if cuda_devices() else detect_device("cpu")


def _sync(device: Any) -> None:
    if device.kind == "cuda":
        import torch

        torch.cuda.synchronize()


def _trainer(results: Any, port: int, hub: str, args: dict) -> dict:
    from ckpt_engine.codec import encode
    from ckpt_engine.plan.modes import mode_of
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Publisher, Route
    from ckpt_engine.workers.pull_server import PullServer

    device = _device()
    store = _store(port, WAIT_S)
    tensors = _model(args["nbytes"], args["tensors"], device.torch_device)
    names = list(tensors)
    ipc = Publisher(device=device, bucket_size=args["bucket_size"], ipc_hub_name=hub, keep_versions=1,
                    timeout_s=args["timeout_s"])
    ipc.attach(None, ipc_peers={"bench": 1})
    pulled = Publisher(device=device, bucket_size=args["bucket_size"], keep_versions=2, timeout_s=args["timeout_s"])
    route = Route(None, {})  # (no group, no colocated receiver: pullers only)
    pulls = PullServer()
    pulls.start()
    nbytes = pulled.layout_for(NamedTensors(tensors)).total_bytes
    floor = _copy_floor(tensors, device)
    records = []
    for step, (variant, rnd) in enumerate(rotated_rounds(VARIANTS, args["repeats"], args["warmup"])):
        tensors[names[step % len(names)]].add_(1.0)  # a new version every time (not timed)
        _sync(device)
        version, bypass = step + 1, variant.endswith("bypass")
        t0 = time.perf_counter()
        if variant.startswith("ipc"):
            result = ipc.publish(version, NamedTensors(tensors), mode=mode_of(bypass)).result(WAIT_S)
            if not result.ok or not all(a.ok for a in result.receivers):
                raise RuntimeError(f"{variant}: {result.reason} {result.receivers}")
        else:
            transfer = pulled.publish(version, NamedTensors(tensors), mode=mode_of(bypass), route=lambda: route,
                                      pulled=True)
            pulls.release(before=version)
            if bypass:  # (offered once its send kept the slots: workers/pull_server.py offers_before_send)
                transfer.result(WAIT_S)
                offer = pulls.offer(pulled.cache, version, None, device.digest_algo, args["timeout_s"],
                                    pulled.own_digests, kept=pulled.kept(version))
            else:
                offer = pulls.offer(pulled.cache, version, None, device.digest_algo, args["timeout_s"],
                                    pulled.own_digests)
            store.set(f"offer/{version}", encode(offer))
            outcome = json.loads(store.get(f"done/{version}"))
            sent = transfer.result(WAIT_S)
            if not sent.ok or not outcome["ok"]:
                raise RuntimeError(f"{variant}: sent {sent.reason}; pulled {outcome['reason']}")
        records.append({"variant": variant, "round": rnd, "seconds": time.perf_counter() - t0})
        results.put(("progress", 0, f"  nixl colocated: {variant:<12} "
                                    f"{'warm-up' if rnd < 0 else f'round {rnd + 1}'} {records[-1]['seconds']:.4f}s"))
    pulls.close()
    ipc.close()
    pulled.close()
    return {"bytes": nbytes, "records": records, "copy_floor_s": floor, "device": str(device.torch_device)}


def _copy_floor(tensors: dict, device: Any) -> float:
    """One device copy of the same bytes (what a move without verification costs at least)."""
    import torch

    flat = torch.empty(sum(t.numel() for t in tensors.values()), dtype=torch.bfloat16, device=device.torch_device)
    into = torch.empty_like(flat)
    return device_timed(lambda: into.copy_(flat), 5, device.torch_device)


def _rollout(port: int, hub: str, args: dict) -> None:
    from ckpt_engine.codec import decode
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.colocated import IpcReceiver
    from ckpt_engine.receive.pulled import pull
    from ckpt_engine.server.decisions.assignments import pull_assignments
    from ckpt_engine.transport.messages import PullOffer
    from ckpt_engine.transport.nixl import NixlEndpoint

    device = _device()
    store = _store(port, WAIT_S)
    receiver = IpcReceiver(hub, "bench", 1, lambda payload: None, device=device, timeout_s=args["timeout_s"])
    assembler = VersionAssembler(device, lambda payload: None, staging="device")
    endpoint = NixlEndpoint("rollout")
    for step, (variant, _) in enumerate(rotated_rounds(VARIANTS, args["repeats"], args["warmup"])):
        version = step + 1
        if variant.startswith("ipc"):
            result = receiver.receive(WAIT_S)
            if result is None or not result.ok:
                raise RuntimeError(f"{variant}: {result}")
            continue
        offer = decode(PullOffer, store.get(f"offer/{version}"))
        mode = "bypass_cpu" if variant.endswith("bypass") else "cached"
        [(_, assignment)] = pull_assignments(version, mode, None, {"bench": 1}, offer)
        pulled = pull(assembler, endpoint, assignment.offer, args["timeout_s"])  # type: ignore[arg-type]
        _sync(device)
        store.set(f"done/{version}", json.dumps({"ok": pulled.ok, "reason": pulled.reason}))
    receiver.close()
    endpoint.close()


def run(opts: dict, progress: Progress) -> dict:
    from ckpt_engine.transport.nixl import nixl_missing

    missing = nixl_missing()
    if missing:
        return {"skipped": missing}
    store = master_store(WAIT_S)
    args = {"nbytes": opts["mib"] * MiB, "tensors": opts["tensors"], "bucket_size": opts["bucket_size"],
            "repeats": opts["repeats"], "warmup": opts["warmup"], "timeout_s": opts["timeout_s"]}
    hub = f"ckpt-nixl-colocated-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    out = run_processes(_child, [(store.port, hub, args)] * 2, deadline_s=opts["deadline_s"], progress=progress,
                        name="nixl-colocated")
    return summarize(opts, out[0]) | {"wall_seconds": time.perf_counter() - started}


def summarize(opts: dict, trainer: dict) -> dict:
    records = [r for r in trainer["records"] if r["round"] >= 0]
    seconds = {v: [r["seconds"] for r in records if r["variant"] == v] for v in VARIANTS}
    variants = {v: {"seconds": stats(x), "gbps": gbps(trainer["bytes"], stats(x))} for v, x in seconds.items() if x}
    ratios = {f"{kind}_pull_over_ipc": paired_ratio(seconds[f"nixl_{kind}"], seconds[f"ipc_{kind}"])
              for kind in ("cached", "bypass")}
    return {"name": f"{opts['tensors']:,} tensors", "device": trainer["device"], "bytes": trainer["bytes"],
            "variants": variants, "ratios": ratios, "copy_floor_s": trainer["copy_floor_s"], "ucx": ucx_settings(),
            "args": {k: opts[k] for k in ("bucket_size", "repeats", "warmup")}}


def ucx_settings(environ: Mapping[str, str] = os.environ) -> dict:
    """What decides UCX's transports for the pulls (inherited by both processes): NIXL's error handling mode
    and the UCX variables set (UCX_TLS unset: UCX picks)."""
    from ckpt_engine.transport.nixl import ucx_error_handling

    return {"error_handling": ucx_error_handling(environ),
            "env": {k: v for k, v in sorted(environ.items()) if k.startswith("UCX_")}}


def render(result: dict) -> list[str]:
    if "skipped" in result:
        return [f"The colocated NIXL pull: not measured ({result['skipped']}).", ""]
    a = result["args"]
    ucx = result.get("ucx") or {}
    env = ", ".join(f"{k}={v}" for k, v in (ucx.get("env") or {}).items()) or "no UCX_ variable set"
    lines = [(f"{mib(result['bytes'])} in {result['name']} on {result['device']}; bucket "
              f"{a['bucket_size'] / MiB:g} MiB; {a['repeats']} rounds after {a['warmup']} warm-up, variants "
              "interleaved, order rotated; median (min–max). One device copy of the same bytes: "
              f"{result['copy_floor_s'] * 1e3:.2f} ms. UCX: error handling {ucx.get('error_handling', '?')}, "
              f"{env}."), "",
             "| Variant | Time s, median (min–max) | GB/s |", "|---|---:|---:|"]
    for v, e in result["variants"].items():
        lines.append(f"| {LABEL[v]} | {fmt_s(e['seconds'], 4)} | {e['gbps']['median']:.1f} |")
    lines.append("")
    for key, ratio in result["ratios"].items():
        if ratio:
            lines.append(f"- {key.replace('_', ' ')}: **{ratio['value']:.2f}** (paired, "
                         f"{ratio['paired_min']:.2f}–{ratio['paired_max']:.2f})")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nixl_colocated", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="model size")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-size-mib", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--deadline-s", type=float, default=600.0, help="the whole run's bound")
    parser.add_argument("--out", default=None, help="markdown table")
    parser.add_argument("--json", default=None, help="raw results")
    ns = parser.parse_args(argv)
    if ns.mib < 1 or ns.tensors < 1 or ns.repeats < 1 or ns.warmup < 0:
        parser.error("--mib, --tensors and --repeats must be at least 1, --warmup at least 0")
    opts = {"mib": ns.mib, "tensors": ns.tensors, "repeats": ns.repeats, "warmup": ns.warmup,
            "bucket_size": ns.bucket_size_mib * MiB, "timeout_s": ns.timeout_s, "deadline_s": ns.deadline_s}
    result = run(opts, lambda text: print(text, file=sys.stderr, flush=True))
    text = "\n".join(["## The colocated NIXL pull beside same-host IPC", "", *render(result)])
    write_report(text, result, ns.out, ns.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
