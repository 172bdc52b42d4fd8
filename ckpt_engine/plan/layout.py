"""Bucket layout: a pure planner from tensor specs to flat, aligned buckets.

Every rank plans the same layout from the same (names, dtypes, shapes, bucket size, alignment), so no
per-bucket metadata has to travel; a digest of the plan lets ranks check they agree.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.dtypes import itemsize

DEFAULT_ALIGNMENT = 256
# Device digests read buckets as 8-byte words, so offsets must stay word-aligned.
MIN_ALIGNMENT = 8


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
    """Where a tensor sits: bucket index and byte offset inside that bucket."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True)
class Bucket:
    """One flat buffer on the wire. ``flat_offset`` is its start in a buffer holding all buckets."""

    index: int
    nbytes: int
    flat_offset: int
    slots: tuple[TensorSlot, ...]


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
        return tuple(slot for bucket in self.buckets for slot in bucket.slots)

    @functools.cached_property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(slot.spec for slot in self.slots)

    @property
    def total_bytes(self) -> int:
        """Bytes of all buckets, padding included: the size of a flat buffer holding the version."""
        return sum(bucket.nbytes for bucket in self.buckets)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data alone."""
        return sum(slot.nbytes for bucket in self.buckets for slot in bucket.slots)

    @property
    def max_bucket_bytes(self) -> int:
        return max((bucket.nbytes for bucket in self.buckets), default=0)

    @property
    def num_tensors(self) -> int:
        return sum(len(bucket.slots) for bucket in self.buckets)


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

    Offsets are aligned to ``alignment``; a tensor larger than ``bucket_size`` gets a bucket of its own.
    A bucket's size is its last tensor's end rounded up to the alignment, so no bucket exceeds
    ``max(bucket_size rounded up, largest tensor rounded up)``. With ``groups`` (one per tensor), a new
    bucket starts wherever the group changes, so each bucket holds tensors of one group.
    """
    _validate(specs, bucket_size, alignment)
    if groups is not None and len(groups) != len(specs):
        raise LayoutError(f"{len(groups)} groups for {len(specs)} tensors")
    packer = Packer(bucket_size, alignment)
    for position, spec in enumerate(specs):
        packer.add(spec, regroup=groups is not None and position > 0 and groups[position] != groups[position - 1])
    return _build(packer.packed(), bucket_size, alignment, tuple(groups) if groups is not None else None)


class Packer:
    """plan_layout's packing one tensor at a time: each tensor's bucket is known as it comes, so a stream that
    cannot be held whole (verl's weight generator) can keep only the tensors of the buckets it owns. The one
    packing rule, so a streamed plan and plan_layout always agree."""

    def __init__(self, bucket_size: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        self.bucket_size = bucket_size
        self.alignment = alignment
        self._packed: list[list[tuple[TensorSpec, int]]] = [[]]
        self._cursor = 0

    def add(self, spec: TensorSpec, *, regroup: bool = False) -> int:
        """Place ``spec``; returns the index of its bucket (buckets before it are closed from then on)."""
        nbytes = spec.nbytes
        oversize = nbytes > self.bucket_size
        if self._packed[-1] and (oversize or regroup or self._cursor + nbytes > self.bucket_size):
            self._packed.append([])
            self._cursor = 0
        self._packed[-1].append((spec, self._cursor))
        index = len(self._packed) - 1
        self._cursor = align_up(self._cursor + nbytes, self.alignment)
        if oversize:  # a tensor larger than a bucket gets a bucket of its own
            self._packed.append([])
            self._cursor = 0
        return index

    def bucket_nbytes(self, index: int) -> int:
        """Bytes of bucket ``index`` as the layout will have them (final once a later bucket opened)."""
        end = max((offset + spec.nbytes for spec, offset in self._packed[index]), default=0)
        return align_up(end, self.alignment)

    def packed(self) -> list[list[tuple[TensorSpec, int]]]:
        return self._packed[:-1] if not self._packed[-1] else list(self._packed)


def _build(groups: list[list[tuple[TensorSpec, int]]], bucket_size: int, alignment: int,
           tensor_groups: tuple[int, ...] | None = None) -> Layout:
    buckets: list[Bucket] = []
    flat_offset = 0
    index = 0
    for bucket_index, group in enumerate(groups):
        slots = []
        for spec, offset in group:
            slots.append(TensorSlot(index, spec.name, spec.dtype, spec.shape, bucket_index, offset, spec.nbytes))
            index += 1
        end = max((slot.offset + slot.nbytes for slot in slots), default=0)
        nbytes = align_up(end, alignment)
        buckets.append(Bucket(bucket_index, nbytes, flat_offset, tuple(slots)))
        flat_offset += nbytes
    specs = [slot.spec for bucket in buckets for slot in bucket.slots]
    salt = "" if tensor_groups is None else "groups|" + ",".join(map(str, tensor_groups))
    return Layout(bucket_size, alignment, tuple(buckets), layout_digest(specs, bucket_size, alignment, salt=salt),
                  tensor_groups)


def layout_digest(specs: Iterable[TensorSpec], bucket_size: int, alignment: int, *, salt: str = "") -> str:
    """Hex digest of everything the plan depends on; equal digests mean equal layouts."""
    hasher = xxhash.xxh3_64()
    hasher.update(f"ckpt-layout-v1|{bucket_size}|{alignment}|".encode())
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
