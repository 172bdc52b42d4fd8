"""The benchmark suite: one command measures everything and writes one report.

    ckpt-engine bench [--quick] [--json PATH] [--out PATH]        (or: python -m ckpt_engine.bench.suite ...)

Sections (each in its own module, run in this order; ``--only`` / ``--skip`` pick them):

- ``side_by_side``  (bench/sync_bench.py): ckpt-engine e2e cached and bypass_cpu vs raw broadcast, memcpy,
                    per-tensor broadcast loop, safetensors disk round trip (local disk, /dev/shm), 100 → 20,000
                    tensors at fixed bytes.
- ``owners``        (bench/owners_bench.py): trainer held time and per-rank host cache with 1, 2 and 4 trainer
                    ranks owning shares of each version.
- ``ipc``           (bench/ipc_bench.py): the same-host shared-memory path vs memcpy and gloo.
- ``curves``        (bench/curves.py): model size 64 MiB → 4 GiB, receivers 1 → 3.
- ``memory``        (bench/receiver_memory.py, bench/staging_bench.py): receiver peak extra memory during a sync
                    vs bucket size; per receiver staging (device / host / stream): receiver and trainer peak
                    memory in buckets, time to verified / applied.
- ``trainer``       (bench/trainer_overhead.py): training step time during a cached sync vs idle.
- ``daemon_e2e``    (bench/daemon_e2e.py): POST /sync → every receiver verified, through the real daemon.
- ``control_plane`` (bench/control_plane.py): GET /versions and POST /sync latency at ~200 requests/s.
- ``sparse``        (bench/sparse_bench.py): sparse sync of 1% / 10% / 50% of the tensors vs a full sync.
- ``load``          (bench/load_bench.py): 200 requests/s of mixed reads for 60 s (quick: 10 s) while versions
                    run back to back: errors, latency per endpoint, sync time vs without the load.
- ``netns``         (bench/netns_bench.py): trainer and receivers in network namespaces of their own, on
                    rate-limited veth links (tc): full vs sharded delivery at TP 2 and 4, the raw broadcast,
                    and full delivery pulled over NIXL (root only; skipped saying why elsewhere).
- ``join``          (bench/join_bench.py): a receiver joining a running daemon, pushed vs pulled (NIXL): time
                    to its catch-up, and what its first regular version costs the others.
- ``pull_pieces``   (bench/pull_pieces.py): the same bytes pulled over NIXL as one read or as 512 B - 32 KiB
                    pieces (a column piece is read one row at a time): puller time and CPU, owner CPU.
- ``digest``        (bench/digest_bench.py): the device digest's code (torch-block64, eager and compiled) on CPU
                    tensors, 256 MiB in 1, 100 and 4,000 tensors, beside a memcpy of the same bytes.
- ``gpu``           (bench/gpu_bench.py): the CUDA data paths against their raw copies (snapshot, bypass fill,
                    device digest vs PCIe and the read floor, CUDA IPC, NCCL); says so and measures nothing
                    without CUDA.

It writes the markdown report (default docs/benchmarks.md), PNG plots next to it (bench-*.png) and, with
``--json``, every measured figure. Every number in the report comes from the run. ``--quick`` takes about
1–3 minutes on a 2-core machine; the full run is sized to stay under 15 minutes there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_engine.bench import (
    control_plane,
    curves,
    daemon_e2e,
    digest_bench,
    gpu_bench,
    ipc_bench,
    join_bench,
    load_bench,
    netns_bench,
    owners_bench,
    plots,
    pull_pieces,
    receiver_memory,
    staging_bench,
    sync_bench,
    trainer_overhead,
)
from ckpt_engine.bench.common import GiB, MiB, machine_info

# under the working directory (a checkout's root: its docs/); a quick run never overwrites the full report
DEFAULT_OUT = Path("docs") / "benchmarks.md"
QUICK_OUT = Path("docs") / "benchmarks-quick.md"

class _SparseSection:
    """bench/sparse_bench.py exposes ``run(quick, progress)`` and ``section(result)``: adapt them."""

    @staticmethod
    def run(opts: dict, progress: Callable[[str], None]) -> dict:
        from ckpt_engine.bench import sparse_bench

        return sparse_bench.run(opts["quick"], progress)

    @staticmethod
    def render(result: dict, machine: dict) -> list[str]:
        from ckpt_engine.bench import sparse_bench

        lines = list(sparse_bench.section(result))
        while lines and (lines[0].startswith("## ") or not lines[0].strip()):  # the suite numbers its headings
            lines.pop(0)
        return lines


SECTIONS: list[tuple[str, str, Any]] = [
    ("side_by_side", "Side by side: ckpt-engine vs the alternatives", sync_bench),
    ("owners", "Owner-sharded versions: 1, 2 and 4 trainer ranks", owners_bench),
    ("ipc", "Same-host shared-memory path", ipc_bench),
    ("curves", "Curves: model size and receivers", curves),
    ("memory", "Receiver memory during a sync", receiver_memory),
    ("trainer", "Trainer step time during a cached sync", trainer_overhead),
    ("daemon_e2e", "Through the daemon: POST /sync → every receiver verified", daemon_e2e),
    ("control_plane", "Control plane under load", control_plane),
    ("sparse", "Sparse sync vs full sync", _SparseSection),
    ("load", "Load: mixed reads while versions run", load_bench),
    ("netns", "Network-bound cluster: full vs sharded delivery, pushed vs pulled, on rate-limited links", netns_bench),
    ("join", "Elastic join: a receiver registering while the daemon runs, pushed vs pulled", join_bench),
    ("pull_pieces", "Pulled pieces by size: one read a row of a column piece vs one read", pull_pieces),
    ("digest", "Device digest on the CPU (torch-block64)", digest_bench),
    ("gpu", "GPU data paths (CUDA)", gpu_bench),
]
SECTION_NAMES = [s[0] for s in SECTIONS]


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="sections: " + ", ".join(SECTION_NAMES))
    p.add_argument("--quick", action="store_true", help="smaller models, fewer repetitions (~1-3 minutes)")
    p.add_argument("--json", metavar="PATH", help="also write every measured figure as JSON")
    p.add_argument("--out", metavar="PATH", default=None,
                   help=f"markdown report (default {DEFAULT_OUT}, with --quick {QUICK_OUT}, under the working "
                        "directory); plots go next to it")
    p.add_argument("--only", metavar="LIST", help="comma-separated sections to run (default: all)")
    p.add_argument("--skip", metavar="LIST", help="comma-separated sections to leave out")
    p.add_argument("--repeats", type=int, default=None, help="measured rounds per variant (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="unreported warm-up rounds (default 1)")
    p.add_argument("--bucket-mib", type=float, default=64, help="bucket size in MiB (default 64)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-collective timeout in seconds")
    p.add_argument("--from-json", metavar="PATH", help="measure nothing: write the report and plots of an earlier "
                   "run from its --json output")
    p.add_argument("--merge-json", metavar="PATH", action="append", default=[],
                   help="add the sections another run measured (its --json output) where this one has none, "
                   "e.g. the gpu section of scripts/gpu-check.sh OUTDIR/gpu-bench.json; repeatable")
    args = p.parse_args(argv)
    for opt in ("only", "skip"):
        value = getattr(args, opt)
        if value:
            bad = [s for s in value.split(",") if s.strip() not in SECTION_NAMES]
            if bad:
                p.error(f"--{opt}: unknown section(s) {bad}; known: {', '.join(SECTION_NAMES)}")
    return args


def main(argv: list[str] | None = None, prog: str = "python -m ckpt_engine.bench.suite") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    if importlib.util.find_spec("matplotlib") is None:  # before anything is measured
        print("error: the benchmark suite draws its plots with matplotlib, which is not installed here: "
              "pip install matplotlib (or, in a checkout, pip install -e '.[bench]'; scripts/setup.sh does)",
              file=sys.stderr)
        return 2
    chosen = [s.strip() for s in args.only.split(",")] if args.only else list(SECTION_NAMES)
    if args.skip:
        chosen = [s for s in chosen if s not in {x.strip() for x in args.skip.split(",")}]
    opts = {"quick": args.quick, "repeats": args.repeats if args.repeats is not None else (3 if args.quick else 5),
            "warmup": args.warmup, "bucket_size": int(args.bucket_mib * MiB), "timeout_s": args.timeout}
    out_path = Path(args.out) if args.out else (QUICK_OUT if args.quick else DEFAULT_OUT)
    if args.from_json:
        return _write(merge_sections(json.loads(Path(args.from_json).read_text()), args.merge_json), out_path,
                      args.json)
    command = " ".join([prog, *map(shlex.quote, argv)])
    print(f"command: {command}", flush=True)
    machine = machine_info()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    started = time.perf_counter()
    for name, title, module in SECTIONS:
        if name not in chosen:
            continue
        print(f"\n== {name}: {title} ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = module.run(opts, _progress)
        except Exception:  # noqa: BLE001 - one failing section must not lose the others: reported in the markdown
            errors[name] = traceback.format_exc()
            print(f"section {name} FAILED:\n{errors[name]}", flush=True)
        timings[name] = time.perf_counter() - t0
        print(f"   {name} took {timings[name]:.1f}s", flush=True)
    wall = time.perf_counter() - started
    report = {"command": command, "machine": machine, "settings": opts, "sections": chosen,
              "wall_seconds": wall, "section_seconds": timings, "errors": errors, "results": results}
    report = merge_sections(report, args.merge_json)
    print(f"total wall time {wall:.1f}s", flush=True)
    return _write(report, out_path, args.json)


def merge_sections(report: dict, paths: list[str]) -> dict:
    """Sections measured by other runs (such as the gpu section of a GPU machine's scripts/gpu-check.sh run)
    where this report has none, or only a skip; each keeps the name of the run and machine it comes from."""
    for path in paths:
        other = json.loads(Path(path).read_text())
        for name, result in other.get("results", {}).items():
            mine = report["results"].get(name)
            if name not in SECTION_NAMES or (mine is not None and not (isinstance(mine, dict) and mine.get("skipped"))):
                continue
            report["results"][name] = result
            report["errors"].pop(name, None)
            report.setdefault("merged", {})[name] = {"command": other.get("command"),
                                                     "machine": other.get("machine", {}), "file": Path(path).name}
            if name not in report["sections"]:
                report["sections"].append(name)
    report["targets"] = evaluate_targets(report)
    return report


def _write(report: dict, out_path: Path, json_path: str | None) -> int:
    """Plots, markdown and (optionally) JSON of a run; prints the targets. Non-zero when a section failed."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if json_path:  # first: whatever fails below, the measured figures are kept (--from-json renders them again)
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1, default=str))
    images: dict[str, str] = {}
    machine = report["machine"]
    try:
        bars, bar_title = compare_bars(report)
        subtitle = (f"{'quick' if report['settings']['quick'] else 'full'} run, {machine['usable_cores']} CPU "
                    f"cores, gloo, {machine['date_utc']}")
        prefix = "bench" if out_path.stem == "benchmarks" else f"bench-{out_path.stem.removeprefix('benchmarks-')}"
        images = plots.make_all(report["results"], out_path.parent, subtitle, bars, bar_title, prefix)
    except Exception:  # noqa: BLE001 - no matplotlib, say: the report still comes out, without pictures
        report["errors"]["plots"] = traceback.format_exc()
        print(f"plots FAILED:\n{report['errors']['plots']}", flush=True)
    report["images"] = images
    out_path.write_text(render(report))
    print(f"\nwrote {out_path}" + (f" and {', '.join(images.values())}" if images else ""), flush=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {json_path}", flush=True)
    print(flush=True)
    for t in report["targets"]:
        print(f"{t['status']:<13} {t['target']}: {t['summary']}", flush=True)
    return 1 if any(k != "plots" for k in report["errors"]) else 0


def _progress(text: str) -> None:
    print(text, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------------------


def _check(op: str, value: float, threshold: float) -> bool:
    return value >= threshold if op == ">=" else (value <= threshold if op == "<=" else value < threshold)


def evaluate_targets(report: dict) -> list[dict]:
    res, errors = report["results"], report["errors"]
    targets: list[dict] = []

    def add(target: str, op: str, threshold: float, unit: str, section: str,
            measurements: Callable[[], list[tuple[str, float, str]]], how: str) -> None:
        entry: dict[str, Any] = {"target": target, "op": op, "threshold": threshold, "unit": unit, "how": how}
        if section not in res:
            entry.update(status="NOT MEASURED", measured=[],
                         summary="section failed" if section in errors else "section not run")
        elif isinstance(res[section], dict) and res[section].get("skipped"):
            entry.update(status="NOT MEASURED", measured=[], summary=res[section]["skipped"])
        else:
            ms = measurements()
            if not ms:
                entry.update(status="NOT MEASURED", measured=[], summary="no data")
            else:
                met = [(w, v, rng, _check(op, v, threshold)) for w, v, rng in ms]
                n_met = sum(m[3] for m in met)
                entry["measured"] = [{"where": w, "value": v, "range": rng, "met": ok} for w, v, rng, ok in met]
                entry["status"] = "MET" if n_met == len(met) else "MISSED"
                entry["summary"] = "; ".join(f"{w}: {v:.3f}{unit}{' ' + rng if rng else ''} "
                                             f"{'met' if ok else 'missed'}" for w, v, rng, ok in met)
                if len(met) > 1:
                    entry["summary"] += f" (met at {n_met} of {len(met)})"
        targets.append(entry)

    def side_ratio(key: str, rows_filter: Callable[[dict], bool] | None = None) -> list[tuple[str, float, str]]:
        rows = res["side_by_side"]["rows"]
        out = []
        for row in rows:
            if rows_filter is None or rows_filter(row):
                r = row["ratios"].get(key)
                if r:
                    out.append((row["name"], r["value"], f"[{r['paired_min']:.3f}–{r['paired_max']:.3f}]"))
        return out

    def biggest(row: dict) -> bool:
        return row["num_tensors"] == max(r["num_tensors"] for r in res["side_by_side"]["rows"]
                                         if "per_tensor" in r["variants"])

    def every_variant(row: dict) -> bool:
        return set(sync_bench.ALL_VARIANTS) <= set(row["variants"])

    add("ckpt-engine e2e (cached) throughput ÷ raw broadcast, 100 and 2,000 tensors", ">=", 0.9, "", "side_by_side",
        lambda: side_ratio("raw_over_cached", lambda row: row["num_tensors"] in (100, 2000)),
        "raw time / cached time-to-verified, same bytes, same group")
    add("ckpt-engine e2e (cached) throughput ÷ raw broadcast, 20,000 tensors", ">=", 0.8, "", "side_by_side",
        lambda: side_ratio("raw_over_cached", lambda row: row["num_tensors"] == 20000), "the same at 20,000 tensors")
    add("ckpt-engine e2e (cached) throughput ÷ raw broadcast, 100,000 tensors (reported)", ">=", 0.0, "",
        "side_by_side", lambda: side_ratio("raw_over_cached", lambda row: row["num_tensors"] == 100000),
        "the same at 100,000 tensors: no goal, reported")

    add("ckpt-engine e2e (cached) no slower than a per-tensor broadcast loop, 100 tensors", ">=", 1.0, "×",
        "side_by_side", lambda: side_ratio("per_tensor_over_cached", lambda row: row["num_tensors"] == 100),
        "per-tensor loop time / cached time-to-verified")
    add("cached time-to-verified: send after the whole snapshot ÷ overlapped with it (reported)", ">=", 0.0, "",
        "side_by_side", lambda: side_ratio("cached_over_overlap", lambda row: row["num_tensors"] in (100, 2000)),
        "> 1: the overlap saves time; the CPU-bound table says why it saves little on shared cores")
    add("cached trainer-held: overlapped ÷ send after the snapshot (reported)", ">=", 0.0, "", "side_by_side",
        lambda: side_ratio("held_overlap_over_cached", lambda row: row["num_tensors"] in (100, 2000)),
        "> 1: the overlapped send takes the cores the snapshot needs (why CPU trainers do not overlap by default)")
    add("cached e2e: its CPU bound (CPU s of every process ÷ cores) ÷ its time (reported)", ">=", 0.0, "",
        "side_by_side", lambda: side_ratio("cpu_bound_over_cached", lambda row: row["num_tensors"] in (100, 2000)),
        "near the raw broadcast's own: both are CPU-bound here, and e2e ÷ raw follows their CPU work")

    def slope_measure() -> list[tuple[str, float, str]]:
        slopes = res["side_by_side"].get("slopes", {})
        return [(VARIANT, slopes[VARIANT]["slope_s"] * 1e6, f"({slopes[VARIANT]['points']} tensor counts)")
                for VARIANT in ("cached", "bypass") if VARIANT in slopes]

    add("per-tensor slope of e2e time at fixed bytes", "<=", 2.0, " µs", "side_by_side", slope_measure,
        "least-squares slope of the median time-to-verified over the tensor counts")

    def owners_measure(key: str) -> Callable[[], list[tuple[str, float, str]]]:
        def measure() -> list[tuple[str, float, str]]:
            r = res["owners"]["ratios"].get(key)
            if r is None:
                return []
            rng = f"[{r['paired_min']:.3f}–{r['paired_max']:.3f}]" if "paired_min" in r else ""
            return [(f"{res['owners']['args']['bytes'] // MiB} MiB, 4 ranks ÷ 1", r["value"], rng)]
        return measure

    add("trainer held time (cached), 4 trainer ranks ÷ 1", "<=", 0.35, "", "owners",
        owners_measure("held_cached_4_over_1"), "slowest rank's publish() return with 4 owners / with 1")
    add("host cache per rank, 4 trainer ranks ÷ 1", "<=", 0.3, "", "owners", owners_measure("cache_4_over_1"),
        "largest rank's cache bytes with 4 owners / the single rank's")
    add("speedup over a per-tensor broadcast loop at 20k tensors", ">=", 20, "×", "side_by_side",
        lambda: side_ratio("per_tensor_over_cached", biggest), "per-tensor loop time / cached time-to-verified")
    add("speedup over a safetensors round trip on local disk", ">=", 3, "×", "side_by_side",
        lambda: side_ratio("disk_local_over_cached", every_variant),
        "save → every receiver loaded + copied / cached time")
    add("speedup over a safetensors round trip on /dev/shm", ">=", 3, "×", "side_by_side",
        lambda: side_ratio("disk_shm_over_cached", every_variant), "the same with the file on tmpfs")
    add("bypass_cpu time-to-verified ÷ cached", "<=", 0.8, "", "side_by_side",
        lambda: side_ratio("bypass_over_cached", every_variant), "bypass time / cached time")
    add("cached trainer-held ÷ bypass_cpu trainer-held", "<=", 0.25, "", "side_by_side",
        lambda: side_ratio("held_cached_over_bypass", every_variant), "publish() return / params_released")

    def sparse_measure() -> list[tuple[str, float, str]]:
        r = res["sparse"]
        ten = r.get("ratio_vs_full", {}).get("sparse 10%")
        return [] if ten is None else [(f"{r['args']['mib']} MiB × {r['args']['tensors']:,}", ten, "")]

    add("sparse sync of 10% of the tensors ÷ full sync", "<=", 0.2, "", "sparse", sparse_measure,
        "time of a version with 10% of the tensors changed / time of a full version")

    def ipc_measure() -> list[tuple[str, float, str]]:
        r = res["ipc"]["ratios"]["ipc_cached_vs_memcpy"]
        rng = f"[{r['paired_min']:.3f}–{r['paired_max']:.3f}]"
        return [(f"{res['ipc']['args']['mib']} MiB cached", r["value"], rng)]

    add("same-host shared-memory path throughput ÷ memcpy", ">=", 0.7, "", "ipc", ipc_measure,
        "memcpy time / shared-memory cached time-to-verified")

    def staging(key: str) -> Callable[[], list[tuple[str, float, str]]]:
        return lambda: staging_bench.target_measurements(res["memory"].get("staging", {})).get(key, [])

    add("receiver peak extra memory ÷ bucket, stream staging, beyond the one-time cost (no tensor larger than a "
        "bucket)", "<=", staging_bench.GOAL_STREAM_BUCKETS, "", "memory", staging("stream_memory"),
        "peak RSS during a version − RSS after the process's first (tiny) sync, ÷ bucket size")
    add("trainer peak extra memory ÷ bucket, largest tensor 4× the bucket (beyond the cached version and the "
        "one-time cost)", "<=", staging_bench.GOAL_SENDER_BUCKETS, "", "memory", staging("sender_memory"),
        "peak RSS while publishing − RSS after the first (tiny) version, less the host cache, ÷ bucket size")
    add("memory a process's first sync adds once, whatever the bucket (MiB)", "<=", staging_bench.GOAL_ONE_TIME_MIB,
        " MiB", "memory", staging("one_time_memory"), "RSS after a first version of one 64 KiB tensor − RSS before")
    add("stream ÷ device staging time-to-applied", "<=", staging_bench.GOAL_STREAM_OVER_DEVICE, "", "memory",
        staging("stream_time"), "publish start → the receiver's result, median of the per-round ratios")

    def trainer_measure() -> list[tuple[str, float, str]]:
        t = res["trainer"]
        return [(f"{t['args']['mib']} MiB sync", t["ratio"], "")]

    add("trainer step during a cached sync ÷ idle step", "<=", 1.1, "", "trainer", trainer_measure,
        "median step time while a transfer is in flight / idle median")

    def post_measure() -> list[tuple[str, float, str]]:
        a = res["control_plane"]["post_accepted"]
        return [] if not a["n"] else [(f"{a['n']} accepted", a["p50"] * 1e3, "")]

    def get_measure() -> list[tuple[str, float, str]]:
        g, late = res["control_plane"]["get_versions"], res["control_plane"].get("late_p99")
        # a starved generator (this shared machine's other load) delays the daemon as much: say how late it was
        starved = f" (generator late by p99 {late * 1e3:.1f} ms)" if late is not None else ""
        return [] if not g["n"] else [(f"{g['n']} requests{starved}", g["p99"] * 1e3, "")]

    add("POST /sync accept latency p50 (ms)", "<", 5, " ms", "control_plane", post_measure,
        f"at ~{control_plane.RATE:.0f} requests/s")
    add("GET /versions latency p99 (ms)", "<", 20, " ms", "control_plane", get_measure,
        f"at ~{control_plane.RATE:.0f} requests/s")

    def netns(key: str) -> Callable[[], list[tuple[str, float, str]]]:
        return lambda: netns_bench.target_measurements(res["netns"]).get(key, [])

    add("sharded delivery on rate-limited links: (sharded ÷ full time) × TP", "<=", 1.2, "", "netns", netns("time"),
        "the same receivers, whole model vs each its TP rank's ranges; ≤ 1.2 is sharded ÷ full ≤ 1/TP × 1.2")
    add("sharded delivery: bytes a receiver gets ÷ model bytes, less 1/TP", "<=", 0.05, "", "netns", netns("bytes"),
        "Llama-style model (q/k/v, gate/up, down, embeddings split; norms whole)")
    add("owner-sharded versions on rate-limited links: 4 owners ÷ 1 owner time", "<=", 0.35, "", "netns",
        netns("owners"), "each trainer rank on a link of its own, full delivery")
    add("pulled over NIXL ÷ pushed on rate-limited links, the same delivery", "<=", 1.0, "", "netns", netns("pull"),
        "transport nixl: each receiver reads the owners' cached shares over UCX/TCP on its link (sharded: its "
        "pieces only)")
    add("sharded pull from 4 owners ÷ full push from 1 owner, TP=4", "<=", 0.1, "", "netns", netns("pull_owners"),
        "each trainer rank and each receiver on a link of its own")

    def join(key: str) -> Callable[[], list[tuple[str, float, str]]]:
        return lambda: join_bench.target_measurements(res["join"]).get(key, [])

    add("elastic join: registration to the newest version held, pulled ÷ pushed", "<=", 1.0, "", "join",
        join("join"), "a third receiver joins a running daemon; its catch-up, nixl vs collective")
    add("elastic join: the first version after it ÷ the versions after that (same receivers)", "<=", 1.2, "",
        "join", join("cost"), "per transport: the join's one-time cost to the others; pushed re-forms the sync "
        "group, pulled forms nothing")

    def gpu(key: str) -> Callable[[], list[tuple[str, float, str]]]:
        return lambda: gpu_bench.target_measurements(res["gpu"]).get(key, [])

    add("GPU: cached snapshot (device → pinned) throughput ÷ one pinned copy_", ">=", gpu_bench.GOAL_SNAPSHOT, "",
        "gpu", gpu("snapshot"), "pinned copy_ time / VersionCache.snapshot time, same bytes, 100 and 4,000 tensors")
    add("GPU: bypass_cpu fill (D2D) throughput ÷ one device copy_", ">=", gpu_bench.GOAL_FILL, "", "gpu", gpu("fill"),
        "device copy_ time / fill of every bucket into the send slots, 100 and 4,000 tensors")
    add("CPU: device digest time per byte, 4,000 tensors ÷ 1 tensor (same bytes)", "<=",
        digest_bench.GOAL_TENSOR_GROWTH, "", "digest", lambda: digest_bench.target_measurements(res["digest"]),
        "torch-block64 (eager and compiled) of 256 MiB in 4,000 tensors vs in 1: no growth beyond the bytes")
    add("GPU: device digest throughput, 500 large and 20,000 small tensors", ">=", gpu_bench.GOAL_DIGEST_GBPS,
        " GB/s", "gpu", gpu("digest_gbps"), "torch-block64 of every bucket (one call per bucket) at the default "
        "512 MiB buckets, model bytes / time")
    add("GPU: device digest throughput ÷ read floor, 500 and 20,000 tensors", ">=", gpu_bench.GOAL_DIGEST_OVER_READ,
        "", "gpu", gpu("digest_read"), "int64 read-and-reduce time / digest time, same bytes")
    add("GPU: device digest throughput ÷ PCIe rate", ">=", gpu_bench.GOAL_DIGEST_OVER_PCIE, "×", "gpu",
        gpu("digest"), "torch-block64 GB/s / the faster pinned copy direction's GB/s")
    add("GPU: CUDA IPC path throughput ÷ one device copy_", ">=", gpu_bench.GOAL_COPY, "", "gpu", gpu("ipc"),
        "device copy_ time / time until the colocated receiver verified and acknowledged")
    return targets


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def compare_bars(report: dict) -> tuple[list[dict], str]:
    """The side-by-side bar chart: every alternative on the headline model's bytes."""
    res = report["results"]
    side = res.get("side_by_side")
    row = sync_bench.headline_row(side) if side else None
    if row is None:
        return [], ""
    bars = []
    for v in sync_bench.ALL_VARIANTS:
        e = row["variants"].get(v)
        if e:
            bars.append({"key": v, "label": plots.LABELS[v], "seconds": e["seconds"], "nbytes": row["bytes"]})
    ipc = res.get("ipc")
    if ipc and abs(ipc["bytes"] - row["bytes"]) <= 0.01 * row["bytes"]:
        for v in ("ipc_cached", "ipc_bypass"):
            bars.append({"key": v, "label": plots.LABELS[v], "seconds": ipc["variants"][v]["seconds"],
                         "nbytes": ipc["bytes"], "note": "1 receiver, same-host section"})
    dm = res.get("daemon_e2e")
    if dm:
        for mode in ("cached", "bypass"):
            e = dm["modes"].get(mode)
            if e and e["seconds"]["n"] and e["bytes"] and abs(e["bytes"] - row["bytes"]) <= 0.01 * row["bytes"]:
                bars.append({"key": f"daemon_{mode}", "label": plots.LABELS[f"daemon_{mode}"], "seconds": e["seconds"],
                             "nbytes": e["bytes"], "note": "daemon section"})
    title = (f"{row['bytes'] / MiB:.0f} MiB in {row['num_tensors']:,} tensors to "
             f"{side['world'] - 1} receivers (CPU, gloo): time until every receiver has the weights")
    return bars, title


def _section_anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -")
    return keep.replace(" ", "-")


def render(report: dict) -> str:
    m, s, res = report["machine"], report["settings"], report["results"]
    images = report.get("images", {})
    lines: list[str] = []
    add = lines.append
    add("# Benchmarks")
    add("")
    add(f"Generated by `ckpt-engine bench` ({'quick' if s['quick'] else 'full'} run) on {m['date_utc']}, "
        f"{report['wall_seconds']:.0f} s wall. Every number below was measured in that run; re-running the "
        "command regenerates this file and its plots.")
    add("")
    add("## Command")
    add("")
    add("```")
    add(report["command"])
    add("```")
    add("")
    add("(run from the repository root; `python -m ckpt_engine.bench.suite` takes the same options)")
    add("")
    add("## Machine")
    add("")
    mem = f"{m['memory_bytes'] / GiB:.1f} GiB" if m.get("memory_bytes") else "unknown"
    add(f"- CPU: {m['cpu_model']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable), {mem} RAM")
    add("- GPU: " + (m["gpu"] if m.get("gpu") else
                     "**none**. Every figure is CPU + gloo over loopback; the GPU data paths (NCCL, CUDA IPC, "
                     "device-side digests) are not measured here."))
    add(f"- torch {m['torch']}, Python {m['python']}, {m['platform']}")
    add(f"- local disk for the safetensors baseline: {m.get('disk_tmp')}; /dev/shm: {m.get('disk_shm')}")
    add(f"- bucket size {s['bucket_size'] / MiB:g} MiB unless a section says otherwise; {s['repeats']} measured "
        f"rounds per variant after {s['warmup']} warm-up round(s) unless a section says otherwise")
    add("- section wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in report["section_seconds"].items()))
    add("")
    add("Method: variants that are compared run in the same processes, round-robin interleaved (all variants of "
        "a round back to back, order rotated every round), so machine noise hits all of them alike. Times are "
        "medians with the min–max range; ratios are ratios of medians, with the min–max of the per-round ratio "
        "in brackets. GB/s = model bytes / time, 1 GB = 1e9 bytes; MiB = 2^20 bytes.")
    add("")
    if report["errors"]:
        add("## Failures in this run")
        add("")
        for name, text in report["errors"].items():
            add(f"- **{name}** failed: `{text.strip().splitlines()[-1][:300]}` (full traceback in the console / JSON)")
        add("")
    add("## Targets")
    add("")
    add("| Target | Threshold | Measured (per-round range) | Status |")
    add("|---|---|---|---|")
    for t in report["targets"]:
        thr = f"{t['op']} {t['threshold']:g}{t['unit']}"
        add(f"| {t['target']} | {thr} | {t['summary']} | **{t['status']}** |")
    met = sum(t["status"] == "MET" for t in report["targets"])
    add("")
    add(f"{met} of {len(report['targets'])} targets met on this machine. A target measured at several model "
        "configurations is MET only if it is met at every one. Why some are missed here and what was changed "
        "because of them: [performance-notes.md](performance-notes.md).")
    add("")
    side = res.get("side_by_side")
    head = sync_bench.headline_row(side) if side else None
    if head is not None:
        add(f"## Headline: {head['bytes'] / MiB:.0f} MiB in {head['num_tensors']:,} tensors, "
            f"1 sender → {side['world'] - 1} receivers")
        add("")
        if "compare" in images:
            add(f"![side-by-side comparison]({images['compare']})")
            add("")
        add("| Variant | Time s, median (min–max) | GB/s | ckpt-engine cached vs it | ckpt-engine bypass_cpu vs it |")
        add("|---|---:|---:|---|---|")
        bars, _ = compare_bars(report)
        cached = head["variants"]["cached"]["seconds"]["median"]
        bypass = head["variants"]["bypass"]["seconds"]["median"]

        def rel(med: float, ours: float) -> str:
            return f"{med / ours:.2f}× faster" if med >= ours else f"{ours / med:.2f}× slower"

        for b in bars:
            med = b["seconds"]["median"]
            note = f" ({b['note']})" if b.get("note") else ""
            ours = b["key"] in ("cached", "bypass") or b["key"].startswith(("ipc_", "daemon_"))
            add(f"| {b['label']}{note} | {med:.3f} ({b['seconds']['min']:.3f}–{b['seconds']['max']:.3f}) | "
                f"{b['nbytes'] / med / 1e9:.2f} | {'—' if ours else rel(med, cached)} | "
                f"{'—' if ours else rel(med, bypass)} |")
        add("")
        add("\"N× faster\" = the alternative's time ÷ ckpt-engine's time (\"slower\": the inverse). The raw broadcast "
            "and memcpy are the limits: ckpt-engine sends the same bytes plus digests, headers and "
            "acknowledgements, and verifies every tensor before `load`. Rows marked with a section are other "
            "ckpt-engine paths on the same bytes, measured in that section of this run (not interleaved with "
            "the rows above).")
        add("")
    n = 0
    for name, title, module in SECTIONS:
        if name not in report["sections"]:
            continue
        n += 1
        add(f"## {n}. {title}")
        add("")
        if name in report["errors"]:
            add(f"Not measured: the section failed (`{report['errors'][name].strip().splitlines()[-1][:300]}`).")
            add("")
            continue
        result = res[name]
        origin = report.get("merged", {}).get(name)
        if origin is not None:
            om = origin["machine"]
            add(f"*Measured by another run: `{origin['command']}` on {om.get('date_utc')}, {om.get('cpu_model')} "
                f"({om.get('usable_cores')} cores), GPU {om.get('gpu') or 'none'}; from {origin['file']}.*")
            add("")
        if name == "curves":
            lines.extend(curves.render(result, m, images))
        elif name == "daemon_e2e":
            lines.extend(daemon_e2e.render(result, m, head))
        else:
            lines.extend(module.render(result, m))
        if name == "side_by_side" and "tensors" in images:
            add(f"![time vs tensor count]({images['tensors']})")
            add("")
    lines.extend(gpu_check_section(res.get("gpu"), report["sections"]))
    add("---")
    add("")
    add("Raw per-repetition samples of every variant are in the JSON output (`--json PATH`). Analysis of the "
        "figures and of the targets missed on this machine: [performance-notes.md](performance-notes.md).")
    add("")
    return "\n".join(lines)


def gpu_check_section(gpu: dict | None, sections: list[str]) -> list[str]:
    """How the GPU figures are produced on a CUDA machine without internet; in every report."""
    if gpu and not gpu.get("skipped"):
        number = [name for name, _, _ in SECTIONS if name in sections].index("gpu") + 1
        status = (f"The GPU figures of this report (section {number}) were measured on "
                  f"{gpu['devices']['count']} × {', '.join(sorted(set(gpu['devices']['names'])))}.")
    else:
        status = ("**No GPU figures in this report**: it was generated without CUDA. The GPU runs on record, with "
                  "the command that measured each figure, are in [gpu-runs.md](gpu-runs.md); a new one is made "
                  "with the command below.")
    return [
        "## GPU check",
        "",
        status,
        "",
        "One command proves the CUDA path on a GPU machine, also one without internet access that keeps its own "
        "torch build:",
        "",
        "```bash",
        "scripts/gpu-wheels.sh --python 3.12 --dest .whl   # on a connected machine: wheels for the GPU machine",
        "scripts/gpu-check.sh OUTDIR                         # on the GPU machine, from the repository root",
        "```",
        "",
        "- `scripts/gpu-wheels.sh [--python X.Y] [--dest DIR] [--platform TAG]...` downloads binary wheels of every "
        "dependency except torch (and pytest, pytest-timeout), with everything they need, for that CPython on "
        "manylinux x86-64 (glibc 2.28 and older tags by default), then checks that the folder covers every "
        "requirement for that target. Copy the folder to the GPU machine as `.whl/` (git-ignored).",
        "- `scripts/gpu-check.sh [--dry-run] [--quick] [--wheels DIR] OUTDIR` installs from `.whl/` only what the "
        "machine lacks or has too old, with `pip install --no-index --no-deps --target` into a folder put on "
        "`PYTHONPATH` (no venv, no root, torch untouched), stages the package as pip would install it "
        "(`server/` and `workers/` as `ckpt_engine.server` / `ckpt_engine.workers`), runs `tests/gpu` and this "
        "suite's `gpu` section (`ckpt-engine bench --only gpu`), and writes `OUTDIR/report.md` and "
        "`OUTDIR/report.json` next to the logs, the JUnit XML and the benchmark's own report and JSON. Without "
        "CUDA it says so, collects the GPU tests (they skip) and exits 0. With CUDA it exits 1 if a test failed or "
        "the benchmark did not finish; the run is bounded to about 14 minutes (tests 300 s, benchmark 220 s, "
        "side by side 300 s). "
        "`--dry-run` checks torch and the wheel plan, then prints every command instead of running it.",
        "- `tests/gpu` is collected everywhere (CI included) and skips with a reason without CUDA; its multi-GPU "
        "tests skip with fewer than 2 GPUs.",
        '- **The colocated NIXL pull** (`bench/nixl_colocated.py`, run by `gpu-check.sh` before the side by s'
        "ide where NIXL imports, at most 200 s, `CKPT_GPU_NIXL_TIMEOUT`): NIXL's wheel is ~60 MB, so the kit "
        "fetches it only when asked, `scripts/gpu-wheels.sh --nixl 13` (the GPU machine's CUDA major), slimme"
        "d to ~23 MB (`gpu_check.py slim-nixl`: its expert-parallel kernels, tools and other backends' plugin"
        "s left out). A rollout process on the trainer's GPU pulls each version (cached: from the pinned cach"
        'e; bypass_cpu: from the device send slots) beside our same-host CUDA IPC path, interleaved in one ru'
        'n; `tests/gpu/test_cuda_nixl.py` checks the pulled weights byte-exact. Without NIXL the report says '
        'why it did not run.',
        "- **Side by side with MoonshotAI's checkpoint-engine** (`bench/anchor_bench.py`, run by `gpu-check.sh` "
        'after the benchmark, at most 300 s, `CKPT_GPU_ANCHOR_TIMEOUT`): `gpu-wheels.sh` also fetches '
        '`checkpoint-engine==0.4.2` and its dependencies (fastapi, pydantic, safetensors, pyzmq, uvicorn, loguru, '
        "numpy, httpx; torch stays the machine's own), and `gpu-check.sh` installs them from the folder when it "
        'has them (without them the rest of the check runs and the report says the side by side was skipped). For '
        'the same bf16 model bytes and tensor counts (4 and 16 GiB in 500 and 20,000 tensors; `--quick` 1 GiB; '
        "each size lowered to the largest power of two within 12 % of the GPU's memory and 20 % of the host's "
        'available memory) it runs, interleaved in one run with the order rotated every round: on 1 GPU the '
        'colocated path, their `ParameterServer` (`register_checkpoint` of the device tensors into their reused '
        'pinned pool, `gather_metas`, `update` whose request function hands the ZMQ address to a plain torch '
        'worker process on the same GPU running their public `update_weights_from_ipc`) against our same-host CUDA '
        'IPC path (`Publisher` → `IpcReceiver`), cached and bypass_cpu; on 2+ GPUs the broadcast path, their two '
        'PS ranks (cuda:0 owns the checkpoint) each with the colocated worker their design requires, against our '
        'NCCL sender on cuda:0 and receiver on cuda:1. Each time ends when the inference side holds (ours: has '
        'verified and acknowledged) the bytes; both sides hand them to a no-op. The table gives time, GB/s and the '
        "per-round ratio ours ÷ theirs (below 1 is faster; the issue's target is ≤ 0.9), their `update` alone, and "
        'the device digest rate. Their package is used only through its public API; nothing of it is copied into '
        "ours. It ran on an H200 on 2026-11-27 (docs/gpu-runs.md); the CUDA-only parts were written from the 0.4.2 "
        "wheel's `ps.py` and `worker.py`; here they are tested only as a dry run and a CPU skip.",
        "",
        "To put a GPU machine's figures into this file, regenerate it with that run's results merged in: "
        "`ckpt-engine bench --merge-json OUTDIR/gpu-bench.json` (or `--from-json` of an earlier run plus "
        "`--merge-json`). The `gpu` section then names the run and machine it comes from. Run on a GPU "
        "machine, the suite measures the section itself.",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
