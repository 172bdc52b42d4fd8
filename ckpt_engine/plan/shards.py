"""Sharded delivery, the pure part: what each receiver keeps of every tensor, which receivers keep the same
(a class), and what goes on the wire for a class.

A receiver declares a shard spec: for some tensors, the slices of them it keeps (a tensor-parallel rank keeps
one contiguous range of rows or columns of most weights, or, for a checkpoint tensor stored fused, one range
of each of its parts); every tensor it does not name it keeps whole. Receivers with identical specs form one
class (TP rank r of every data-parallel replica) and share one stream of exactly their bytes.

On the wire a class's version is a version like any other, of *pieces*: each (tensor, slice) becomes one
wire tensor named ``<tensor>@<dim>:<start>:<length>`` whose shape is the tensor's with ``dim`` cut to
``length``, packed contiguously by the owner (a column slice of a row-major weight is strided in the full
tensor and contiguous on the wire). A whole tensor keeps its name. Buckets, digests, chunking and
verification then apply to a class's pieces unchanged, so each receiver verifies exactly what it receives.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.layout import TensorSpec

PIECE_MARK = "@"


@dataclass(frozen=True, order=True)
class Slice:
    """Elements ``start .. start + length`` of a tensor along ``dim``."""

    dim: int
    start: int
    length: int

    def __post_init__(self) -> None:
        for field, value in (("dim", self.dim), ("start", self.start), ("length", self.length)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"a slice's {field} is an int, got {value!r}")
        if self.dim < 0 or self.start < 0 or self.length < 1:
            raise ConfigError(f"a slice needs dim >= 0, start >= 0 and length >= 1, got {self}")

    @property
    def end(self) -> int:
        return self.start + self.length


# tensor name -> the slices of it a receiver keeps (sorted, disjoint, along one dim); absent: the whole tensor
ShardSpec = Mapping[str, tuple[Slice, ...]]


@dataclass(frozen=True)
class Piece:
    """One wire tensor of a class: ``tensor``'s ``part`` (None: all of it)."""

    tensor: str
    part: Slice | None
    spec: TensorSpec  # the wire tensor: its name, dtype and shape as sent

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


def piece_name(tensor: str, part: Slice | None) -> str:
    return tensor if part is None else f"{tensor}{PIECE_MARK}{part.dim}:{part.start}:{part.length}"


def check_spec(spec: ShardSpec, tensors: Iterable[TensorSpec]) -> dict[str, tuple[Slice, ...]]:
    """``spec`` normalised (slices sorted; a spec that keeps a whole tensor drops it) against the version's
    tensors; a ConfigError naming the first problem: an unknown tensor, a slice out of the tensor's shape,
    slices along different dims or overlapping, a 0-dim tensor sliced."""
    by_name = {t.name: t for t in tensors}
    out: dict[str, tuple[Slice, ...]] = {}
    for name, slices in spec.items():
        tensor = by_name.get(name)
        if tensor is None:
            raise ConfigError(f"shard spec: no tensor {name!r} in the version")
        ordered = tuple(sorted(slices))
        if not ordered:
            raise ConfigError(f"shard spec: {name!r} lists no slice (leave it out to keep it whole)")
        dims = {s.dim for s in ordered}
        if len(dims) != 1:
            raise ConfigError(f"shard spec: {name!r} is sliced along several dims {sorted(dims)}")
        dim = ordered[0].dim
        if dim >= len(tensor.shape):
            raise ConfigError(f"shard spec: {name!r} has {len(tensor.shape)} dim(s), a slice is along dim {dim}")
        for before, after in itertools.pairwise(ordered):
            if after.start < before.end:
                raise ConfigError(f"shard spec: {name!r} slices {before} and {after} overlap")
        if ordered[-1].end > tensor.shape[dim]:
            raise ConfigError(f"shard spec: {name!r} has {tensor.shape[dim]} along dim {dim}, a slice ends at "
                              f"{ordered[-1].end}")
        if sum(s.length for s in ordered) == tensor.shape[dim]:
            continue  # disjoint and within the dim, they cover all of it: the whole tensor
        out[name] = ordered
    return out


def pieces_of(tensors: Iterable[TensorSpec], spec: ShardSpec) -> list[Piece]:
    """The wire tensors of a class with ``spec`` (checked), in the version's tensor order, each tensor's slices
    in order."""
    out: list[Piece] = []
    for tensor in tensors:
        slices = spec.get(tensor.name)
        if not slices:
            out.append(Piece(tensor.name, None, tensor))
            continue
        for part in slices:
            shape = tuple(part.length if d == part.dim else n for d, n in enumerate(tensor.shape))
            out.append(Piece(tensor.name, part, TensorSpec(piece_name(tensor.name, part), tensor.dtype, shape)))
    return out


def spec_key(spec: ShardSpec) -> str:
    """A class's identity: the same for identical (normalised) specs, whatever their order."""
    canonical = sorted((name, [(s.dim, s.start, s.length) for s in sorted(slices)]) for name, slices in spec.items())
    # (a cryptographic digest: a receiver must not be able to make its spec's key equal another class's and so
    # choose what that class's receivers are sent)
    return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()[:32] if canonical \
        else "whole"


def even_split(dim: int, length: int, parts: int, rank: int) -> Slice:
    """Rank ``rank``'s range of ``length`` elements along ``dim`` split evenly into ``parts`` (the usual
    tensor-parallel rule); a ConfigError when it does not divide."""
    if parts < 1 or not 0 <= rank < parts:
        raise ConfigError(f"even split: rank {rank} of {parts} parts")
    if length % parts:
        raise ConfigError(f"even split: {length} does not split evenly into {parts}")
    size = length // parts
    return Slice(dim, rank * size, size)


def cut(tensor: torch.Tensor, part: Slice | None) -> torch.Tensor:
    """The wire tensor of ``part`` of ``tensor``: contiguous (a column range of a row-major weight is copied
    into rows of its own), the whole tensor when ``part`` is None."""
    return cut_view(tensor, part).contiguous()


def placed(piece: torch.Tensor, full_shape: tuple[int, ...], part: Slice, *, rest: float | None = None) -> torch.Tensor:
    """``piece`` at its place in a tensor of the full shape: for an engine loader that slices the full checkpoint
    tensor itself and reads only this rank's range. The other elements are left unwritten (on the CPU their
    pages are never touched: torch.empty does not fault them in), or set to ``rest``."""
    if piece.shape[part.dim] != part.length:
        raise ConfigError(f"a piece of {piece.shape[part.dim]} along dim {part.dim} for a slice of {part.length}")
    full = torch.empty(full_shape, dtype=piece.dtype, device=piece.device)
    if rest is not None:
        full.fill_(rest)
    full.narrow(part.dim, part.start, part.length).copy_(piece)
    return full


def class_aliases(aliases: Mapping[str, str], spec: ShardSpec) -> dict[str, str]:
    """A class's tied names: each tied name's piece is its canonical tensor's piece (the same bytes, the same
    ranges)."""
    return {piece_name(alias, part): piece_name(canonical, part)
            for alias, canonical in aliases.items() for part in spec.get(canonical) or (None,)}


def cut_view(tensor: torch.Tensor, part: Slice | None) -> torch.Tensor:
    """``part`` of ``tensor`` as a view (strided for a column range)."""
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.length)


def piece_runs(shape: tuple[int, ...], item: int, part: Slice | None) -> list[tuple[int, int]]:
    """Where the bytes of ``part`` of a row-major tensor of ``shape`` (``item`` bytes an element) lie in the
    tensor, in the order its wire tensor holds them: (byte offset, byte count) runs, adjacent ones joined. A
    range of rows is one run; a range of columns is one run per row. For a puller that reads a class's pieces
    straight out of an owner's copy of the full tensors."""
    if part is None:
        return [(0, math.prod(shape) * item)]
    if part.dim >= len(shape) or part.end > shape[part.dim]:
        raise ConfigError(f"slice {part} does not fit a tensor of shape {shape}")
    inner = math.prod(shape[part.dim + 1 :]) * item
    outer, span = math.prod(shape[: part.dim]), shape[part.dim] * inner
    runs: list[tuple[int, int]] = []
    for row in range(outer):
        start, count = row * span + part.start * inner, part.length * inner
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        elif count:
            runs.append((start, count))
    return runs


def runs_within(runs: list[tuple[int, int]], start: int, nbytes: int) -> list[tuple[int, int, int]]:
    """The part of ``runs`` (a wire tensor's bytes, in order) that its bytes ``start .. start + nbytes`` come
    from (a chunk of a piece too large for one bucket): (byte offset in the tensor, offset in the chunk, count)."""
    out, at, end = [], 0, start + nbytes
    for offset, count in runs:
        lo, hi = max(at, start), min(at + count, end)
        if lo < hi:
            out.append((offset + lo - at, lo - start, hi - lo))
        at += count
        if at >= end:
            break
    return out


_PIECE_RANGE = re.compile(r"(0|[1-9][0-9]*):(0|[1-9][0-9]*):([1-9][0-9]*)", re.ASCII)  # exactly what piece_name writes

# On the control plane a spec is {tensor name: [[dim, start, length], ...]} (msgpack/JSON, never pickle).
WireSpec = dict[str, list[list[int]]]


def spec_to_wire(spec: ShardSpec) -> WireSpec:
    return {name: [[s.dim, s.start, s.length] for s in sorted(slices)] for name, slices in spec.items()}


def spec_from_wire(wire: Mapping[str, Iterable[Iterable[int]]]) -> dict[str, tuple[Slice, ...]]:
    """A spec from its wire form; a ConfigError for a slice that is not three ints (dim, start, length)."""
    out: dict[str, tuple[Slice, ...]] = {}
    for name, slices in wire.items():
        parts = []
        for triple in slices:
            values = list(triple)
            if len(values) != 3:
                raise ConfigError(f"shard spec: a slice of {name!r} is [dim, start, length], got {values!r}")
            parts.append(Slice(*values))
        out[name] = tuple(sorted(parts))
    return out


def split_piece_name(name: str) -> tuple[str, Slice | None]:
    """(tensor, slice) of a wire tensor's name (``qkv.weight@0:128:64``); a whole tensor's name, (name, None).
    For a receiver's loader: where each piece goes in the full tensor."""
    tensor, mark, rest = name.rpartition(PIECE_MARK)
    numbers = _PIECE_RANGE.fullmatch(rest) if mark and tensor else None
    if numbers is None:
        return name, None  # an @ in a tensor's own name: not a piece (sharded versions refuse such names)
    try:
        return tensor, Slice(*(int(v) for v in numbers.groups()))
    except ConfigError:
        return name, None


def local_range(spec: ShardSpec, tensor: str, part: Slice | None) -> Slice | None:
    """Where ``part`` of ``tensor`` sits in a receiver's local shard of it, when the local shard is its slices
    concatenated along their dim, in order (a tensor-parallel rank's weight; for a checkpoint tensor stored
    fused, its rank's range of each part); None for a tensor kept whole. A ConfigError for a slice the spec
    does not list."""
    if part is None:
        return None
    offset = 0
    for mine in sorted(spec.get(tensor) or ()):
        if mine == part:
            return Slice(part.dim, offset, part.length)
        offset += mine.length
    raise ConfigError(f"{tensor}: slice {part} is not in this receiver's shard spec")


def resolve_aliases(spec: ShardSpec, aliases: Mapping[str, str]) -> dict[str, tuple[Slice, ...]]:
    """``spec`` over canonical names: a receiver names tensors as its engine does, and a tied name (an alias,
    e.g. ``lm_head.weight`` of ``embed_tokens.weight``) carries its canonical tensor's bytes, so it gets the
    canonical tensor's slices. A ConfigError when a tied name and its canonical ask for different slices."""
    out = {name: tuple(sorted(slices)) for name, slices in spec.items() if name not in aliases}
    for alias, canonical in aliases.items():
        slices = spec.get(alias)
        if slices is None:
            continue
        mine = tuple(sorted(slices))
        if out.setdefault(canonical, mine) != mine:
            raise ConfigError(f"shard spec: {alias!r} is tied to {canonical!r} but asks for other slices")
    return out
