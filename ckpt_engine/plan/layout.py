"""Bucket layout: a pure planner from tensor specs to flat, aligned buckets.

Every rank plans the same layout from the same (names, dtypes, shapes, bucket size, alignment), so no
per-bucket metadata has to travel; a digest of the plan lets ranks check they agree.

A tensor larger than a bucket is split into pieces (chunks) of one bucket each, the last possibly shorter.
So no bucket, and no send or receive buffer, is larger than the bucket size, whatever the largest tensor. A
chunked tensor's first piece opens a bucket and every piece but the last fills one exactly. Its pieces then lie
back to back in a buffer holding the whole version, where the tensor is still one view.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.dtypes import itemsize

DEFAULT_ALIGNMENT = 256
# Device digests read buckets as 8-byte words, so offsets must stay word-aligned.
MIN_ALIGNMENT = 8
# The widest item a tensor can have (complex128). Every bucket starts on a multiple of it, so any tensor in the
# whole-version buffer can be viewed with its dtype. Only alignment 8 needs this.
WIDEST_ITEM = 16


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor is, independent of where it lives: name, wire dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor, or one piece of a chunked tensor, sits: bucket index and byte offset inside that bucket.
    ``index`` is the tensor's, shared by its pieces. ``start`` is the piece's first byte within the tensor and
    ``parts`` the tensor's number of pieces. ``Bucket.slots`` holds pieces. ``Layout.slots`` holds one slot per
    tensor, with ``nbytes`` its whole size: the pieces lie back to back from the first."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int
    start: int = 0
    parts: int = 1
    part: int = 0

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)

    @property
    def chunked(self) -> bool:
        """A tensor sent in several pieces (this slot may be one piece, or the whole tensor)."""
        return self.parts > 1

    @property
    def is_piece(self) -> bool:
        """Less than the whole tensor: one chunk of it."""
        return self.parts > 1 and self.nbytes != self.spec.nbytes


@dataclass(frozen=True)
class Bucket:
    """One flat buffer on the wire. ``flat_offset`` is its start in a buffer holding all buckets."""

    index: int
    nbytes: int
    flat_offset: int
    slots: tuple[TensorSlot, ...]  # what it carries: whole tensors and pieces of chunked ones

    @property
    def continues(self) -> bool:
        """It opens with a later piece of a tensor chunked across the buckets before it."""
        return bool(self.slots) and self.slots[0].part > 0


@dataclass(frozen=True)
class Layout:
    bucket_size: int
    alignment: int
    buckets: tuple[Bucket, ...]
    digest: str
    # per tensor, when planned by groups (a bucket never mixes groups): e.g. the trainer rank that owns it
    groups: tuple[int, ...] | None = None

    @functools.cached_property
    def slots(self) -> tuple[TensorSlot, ...]:
        """One per tensor, in order; a chunked tensor's is its first piece grown to the whole tensor."""
        return tuple((slot if slot.parts == 1 else dataclasses.replace(slot, nbytes=slot.spec.nbytes))
                     for slot in self.pieces if slot.part == 0)

    @functools.cached_property
    def pieces(self) -> tuple[TensorSlot, ...]:
        """What the buckets carry, in wire order (the tensors themselves unless some are chunked)."""
        return tuple(slot for bucket in self.buckets for slot in bucket.slots)

    @functools.cached_property
    def chunked(self) -> bool:
        """Some tensor is larger than a bucket and travels in pieces."""
        return any(slot.parts > 1 for slot in self.pieces)

    @functools.cached_property
    def largest_chunked_bytes(self) -> int:
        """Bytes of the largest tensor that travels in pieces (0: none does)."""
        return max((slot.nbytes for slot in self.slots if slot.chunked), default=0)

    @functools.cached_property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(slot.spec for slot in self.slots)

    @functools.cached_property
    def spec_of(self) -> Mapping[str, TensorSpec]:
        """Every tensor's spec by name; read-only, as every version of this layout shares it."""
        return types.MappingProxyType({spec.name: spec for spec in self.specs})

    @property
    def total_bytes(self) -> int:
        """Bytes of all buckets, padding included: the size of a flat buffer holding the version."""
        return sum(bucket.nbytes for bucket in self.buckets)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data alone."""
        return sum(slot.nbytes for slot in self.pieces)

    @property
    def max_bucket_bytes(self) -> int:
        return max((bucket.nbytes for bucket in self.buckets), default=0)

    @property
    def num_tensors(self) -> int:
        return len(self.slots)


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _validate(specs: Sequence[TensorSpec], bucket_size: int, alignment: int) -> None:
    if bucket_size <= 0:
        raise LayoutError(f"bucket_size must be positive, got {bucket_size}")
    if alignment < MIN_ALIGNMENT or alignment & (alignment - 1):
        raise LayoutError(f"alignment must be a power of two >= {MIN_ALIGNMENT}, got {alignment}")
    seen: set[str] = set()
    for spec in specs:
        if not spec.name:
            raise LayoutError("tensor names must be non-empty")
        if spec.name in seen:
            raise LayoutError(f"tensor name {spec.name!r} appears twice")
        if any(dim < 0 for dim in spec.shape):
            raise LayoutError(f"tensor {spec.name!r} has a negative dimension: {spec.shape}")
        seen.add(spec.name)


def plan_layout(
    specs: Sequence[TensorSpec], bucket_size: int, alignment: int = DEFAULT_ALIGNMENT,
    groups: Sequence[int] | None = None,
) -> Layout:
    """Pack tensors into buckets in the given order.

    Offsets are aligned to ``alignment``, and a tensor larger than ``bucket_size`` is chunked (see the module).
    A bucket's size is its last tensor's end rounded up to the alignment, or to WIDEST_ITEM where that is
    larger. So no bucket exceeds ``bucket_size`` rounded up the same way. With ``groups`` (one per tensor), a
    new bucket starts wherever the group changes, so each bucket holds tensors of one group.
    """
    _validate(specs, bucket_size, alignment)
    if groups is not None and len(groups) != len(specs):
        raise LayoutError(f"{len(groups)} groups for {len(specs)} tensors")
    packer = Packer(bucket_size, alignment)
    for position, spec in enumerate(specs):
        packer.add(spec, regroup=groups is not None and position > 0 and groups[position] != groups[position - 1])
    return _build(packer.packed(), bucket_size, alignment, tuple(groups) if groups is not None else None)


class Packer:
    """plan_layout's packing, one tensor at a time. Each tensor's buckets are known as it comes, so a stream
    that cannot be held whole (verl's weight generator) can keep only the tensors of the buckets it owns.
    plan_layout packs with it too, so a streamed plan and plan_layout always agree."""

    def __init__(self, bucket_size: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        self.bucket_size = bucket_size
        self.alignment = alignment
        # per bucket: (spec, offset in the bucket, first byte in the tensor, bytes, part, parts)
        self._packed: list[list[tuple[TensorSpec, int, int, int, int, int]]] = [[]]
        self._cursor = 0

    def add(self, spec: TensorSpec, *, regroup: bool = False) -> range:
        """Place ``spec``; returns the indices of the buckets it lies in, one unless it is chunked. Buckets
        before the last of them are closed from then on."""
        nbytes = spec.nbytes
        if nbytes > self.bucket_size:
            return self._add_chunked(spec, nbytes)
        # a typed view of the slot needs its items aligned: complex128 (16 bytes) at an alignment of 8 moves up
        start = align_up(self._cursor, max(self.alignment, itemsize(spec.dtype)))
        if self._packed[-1] and (regroup or start + nbytes > self.bucket_size):
            self._open()
            start = self._cursor
        self._packed[-1].append((spec, start, 0, nbytes, 0, 1))
        self._cursor = align_up(start + nbytes, self.alignment)
        return range(len(self._packed) - 1, len(self._packed))

    def _add_chunked(self, spec: TensorSpec, nbytes: int) -> range:
        """Pieces of ``chunk_bytes`` each, one bucket each (a new group always opens a bucket here too)."""
        size = chunk_bytes(self.bucket_size, self.alignment, itemsize(spec.dtype))
        parts = -(-nbytes // size)
        if self._packed[-1]:
            self._open()
        first = len(self._packed) - 1
        for part in range(parts):
            if part:
                self._open()
            start = part * size
            piece = min(size, nbytes - start)
            self._packed[-1].append((spec, 0, start, piece, part, parts))
            self._cursor = align_up(piece, self.alignment)
        return range(first, len(self._packed))

    def _open(self) -> None:
        self._packed.append([])
        self._cursor = 0

    def continues(self, index: int) -> bool:
        """Bucket ``index`` opens with a later piece of a chunked tensor (its owner is that tensor's)."""
        entries = self._packed[index]
        return bool(entries) and entries[0][4] > 0

    def bucket_nbytes(self, index: int) -> int:
        """Bytes of bucket ``index`` as the layout will have them (final once a later bucket opened)."""
        end = max((offset + piece for _, offset, _, piece, _, _ in self._packed[index]), default=0)
        return align_up(end, max(self.alignment, WIDEST_ITEM))

    def packed(self) -> list[list[tuple[TensorSpec, int, int, int, int, int]]]:
        return self._packed[:-1] if not self._packed[-1] else list(self._packed)


def chunk_bytes(bucket_size: int, alignment: int, element: int) -> int:
    """Bytes of each piece of a chunked tensor but the last: the most whole aligned elements that fit a bucket,
    and at least one. It is a multiple of a bucket's own rounding too, so the pieces lie end to end in the
    whole-version buffer."""
    unit = math.lcm(max(alignment, WIDEST_ITEM), element)
    return max(unit, bucket_size // unit * unit)


def _build(groups: list[list[tuple[TensorSpec, int, int, int, int, int]]], bucket_size: int, alignment: int,
           tensor_groups: tuple[int, ...] | None = None) -> Layout:
    buckets: list[Bucket] = []
    flat_offset = 0
    index = -1
    specs: list[TensorSpec] = []
    for bucket_index, group in enumerate(groups):
        slots = []
        for spec, offset, start, piece, part, parts in group:
            if part == 0:
                index += 1
                specs.append(spec)
            slots.append(TensorSlot(index, spec.name, spec.dtype, spec.shape, bucket_index, offset, piece, start,
                                    parts, part))
        end = max((slot.offset + slot.nbytes for slot in slots), default=0)
        nbytes = align_up(end, max(alignment, WIDEST_ITEM))
        buckets.append(Bucket(bucket_index, nbytes, flat_offset, tuple(slots)))
        flat_offset += nbytes
    chunked = any(slot.parts > 1 for bucket in buckets for slot in bucket.slots)
    salt = "" if tensor_groups is None else "groups|" + ",".join(map(str, tensor_groups))
    return Layout(bucket_size, alignment, tuple(buckets),
                  layout_digest(specs, bucket_size, alignment, salt=salt, chunked=chunked), tensor_groups)


def layout_digest(specs: Iterable[TensorSpec], bucket_size: int, alignment: int, *, salt: str = "",
                  chunked: bool = False) -> str:
    """Hex digest of everything the plan depends on; equal digests mean equal layouts. A layout with chunked
    tensors is of another kind (v2): a planner that does not chunk cannot arrive at the same digest."""
    hasher = xxhash.xxh3_64()
    hasher.update(f"ckpt-layout-{'v2' if chunked else 'v1'}|{bucket_size}|{alignment}|".encode())
    if salt:
        hasher.update(f"{salt}|".encode())
    for spec in specs:
        hasher.update(spec.name.encode())
        hasher.update(b"\0")
        hasher.update(f"{spec.dtype}|{','.join(map(str, spec.shape))}\n".encode())
    return hasher.hexdigest()


def check_same_layout(local: Layout, remote_digest: str, *, peer: str = "peer") -> None:
    """Raise LayoutMismatchError when a peer's layout digest differs from ours."""
    if local.digest != remote_digest:
        raise LayoutMismatchError(
            f"layout mismatch with {peer}: local digest {local.digest} ({local.num_tensors} tensors, "
            f"{len(local.buckets)} buckets) != remote digest {remote_digest}; both sides must list the same "
            "tensors (names, dtypes, shapes) in the same order with the same bucket size and alignment"
        )
