"""Side by side with the anchor: MoonshotAI's checkpoint-engine (``checkpoint-engine==0.4.2``) and ckpt-engine,
the same model bytes on the same GPUs, interleaved in one run.

    python -m ckpt_engine.bench.anchor_bench [--quick] [--out PATH] [--json PATH]

Skips with a reason (and measures nothing) without CUDA or without their package. With them:

- 1 GPU, the colocated path: a trainer process holding bf16 tensors on cuda:0 and an inference worker process on
  the same GPU. Theirs: ``ParameterServer.register_checkpoint`` of the device tensors (their pinned pool, reused
  across rounds) + ``gather_metas`` + ``update`` with a request function that hands the ZMQ address to the
  worker, which runs their public ``update_weights_from_ipc``. Ours: ``Publisher.publish`` over same-host CUDA
  IPC to an ``IpcReceiver``, cached and bypass_cpu, until the receiver has verified and acknowledged.
- 2 GPUs or more, the broadcast path: the model on cuda:0. Theirs: two ParameterServer ranks (cuda:0 owns the
  checkpoint, cuda:1 registers nothing) and, as their design requires, a worker on each GPU fed over IPC. Ours:
  an NCCL sync group, sender on cuda:0 and receiver on cuda:1, cached and bypass_cpu.

Every time ends when the inference side holds the bytes. Variants rotate every round (after warm-up); medians,
and per-round ratios ours ÷ theirs. Neither side applies the weights to a model (both hand them to a no-op).
Their code is used only through its public API (README, ``checkpoint_engine/__init__.py`` exports); nothing
of it is copied here. The device digest rate (the cost model's weakest input) is measured once per size.

Everything CUDA-only here was written from the 0.4.2 wheel's ``checkpoint_engine/ps.py`` and
``checkpoint_engine/worker.py`` and has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import socket
import sys
import time
import uuid
from typing import Any

from ckpt_engine.bench.common import (
    GiB,
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
    write_report,
)

ANCHOR = "checkpoint-engine==0.4.2"
# (GiB of bf16, tensors) as the issue asks; scaled down to what the GPU and host memory allow.
FULL_SIZES = ((4, 500), (4, 20000), (16, 500), (16, 20000))
QUICK_SIZES = ((1, 500), (1, 20000))
COLS = 256  # bf16 rows of 512 bytes: no padding in either layout
MODEL_SHARE_OF_GPU = 0.12  # model + their 2×bucket IPC buffer and h2d bucket + our slots and receiver copies
MODEL_SHARE_OF_HOST = 0.2  # their pinned pool and our pinned cache each hold one copy
VARIANTS = {1: ("theirs", "ours_cached", "ours_bypass"), 2: ("theirs", "ours_cached", "ours_bypass")}
LABEL = {"theirs": "MoonshotAI checkpoint-engine 0.4.2 (register + gather_metas + update)",
         "ours_cached": "ckpt-engine, cached", "ours_bypass": "ckpt-engine, bypass_cpu"}
HANDOFF_S = 600.0
DIGEST_GOAL_GBPS = 1000.0  # the device digest on 500 large and on 20,000 small tensors (issue 36; gpu_bench's too)


def anchor_missing() -> str | None:
    """Why the side by side cannot run here, or None."""
    if importlib.util.find_spec("checkpoint_engine") is None:
        return (f"MoonshotAI's package is not installed ({ANCHOR}; scripts/gpu-wheels.sh fetches it into the "
                "wheel folder)")
    return None


def scaled_sizes(sizes: tuple[tuple[int, int], ...], gpu_bytes: int, host_bytes: int) -> list[tuple[int, int]]:
    """Each (GiB, tensors) with the GiB lowered to the largest power of two that fits both memories."""
    cap = min(gpu_bytes * MODEL_SHARE_OF_GPU, host_bytes * MODEL_SHARE_OF_HOST) / GiB
    out: list[tuple[int, int]] = []
    for gib, count in sizes:
        fit = gib
        while fit > cap and fit > 0:
            fit //= 2
        if fit >= 1 and (fit, count) not in out:
            out.append((fit, count))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(gib: int, count: int, device: Any) -> dict:
    import torch

    rows = max(1, gib * GiB // 2 // count // COLS)
    gen = torch.Generator(device=device).manual_seed(7)
    return {f"layer{i}.weight": torch.randn(rows, COLS, generator=gen, device=device).to(torch.bfloat16)
            for i in range(count)}


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _client_store(port: int, timeout_s: float) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _device_uuid(index: int) -> str:
    # How their ParameterServer names a GPU (ps.py, _get_physical_gpu_id): the worker picks its ZMQ address by it.
    import torch

    return f"GPU-{torch.cuda.get_device_properties(index).uuid!s}"


# ---- roles ---------------------------------------------------------------------------------------------------
# Ranks: 0 trainer (cuda:0: their PS rank 0, our sender); with 2 GPUs, 1 is their PS rank 1 and our receiver
# on cuda:1; then one of their workers per GPU. With 1 GPU, rank 1 is the worker on cuda:0 and also our
# IPC receiver.


def _child(rank: int, results: Any, gpus: int, port: int, ps_port: int, hub: str, cfg: dict, args: dict) -> Any:
    import torch

    schedule = rotated_rounds(VARIANTS[gpus], args["repeats"], args["warmup"])
    if gpus == 1:
        torch.cuda.set_device(0)
        if rank == 0:
            return _trainer(results, gpus, port, ps_port, hub, cfg, args, schedule)
        _worker(0, 0, port, hub, args, schedule, our_ipc=True)
        return None
    if rank < 2:
        torch.cuda.set_device(rank)
        if rank == 0:
            return _trainer(results, gpus, port, ps_port, hub, cfg, args, schedule)
        _second_ps(port, ps_port, args, schedule)
        return None
    torch.cuda.set_device(rank - 2)
    _worker(rank - 2, rank - 2, port, hub, args, schedule, our_ipc=False)
    return None


def _parameter_server(ps_rank: int, world: int, ps_port: int) -> Any:
    # Their constructor as their README shows it, under torchrun's environment: 0.4.2 reads ``rank or
    # int(os.environ["RANK"])`` (ps.py), so rank 0 given as an argument still needs RANK set, as torchrun sets
    # it for their examples. master_port is used as given (_get_master_port); gpu_count=world keeps rank r on
    # cuda:r.
    import os

    from checkpoint_engine import ParameterServer

    os.environ.update(RANK=str(ps_rank), WORLD_SIZE=str(world), LOCAL_RANK=str(ps_rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ps_port))
    return ParameterServer(rank=ps_rank, world_size=world, gpu_count=world, master_addr="127.0.0.1",
                           master_port=ps_port)


def _request_worker(store: Any, ps_rank: int, step: int) -> Any:
    """Their req_func: hand the ZMQ addresses to this rank's worker and return once it has finished, as the
    vLLM collective_rpc POST in their examples does. Runs in their update thread."""
    def req_func(socket_paths: list[tuple[str, str]]) -> None:
        store.set(f"theirs/{step}/{ps_rank}/paths", json.dumps(dict(socket_paths)))
        store.get(f"theirs/{step}/{ps_rank}/done")
    return req_func


def _theirs(ps: Any, store: Any, ps_rank: int, step: int, tensors: dict | None) -> tuple[float, float]:
    """One update of theirs: (seconds from registration to the workers done, seconds of update alone)."""
    name = f"bench-{step}"
    _sync()
    t0 = time.perf_counter()
    if tensors is not None:
        # The shared pool keeps the pinned host memory across rounds, as their README suggests for repeated
        # updates; registering device tensors copies them device → pinned (pin_memory.py, _normal_pin_memory).
        ps.register_checkpoint(name, named_tensors=tensors, use_shared_memory_pool=True)
    ps.gather_metas(name)
    t1 = time.perf_counter()
    ps.update(name, _request_worker(store, ps_rank, step))
    _sync()
    t2 = time.perf_counter()
    if tensors is not None:
        ps.unregister_checkpoint(name)
    return t2 - t0, t2 - t1


def _trainer(results: Any, gpus: int, port: int, ps_port: int, hub: str, cfg: dict, args: dict,
             schedule: list) -> dict:
    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.modes import mode_of
    from ckpt_engine.plan.tensors import NamedTensors

    device = detect_device("cuda", index=0)
    store = _client_store(port, args["timeout_s"])
    ps = _parameter_server(0, gpus, ps_port)
    tensors = _model(cfg["gib"], cfg["tensors"], device.torch_device)
    names = list(tensors)
    publisher = _publisher(gpus, port, hub, device, args)
    nbytes = publisher.layout_for(NamedTensors(tensors)).total_bytes
    digest = _digest_rate(tensors, args["bucket_size"], device)
    records = []
    for step, (variant, rnd) in enumerate(schedule):
        tensors[names[step % len(names)]].add_(1.0)  # a new version every time (not timed)
        _sync()
        if variant == "theirs":
            seconds, update_s = _theirs(ps, store, 0, step, tensors)
            records.append({"variant": variant, "round": rnd, "seconds": seconds, "update": update_s})
        else:
            t0 = time.perf_counter()
            transfer = publisher.publish(step + 1, NamedTensors(tensors), mode=mode_of(variant.endswith("bypass")))
            transfer.params_released.wait()
            held = time.perf_counter() - t0
            result = transfer.result(HANDOFF_S)
            if not result.ok or not result.receivers or not all(a.ok for a in result.receivers):
                raise RuntimeError(f"{variant}: {result.reason} {result.receivers}")
            records.append({"variant": variant, "round": rnd, "seconds": time.perf_counter() - t0, "held": held})
        results.put(("progress", 0, (f"  anchor {cfg['gib']} GiB × {cfg['tensors']:,}: {variant:<12} "
                                    f"{'warm-up' if rnd < 0 else f'round {rnd + 1}'} {records[-1]['seconds']:.3f}s")))
    publisher.close()
    return {"bytes": nbytes, "records": records, "digest": digest}


def _publisher(gpus: int, port: int, hub: str, device: Any, args: dict) -> Any:
    from ckpt_engine.send.publisher import Publisher

    if gpus == 1:
        publisher = Publisher(device=device, bucket_size=args["bucket_size"], ipc_hub_name=hub, keep_versions=1,
                              timeout_s=args["timeout_s"])
        publisher.attach(None, ipc_peers={"bench": 1})
        return publisher
    return Publisher(_our_group(port, 0, device, args["timeout_s"]), bucket_size=args["bucket_size"],
                     keep_versions=1)


def _our_group(port: int, rank: int, device: Any, timeout_s: float) -> Any:
    from ckpt_engine.transport.group import SyncGroup, open_store

    return SyncGroup(open_store("127.0.0.1", port, timeout_s=timeout_s), name="anchor-bench", generation=0,
                     rank=rank, world_size=2, device=device, timeout_s=timeout_s)


def _digest_rate(tensors: dict, bucket_size: int, device: Any) -> dict:
    """GB/s of the device digest over the same model's buckets (what the cost model takes as an input)."""
    import torch

    from ckpt_engine.plan.hashing import block64_bucket_digests, device_digest_kernel
    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import specs_of

    layout = plan_layout(specs_of(tensors), bucket_size)
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device.torch_device).random_(0, 256)
    samples = []
    for _ in range(4):
        _sync()
        t0 = time.perf_counter()
        parts = [block64_bucket_digests(b, flat[b.flat_offset : b.flat_offset + b.nbytes], layout.digest)
                 for b in layout.buckets]
        torch.cat(parts).cpu()
        samples.append(time.perf_counter() - t0)
    del flat
    seconds = stats(samples[1:])
    return {"kernel": device_digest_kernel(device.torch_device), "seconds": seconds,
            "gbps": gbps(layout.total_bytes, seconds)["median"]}


def _second_ps(port: int, ps_port: int, args: dict, schedule: list) -> None:
    """cuda:1 with 2 GPUs: their PS rank 1 (registers nothing: rank 0 owns the checkpoint) and our receiver."""
    import torch

    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.collective import Receiver

    device = detect_device("cuda", index=torch.cuda.current_device())
    store = _client_store(port, args["timeout_s"])
    ps = _parameter_server(1, 2, ps_port)
    receiver = Receiver(_our_group(port, 1, device, args["timeout_s"]), lambda payload: None)
    for step, (variant, _) in enumerate(schedule):
        if variant == "theirs":
            _theirs(ps, store, 1, step, None)
            continue
        result = receiver.receive(HANDOFF_S)
        if result is None or not result.ok:
            raise RuntimeError(f"{variant}: {result}")
    if receiver.receive(args["timeout_s"]) is not None:  # the sender's close of the group
        raise RuntimeError("expected the sender to close the sync group")


def _worker(ps_rank: int, index: int, port: int, hub: str, args: dict, schedule: list, *, our_ipc: bool) -> None:
    """Their inference worker (and, on 1 GPU, our IPC receiver): a plain torch process with a no-op apply."""
    import torch
    import zmq
    from checkpoint_engine import update_weights_from_ipc

    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.colocated import IpcReceiver

    store = _client_store(port, args["timeout_s"])
    context = zmq.Context()
    mine = _device_uuid(index)
    receiver = None
    if our_ipc:
        receiver = IpcReceiver(hub, "bench", 1, lambda payload: None, device=detect_device("cuda", index=index),
                               timeout_s=args["timeout_s"])
    for step, (variant, _) in enumerate(schedule):
        if variant == "theirs":
            paths = json.loads(store.get(f"theirs/{step}/{ps_rank}/paths"))
            # Their public worker entry point (worker.py): rebuilds the IPC buffer on this device and calls run
            # with (name, tensor) views per bucket; a no-op here, as our receiver's apply is.
            update_weights_from_ipc(context, paths[mine], device_id=index, run=lambda weights: None)
            store.set(f"theirs/{step}/{ps_rank}/done", "1")
        elif receiver is not None:
            result = receiver.receive(HANDOFF_S)
            if result is None or not result.ok:
                raise RuntimeError(f"{variant}: {result}")
    if receiver is not None:
        receiver.close()
    torch.cuda.synchronize()
    context.term()


# ---- the section -------------------------------------------------------------------------------------------


def plan(opts: dict, gpus: int, gpu_bytes: int, host_bytes: int) -> dict:
    """What would run: the path and the (scaled) sizes."""
    sizes = scaled_sizes(opts.get("sizes") or (QUICK_SIZES if opts.get("quick") else FULL_SIZES), gpu_bytes,
                         host_bytes)
    return {"path": "broadcast (cuda:0 → cuda:1)" if gpus >= 2 else "colocated (CUDA IPC on cuda:0)",
            "gpus": min(gpus, 2), "sizes": sizes}


def run(opts: dict, progress: Progress) -> dict:
    gpus = cuda_devices()
    if gpus < 1:
        return {"skipped": "no CUDA device in this process (torch.cuda.is_available() is False): nothing measured"}
    missing = anchor_missing()
    if missing:
        return {"skipped": missing}
    import torch

    from ckpt_engine.bench.common import meminfo

    host = meminfo().get("MemAvailable", 0)
    what = plan(opts, gpus, torch.cuda.get_device_properties(0).total_memory, host)
    if not what["sizes"]:
        return {"skipped": "not enough GPU or host memory for the smallest size (1 GiB)"}
    args = {"bucket_size": opts["bucket_size"], "repeats": opts["repeats"], "warmup": opts["warmup"],
            "timeout_s": opts["timeout_s"]}
    started = time.perf_counter()
    configs = []
    for gib, count in what["sizes"]:
        progress(f"  anchor: {what['path']}, {gib} GiB of bf16 in {count:,} tensors")
        configs.append(_config(what["gpus"], {"gib": gib, "tensors": count}, args, progress))
    return {"path": what["path"], "gpus": what["gpus"], "args": args, "configs": configs,
            "anchor": _anchor_version(), "wall_seconds": time.perf_counter() - started}


def _anchor_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("checkpoint-engine")


def _config(gpus: int, cfg: dict, args: dict, progress: Progress) -> dict:
    store = master_store(args["timeout_s"])
    hub = f"ckpt-anchor-bench-{uuid.uuid4().hex[:8]}"
    ranks = 2 if gpus == 1 else 4
    out = run_processes(_child, [(gpus, store.port, _free_port(), hub, cfg, args)] * ranks, deadline_s=900,
                        progress=progress, name="anchor")
    del store
    return summarize(cfg, out[0])


def summarize(cfg: dict, trainer: dict) -> dict:
    records = [r for r in trainer["records"] if r["round"] >= 0]
    seconds = {v: [r["seconds"] for r in records if r["variant"] == v] for v in LABEL}
    variants = {v: {"seconds": stats(x), "gbps": gbps(trainer["bytes"], stats(x))} for v, x in seconds.items() if x}
    update_only = [r["update"] for r in records if r["variant"] == "theirs"]
    if update_only:
        variants["theirs"]["update_only"] = stats(update_only)
    ratios = {v: paired_ratio(seconds[v], seconds["theirs"]) for v in ("ours_cached", "ours_bypass")}
    return {"name": f"{cfg['gib']} GiB × {cfg['tensors']:,}", "bytes": trainer["bytes"], "tensors": cfg["tensors"],
            "variants": variants, "ours_over_theirs": ratios, "digest": trainer["digest"]}


def render(result: dict) -> list[str]:
    if "skipped" in result:
        return [f"Side by side with {ANCHOR}: not measured ({result['skipped']}).", ""]
    a = result["args"]
    lines = [(f"Path: **{result['path']}**; their package {result['anchor']}; our bucket size "
             f"{a['bucket_size'] / MiB:g} MiB (theirs sizes its own); {a['repeats']} measured rounds after "
             f"{a['warmup']} warm-up round(s), variants interleaved, order rotated; median (min–max). Ratio ours ÷ "
             "theirs is per round (paired), below 1 is faster."), "",
             "| Model | Variant | Time s, median (min–max) | GB/s | Ours ÷ theirs |", "|---|---|---:|---:|---:|"]
    for c in result["configs"]:
        for v, e in c["variants"].items():
            ratio = c["ours_over_theirs"].get(v)
            cell = f"**{ratio['value']:.2f}** [{ratio['paired_min']:.2f}–{ratio['paired_max']:.2f}]" if ratio else "—"
            lines.append(f"| {c['name']} ({mib(c['bytes'])}) | {LABEL[v]} | {fmt_s(e['seconds'], 4)} | "
                         f"{e['gbps']['median']:.1f} | {cell} |")
    lines.append("")
    for c in result["configs"]:
        theirs = c["variants"].get("theirs", {})
        if "update_only" in theirs:
            lines.append(f"- {c['name']}: their `update` alone (after registration and gather_metas) "
                         f"{theirs['update_only']['median']:.4f} s")
        d = c["digest"]
        lines.append(f"- {c['name']}: device digest torch-block64 ({d['kernel']}) {d['gbps']:.1f} GB/s (goal ≥ "
                     f"{DIGEST_GOAL_GBPS:,.0f} GB/s)")
    return lines + [""]


_SIZE = re.compile(r"([1-9][0-9]{0,3})x([1-9][0-9]{0,7})")
_MIN_TENSOR_BYTES = 2 * COLS  # _model's smallest tensor: one bf16 row


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``16x500,16x20000``: models of GiB x tensors, each tensor at least one 512-byte row."""
    sizes = []
    for part in text.split(","):
        match = _SIZE.fullmatch(part)
        if match is None:
            raise argparse.ArgumentTypeError(f"{part!r}: expected GiBxTENSORS (e.g. 16x500), comma-separated")
        gib, count = int(match[1]), int(match[2])
        if count > (gib << 30) // _MIN_TENSOR_BYTES:
            raise argparse.ArgumentTypeError(f"{part!r}: {count:,} tensors of at least {_MIN_TENSOR_BYTES} bytes "
                                             f"do not fit {gib} GiB")
        sizes.append((gib, count))
    return tuple(sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="anchor_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 GiB sizes only")
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help="models as GiBxTENSORS, comma-separated (e.g. 16x500,16x20000); default the full set")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-size-mib", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="markdown table")
    parser.add_argument("--json", default=None, help="raw results")
    ns = parser.parse_args(argv)
    if ns.sizes and ns.quick:
        parser.error("--sizes and --quick each choose the models: give one")
    opts = {"sizes": ns.sizes, "quick": ns.quick, "repeats": ns.repeats, "warmup": ns.warmup,
            "bucket_size": ns.bucket_size_mib * MiB,
            "timeout_s": ns.timeout_s}
    result = run(opts, lambda text: print(text, file=sys.stderr, flush=True))
    text = "\n".join(["## Side by side with MoonshotAI's checkpoint-engine", "", *render(result)])
    write_report(text, result, ns.out, ns.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
