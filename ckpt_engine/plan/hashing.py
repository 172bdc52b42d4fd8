"""Per-tensor and per-version digests.

Two algorithms, named in every manifest so a receiver recomputes the one its sender used:

- ``xxh3-64``: xxhash over host bytes (CPU buffers, zero-copy).
- ``torch-block64``: computed with torch integer ops wherever the bucket lives (CUDA/NPU, also CPU), one host
  sync per bucket. A tensor's bytes are rows of 32 words. Each word is XORed with its column's constant and
  passed through the splitmix64 finaliser, and the words are summed per row. The rows are summed per tensor,
  weighted by powers of an odd constant, so the digest depends on every byte and on byte order (unlike an XOR
  or sum of elements such as ``torch.hash_tensor``). Rows are independent: the bucket is read once, by one
  fused kernel (torch.compile), then a prefix sum and a finish work on one value per row (see below).

Both fold the dtype and shape into a per-tensor seed, so equal bytes under another dtype or shape differ.
Digests are signed int64 values so they can travel through any collective backend.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import ProtocolError
from ckpt_engine.plan.layout import Bucket, Layout, TensorSlot, align_up

log = logging.getLogger(__name__)
ALGORITHMS: tuple[str, ...] = ("xxh3-64", "torch-block64")
# Algorithms of earlier releases that this one no longer computes: a header naming one is refused with why.
RETIRED: dict[str, str] = {
    "torch-mix64": "the device digest of ckpt-engine releases before torch-block64 (issue 36): the peer that "
                   "computed it runs an older ckpt-engine; upgrade it (both sides must run a release with "
                   "torch-block64)",
}

_MASK64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15


def to_signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _signed(constant: int) -> int:
    return to_signed64(constant)


def check_algo(algo: str) -> DigestAlgo:
    if algo in RETIRED:
        raise ProtocolError(f"digest algorithm {algo!r} is no longer supported: {RETIRED[algo]}; this side knows "
                            f"{', '.join(ALGORITHMS)}")
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
    array._tensor = buf  # type: ignore[attr-defined]  # from_address alone holds no reference to the memory
    return memoryview(array).cast("B")


def xxh3_digest(dtype: str, shape: Sequence[int], data: torch.Tensor) -> int:
    """xxh3-64 digest of one tensor's bytes (a uint8 CPU slice) under its dtype and shape."""
    return to_signed64(xxhash.xxh3_64_intdigest(host_buffer(data), header_seed(dtype, shape) & _MASK64))


# ---- torch-block64 ----------------------------------------------------------------------------------------
#
# A tensor's (or a piece's) bytes, zero-padded to a multiple of 256, are rows of ROW_WORDS = 32 int64 words;
# b is a row's index within the tensor.
#   level 1, per row:    r_b = sum_c mix(w[b, c] ^ P[c])           (P[c] = mix(c*G + salt): a constant per column)
#   level 2, per tensor: S = sum_b r_b * K^b                         (K odd; every sum and product wraps mod 2^64)
#   digest = mix(S ^ mix(nbytes*G + seed))                           (seed: slot_seed; mix: splitmix64's finaliser)
# Rows are independent, so a bucket's rows spread over the whole chip. A bucket is digested in three steps, one
# call per bucket:
#   1. weighted row sums: r_a * K^a for every row a of the bucket, in one fused read of the bucket;
#   2. their prefix sums (torch.cumsum), on one value per 256 bytes;
#   3. the finish, on one value per tensor: S = (prefix[end] - prefix[first]) * K^-first. K is odd, so it is
#      invertible mod 2^64. Where a tensor's bytes end inside its last row, S is corrected: that row is read
#      again through a masked gather, so bytes past the tensor count as zero whatever the buffer holds there.
#      The correction is gathered per tensor, not scattered into the row sums.
# Compiled (``_CompiledSteps``), steps 1 and 3 are two graphs and step 2 stays eager; that class says why.
# Measured rates are in docs/gpu-runs.md (bench/digest_parts.py): 396 GB/s on an H200, 1 GiB in 512 MiB buckets.
# Every slot offset and the bucket's size must be multiples of 256 (the default alignment). Buckets of layouts
# with a smaller alignment take a slower path that first copies each tensor into a zero-padded scratch (see
# _build_plan).

ROW_WORDS = 32
ROW_BYTES = ROW_WORDS * 8
_ROW_SALT = 0x243F6A8885A308D3  # pi's first hex digits
_K = 0xD1342543DE82EF95  # the row weights' base: odd, 5 mod 8 (its powers cycle only after 2^62 rows)
_K_INV = pow(_K, -1, 1 << 64)
# Rows per step of the eager level 1, which reuses two [rows, 32] int64 temporaries: 32 MiB each on an
# accelerator (few launches), 4 MiB on the CPU (fits in cache, yet enough work per op for its threads).
_CHUNK_ROWS = 1 << 17
_HOST_CHUNK_ROWS = 1 << 14
KERNEL_ENV = "CKPT_ENGINE_DIGEST_KERNEL"


def _mix_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (unsigned 64-bit)."""
    z &= _MASK64
    z ^= z >> 30
    z = (z * _C1) & _MASK64
    z ^= z >> 27
    z = (z * _C2) & _MASK64
    return z ^ (z >> 31)


_COLUMNS = tuple(_mix_int(c * _GOLDEN + _ROW_SALT) for c in range(ROW_WORDS))


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


def row_sums(words: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Level 1: int64 words [rows * 32] (rows of 256 bytes) -> int64 [rows], r = sum_c mix(w[c] ^ P[c])."""
    return _mix(words.view(-1, ROW_WORDS) ^ columns).sum(dim=1)


def weighted_row_sums(words: torch.Tensor, columns: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
    """Step 1: r_a * K^a for every row a of the bucket (``powers``: K^a for its rows)."""
    return row_sums(words, columns) * powers


def _weighted_row_sums_into(words: torch.Tensor, columns: torch.Tensor, powers: torch.Tensor, out: torch.Tensor,
                            chunk_rows: int) -> None:
    """:func:`weighted_row_sums` into ``out`` [rows] with eager torch ops, ``chunk_rows`` rows at a time through
    two reused temporaries (the same arithmetic, in place)."""
    rows = out.numel()
    if rows == 0:
        return
    grid = words.view(rows, ROW_WORDS)
    step = min(rows, chunk_rows)
    z_buf = torch.empty(step, ROW_WORDS, dtype=torch.int64, device=words.device)
    t_buf = torch.empty_like(z_buf)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        z = torch.bitwise_xor(grid[r0:r1], columns, out=z_buf[: r1 - r0])
        t = t_buf[: r1 - r0]
        for shift, factor in ((30, _C1), (27, _C2), (31, None)):
            torch.bitwise_right_shift(z, shift, out=t)
            t &= (1 << (64 - shift)) - 1
            z ^= t
            if factor is not None:
                z *= _signed(factor)
        torch.sum(z, dim=1, out=out[r0:r1])
    out *= powers


def prefix_sums(weighted: torch.Tensor) -> torch.Tensor:
    """Step 2: int64 [rows + 1], prefix[a] = sum of weighted[:a] (wrapping)."""
    prefix = torch.empty(weighted.numel() + 1, dtype=torch.int64, device=weighted.device)
    prefix[:1] = 0
    torch.cumsum(weighted, 0, out=prefix[1:])
    return prefix


def finish(prefix: torch.Tensor, weighted: torch.Tensor, words: torch.Tensor, columns: torch.Tensor,
           powers: torch.Tensor, partial_rows: torch.Tensor, partial_words: torch.Tensor,
           partial_masks: torch.Tensor, partial_of: torch.Tensor, firsts: torch.Tensor, ends: torch.Tensor,
           unshift: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
    """Step 3, for every tensor of the bucket at once: its range of the prefix sums plus the correction of its
    partial row, unweighted by K^-first and finished with its tail. ``partial_of`` names each tensor's entry
    among the partial rows; a tensor without a partial row names an entry whose correction is zero."""
    fixed = row_sums((words[partial_words] & partial_masks).view(-1), columns) * powers[partial_rows]
    correction = (fixed - weighted[partial_rows])[partial_of]
    return _mix(((prefix[ends] - prefix[firsts] + correction) * unshift) ^ tails)


def digest_rows(words: torch.Tensor, columns: torch.Tensor, powers: torch.Tensor, partial_rows: torch.Tensor,
                partial_words: torch.Tensor, partial_masks: torch.Tensor, partial_of: torch.Tensor,
                firsts: torch.Tensor, ends: torch.Tensor, unshift: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
    """The digests of a bucket's tensors from its words (all of it, whole rows), in plain eager ops. It is the
    definition that the chunked eager path and the compiled steps are checked against."""
    weighted = weighted_row_sums(words, columns, powers)
    return finish(prefix_sums(weighted), weighted, words, columns, powers, partial_rows, partial_words,
                  partial_masks, partial_of, firsts, ends, unshift, tails)


# ---- which implementation runs ----

_kernel_lock = threading.Lock()
_compiled: dict[str, Any] = {}  # device type -> _CompiledSteps, or None where it could not be used
_compile_failures: dict[str, str] = {}  # device type -> why
_warned_env: list[str] = []


def _kernel_choice() -> str:
    """"eager", "compiled" or "" (the default: compiled on CUDA, eager elsewhere) from CKPT_ENGINE_DIGEST_KERNEL."""
    value = os.environ.get(KERNEL_ENV, "").strip().lower()
    if value in ("", "eager", "compiled"):
        return value
    if value not in _warned_env:
        _warned_env.append(value)
        log.warning("%s=%r is neither 'eager' nor 'compiled': using the default", KERNEL_ENV, value)
    return ""


def device_digest_kernel(device: torch.device) -> str:
    """Which implementation digests buckets on ``device``: "compiled" (``_CompiledSteps``) or "eager" (torch
    ops, level 1 in passes over bounded chunks). Both give the same digests. The default on CUDA is compiled if
    it builds and agrees with the eager ops on a probe, else eager with a warning; eager on other devices.
    CKPT_ENGINE_DIGEST_KERNEL=eager|compiled forces one; forcing compiled where it cannot be built is an error."""
    return "compiled" if _compiled_fn(device) is not None else "eager"


def warm_up(device: torch.device) -> threading.Thread | None:
    """Start building the compiled digest for ``device`` on a thread of its own, and return the thread.
    Otherwise the first version pays for the build inside its first bucket: seconds to tens of seconds with an
    empty compile cache, against the collectives' timeouts. The first digest waits for the build. None where
    the eager ops run: there is nothing to build."""
    if _kernel_choice() == "eager" or (_kernel_choice() == "" and device.type != "cuda") or device.type in _compiled:
        return None
    thread = threading.Thread(target=device_digest_kernel, args=(device,), name="ckpt-digest-compile", daemon=True)
    thread.start()
    return thread


def compile_failure(device: torch.device) -> str | None:
    """Why the compiled digest is not used on ``device``'s type (None: it compiled, or was never tried)."""
    return _compile_failures.get(device.type)


def _compiled_fn(device: torch.device) -> Any | None:
    choice = _kernel_choice()
    if choice == "eager" or (choice == "" and device.type != "cuda"):
        return None
    kind = device.type
    if kind not in _compiled:
        with _kernel_lock:
            if kind not in _compiled:
                _compiled[kind] = _compile(device)
    fn = _compiled[kind]
    if fn is None and choice == "compiled":
        raise RuntimeError(f"{KERNEL_ENV}=compiled, but the compiled device digest is unavailable on {kind}: "
                           f"{_compile_failures.get(kind)}")
    return fn


def _plain() -> contextlib.ExitStack:
    """The one autograd state every compiled call runs in, whatever the caller's (no_grad, inference_mode or
    neither). torch.compile guards on it, so one state means one graph. Tables and plans are made in it too, so
    they are never inference tensors, which is another guard."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _normal(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a plain tensor over the same memory where it is an inference tensor (made under
    inference_mode, as an engine's buffers may be). The compiled function then sees one kind of input."""
    if not tensor.is_inference():
        return tensor
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


class _CompiledSteps:
    """:func:`digest_rows` as two graphs compiled with dynamic shapes, step 1 (the one read of the bucket) and
    step 3, around torch's own prefix sum (step 2, eager). In one graph, inductor lowers the prefix sum over
    every row as a scan, which ran at ~43 GB/s on an H200 whatever the bucket (docs/gpu-runs.md).
    torch.cumsum alone runs at memory speed."""

    def __init__(self) -> None:
        self.level1 = torch.compile(weighted_row_sums, dynamic=True)
        self.finish = torch.compile(finish, dynamic=True)

    def __call__(self, words: torch.Tensor, columns: torch.Tensor, powers: torch.Tensor,
                 *rest: torch.Tensor) -> torch.Tensor:
        weighted = self.level1(words, columns, powers)
        return self.finish(prefix_sums(weighted), weighted, words, columns, powers, *rest)


def _compile(device: torch.device) -> Any | None:
    """The compiled digest (``_CompiledSteps``), checked once against the eager ops on probes; None, with a
    warning, where it cannot be built or disagrees (correct either way, only slower)."""
    try:
        fn = _CompiledSteps()
        with _plain():
            _check_compiled(fn, device)
        return fn
    except Exception as exc:  # noqa: BLE001  # no compiler, an old torch, an unsupported backend ...
        _compile_failures[device.type] = f"{type(exc).__name__}: {exc}"
        log.warning("device digest: torch.compile unavailable on %s (%s); using eager torch ops", device.type,
                    _compile_failures[device.type])
        return None


def _check_compiled(fn: Any, device: torch.device) -> None:
    """Compare the compiled function with the eager ops on random probes of the shapes buckets give it. The
    probes also build, up front, what the compiled function needs for those shapes."""
    gen = torch.Generator().manual_seed(36)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(-(1 << 63), (1 << 63) - 1, shape, dtype=torch.int64, generator=gen).to(device)

    def index(high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen).to(device)

    # Inductor tunes the dynamic-shape kernels for the first probe's sizes. No two of them are alike: dynamic
    # shapes would give equal sizes one symbol. 16 MiB on an accelerator is a stop-gap: step 1 tuned at it read
    # at 410 GB/s on an H200, tuned at a 512 MiB bucket at 2,944 GB/s (docs/gpu-runs.md). Tuning at the
    # deployment's bucket size is next, once measured.
    first_rows = 1 << 16 if device.type != "cpu" else 67
    for rows, partial, n in ((first_rows, 3, 5), (2, 2, 2), (40, 7, 3)):
        firsts = index(rows, n)
        # distinct partial rows but the last, which repeats the first (as plans pad): the same value written twice
        fixed = torch.randperm(rows, generator=gen)[: partial - 1]
        fixed = torch.cat([fixed, fixed[:1]]).to(device)
        words, masks = index(rows * ROW_WORDS, partial, ROW_WORDS), rand(partial, ROW_WORDS)
        words[-1], masks[-1] = words[0], masks[0]
        args = (rand(rows * ROW_WORDS), _columns(device), _powers(device, rows)[:rows], fixed, words, masks,
                index(partial, n), firsts,
                (firsts + index(3, n)).clamp(max=rows), rand(n), rand(n))
        if not torch.equal(fn(*args).cpu(), digest_rows(*args).cpu()):
            raise RuntimeError(f"the compiled digest disagrees with the eager torch ops ({rows} rows)")


# ---- per-device tables and per-bucket plans ----

_columns_cache: dict[str, torch.Tensor] = {}
_powers_cache: dict[str, torch.Tensor] = {}


def _columns(device: torch.device) -> torch.Tensor:
    """P: int64 [32] on ``device``."""
    key = str(device)
    columns = _columns_cache.get(key)
    if columns is None:
        with _plain():
            columns = torch.tensor([to_signed64(p) for p in _COLUMNS], dtype=torch.int64, device=device)
        _columns_cache[key] = columns
    return columns


def _powers(device: torch.device, rows: int) -> torch.Tensor:
    """K^a mod 2^64 for a in [0, rows) at least: the row weights, shared by every bucket on a device, grown by
    doubling (each step multiplies the table so far by one power of K)."""
    key = str(device)
    table = _powers_cache.get(key)
    if table is None or table.numel() < rows:
        size = max(1024, 1 << max(rows - 1, 0).bit_length())
        with _plain():
            table = torch.ones(1, dtype=torch.int64, device=device)
            while table.numel() < size:
                table = torch.cat([table, table * to_signed64(pow(_K, table.numel(), 1 << 64))])
        _powers_cache[key] = table
    return table


@dataclass(frozen=True)
class _BucketPlan:
    """What the device digest of one bucket needs, built once per (layout, bucket, device)."""

    n: int  # tensors (pieces)
    rows: int  # rows of 256 bytes read: the bucket's, or the scratch's (copies)
    partial: int  # rows that are not all their tensor's bytes (a tensor's last row, where it ends inside it)
    # Those rows, their words' indices and the tensor's bytes in each word, then one zero-correction entry
    # (row 0 read whole). At least 2 entries, so torch.compile makes no graph of its own for 0 or 1 of them.
    partial_rows: torch.Tensor  # int64 [max(partial + 1, 2)]
    partial_words: torch.Tensor  # int64 [max(partial + 1, 2), 32]
    partial_masks: torch.Tensor  # int64 [max(partial + 1, 2), 32]
    # Per tensor, and one dummy entry after them (rows 0 to 0), for the same reason
    partial_of: torch.Tensor  # int64 [n + 1]: its entry of the partial rows (none: the zero-correction one)
    firsts: torch.Tensor  # int64 [n + 1]: each tensor's first row
    ends: torch.Tensor  # int64 [n + 1]: one past its last row
    unshift: torch.Tensor  # int64 [n + 1]: K^-first
    tails: torch.Tensor  # int64 [n + 1]: mix(nbytes*G + seed)
    copies: tuple[tuple[int, int, int], ...] | None  # slow path: (bucket offset, nbytes, scratch offset)


_plan_cache: dict[tuple[str, int, str], _BucketPlan] = {}


def _bucket_plan(bucket: Bucket, device: torch.device, layout_digest: str) -> _BucketPlan:
    key = (layout_digest, bucket.index, str(device))
    plan = _plan_cache.get(key)
    if plan is None:
        if len(_plan_cache) > 4096:
            _plan_cache.clear()
        with _plain():
            plan = _plan_cache[key] = _build_plan(bucket, device)
    return plan


def _build_plan(bucket: Bucket, device: torch.device) -> _BucketPlan:
    slots = bucket.slots
    sizes = [s.nbytes for s in slots]
    copies: tuple[tuple[int, int, int], ...] | None = None
    if bucket.nbytes % ROW_BYTES == 0 and all(s.offset % ROW_BYTES == 0 for s in slots):
        offsets, nbytes = [s.offset for s in slots], bucket.nbytes
    else:
        # Slow path, only for layouts planned with an alignment below 256 (config `alignment`). A tensor may
        # start inside a row, so each is first copied to a row boundary in a zero-padded scratch, one copy per
        # tensor in a Python loop: correct, not fast.
        offsets, cursor, moves = [], 0, []
        for slot in slots:
            offsets.append(cursor)
            moves.append((slot.offset, slot.nbytes, cursor))
            cursor = align_up(cursor + slot.nbytes, ROW_BYTES)
        copies, nbytes = tuple(moves), cursor
    rows = nbytes // ROW_BYTES
    firsts = [o // ROW_BYTES for o in offsets]
    ends = [f + -(-n // ROW_BYTES) for f, n in zip(firsts, sizes)]
    seeds = [slot_seed(s) & _MASK64 for s in slots]
    partial = [j for j, n in enumerate(sizes) if n % ROW_BYTES]
    entries = max(len(partial) + 1, 2)
    # the partial rows' words and how many of each word's bytes are the tensor's; then row 0, whole (its
    # correction is zero), as the entry of every tensor without a partial row
    last = torch.tensor([ends[j] - 1 for j in partial] + [0] * (entries - len(partial)), dtype=torch.int64)
    stop = torch.tensor([offsets[j] + sizes[j] for j in partial] + [1 << 62] * (entries - len(partial)),
                        dtype=torch.int64)
    words = last[:, None] * ROW_WORDS + torch.arange(ROW_WORDS, dtype=torch.int64)
    valid = (stop[:, None] - words * 8).clamp(0, 8)
    masks = torch.where(valid == 8, torch.full_like(valid, -1),
                        torch.bitwise_left_shift(torch.ones_like(valid), valid * 8) - 1)
    own = dict(zip(partial, range(len(partial))))
    partial_of = [own.get(j, len(partial)) for j in range(len(slots) + 1)]

    def signed(values: list[int]) -> torch.Tensor:
        return torch.tensor([to_signed64(v) for v in values], dtype=torch.int64).to(device)

    return _BucketPlan(
        n=len(slots), rows=rows, partial=len(partial), partial_rows=last.to(device),
        partial_words=words.clamp(max=max(rows * ROW_WORDS - 1, 0)).to(device), partial_masks=masks.to(device),
        partial_of=signed(partial_of), firsts=signed([*firsts, 0]), ends=signed([*ends, 0]),
        unshift=signed([*(pow(_K_INV, f, 1 << 64) for f in firsts), 0]),
        tails=signed([*(_mix_int(n * _GOLDEN + seed) for n, seed in zip(sizes, seeds)), 0]), copies=copies)


def block64_bucket_digests(bucket: Bucket, buf: torch.Tensor, layout_digest: str) -> torch.Tensor:
    """torch-block64 digests of every tensor (piece) in ``bucket``, read from ``buf`` (its uint8 bytes): int64
    [len(bucket.slots)] on buf's device. ``layout_digest`` keys the cached plan. No host sync happens here.
    There is no Python loop per tensor except on the slow path of layouts aligned below 256; the compiled form
    is one call per bucket."""
    device = buf.device
    if not bucket.slots:
        return torch.empty(0, dtype=torch.int64, device=device)
    plan = _bucket_plan(bucket, device, layout_digest)
    data = buf[: bucket.nbytes]
    if plan.copies is not None:
        scratch = torch.zeros(plan.rows * ROW_BYTES, dtype=torch.uint8, device=device)
        for src, size, dst in plan.copies:
            scratch[dst : dst + size].copy_(data[src : src + size])
        data = scratch
    if plan.rows == 0:  # only empty tensors: S = 0 for each
        return _mix(plan.tails)[: plan.n]
    words, columns, powers = data.view(torch.int64), _columns(device), _powers(device, plan.rows)[: plan.rows]
    args = (plan.partial_rows, plan.partial_words, plan.partial_masks, plan.partial_of, plan.firsts, plan.ends,
            plan.unshift, plan.tails)
    compiled = _compiled_fn(device) if plan.rows > 1 else None  # one row would get a graph of its own
    if compiled is not None:
        with _plain():
            return compiled(_normal(words), columns, powers, *args)[: plan.n]
    weighted = torch.empty(plan.rows, dtype=torch.int64, device=device)
    _weighted_row_sums_into(words, columns, powers, weighted, _HOST_CHUNK_ROWS if device.type == "cpu" else _CHUNK_ROWS)
    return finish(prefix_sums(weighted), weighted, words, columns, powers, *args)[: plan.n]


def bucket_digests(bucket: Bucket, buf: torch.Tensor, algo: DigestAlgo, layout_digest: str) -> torch.Tensor:
    """Digests of the tensors of ``bucket`` read from ``buf``: int64 [n] on the CPU (xxh3) or buf's device."""
    if algo == "torch-block64":
        return block64_bucket_digests(bucket, buf, layout_digest)
    if buf.device.type != "cpu":
        buf = buf.cpu()  # a device receiver of a host-hashing sender: correct, not fast
    view = host_buffer(buf[: bucket.nbytes])
    digest = xxhash.xxh3_64_intdigest
    values = array.array("Q", [digest(view[start:end], seed)
                               for start, end, seed in _xxh3_spans(bucket, layout_digest)])
    # the unsigned digests' bytes read as int64: the signed values, with no per-tensor Python conversion
    return torch.frombuffer(values, dtype=torch.int64).clone() if values else torch.empty(0, dtype=torch.int64)


def layout_digests(layout: Layout, read: Callable[[Bucket], torch.Tensor], algo: DigestAlgo,
                   device: torch.device | None = None) -> list[int]:
    """Per-tensor digests of every tensor of ``layout``; ``read(bucket)`` returns a bucket's bytes. It may reuse
    one scratch buffer: each bucket is digested before the next is read. torch-block64 runs on ``device`` when
    given, with one host sync in all."""
    parts = []
    for bucket in layout.buckets:
        data = read(bucket)
        if algo == "torch-block64" and device is not None and data.device != device:
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


def reference_block64_digest(dtype: str, shape: Sequence[int], data: bytes, *, seed: int | None = None) -> int:
    """Plain-Python torch-block64 of one tensor (or, with a piece's ``seed``, one piece), straight from the
    definition, for cross-checking the vectorised version in tests."""
    seed = (header_seed(dtype, shape) if seed is None else seed) & _MASK64
    padded = data + b"\0" * (-len(data) % ROW_BYTES)
    total, weight = 0, 1
    for row in range(len(padded) // ROW_BYTES):
        row_sum = 0
        for column in range(ROW_WORDS):
            at = row * ROW_BYTES + column * 8
            row_sum += _mix_int(int.from_bytes(padded[at : at + 8], "little") ^ _COLUMNS[column])
        total = (total + (row_sum & _MASK64) * weight) & _MASK64
        weight = weight * _K & _MASK64
    return to_signed64(_mix_int(total ^ _mix_int(len(data) * _GOLDEN + seed)))
