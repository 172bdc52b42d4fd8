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

import array
import bisect
import ctypes
import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import ProtocolError
from ckpt_engine.plan.layout import Bucket, Layout, TensorSlot

log = logging.getLogger(__name__)
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


def slot_seed(slot: TensorSlot) -> int:
    """The seed of what a slot carries: a whole tensor's is its header seed; a piece's also names where in
    its tensor the piece starts, so pieces swapped or moved do not digest alike."""
    if slot.parts == 1:
        return header_seed(slot.dtype, slot.shape)
    text = f"{slot.dtype}|{','.join(map(str, slot.shape))}|piece {slot.start}+{slot.nbytes}"
    return to_signed64(xxhash.xxh3_64_intdigest(text.encode()))


def fold_pieces(dtype: str, shape: Sequence[int], piece_digests: Sequence[int]) -> int:
    """A chunked tensor's digest from its pieces' (in order): it depends on every byte through them."""
    packed = struct.pack(f"<{len(piece_digests)}q", *piece_digests)
    return to_signed64(xxhash.xxh3_64_intdigest(packed, header_seed(dtype, shape) & _MASK64))


def tensor_digests(layout: Layout, piece_digests: Sequence[int]) -> list[int]:
    """Per-tensor digests (manifests, version digests) from the per-piece digests the buckets carry, in wire
    order: a chunked tensor's is its pieces' folded; the others are their own."""
    if not layout.chunked:
        return list(piece_digests)
    if len(piece_digests) != len(layout.pieces):
        raise ProtocolError(f"{len(piece_digests)} piece digests for {len(layout.pieces)} pieces")
    out: list[int] = []
    pending: list[int] = []
    for slot, digest in zip(layout.pieces, piece_digests):
        if slot.parts == 1:
            out.append(digest)
            continue
        pending.append(digest)
        if slot.part == slot.parts - 1:
            out.append(fold_pieces(slot.dtype, slot.shape, pending))
            pending = []
    return out


def host_buffer(buf: torch.Tensor) -> memoryview:
    """Zero-copy memoryview of a contiguous uint8 CPU tensor (no numpy, so bf16 sources work too). The view
    keeps the tensor alive: ``host_buffer(t.cpu())`` of a device tensor must not read a freed temporary."""
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("host_buffer needs a contiguous uint8 CPU tensor")
    size = buf.numel()
    if size == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * size).from_address(buf.data_ptr())
    array._tensor = buf  # type: ignore[attr-defined]  # (from_address alone holds no reference to the memory)
    return memoryview(array).cast("B")


def xxh3_digest(dtype: str, shape: Sequence[int], data: torch.Tensor) -> int:
    """xxh3-64 digest of one tensor's bytes (a uint8 CPU slice) under its dtype and shape."""
    return to_signed64(xxhash.xxh3_64_intdigest(host_buffer(data), header_seed(dtype, shape) & _MASK64))


# ---- torch-mix64 ----------------------------------------------------------------------------------------
#
# Per tensor j (start word s, full words f, seed): acc = sum over its words k of mix(word ^ mix(k*G + seed)), the
# last word masked to the tensor's bytes; digest = mix(acc ^ mix(nbytes*G + seed)). Written with the word's
# index i in the bucket, k*G + seed = i*G + off with off = seed - s*G, so one precomputed i*G serves every
# tensor. Full words are mixed chunk by chunk and summed per tensor by prefix sums (no atomics: one big tensor
# would otherwise make every word add into the same accumulator); partial last words are mixed separately.


@dataclass(frozen=True)
class _Chunk:
    """Words [start, start + nwords) of a bucket and the tensors whose full words lie in them."""

    start: int
    nwords: int
    single: torch.Tensor | None  # int64 [1]: off + start*G when one tensor's full words fill the chunk
    slot: int  # that tensor's index in the bucket (single chunks)
    run_offs: torch.Tensor | None  # int64 [runs]: off + start*G of each run of words (gaps: 0, never summed)
    run_lengths: torch.Tensor | None  # int64 [runs], summing to nwords
    slots: torch.Tensor | None  # int64 [m]: the tensors with full words here
    first: torch.Tensor | None  # int64 [m]: first word of each, relative to the chunk
    last: torch.Tensor | None  # int64 [m]: last word of each (inclusive), relative to the chunk


@dataclass(frozen=True)
class _BucketPlan:
    """Index tensors of the device digest, built once per (layout, bucket, device, chunk size)."""

    n: int
    chunks: tuple[_Chunk, ...]
    tails: torch.Tensor  # int64 [n]: mix(nbytes*G + seed) per tensor
    partial_slots: torch.Tensor  # int64 [p]: tensors whose last word is partial
    partial_words: torch.Tensor  # int64 [p]: that word's index in the bucket
    partial_masks: torch.Tensor  # int64 [p]: its valid bytes
    partial_offs: torch.Tensor  # int64 [p]: off of those tensors


_plan_cache: dict[tuple[str, int, str, int], _BucketPlan] = {}
_positions_cache: dict[tuple[str, int], torch.Tensor] = {}


def _mix_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (unsigned 64-bit)."""
    z &= _MASK64
    z ^= z >> 30
    z = (z * _C1) & _MASK64
    z ^= z >> 27
    z = (z * _C2) & _MASK64
    return z ^ (z >> 31)


def _bucket_plan(bucket: Bucket, device: torch.device, layout_digest: str) -> _BucketPlan:
    key = (layout_digest, bucket.index, str(device), _CHUNK_WORDS)
    plan = _plan_cache.get(key)
    if plan is None:
        if len(_plan_cache) > 4096:
            _plan_cache.clear()
        plan = _plan_cache[key] = _build_plan(bucket, device)
    return plan


def _build_plan(bucket: Bucket, device: torch.device) -> _BucketPlan:
    slots = bucket.slots
    starts = [s.offset // 8 for s in slots]
    full = [s.nbytes // 8 for s in slots]
    seeds = [slot_seed(s) & _MASK64 for s in slots]
    offs = [(seed - start * _GOLDEN) & _MASK64 for seed, start in zip(seeds, starts)]
    chunks = tuple(_plan_chunk(c0, min(c0 + _CHUNK_WORDS, bucket.nbytes // 8), starts, full, offs, device)
                   for c0 in range(0, bucket.nbytes // 8, _CHUNK_WORDS))
    partial = [j for j, s in enumerate(slots) if s.nbytes % 8]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor([to_signed64(v) for v in values], dtype=torch.int64).to(device)

    return _BucketPlan(
        n=len(slots), chunks=tuple(c for c in chunks if c is not None),
        tails=tensor([_mix_int(s.nbytes * _GOLDEN + seed) for s, seed in zip(slots, seeds)]),
        partial_slots=tensor(partial), partial_words=tensor([starts[j] + full[j] for j in partial]),
        partial_masks=tensor([(1 << (8 * (slots[j].nbytes % 8))) - 1 for j in partial]),
        partial_offs=tensor([offs[j] for j in partial]))


def _plan_chunk(c0: int, c1: int, starts: list[int], full: list[int], offs: list[int],
                device: torch.device) -> _Chunk | None:
    """The tensors whose full words meet words [c0, c1); None when there are none (padding only)."""
    first = bisect.bisect_right(starts, c0) - 1  # the last tensor starting at or before c0 may reach into it
    inside = [j for j in range(max(first, 0), bisect.bisect_left(starts, c1))
              if full[j] and starts[j] + full[j] > c0]
    if not inside:
        return None
    shift = c0 * _GOLDEN  # positions come chunk-relative: off + c0*G makes them absolute

    def signed(values: list[int]) -> torch.Tensor:
        return torch.tensor([to_signed64(v) for v in values], dtype=torch.int64).to(device)

    j = inside[0]
    if len(inside) == 1 and starts[j] <= c0 and starts[j] + full[j] >= c1:
        return _Chunk(c0, c1 - c0, signed([offs[j] + shift]), j, None, None, None, None, None)
    run_offs, run_lengths, cursor = [], [], c0
    lo, hi = [], []
    for j in inside:
        a, b = max(starts[j], c0), min(starts[j] + full[j], c1)
        if a > cursor:  # padding, partial words or empty tensors in between
            run_offs.append(0)
            run_lengths.append(a - cursor)
        run_offs.append(offs[j] + shift)
        run_lengths.append(b - a)
        lo.append(a - c0)
        hi.append(b - 1 - c0)
        cursor = b
    if cursor < c1:
        run_offs.append(0)
        run_lengths.append(c1 - cursor)
    return _Chunk(c0, c1 - c0, None, -1, signed(run_offs), signed(run_lengths), signed(inside), signed(lo),
                  signed(hi))


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


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` in place (fewer temporaries on big chunks)."""
    for shift, factor in ((30, _C1), (27, _C2), (31, None)):
        shifted = z >> shift
        shifted &= (1 << (64 - shift)) - 1
        z ^= shifted
        if factor is not None:
            z *= _signed(factor)
    return z


def _positions(device: torch.device) -> torch.Tensor:
    """i*G for i in [0, chunk words): the position term of every word, shared by all buckets on a device."""
    key = (str(device), _CHUNK_WORDS)
    positions = _positions_cache.get(key)
    if positions is None:
        positions = torch.arange(_CHUNK_WORDS, dtype=torch.int64, device=device) * _signed(_GOLDEN)
        _positions_cache[key] = positions
    return positions


# One fused CUDA kernel for the per-word mixing (jiterator, compiled at first use by NVRTC); the same
# arithmetic as the eager ops below, in unsigned 64-bit. Where it cannot be built the eager ops run.
_FUSED_SOURCE = """
template <typename T> T ckpt_mix64_word(T word, T position, T offset) {
  unsigned long long z = (unsigned long long)position + (unsigned long long)offset;
  z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 27; z *= 0x94D049BB133111EBull; z ^= z >> 31;
  z ^= (unsigned long long)word;
  z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 27; z *= 0x94D049BB133111EBull; z ^= z >> 31;
  return (T)z;
}
"""
_fused: dict[str, Any] = {}  # "fn": the jitted function, "failed": why it could not be used


def device_digest_kernel(device: torch.device) -> str:
    """Which implementation mixes words on ``device``: "fused" (one CUDA kernel) or "eager" (torch ops)."""
    return "fused" if _fused_fn(device) is not None else "eager"


def _fused_fn(device: torch.device) -> Any | None:
    if device.type != "cuda" or "failed" in _fused or os.environ.get("CKPT_ENGINE_DIGEST_KERNEL") == "eager":
        return None
    if "fn" not in _fused:
        try:
            from torch.cuda.jiterator import _create_jit_fn

            fn = _create_jit_fn(_FUSED_SOURCE)
            probe = torch.tensor([1, -2, 3], dtype=torch.int64, device=device)
            if not torch.equal(fn(probe, probe, probe).cpu(), _mixed_eager(probe, probe, probe).cpu()):
                raise RuntimeError("fused kernel disagrees with the eager ops")
            _fused["fn"] = fn
        except Exception as exc:  # no NVRTC, an old torch, ...: correct either way, only slower
            _fused["failed"] = f"{type(exc).__name__}: {exc}"
            log.warning("device digest: fused CUDA kernel unavailable (%s); using torch ops", _fused["failed"])
            return None
    return _fused["fn"]


def _mixed_eager(words: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    z = _mix_(positions + offsets)
    z ^= words
    return _mix_(z)


def _mixed(words: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """mix(word ^ mix(position + offset)) per word (offsets broadcast)."""
    fused = _fused_fn(words.device)
    return fused(words, positions, offsets) if fused is not None else _mixed_eager(words, positions, offsets)


def mix64_bucket_digests(bucket: Bucket, buf: torch.Tensor, layout_digest: str) -> torch.Tensor:
    """torch-mix64 digests of every tensor in ``bucket``, read from ``buf`` (its uint8 bytes), on buf's device.

    ``layout_digest`` keys the cached index tensors. Returns int64 [len(bucket.slots)] on buf's device;
    no host sync happens here.
    """
    device = buf.device
    if not bucket.slots:
        return torch.empty(0, dtype=torch.int64, device=device)
    plan = _bucket_plan(bucket, device, layout_digest)
    words = buf[: bucket.nbytes].view(torch.int64)
    positions = _positions(device)
    acc = torch.zeros(plan.n, dtype=torch.int64, device=device)
    for chunk in plan.chunks:
        mixed = _mixed(words[chunk.start : chunk.start + chunk.nwords], positions[: chunk.nwords],
                       chunk.single if chunk.single is not None else _run_offsets(chunk))
        if chunk.single is not None:
            acc.narrow(0, chunk.slot, 1).add_(mixed.sum())
        else:
            acc.index_add_(0, chunk.slots, _range_sums(mixed, chunk))  # type: ignore[arg-type]
    if plan.partial_slots.numel():
        last = words[plan.partial_words] & plan.partial_masks
        position = _mix(plan.partial_words * _signed(_GOLDEN) + plan.partial_offs)
        acc.index_add_(0, plan.partial_slots, _mix(last ^ position))
    return _mix(acc ^ plan.tails)


def _run_offsets(chunk: _Chunk) -> torch.Tensor:
    return torch.repeat_interleave(chunk.run_offs, chunk.run_lengths, output_size=chunk.nwords)  # type: ignore[arg-type]


def _range_sums(mixed: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
    """Sum of ``mixed`` over each tensor's word range in the chunk, from one prefix sum (wrapping int64)."""
    prefix = mixed.cumsum(0)
    before = prefix[(chunk.first - 1).clamp(min=0)]  # type: ignore[operator]
    return prefix[chunk.last] - torch.where(chunk.first > 0, before, torch.zeros_like(before))  # type: ignore[index]


def bucket_digests(bucket: Bucket, buf: torch.Tensor, algo: DigestAlgo, layout_digest: str) -> torch.Tensor:
    """Digests of the tensors of ``bucket`` read from ``buf``: int64 [n] on the CPU (xxh3) or buf's device."""
    if algo == "torch-mix64":
        return mix64_bucket_digests(bucket, buf, layout_digest)
    if buf.device.type != "cpu":
        buf = buf.cpu()  # a device receiver of a host-hashing sender: correct, not fast
    view = host_buffer(buf[: bucket.nbytes])
    digest = xxhash.xxh3_64_intdigest
    values = array.array("Q", [digest(view[start:end], seed) for start, end, seed in _xxh3_spans(bucket, layout_digest)])
    # the unsigned digests' bytes read as int64: the signed values, with no per-tensor Python conversion
    return torch.frombuffer(values, dtype=torch.int64).clone() if values else torch.empty(0, dtype=torch.int64)


def layout_digests(layout: Layout, read: Callable[[Bucket], torch.Tensor], algo: DigestAlgo,
                   device: torch.device | None = None) -> list[int]:
    """Per-tensor digests of every tensor of ``layout``, whose buckets' bytes ``read(bucket)`` returns (it may
    reuse one scratch buffer: each bucket is digested before the next is read). torch-mix64 runs on
    ``device`` when given; one host sync in all."""
    parts = []
    for bucket in layout.buckets:
        data = read(bucket)
        if algo == "torch-mix64" and device is not None and data.device != device:
            data = data.to(device, non_blocking=True)
        parts.append(bucket_digests(bucket, data, algo, layout.digest))
    return tensor_digests(layout, torch.cat(parts).cpu().tolist() if parts else [])


_span_cache: dict[tuple[str, int], list[tuple[int, int, int]]] = {}


def _xxh3_spans(bucket: Bucket, layout_digest: str) -> list[tuple[int, int, int]]:
    """(start, end, seed) of every tensor of the bucket, made once per layout: the per-tensor work of a
    digest is then one xxh3 call."""
    key = (layout_digest, bucket.index)
    spans = _span_cache.get(key)
    if spans is None:
        if len(_span_cache) > 4096:
            _span_cache.clear()
        spans = _span_cache[key] = [(s.offset, s.offset + s.nbytes, slot_seed(s) & _MASK64)
                                    for s in bucket.slots]
    return spans


def version_digest(algo: str, layout_digest: str, digests: Sequence[int]) -> str:
    """Hex digest of a whole version: algorithm, layout (names, dtypes, shapes, order) and tensor digests."""
    hasher = xxhash.xxh3_64()
    hasher.update(f"ckpt-version-v1|{algo}|{layout_digest}|".encode())
    hasher.update(struct.pack(f"<{len(digests)}q", *digests))
    return hasher.hexdigest()


def reference_mix64_digest(dtype: str, shape: Sequence[int], data: bytes, *, seed: int | None = None) -> int:
    """Plain-Python torch-mix64 of one tensor (or, with a piece's ``seed``, one piece), for cross-checking the
    vectorised version in tests."""

    def mix(z: int) -> int:
        z ^= z >> 30
        z = (z * _C1) & _MASK64
        z ^= z >> 27
        z = (z * _C2) & _MASK64
        return z ^ (z >> 31)

    seed = (header_seed(dtype, shape) if seed is None else seed) & _MASK64
    acc = 0
    padded = data + b"\0" * (-len(data) % 8)
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[i * 8 : i * 8 + 8], "little")
        acc = (acc + mix(word ^ mix((i * _GOLDEN + seed) & _MASK64))) & _MASK64
    return to_signed64(mix(acc ^ mix((len(data) * _GOLDEN + seed) & _MASK64)))
