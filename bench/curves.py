"""Curves: time and GB/s against model size (e2e cached, bypass_cpu, raw broadcast) and against the number of
receivers, on the engine of :mod:`ckpt_engine.bench.sync_bench`. (The tensor-count curve comes from the side-by-side
section, which runs 100 → 20,000 tensors at fixed bytes.)

Every model size runs with 1 receiver and, where memory allows, with 2. Memory: every process holds the
model-sized buffers it needs (sender: the model, whose flat storage the raw broadcast reuses, plus the version
cache; each receiver: its staging buffer plus a raw receive buffer), about 2× the model per process; a point
whose estimate exceeds /proc/meminfo's MemAvailable is skipped, and the table says so.
"""

from __future__ import annotations

from typing import Any

from ckpt_engine.bench.common import GiB, MiB, Progress, fmt_s, meminfo
from ckpt_engine.bench.sync_bench import make_config, run_engine

VARIANTS = ("cached", "bypass", "raw")
LABEL = {"cached": "e2e cached", "bypass": "e2e bypass_cpu", "raw": "raw broadcast"}
TENSORS = 100
HEADER = ("| Model | Receivers | e2e cached s | GB/s | e2e bypass_cpu s | GB/s | raw broadcast s | GB/s "
          "| cached ÷ raw (throughput) | note |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def _need(size: int, world: int) -> int:
    return size * 2 * world + GiB  # ~2 model-sized buffers per process, plus interpreters and slack


def plan(opts: dict, available: int | None = None) -> dict:
    quick = opts["quick"]
    sizes = [64, 128] if quick else [64, 256, 1024, 4096]
    fixed = 64 if quick else 256
    avail = meminfo().get("MemAvailable", 0) if available is None else available
    points: list[dict] = []
    for world in (2, 3):
        for s in sizes:
            need = _need(s * MiB, world)
            fits = need <= avail
            points.append({"curve": "size", "mib": s, "world": world if fits else 0, "receivers": world - 1,
                           "note": None if fits else f"not run: needs ~{need / GiB:.0f} GiB, "
                                                     f"{avail / GiB:.1f} GiB available"})
    for receivers in (1, 2, 3):
        points.append({"curve": "receivers", "mib": fixed, "world": receivers + 1, "receivers": receivers,
                       "note": None})
    return {"points": points, "repeats": min(opts["repeats"], 3), "warmup": 1}


def run(opts: dict, progress: Progress) -> dict:
    p = plan(opts)
    by_world: dict[int, list[int]] = {}
    for pt in p["points"]:
        if pt["world"]:
            sizes = by_world.setdefault(pt["world"], [])
            if pt["mib"] not in sizes:
                sizes.append(pt["mib"])
    runs: dict[str, Any] = {}
    for world in sorted(by_world):
        sizes = sorted(by_world[world])
        configs = [make_config(s * MiB, TENSORS, VARIANTS, flat=True) for s in sizes]
        progress(f"  {world - 1} receiver(s): models {', '.join(f'{s} MiB' for s in sizes)}")
        runs[str(world)] = run_engine(world, configs, p["repeats"], p["warmup"], opts["bucket_size"],
                                      max(opts["timeout_s"], 300.0), progress)
    points = []
    for pt in p["points"]:
        row = None
        if pt["world"]:
            row = next(r for r in runs[str(pt["world"])]["rows"] if r["bytes"] == make_config(
                pt["mib"] * MiB, TENSORS, VARIANTS, flat=True).payload_bytes)
        points.append(pt | {"row": row})
    return {"points": points, "repeats": p["repeats"], "warmup": p["warmup"], "tensors": TENSORS,
            "bucket_size": opts["bucket_size"], "runs_wall_seconds": {w: r["wall_seconds"] for w, r in runs.items()}}


def render(result: dict, machine: dict, images: dict[str, str] | None = None) -> list[str]:
    images = images or {}
    lines: list[str] = []
    add = lines.append
    add(f"Models of {result['tensors']} float32 tensors, bucket {result['bucket_size'] // MiB} MiB, "
        f"{result['repeats']} measured rounds after {result['warmup']} warm-up round per point, variants "
        "interleaved as in the side-by-side section; raw = one broadcast of the same bytes on the same group. "
        "Time median (min–max) in s; GB/s of the median.")
    add("")
    for curve, title, alt in (("size", "Model size", "model size vs GB/s"),
                              ("receivers", "Receivers", "receivers vs time")):
        add(f"### {title}")
        add("")
        if curve in images:
            add(f"![{alt}]({images[curve]})")
            add("")
        add(HEADER)
        lines += [_row(pt) for pt in result["points"] if pt["curve"] == curve]
        add("")
    add(f"All receivers and the sender share the machine's {machine['usable_cores']} cores, so every added "
        "receiver also takes CPU from the others (gloo's loopback copies, each receiver's verification).")
    add("")
    return lines


def _row(pt: dict) -> str:
    row = pt["row"]
    receivers = pt["receivers"]
    if row is None:
        return f"| {pt['mib']} MiB | {receivers} | — | — | — | — | — | — | — | {pt['note'] or ''} |"
    cells = []
    for v in VARIANTS:
        e = row["variants"][v]
        cells += [fmt_s(e["seconds"]), f"{e['gbps']['median']:.2f}"]
    ratio = row["ratios"].get("raw_over_cached")
    r = f"{ratio['value']:.3f}" if ratio else "—"
    return f"| {pt['mib']} MiB | {receivers} | " + " | ".join(cells) + f" | {r} | {pt['note'] or ''} |"
