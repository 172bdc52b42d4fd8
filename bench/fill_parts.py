"""Where bypass_cpu's fill of many small tensors spends its time, on one CUDA device (a diagnostic beside the
``gpu`` section):

    python -m ckpt_engine.bench.fill_parts [--mib 64] [--count 4000] [--bucket-mib 64] [--rounds 9] [--odd]

The ``gpu`` section's model (``count`` float32 tensors of [rows, 64], ``mib`` MiB; ``--odd``: one row more or
less per tensor and an odd width, so the layout pads between tensors) filled into two device send slots as the
sender does (``fill_bucket``), beside its parts on the same bytes: the batched copies alone (one
``torch._foreach_copy_`` per bucket over views made beforehand), zeroing the padding views alone
(``torch._foreach_zero_``; the fill itself may zero a span in one memset instead: ``memset_spans``), zeroing whole
slots (one memset each), the host's time to queue a fill (no
synchronisation), the same fill captured once in a CUDA graph and replayed, and one device copy of the same bytes.
Medians of ``rounds`` after one warm-up; one JSON object per line. ``--device cpu`` checks the script here; its
figures mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from ckpt_engine.bench.common import device_timed
from ckpt_engine.plan import tensors as plan_tensors
from ckpt_engine.plan.layout import plan_layout


def _padding_views(buf: torch.Tensor, bucket) -> list[torch.Tensor]:
    """Views of every byte of ``bucket`` that no slot covers (what a fill zeroes)."""
    views, cursor = [], 0
    for slot in sorted(bucket.slots, key=lambda s: s.offset):
        if slot.offset > cursor:
            views.append(buf[cursor : slot.offset])
        cursor = max(cursor, slot.offset + slot.nbytes)
    if bucket.nbytes > cursor:
        views.append(buf[cursor : bucket.nbytes])
    return views


def _model(mib: int, count: int, odd: bool, device: torch.device) -> dict[str, torch.Tensor]:
    width = 63 if odd else 64
    rows = max(1, mib * (1 << 20) // 4 // count // width)
    gen = torch.Generator(device=device).manual_seed(7)
    return {f"layer{i}.weight": torch.randn(rows + (i % 3 - 1 if odd and rows > 1 else 0), width, generator=gen,
                                            device=device) for i in range(count)}


def _triton_gather(layout, tensors: dict[str, torch.Tensor], slots: list[torch.Tensor],
                   device: torch.device) -> dict[str, Callable[[], object]] | None:
    """A trial, not what ships: one Triton kernel per bucket copying every tensor from a device table of the
    sources' addresses (kept across versions), with and without the per-version check that the addresses still
    hold. float32 contiguous tensors only (what the model is). Checked byte-exact against ``fill_bucket``."""
    try:
        import triton  # type: ignore[import-not-found]
        import triton.language as tl  # type: ignore[import-not-found]
    except ImportError as exc:
        print(json.dumps({"form": "triton_gather", "skipped": str(exc)}), flush=True)
        return None

    @triton.jit
    def gather(src_ptrs, dst_words, n_words, dst, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        start = tl.program_id(1) * BLOCK
        n = tl.load(n_words + t)
        if start < n:
            src = tl.load(src_ptrs + t).to(tl.pointer_type(tl.int32))
            idx = start + tl.arange(0, BLOCK)
            mask = idx < n
            tl.store(dst + tl.load(dst_words + t) + idx, tl.load(src + idx, mask=mask), mask=mask)

    block = 1024
    tables = []
    for bucket in layout.buckets:
        names = [slot.name for slot in bucket.slots]
        sources = [tensors[name] for name in names]
        ptrs = [t.data_ptr() for t in sources]
        words = torch.tensor([slot.nbytes // 4 for slot in bucket.slots], dtype=torch.int64, device=device)
        tables.append((bucket, names, ptrs, torch.tensor(ptrs, dtype=torch.int64, device=device),
                       torch.tensor([slot.offset // 4 for slot in bucket.slots], dtype=torch.int64, device=device),
                       words, max(1, -(-max(s.nbytes // 4 for s in bucket.slots) // block))))

    def run(checked: bool) -> None:
        for bucket, names, ptrs, ptr_table, offsets, words, blocks in tables:
            if checked and [tensors[name].data_ptr() for name in names] != ptrs:
                raise RuntimeError("a source moved")
            out = slots[bucket.index % 2][: bucket.nbytes].view(torch.int32)
            gather[(len(names), blocks)](ptr_table, offsets, words, out, BLOCK=block)

    try:
        last = layout.buckets[-2:]  # what the slots hold after a fill of every bucket
        reference = {b.index: slots[b.index % 2][: b.nbytes].clone() for b in last}
        for s in slots:
            s.zero_()
        run(True)
        torch.cuda.synchronize(device)  # (a trial that runs on CUDA only)
        agree = all(torch.equal(slots[b.index % 2][: b.nbytes], reference[b.index]) for b in last)
        print(json.dumps({"form": "triton_gather", "agrees_with_fill_bucket": agree}), flush=True)
    except Exception as exc:  # noqa: BLE001 - a trial: report and go on
        print(json.dumps({"form": "triton_gather", "failed": repr(exc)[:500]}), flush=True)
        return None
    return {"triton_gather": lambda: run(False), "triton_gather_checked": lambda: run(True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--odd", action="store_true", help="shapes that leave padding between tensors")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fill_parts needs a CUDA device (or --device cpu to check the script)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    tensors = _model(args.mib, args.count, args.odd, device)
    layout = plan_layout(plan_tensors.specs_of(tensors), args.bucket_mib << 20)
    slots = [torch.empty(layout.max_bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat)

    def fill() -> None:
        for bucket in layout.buckets:
            plan_tensors.fill_bucket(slots[bucket.index % 2], bucket.slots, tensors, bucket.nbytes)

    fill()
    plans = [plan_tensors._fill_plan(slots[b.index % 2], b.slots, b.nbytes, 0, None) for b in layout.buckets]
    copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [
        (targets, [get(tensors)] if single else list(get(tensors)))  # type: ignore[call-overload,list-item]
        for plan in plans for span in plan.spans for get, single, targets, _ in span.batches]
    # The padding's views, made here from the layout: on an accelerator the fill itself may zero a span in one
    # memset instead (plan_tensors.zero_whole_span), and its plan then holds no views to time.
    gaps = [_padding_views(slots[b.index % 2], b) for b in layout.buckets]
    gaps = [views for views in gaps if views]
    memset_spans = sum(span.clear is not None for plan in plans for span in plan.spans)

    def copies_only() -> None:
        for targets, sources in copies:
            torch._foreach_copy_(targets, sources, non_blocking=True)

    def gaps_only() -> None:
        for views in gaps:
            torch._foreach_zero_(views)

    forms: dict[str, Callable[[], object]] = {
        "fill": fill,
        "foreach_copy_only": copies_only,
        "foreach_zero_gaps_only": gaps_only,
        "zero_whole_slots": lambda: [slots[b.index % 2][: b.nbytes].zero_() for b in layout.buckets],
        "d2d_copy": lambda: flat_dst.copy_(flat),
    }
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fill()
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph):
            fill()
        forms["fill_graph_replay"] = graph.replay
        gather = _triton_gather(layout, tensors, slots, device)
        if gather is not None:
            forms.update(gather)
    print(json.dumps({"model_mib": args.mib, "tensors": args.count, "buckets": len(layout.buckets),
                      "bytes": layout.total_bytes, "padding_views": sum(len(g) for g in gaps),
                      "memset_spans": memset_spans,
                      "copy_batches": len(copies), "device": torch.cuda.get_device_name(device)
                      if device.type == "cuda" else device.type}), flush=True)
    for name, fn in forms.items():
        seconds = device_timed(fn, args.rounds, device)
        print(json.dumps({"form": name, "ms": round(seconds * 1e3, 4),
                          "gbps": round(layout.total_bytes / seconds / 1e9, 1)}), flush=True)
    queued = device_timed(fill, args.rounds, device, synced=False)
    print(json.dumps({"form": "fill_host_queue_only", "ms": round(queued * 1e3, 4),
                      "us_per_tensor": round(queued * 1e6 / args.count, 3)}), flush=True)


if __name__ == "__main__":
    main()
