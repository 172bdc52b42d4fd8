"""Where a device digest's time goes, step by step, on one CUDA device (a diagnostic beside the ``gpu`` section):

    python -m ckpt_engine.bench.digest_parts [--mib 256] [--count 500] [--bucket-mib 64] [--rounds 5] [--device cpu]

A model of ``count`` float32 tensors (``mib`` MiB, random bytes) in buckets of ``bucket-mib`` MiB, every bucket
digested as the sender does (one call per bucket, the compiled graph of ``hashing.digest_rows``), beside each of
its steps compiled on its own on the same buckets: step 1 (weighted row sums), step 2 (the prefix sums,
torch.cumsum, eager), step 3 (the finish), the eager torch ops, and the read floor (an int64 sum of the same
bytes). Medians of ``rounds`` after one warm-up round;
prints one JSON object per line. Also checks that every form gives the eager digests.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from ckpt_engine.bench.common import device_timed
from ckpt_engine.plan import hashing
from ckpt_engine.plan.layout import TensorSpec, plan_layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: check the script here (with "
                        "CKPT_ENGINE_DIGEST_KERNEL=compiled); its figures mean nothing for a GPU")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("digest_parts needs a CUDA device")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    numel = args.mib * (1 << 20) // 4 // args.count
    specs = [TensorSpec(f"t{i}", "float32", (numel + (i % 7),)) for i in range(args.count)]
    layout = plan_layout(specs, bucket_size=args.bucket_mib << 20)
    flat = torch.randint(0, 255, (layout.total_bytes,), dtype=torch.uint8, device=device)
    buckets = [(b, flat[b.flat_offset : b.flat_offset + b.nbytes]) for b in layout.buckets]
    plans = [(hashing._bucket_plan(b, device, layout.digest), data.view(torch.int64)) for b, data in buckets]
    columns = hashing._columns(device)
    if hashing._compiled_fn(device) is None:
        raise SystemExit(f"the compiled digest is unavailable: {hashing.compile_failure(device)}")
    level1 = torch.compile(hashing.weighted_row_sums, dynamic=True)
    finish = torch.compile(hashing.finish, dynamic=True)

    def rest(plan: hashing._BucketPlan) -> tuple[torch.Tensor, ...]:
        return (plan.partial_rows, plan.partial_words, plan.partial_masks, plan.partial_of, plan.firsts, plan.ends,
                plan.unshift, plan.tails)

    def each(step: Callable[[hashing._BucketPlan, torch.Tensor, torch.Tensor], object]) -> Callable[[], None]:
        def run() -> None:
            for plan, words in plans:
                step(plan, words, hashing._powers(device, plan.rows)[: plan.rows])
        return run

    weighted = [level1(w, columns, hashing._powers(device, p.rows)[: p.rows]) for p, w in plans]
    prefixes = [hashing.prefix_sums(w) for w in weighted]
    forms: dict[str, Callable[[], object]] = {
        "read_floor": lambda: flat.view(torch.int64).sum(),
        "digest": lambda: [hashing.block64_bucket_digests(b, d, layout.digest) for b, d in buckets],
        "step1_level1": each(lambda p, w, k: level1(w, columns, k)),
        "step2_cumsum": lambda: [hashing.prefix_sums(w) for w in weighted],
        "step3_finish": lambda: [finish(pre, wt, w, columns, hashing._powers(device, p.rows)[: p.rows],
                                                 *rest(p)) for (p, w), pre, wt in zip(plans, prefixes, weighted)],
        "eager": each(lambda p, w, k: hashing.digest_rows(w, columns, k, *rest(p))),
    }
    reference = [hashing.digest_rows(w, columns, hashing._powers(device, p.rows)[: p.rows], *rest(p))[: p.n]
                 for p, w in plans]
    digests = [hashing.block64_bucket_digests(b, d, layout.digest) for b, d in buckets]
    agree = all(torch.equal(a, b) for a, b in zip(reference, digests))
    print(json.dumps({"model_mib": args.mib, "tensors": args.count, "buckets": len(plans), "agree": agree,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type}),
          flush=True)
    for name, fn in forms.items():
        seconds = device_timed(fn, args.rounds, device)
        print(json.dumps({"form": name, "s": round(seconds, 6), "gbps": round(layout.total_bytes / seconds / 1e9, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
