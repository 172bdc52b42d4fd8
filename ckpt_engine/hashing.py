"""Per-tensor and per-version digests.

Two algorithms, named in every manifest so a receiver recomputes the one its sender used:

- ``xxh3-64``: xxhash over host bytes (CPU buffers, zero-copy).
- ``torch-mix64``: computed with torch integer ops wherever the bucket lives (CUDA/NPU, also CPU), one host
  sync per bucket. Each 8-byte word is mixed with its position before a splitmix64 finaliser and the results
  are summed per tensor, so the digest depends on every byte and on byte order (unlike an XOR/sum of
  elements such as ``torch.hash_tensor``).

Both fold the dtype and shape into a per-tensor seed, so equal bytes under another dtype or shape differ.
Digests are signed int64 values so they can travel through any collective backend.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import xxhash

from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import ProtocolError
from ckpt_engine.layout import Bucket, Layout

ALGORITHMS: tuple[str, ...] = ("xxh3-64", "torch-mix64")

_MASK64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15
# Words per chunk of the device digest: bounds temporaries to a few times 32 MiB whatever the bucket size.
_CHUNK_WORDS = 4 << 20


def to_signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _signed(constant: int) -> int:
    return to_signed64(constant)


def check_algo(algo: str) -> DigestAlgo:
    if algo not in ALGORITHMS:
        raise ProtocolError(f"unknown digest algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")
    return algo  # type: ignore[return-value]


def header_seed(dtype: str, shape: Sequence[int]) -> int:
    """Signed 64-bit seed from dtype and shape: the part of a digest that is not bytes."""
    return to_signed64(xxhash.xxh3_64_intdigest(f"{dtype}|{','.join(map(str, shape))}".encode()))


def host_buffer(buf: torch.Tensor) -> memoryview:
    """Zero-copy memoryview of a contiguous uint8 CPU tensor (no numpy, so bf16 sources work too)."""
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("host_buffer needs a contiguous uint8 CPU tensor")
    size = buf.numel()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(buf.data_ptr())).cast("B")


def xxh3_digest(dtype: str, shape: Sequence[int], data: torch.Tensor) -> int:
    """xxh3-64 digest of one tensor's bytes (a uint8 CPU slice) under its dtype and shape."""
    return to_signed64(xxhash.xxh3_64_intdigest(host_buffer(data), header_seed(dtype, shape) & _MASK64))


@dataclass(frozen=True)
class _BucketPlan:
    """Per-bucket index tensors for the device digest, built once per (layout, bucket, device)."""

    start_words: torch.Tensor  # int64 [n]
    nbytes: torch.Tensor  # int64 [n]
    seeds: torch.Tensor  # int64 [n]


_plan_cache: dict[tuple[str, int, str], _BucketPlan] = {}


def _bucket_plan(bucket: Bucket, device: torch.device, layout_digest: str) -> _BucketPlan:
    key = (layout_digest, bucket.index, str(device))
    plan = _plan_cache.get(key)
    if plan is None:
        slots = bucket.slots
        plan = _BucketPlan(
            start_words=torch.tensor([s.offset // 8 for s in slots], dtype=torch.int64, device=device),
            nbytes=torch.tensor([s.nbytes for s in slots], dtype=torch.int64, device=device),
            seeds=torch.tensor([header_seed(s.dtype, s.shape) for s in slots], dtype=torch.int64, device=device),
        )
        if len(_plan_cache) > 4096:
            _plan_cache.clear()
        _plan_cache[key] = plan
    return plan


def _lsr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser with wrapping int64 arithmetic."""
    z = z ^ _lsr(z, 30)
    z = z * _signed(_C1)
    z = z ^ _lsr(z, 27)
    z = z * _signed(_C2)
    return z ^ _lsr(z, 31)


def mix64_bucket_digests(bucket: Bucket, buf: torch.Tensor, layout_digest: str) -> torch.Tensor:
    """torch-mix64 digests of every tensor in ``bucket``, read from ``buf`` (its uint8 bytes), on buf's device.

    ``layout_digest`` keys the cached index tensors. Returns int64 [len(bucket.slots)] on buf's device;
    no host sync happens here.
    """
    n = len(bucket.slots)
    device = buf.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    plan = _bucket_plan(bucket, device, layout_digest)
    words = buf[: bucket.nbytes].view(torch.int64)
    acc = torch.zeros(n + 1, dtype=torch.int64, device=device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS]
        index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=device)
        seg = (torch.searchsorted(plan.start_words, index, right=True) - 1).clamp_(min=0)
        rel = index - plan.start_words[seg]
        valid = plan.nbytes[seg] - rel * 8
        # Mask bytes past the tensor's end in its last word; words past the end go to a dummy slot n.
        keep = torch.where(valid >= 8, torch.full_like(valid, -1), (1 << (valid.clamp(0, 7) * 8)) - 1)
        seg = torch.where(valid > 0, seg, torch.full_like(seg, n))
        position = _mix(rel * _signed(_GOLDEN) + plan.seeds[seg.clamp(max=n - 1)])
        acc.index_add_(0, seg, _mix((chunk & keep) ^ position))
    acc = acc[:n]
    return _mix(acc ^ _mix(plan.nbytes * _signed(_GOLDEN) + plan.seeds))


def bucket_digests(bucket: Bucket, buf: torch.Tensor, algo: DigestAlgo, layout_digest: str) -> torch.Tensor:
    """Digests of the tensors of ``bucket`` read from ``buf``: int64 [n] on the CPU (xxh3) or buf's device."""
    if algo == "torch-mix64":
        return mix64_bucket_digests(bucket, buf, layout_digest)
    if buf.device.type != "cpu":
        buf = buf.cpu()  # a device receiver of a host-hashing sender: correct, not fast
    view = host_buffer(buf[: bucket.nbytes])
    digest = xxhash.xxh3_64_intdigest
    seeds = _xxh3_seeds(bucket, layout_digest)
    values = [to_signed64(digest(view[s.offset : s.offset + s.nbytes], seed)) for s, seed in zip(bucket.slots, seeds)]
    return torch.tensor(values, dtype=torch.int64)


def layout_digests(layout: Layout, read: Callable[[Bucket], torch.Tensor], algo: DigestAlgo,
                   device: torch.device | None = None) -> list[int]:
    """Per-tensor digests of every bucket of ``layout``, whose bytes ``read(bucket)`` returns (it may reuse
    one scratch buffer: each bucket is digested before the next is read). torch-mix64 runs on ``device``
    when given; one host sync in all."""
    parts = []
    for bucket in layout.buckets:
        data = read(bucket)
        if algo == "torch-mix64" and device is not None and data.device != device:
            data = data.to(device, non_blocking=True)
        parts.append(bucket_digests(bucket, data, algo, layout.digest))
    return torch.cat(parts).cpu().tolist() if parts else []


_seed_cache: dict[tuple[str, int], list[int]] = {}


def _xxh3_seeds(bucket: Bucket, layout_digest: str) -> list[int]:
    key = (layout_digest, bucket.index)
    seeds = _seed_cache.get(key)
    if seeds is None:
        if len(_seed_cache) > 4096:
            _seed_cache.clear()
        seeds = _seed_cache[key] = [header_seed(s.dtype, s.shape) & _MASK64 for s in bucket.slots]
    return seeds


def version_digest(algo: str, layout_digest: str, digests: Sequence[int]) -> str:
    """Hex digest of a whole version: algorithm, layout (names, dtypes, shapes, order) and tensor digests."""
    hasher = xxhash.xxh3_64()
    hasher.update(f"ckpt-version-v1|{algo}|{layout_digest}|".encode())
    hasher.update(struct.pack(f"<{len(digests)}q", *digests))
    return hasher.hexdigest()


def reference_mix64_digest(dtype: str, shape: Sequence[int], data: bytes) -> int:
    """Plain-Python torch-mix64 of one tensor, for cross-checking the vectorised version in tests."""

    def mix(z: int) -> int:
        z ^= z >> 30
        z = (z * _C1) & _MASK64
        z ^= z >> 27
        z = (z * _C2) & _MASK64
        return z ^ (z >> 31)

    seed = header_seed(dtype, shape) & _MASK64
    acc = 0
    padded = data + b"\0" * (-len(data) % 8)
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[i * 8 : i * 8 + 8], "little")
        acc = (acc + mix(word ^ mix((i * _GOLDEN + seed) & _MASK64))) & _MASK64
    return to_signed64(mix(acc ^ mix((len(data) * _GOLDEN + seed) & _MASK64)))
