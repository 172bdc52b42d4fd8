"""What a pulled piece costs by its size: the same bytes READ over NIXL as one range, or as many small ones.

    ckpt-engine bench --only pull_pieces        (NIXL installed; on this machine's loopback, UCX over TCP)

A sharded class's column piece (a row-parallel weight's columns: ``o_proj``, ``down_proj``) lies in its owner's
copy of the full tensor as one run a row, so a puller reads it one row at a time (plan/pull_reads.py), where a
range of rows is one read. Here an owner process registers a buffer and a puller reads the same ``--mib`` of it
(every other piece-sized range, as a column piece's rows lie) in pieces of 512 B to 32 KiB and in one read,
rounds interleaved: the puller's wall time, its CPU and the owner's CPU, each ÷ the one read's. With RDMA the
owner's side costs no CPU (a READ is one-sided); over TCP UCX serves every read in software.

The reads a version costs a puller come from the model's shapes (counted, not measured): a Llama-style 70B class
at TP 8 (80 layers, hidden 8192, intermediate 28672, bf16) and this bench's 48 MiB model at TP 4.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import time
from typing import Any

from ckpt_engine.bench.common import MiB, Progress
from ckpt_engine.bench.netns_cluster import model_shapes

_PIECES = (512, 2048, 8192, 32768)  # bytes; 0 below: one read of the same bytes
_DEADLINE_S = 120.0


def _owner(commands: Any, replies: Any, nbytes: int) -> None:
    import os

    os.environ["UCX_TLS"], os.environ["UCX_NET_DEVICES"] = "tcp", "lo"

    from ckpt_engine.transport.nixl import NixlEndpoint

    endpoint = NixlEndpoint("bench-owner")
    endpoint.serve_for(3600)
    source = _pattern(nbytes)
    region = endpoint.register(source)
    replies.put((endpoint.metadata(), region.addr, region.nbytes, region.mem, region.device_id))
    while commands.get(timeout=_DEADLINE_S) == "cpu":
        replies.put(time.process_time())
    endpoint.close()


def _ranges(piece: int, nbytes: int) -> Any:
    """``nbytes`` as pieces of ``piece`` bytes, every other one of the owner's (a column piece's rows), or one:
    (offset in the owner's buffer, offset in the puller's, bytes) a row, as a puller's plan gives them."""
    import torch

    if piece == 0:
        return torch.tensor([[0, 0, nbytes]], dtype=torch.int64)
    at = torch.arange(nbytes // piece, dtype=torch.int64) * piece
    return torch.stack([2 * at, at, torch.full_like(at, piece)], 1)


def _pattern(nbytes: int) -> Any:
    """The owner's bytes: position mod 251 (no piece reads like its neighbour)."""
    import torch

    return (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.uint8)


def _expected(pattern: Any, piece: int, nbytes: int) -> Any:
    """What the puller's buffer holds after reading :func:`_ranges` of the owner's ``pattern``."""
    if piece == 0:
        return pattern[:nbytes]
    return pattern[: 2 * nbytes].view(-1, 2 * piece)[:, :piece].reshape(-1)


def measure(mib: int, rounds: int, progress: Progress) -> dict:
    """Over TCP on loopback: this process's agent is made with UCX told so, and the environment is put back
    after (a test process's later agents and children must not inherit it)."""
    import os

    saved = {key: os.environ.get(key) for key in ("UCX_TLS", "UCX_NET_DEVICES")}
    os.environ["UCX_TLS"], os.environ["UCX_NET_DEVICES"] = "tcp", "lo"
    try:
        return _measure(mib, rounds, progress)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _measure(mib: int, rounds: int, progress: Progress) -> dict:
    import torch

    from ckpt_engine.transport.nixl import NixlEndpoint, Region

    nbytes = mib * MiB
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_owner, args=(commands, replies, 2 * nbytes), daemon=True)
    owner.start()
    endpoint = None
    try:
        meta, addr, size, mem, device_id = replies.get(timeout=_DEADLINE_S)
        endpoint = NixlEndpoint("bench-puller")
        remote, region = endpoint.remote(meta), Region(addr, size, mem, device_id)
        into = torch.zeros(nbytes, dtype=torch.uint8)
        endpoint.register(into)
        pattern = _pattern(2 * nbytes)
        samples: dict[int, dict[str, list[float]]] = {p: {"wall": [], "cpu": [], "owner_cpu": []}
                                                      for p in (0, *_PIECES)}
        for round_ in range(rounds + 1):  # the first: a warm-up
            order = [(0, *_PIECES)[(round_ + k) % (len(_PIECES) + 1)] for k in range(len(_PIECES) + 1)]
            for piece in order:
                into.zero_()
                commands.put("cpu")
                owner0 = replies.get(timeout=_DEADLINE_S)
                t0, cpu0 = time.perf_counter(), time.process_time()
                ranges = _ranges(piece, nbytes)  # (timed: a puller's feed makes its ranges per bucket too)
                endpoint.start_read(remote, region, into, ranges).wait(_DEADLINE_S)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                if not torch.equal(into, _expected(pattern, piece, nbytes)):
                    raise RuntimeError(f"the bytes read as {piece or nbytes}-byte pieces are not the owner's")
                commands.put("cpu")
                owner_cpu = replies.get(timeout=_DEADLINE_S) - owner0
                if round_:
                    for key, value in (("wall", wall), ("cpu", cpu), ("owner_cpu", owner_cpu)):
                        samples[piece][key].append(value)
            progress(f"    round {round_}/{rounds} done")
        commands.put("stop")
    finally:
        if endpoint is not None:
            endpoint.close()
        owner.join(timeout=30)
        if owner.is_alive():
            owner.kill()
    rows = []
    one = {key: statistics.median(values) for key, values in samples[0].items()}
    for piece in (0, *_PIECES):
        med = {key: statistics.median(values) for key, values in samples[piece].items()}
        rows.append({"piece": piece, "reads": 1 if piece == 0 else nbytes // piece, **med,
                     "wall_over_one": med["wall"] / one["wall"], "cpu_over_one": med["cpu"] / one["cpu"],
                     "owner_cpu_over_one": med["owner_cpu"] / max(one["owner_cpu"], 1e-6),
                     "samples": samples[piece]})
    return {"mib": mib, "rounds": rounds, "rows": rows}


def column_reads(layers: int, hidden: int, intermediate: int, tp: int, item: int, others: int) -> dict[str, int]:
    """A TP rank's reads of one version of a Llama-style model of ``others`` tensors besides the row-parallel
    o_proj [hidden, hidden] and down_proj [hidden, intermediate] of each layer (those: one read a row of their
    columns; every other tensor's piece: one read), and the bytes a column-piece read."""
    column_rows = layers * (hidden + hidden)
    column_bytes = layers * hidden * (hidden + intermediate) * item // tp
    return {"reads": column_rows + others, "column_reads": column_rows,
            "column_piece_bytes": math.ceil(column_bytes / column_rows)}


def run(opts: dict, progress: Progress) -> dict:
    from ckpt_engine.transport.nixl import nixl_missing

    why = nixl_missing()
    if why is not None:
        return {"skipped": why}
    mib, rounds = (8, 2) if opts.get("quick") else (32, 5)
    result = measure(mib, rounds, progress)
    netns = model_shapes(48, 4)  # (bench/netns_cluster.py: hidden 512, intermediate 2048)
    layers = sum(name.endswith("o_proj.weight") for name in netns)
    # 70B: q, k, v, gate, up and two norms a layer, the embeddings, the head and the last norm
    result["models"] = {"Llama-style 70B, TP 8 (bf16)": column_reads(80, 8192, 28672, 8, 2, 80 * 7 + 3),
                        "this suite's netns model (48 MiB), TP 4 (float32)": column_reads(
                            layers, 512, 2048, 4, 4, len(netns) - 2 * layers)}
    return result


def render(result: dict, machine: dict) -> list[str]:
    if "skipped" in result:
        return [f"Not measured: {result['skipped']}.", ""]
    lines = [f"{result['mib']} MiB read from an owner process over NIXL (UCX over TCP, loopback), as one read or "
             f"as pieces (every other piece-sized range of its buffer, as a column piece's rows lie); "
             f"{result['rounds']} rounds after a warm-up, variants interleaved; medians.", "",
             "| Read as | reads | puller s | ÷ one read | puller CPU s | ÷ one read | puller CPU a read, µs "
             "| owner CPU s | ÷ one read |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        what = "one read" if r["piece"] == 0 else f"{r['piece']:,} B pieces"
        lines.append(f"| {what} | {r['reads']:,} | {r['wall']:.3f} | {r['wall_over_one']:.1f} | {r['cpu']:.3f} "
                     f"| {r['cpu_over_one']:.1f} | {per_read_us(result, r):.1f} | {r['owner_cpu']:.3f} "
                     f"| {r['owner_cpu_over_one']:.1f} |")
    lines += ["", "Reads a version costs one puller of a sharded class (counted from the shapes), and the puller CPU "
              "they would cost at the measured CPU a read of the largest piece size here not above theirs "
              "(an estimate, over TCP):", "",
              "| Model | reads | of them, one a row of a column piece | bytes a column-piece read "
              "| puller CPU s, estimated |",
              "|---|---:|---:|---:|---:|"]
    for name, m in result["models"].items():
        lines.append(f"| {name} | {m['reads']:,} | {m['column_reads']:,} | {m['column_piece_bytes']:,} "
                     f"| {estimated_cpu_s(result, m):.2f} |")
    return lines + [""]


def per_read_us(result: dict, row: dict) -> float:
    """The puller CPU a read of ``row`` costs above reading the same bytes at once, in µs (0 for one read)."""
    one = result["rows"][0]
    return 0.0 if row["piece"] == 0 else max(0.0, row["cpu"] - one["cpu"]) / row["reads"] * 1e6


def estimated_cpu_s(result: dict, model: dict) -> float:
    """``model``'s column reads at the CPU a read of the largest measured piece not above its pieces."""
    fits = [r for r in result["rows"] if 0 < r["piece"] <= model["column_piece_bytes"]] or result["rows"][1:2]
    return model["column_reads"] * per_read_us(result, fits[-1]) / 1e6
