"""PNG plots of a suite run (matplotlib, Agg backend), written next to the markdown report as bench-*.png.
Every point comes from the run's results; nothing is hard-coded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 1 << 20
COLORS = {"cached": "#1f77b4", "cached_overlap": "#aec7e8", "bypass": "#ff7f0e", "raw": "#2ca02c",
          "per_tensor": "#d62728", "memcpy": "#9467bd", "disk_local": "#8c564b", "disk_shm": "#e377c2",
          "ipc_cached": "#17becf",
          "ipc_bypass": "#bcbd22", "daemon_cached": "#7f7f7f", "daemon_bypass": "#aaaaaa"}
LABELS = {"cached": "ckpt-engine e2e cached", "cached_overlap": "cached, send overlapping the snapshot",
          "bypass": "ckpt-engine e2e bypass_cpu", "raw": "raw broadcast",
          "per_tensor": "per-tensor broadcast loop", "memcpy": "memcpy (1 thread)",
          "disk_local": "safetensors, local disk", "disk_shm": "safetensors, /dev/shm",
          "ipc_cached": "same-host shm, cached", "ipc_bypass": "same-host shm, bypass_cpu",
          "daemon_cached": "daemon POST /sync, cached", "daemon_bypass": "daemon POST /sync, bypass_cpu"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _errs(entries: list[dict], key: str) -> tuple[list[float], list[list[float]]]:
    med = [e[key]["median"] for e in entries]
    lo = [m - e[key]["min"] for m, e in zip(med, entries)]
    hi = [e[key]["max"] - m for m, e in zip(med, entries)]
    return med, [lo, hi]


def size_plot(curves: dict, path: Path, subtitle: str) -> bool:
    points = [p for p in curves["points"] if p["curve"] == "size" and p["row"] is not None]
    if not points:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    counts = sorted({p["receivers"] for p in points}, reverse=True)
    styles = {0: ("-", "o"), 1: ("--", "s")}
    for i, receivers in enumerate(counts):
        sel = sorted((p for p in points if p["receivers"] == receivers), key=lambda p: p["mib"])
        line, marker = styles.get(i, (":", "^"))
        for v in ("cached", "bypass", "raw"):
            med, err = _errs([p["row"]["variants"][v] for p in sel], "gbps")
            ax.errorbar([p["mib"] for p in sel], med, yerr=err, marker=marker, linestyle=line, capsize=3,
                        color=COLORS[v], label=f"{LABELS[v]}, {receivers} receiver{'s' if receivers > 1 else ''}",
                        markerfacecolor="white" if i else COLORS[v])
    xs = sorted({p["mib"] for p in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x} MiB" if x < 1024 else f"{x // 1024} GiB" for x in xs])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("model size")
    ax.set_ylabel("GB/s (model bytes / time), median, min–max bars")
    ax.set_title(f"Throughput vs model size\n{subtitle}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def tensors_plot(side: dict, path: Path, subtitle: str) -> bool:
    rows = sorted(side["rows"], key=lambda r: r["num_tensors"])
    if len(rows) < 2:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for v in ("cached", "bypass", "raw", "per_tensor"):
        sel = [r for r in rows if v in r["variants"]]
        med, err = _errs([r["variants"][v] for r in sel], "seconds")
        ax.errorbar([r["num_tensors"] for r in sel], med, yerr=err, marker="o", capsize=3, color=COLORS[v],
                    label=LABELS[v])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensors in the model (same total bytes)")
    ax.set_ylabel("time to all receivers (s), log scale")
    size = rows[0]["bytes"] / MiB
    ax.set_title(f"Time vs tensor count, {size:.0f} MiB model\n{subtitle}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def receivers_plot(curves: dict, path: Path, subtitle: str) -> bool:
    points = [p for p in curves["points"] if p["curve"] == "receivers" and p["row"] is not None]
    if not points:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    xs = [p["world"] - 1 for p in points]
    for v in ("cached", "bypass", "raw"):
        med, err = _errs([p["row"]["variants"][v] for p in points], "seconds")
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, color=COLORS[v], label=LABELS[v])
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("receivers (one process each)")
    ax.set_ylabel("time to all receivers (s), median, min–max bars")
    ax.set_title(f"Time vs receivers, {points[0]['mib']} MiB model\n{subtitle}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def compare_plot(bars: list[dict], path: Path, title: str) -> bool:
    """Horizontal bars: median time with min–max whiskers, GB/s written beside each bar."""
    if not bars:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(bars) + 1.6), dpi=110)
    ys = list(range(len(bars)))[::-1]
    med = [b["seconds"]["median"] for b in bars]
    err = [[m - b["seconds"]["min"] for m, b in zip(med, bars)], [b["seconds"]["max"] - m for m, b in zip(med, bars)]]
    ax.barh(ys, med, xerr=err, capsize=3, color=[COLORS.get(b["key"], "#999999") for b in bars],
            hatch=None, alpha=0.9)
    for y, b, m in zip(ys, bars, med):
        note = f"  ({b['note']})" if b.get("note") else ""
        ax.text(b["seconds"]["max"] * 1.01 + 1e-4, y, f" {m:.3f} s, {b['nbytes'] / m / 1e9:.2f} GB/s{note}",
                va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([b["label"] for b in bars], fontsize=8)
    ax.set_xlabel("time (s), median, min–max whiskers")
    ax.set_xlim(0, max(b["seconds"]["max"] for b in bars) * 1.6)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def make_all(results: dict[str, Any], out_dir: Path, subtitle: str, compare_bars: list[dict],
             compare_title: str, prefix: str = "bench") -> dict[str, str]:
    """Write every plot the results allow, as ``<prefix>-<kind>.png``; returns {kind: file name} of those
    written."""
    written: dict[str, str] = {}
    jobs = []
    if results.get("curves"):
        jobs += [("size", f"{prefix}-size.png", lambda p: size_plot(results["curves"], p, subtitle)),
                 ("receivers", f"{prefix}-receivers.png", lambda p: receivers_plot(results["curves"], p, subtitle))]
    if results.get("side_by_side"):
        jobs.append(("tensors", f"{prefix}-tensors.png", lambda p: tensors_plot(results["side_by_side"], p, subtitle)))
    jobs.append(("compare", f"{prefix}-compare.png", lambda p: compare_plot(compare_bars, p, compare_title)))
    for kind, name, fn in jobs:
        path = out_dir / name
        if fn(path):
            written[kind] = name
    return written
