"""A cost model on paper: the sync time of MoonshotAI checkpoint-engine's README rows, projected for
ckpt-engine in cached and bypass_cpu mode from per-byte and per-tensor costs and link bandwidths.

    python -m ckpt_engine.bench.cost_model [--per-tensor-us X] [--digest-gbps Y]

Nothing here measures anything; every input is named in ``ASSUMPTIONS`` or given on the command line (the
per-tensor cost comes from ``ckpt-engine bench``, side-by-side section, *Per-tensor cost*). The wire rate of each
row is calibrated from MoonshotAI's own measured broadcast time (the same torch.distributed NCCL broadcast we
use), so the projection isolates what ckpt-engine adds or removes on the same wire: the digests, the per-tensor
work, the host→device copy, and whether a whole version fits where a receiver stages it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Row:
    model: str
    devices: str
    ranks: int  # GPUs that own a share of the weights (MoonshotAI: every GPU of the group)
    bytes: float  # one version on the wire
    tensors: int
    measured_s: float  # MoonshotAI README, "Update Broadcast" (bucket size in their table)
    pcie_gbps: float  # host→device per GPU
    hbm_gbps: float
    device_gib: float  # memory of one GPU
    host_gib_per_gpu: float  # a node's host memory ÷ its GPUs (each GPU's receiver would stage in its share)
    largest_bytes: float  # the largest tensor (a streamed one is put together from its pieces)


# Sizes: parameters × bytes per parameter; tensor counts from the models' configs (experts × 3 projections ×
# MoE layers + the rest; FP8 checkpoints add one scale tensor per quantized weight).
ROWS = (
    Row("Qwen3-235B-A22B BF16", "8×H800 TP8", 8, 235e9 * 2, 94 * (128 * 3 + 10) + 3, 6.22, 45, 3350, 80,
        2048 / 8, 151936 * 4096 * 2),
    Row("Kimi-K2 FP8", "256×H20 TP16", 256, 1.03e12, 2 * 60 * 384 * 3 + 61 * 12 + 3, 16.04, 45, 4000, 96,
        2048 / 8, 163840 * 7168 * 2),
)

ASSUMPTIONS = {
    "pcie_gbps": "45 GB/s pinned host→device per GPU (PCIe Gen5 x16; MoonshotAI's blog: 40–50 GiB/s single-rank H2D)",
    "wire": "the wire rate is MoonshotAI's: bytes ÷ (their measured broadcast time − their parallel H2D time)",
    "digest_gbps": "the device digest (torch-block64: one compiled read of the bytes, goal ≥ 1,000 GB/s, ≥ 25 % of "
                   "the read floor; the torch-mix64 it replaced ran at 48–54 GB/s on an H200) taken at HBM ÷ 12 per "
                   "GPU, below its goal; NOT MEASURED on these GPUs (--digest-gbps takes a measured rate): this is "
                   "the term most likely to be wrong",
    "per_tensor": "host work per tensor (views, names, digest bookkeeping), sender and receiver together, as measured "
                  "on this CPU machine; a GPU host is assumed no slower",
    "host": "2 TiB of host memory per 8-GPU node (256 GiB per GPU's receiver); largest tensor: the bf16 embedding",
    "staging": "auto takes at most half of what is free: device if the version fits half a GPU, host if it fits half "
               "the GPU's share of host memory, else stream (two buckets + the largest tensor on the device); the "
               "engine's pause: device = the version copied on the device (HBM), host = copied in over PCIe, stream = "
               "the whole transfer",
    "overlap": "cached: owners copy their buckets host→device in parallel (as MoonshotAI does), not overlapped with "
               "the wire; receivers verify bucket k while bucket k+1 is on the wire, so only the last bucket's verify "
               "adds (upper bound: every verify adds)",
}


@dataclass(frozen=True)
class Projection:
    row: Row
    wire_gbps: float
    h2d_s: float
    wire_s: float
    verify_s: float  # every receiver hashes every byte it receives
    verify_tail_s: float
    per_tensor_s: float
    owner_digest_s: float  # bypass_cpu: an owner hashes its share on the device before it is sent
    cached_s: float
    cached_upper_s: float
    bypass_s: float
    bypass_upper_s: float
    fits_device: bool  # a whole version fits half a GPU (device staging)
    staging: str  # what auto staging picks for one receiver
    staging_bytes: float  # what that staging holds on the device
    pause_s: float  # how long the engine is paused for a version under that staging (cached mode)


def project(row: Row, per_tensor_us: float, digest_gbps: float | None = None,
            bucket_bytes: float = 2 << 30) -> Projection:
    digest = (digest_gbps or row.hbm_gbps / 12) * GB
    h2d = row.bytes / row.ranks / (row.pcie_gbps * GB)
    wire_gbps = row.bytes / (row.measured_s - h2d) / GB
    wire = row.bytes / (wire_gbps * GB)
    verify = row.bytes / digest
    tail = min(bucket_bytes, row.bytes) / digest
    per_tensor = row.tensors * per_tensor_us * 1e-6
    owner_digest = row.bytes / row.ranks / digest
    cached = h2d + wire + tail + per_tensor
    staging, held, pause = _staging(row, bucket_bytes, cached)
    return Projection(row, wire_gbps, h2d, wire, verify, tail, per_tensor, owner_digest,
                      cached_s=cached, cached_upper_s=h2d + wire + verify + per_tensor,
                      bypass_s=owner_digest + wire + tail + per_tensor,
                      bypass_upper_s=owner_digest + wire + verify + per_tensor,
                      fits_device=staging == "device", staging=staging, staging_bytes=held, pause_s=pause)


def _staging(row: Row, bucket_bytes: float, transfer_s: float) -> tuple[str, float, float]:
    """(auto's pick, device bytes it holds, the engine's pause) for one receiver of the whole version."""
    half_device, half_host = row.device_gib * (1 << 30) * 0.5, row.host_gib_per_gpu * (1 << 30) * 0.5
    if row.bytes <= half_device:
        return "device", row.bytes, row.bytes / (row.hbm_gbps * GB)
    if row.bytes <= half_host and 2 * bucket_bytes <= half_device:
        return "host", 2 * bucket_bytes, row.bytes / (row.pcie_gbps * GB)
    return "stream", 2 * bucket_bytes + row.largest_bytes, transfer_s


@dataclass(frozen=True)
class ShardedRow:
    """A sharded-delivery setting and what the field measured there (issue 30's figures)."""

    row: Row
    tp: int  # the inference engine's tensor-parallel size: a receiver keeps 1/tp of the bytes
    trainer_gpus: int
    nic_gbps: float  # per GPU (8×400G per node: 50 GB/s each)
    field: str  # what others measured on it


SHARDED = (
    ShardedRow(ROWS[0], 8, 8, 50, "vLLM sharded_rdt 3.2–3.3 s (8×H100 FSDP2 → 8×H100, vLLM PR #43375); SkyRL on it "
               "3.54 s vs 64.7 s with NCCL broadcast (SkyRL PR #2090)"),
    ShardedRow(ROWS[1], 16, 256, 50, "MoonshotAI full broadcast 16.04 s; miles P2P RDMA 7.2 s vs 53.3 s NCCL; the "
               "wire's floor ~2.6 s full, ~1.4 s sharded (issue 30)"),
)


@dataclass(frozen=True)
class ShardedProjection:
    receiver_bytes: float
    egress_s: float  # the busiest trainer NIC: every class's pieces it owns
    ingress_s: float  # one receiver's NIC: its class's pieces
    h2d_s: float  # what the busiest owner copies host→device for a device wire
    identity_s: float  # the version's identity digest of the full tensors (see the projection)
    verify_tail_s: float
    per_tensor_s: float
    total_s: float


def project_sharded(s: ShardedRow, owners: int, per_tensor_us: float, digest_gbps: float | None = None,
                    bucket_bytes: float = 2 << 30) -> ShardedProjection:
    """One sharded version: each class's pieces cross the trainer side once in all (the classes partition the
    sharded tensors), so the busiest owner sends bytes ÷ owners and each receiver takes bytes ÷ TP. Each owner
    computes the identity digest of its share from its host cache through the device (one more host→device
    pass of its share and a hash of it). ``owners == 1``: trainer rank 0 sends every class (a job whose other
    ranks are not all heard from); ``owners`` = every trainer GPU: the daemon's choice when all are."""
    row = s.row
    digest = (digest_gbps or row.hbm_gbps / 12) * GB
    share = row.bytes / owners
    egress, ingress = share / (s.nic_gbps * GB), row.bytes / s.tp / (s.nic_gbps * GB)
    h2d = share / (row.pcie_gbps * GB)
    identity = share / (row.pcie_gbps * GB) + share / digest
    tail = min(bucket_bytes, row.bytes / s.tp) / digest
    per_tensor = row.tensors * per_tensor_us * 1e-6
    return ShardedProjection(row.bytes / s.tp, egress, ingress, h2d, identity, tail, per_tensor,
                             total_s=h2d + identity + max(egress, ingress) + tail + per_tensor)


def render_sharded(per_tensor_us: float, digest_gbps: float | None = None) -> list[str]:
    lines = ["| Model, engine | field's figures | bytes per receiver | **ckpt-engine sharded, rank 0 sends**: H2D + "
             "identity + wire | **ckpt-engine sharded, every trainer GPU an owner**: H2D + identity + wire |",
             "|---|---|---:|---:|---:|"]
    for s in SHARDED:
        one = project_sharded(s, 1, per_tensor_us, digest_gbps)
        every = project_sharded(s, s.trainer_gpus, per_tensor_us, digest_gbps)
        cell = lambda p: (f"**{p.total_s:.2f} s**: {p.h2d_s:.2f} + {p.identity_s:.2f} + "  # noqa: E731
                          f"{max(p.egress_s, p.ingress_s):.2f} "
                          f"({'trainer NIC' if p.egress_s > p.ingress_s else 'receiver NIC'})")
        lines.append(f"| {s.row.model}, TP{s.tp} ({s.trainer_gpus} trainer GPUs, {s.nic_gbps:.0f} GB/s NIC per GPU) "
                     f"| {s.field} | {one.receiver_bytes / GB:,.0f} GB | {cell(one)} | {cell(every)} |")
    return lines


def render(per_tensor_us: float, digest_gbps: float | None = None) -> list[str]:
    lines = ["| Model, devices | bytes, tensors | MoonshotAI measured | wire GB/s (calibrated) | H2D (cached) "
             "| owner digest (bypass) | receiver verify: last bucket / all | per-tensor | **ckpt-engine cached** "
             "| **ckpt-engine bypass_cpu** | auto staging: mode, device memory, engine pause |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in ROWS:
        p = project(row, per_tensor_us, digest_gbps)
        lines.append(
            f"| {row.model}, {row.devices} | {row.bytes / GB:,.0f} GB, {row.tensors:,} | {row.measured_s:.2f} s "
            f"| {p.wire_gbps:.0f} | {p.h2d_s:.2f} s | {p.owner_digest_s:.2f} s | {p.verify_tail_s:.2f} / "
            f"{p.verify_s:.2f} s | {p.per_tensor_s:.2f} s | **{p.cached_s:.2f} s** (≤ {p.cached_upper_s:.2f}) "
            f"| **{p.bypass_s:.2f} s** (≤ {p.bypass_upper_s:.2f}) | {p.staging}, {p.staging_bytes / GB:.1f} GB "
            f"of {row.device_gib} GiB, {p.pause_s:.2f} s |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_engine.bench.cost_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-tensor-us", type=float, required=True,
                        help="host µs per tensor, sender + receiver (ckpt-engine bench: per-tensor cost)")
    parser.add_argument("--digest-gbps", type=float, default=None,
                        help="device digest GB/s per GPU (default: HBM ÷ 12, unmeasured; torch-block64's goal "
                             "is ≥ 1,000 GB/s)")
    args = parser.parse_args(argv)
    print("\n".join(render(args.per_tensor_us, args.digest_gbps)))
    print()
    print("\n".join(render_sharded(args.per_tensor_us, args.digest_gbps)))
    print()
    for key, text in ASSUMPTIONS.items():
        print(f"- {key}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
