"""The device digest (torch-block64) run on this machine's CPU, beside a memcpy of the same bytes.

    ckpt-engine bench --only digest [--quick]        (or: python -m ckpt_engine.bench.digest_bench)

The code that digests device buckets (``plan/hashing.py``: level 1 per 256-byte row, then one combine per bucket)
on CPU tensors: 256 MiB of float32 as 1 tensor, as 100 and as 4,000 tensors, every bucket of the layout digested as
the sender does (one call per bucket), in both forms:

- ``eager``: torch ops, level 1 in chunks of rows (the CPU's default form);
- ``compiled``: ``torch.compile`` of the same function (C++ inductor here, Triton on CUDA): one fused read;

beside ``memcpy`` (one ``copy_`` of the same bytes), ``read`` (an int64 sum over them: the read-and-reduce floor)
and ``xxh3`` (the CPU's own digest, xxh3-64 per tensor over host bytes). The digest's work is one read of the
bytes plus one value per row, so its time must not grow with the tensor count beyond what the bytes explain:
the target is time per byte at 4,000 tensors ÷ at 1 tensor ≤ GOAL_TENSOR_GROWTH, for each form. In a process of
its own; variants interleaved, order rotated every round, after warm-up rounds (the compile is done before).
The GPU figures (goal ≥ 1,000 GB/s) come from the ``gpu`` section on a CUDA machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt_engine.bench.common import (
    MiB,
    Progress,
    fmt_s,
    gbps,
    mib,
    paired_ratio,
    rotated_rounds,
    run_processes,
    stats,
)

if TYPE_CHECKING:
    from ckpt_engine.device import DigestAlgo

MODEL_MIB = 256
COUNTS = (1, 100, 4000)
VARIANTS = ("memcpy", "read", "eager", "compiled", "xxh3")
GOAL_TENSOR_GROWTH = 1.25  # time per byte at 4,000 tensors ÷ at 1 tensor, per digest form (noise allowance)
LABEL = {
    "memcpy": "raw: one copy_ of the same bytes (memcpy)",
    "read": "raw: int64 sum of the same bytes (read floor)",
    "eager": "torch-block64, eager torch ops (the CPU's default form)",
    "compiled": "torch-block64, torch.compile (C++ inductor)",
    "xxh3": "xxh3-64 per tensor over host bytes (the CPU's own digest)",
}


def _child(rank: int, results: Any, args: dict) -> dict:
    import torch

    from ckpt_engine.plan import hashing

    os.environ[hashing.KERNEL_ENV] = "compiled"
    t0 = time.perf_counter()
    try:  # compiles and checks before anything is timed
        hashing.device_digest_kernel(torch.device("cpu"))
        variants: tuple[str, ...] = VARIANTS
        failure = None
    except RuntimeError as exc:  # no C++ compiler here, say: the rest is still measured
        variants, failure = tuple(v for v in VARIANTS if v != "compiled"), str(exc)
    out: dict[str, Any] = {"compile_seconds": time.perf_counter() - t0, "compile_failure": failure,
                           "threads": torch.get_num_threads(), "configs": []}
    for count in args["counts"]:
        results.put(("progress", 0, f"  digest: {args['mib']} MiB in {count:,} tensors"))
        out["configs"].append(_config(count, variants, args))
    return out


def _config(count: int, variants: tuple[str, ...], args: dict) -> dict:
    import torch

    from ckpt_engine.plan import hashing
    from ckpt_engine.plan.layout import TensorSpec, plan_layout

    rows = max(1, args["mib"] * MiB // 4 // count // 64)
    specs = [TensorSpec(f"layer{i}.weight", "float32", (rows, 64)) for i in range(count)]
    layout = plan_layout(specs, args["bucket_size"])
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty_like(flat)
    buckets = [(b, flat[b.flat_offset : b.flat_offset + b.nbytes]) for b in layout.buckets]

    def digest(kernel: str, algo: DigestAlgo = "torch-block64") -> Callable[[], None]:
        def run() -> None:
            os.environ[hashing.KERNEL_ENV] = kernel
            torch.cat([hashing.bucket_digests(b, view, algo, layout.digest) for b, view in buckets])
        return run

    ops = {"memcpy": lambda: dst.copy_(flat), "read": lambda: flat.view(torch.int64).sum(),
           "eager": digest("eager"), "compiled": digest("compiled"), "xxh3": digest("eager", "xxh3-64")}
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for variant, rnd in rotated_rounds(variants, args["repeats"], args["warmup"]):
        t0 = time.perf_counter()
        ops[variant]()
        seconds = time.perf_counter() - t0
        if rnd >= 0:
            samples[variant].append(seconds)
    return {"name": f"{args['mib']} MiB × {count:,}", "tensors": count, "bytes": layout.total_bytes,
            "buckets": len(layout.buckets), "samples": samples}


def run(opts: dict, progress: Progress) -> dict:
    args = {"mib": MODEL_MIB, "counts": COUNTS, "bucket_size": opts["bucket_size"],
            "repeats": opts["repeats"], "warmup": opts["warmup"]}
    (child,) = run_processes(_child, [(args,)], deadline_s=900, progress=progress, name="digest")
    configs = []
    for c in child["configs"]:
        entry = dict(c)
        entry["variants"] = {v: {"seconds": stats(x), "gbps": gbps(c["bytes"], stats(x))}
                             for v, x in c["samples"].items() if x}
        s = c["samples"]
        entry["ratios"] = {f"{v}_vs_memcpy": paired_ratio(s["memcpy"], s[v]) for v in ("eager", "compiled", "read")
                           if v in s}
        configs.append(entry)
    first = configs[0]
    growth = {}
    for v in ("eager", "compiled"):
        if v not in first["variants"]:
            continue
        per_byte = {c["tensors"]: c["variants"][v]["seconds"]["median"] / c["bytes"] for c in configs}
        growth[v] = {str(n): per_byte[n] / per_byte[first["tensors"]] for n in per_byte}
    return {"args": args, "compile_seconds": child["compile_seconds"], "compile_failure": child["compile_failure"],
            "threads": child["threads"],
            "configs": configs, "growth": growth}


def target_measurements(result: dict) -> list[tuple[str, float, str]]:
    """(where, time per byte at the most tensors ÷ at 1 tensor, detail) per digest form."""
    if "skipped" in result:
        return []
    last = result["configs"][-1]
    out = []
    for v in result["growth"]:
        value = result["growth"][v][str(last["tensors"])]
        many, one = last["variants"][v]["gbps"]["median"], result["configs"][0]["variants"][v]["gbps"]["median"]
        rates = f"({many:.2f} vs {one:.2f} GB/s)"
        out.append((f"{v}, {last['tensors']:,} ÷ 1 tensor", value, rates))
    return out


def render(result: dict, machine: dict) -> list[str]:
    a = result["args"]
    compiled = (f"The compiled form took {result['compile_seconds']:.1f} s to compile and check (once per "
                "process; the inductor cache keeps it across runs)." if not result.get("compile_failure") else
                f"**The compiled form could not be built here** ({result['compile_failure'][:300]}): not measured.")
    intro = (f"The device digest's code on CPU tensors ({result['threads']} torch threads): {a['mib']} MiB of float32 "
             f"in 1, 100 and 4,000 tensors, bucket size {a['bucket_size'] / MiB:g} MiB, every bucket digested as the "
             f"sender does. {a['repeats']} measured rounds after {a['warmup']} warm-up round(s), variants "
             f"interleaved; median (min–max). {compiled}")
    lines = [intro, ""]
    for c in result["configs"]:
        lines += [f"**{c['name']}** ({mib(c['bytes'])}, {c['buckets']} buckets)", "",
                  "| Variant | Time s, median (min–max) | GB/s | ÷ memcpy time |", "|---|---:|---:|---:|"]
        for v, e in c["variants"].items():
            r = c["ratios"].get(f"{v}_vs_memcpy")
            share = f"{1 / r['value']:.2f}" if r else ("1.00" if v == "memcpy" else "—")
            lines.append(f"| {LABEL[v]} | {fmt_s(e['seconds'], 4)} | {e['gbps']['median']:.2f} | {share} |")
        lines.append("")
    g = result["growth"]
    lines += ["Time per byte ÷ that at 1 tensor (goal ≤ " f"{GOAL_TENSOR_GROWTH:g} at 4,000): "
              + "; ".join(f"{v}: " + ", ".join(f"{int(n):,} tensor{'s' * (n != '1')} {x:.2f}" for n, x in g[v].items())
                           for v in g)
              + ". On a GPU the compiled form is one Triton kernel per bucket at memory speed (goal ≥ 1,000 GB/s, "
              "section *GPU data paths*).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="digest_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mib", type=float, default=64)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    opts = {"bucket_size": int(args.bucket_mib * MiB), "repeats": args.repeats, "warmup": args.warmup}
    result = run(opts, print)
    print("\n".join(render(result, {})))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
