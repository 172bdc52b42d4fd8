"""Which byte ranges a puller READs from its owners to fill each bucket of a version (pure).

Where the owners' buffers hold the version's wire layout (a whole version cached whole), a bucket is one read
from its owner's share. Otherwise the wire layout's pieces are cut out of the full tensors the buffers hold: a
sharded class's slices, a sparse version's changed tensors, a delta's tensors spread over several buffers. A
range of rows is one read, a range of columns one read a row (plan/shards.py ``piece_runs``): tens of thousands
of small reads a class, each with its reply's header and CPU. So an owner that serves a sharded class also keeps
the column pieces as its send cut them (``kept_spans``: back to back in registered memory), and its pullers read
each of those in one read from there, once the owner posted its digests (which it does after keeping them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ckpt_engine.errors import LayoutError
from ckpt_engine.plan.dtypes import itemsize
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.owners import Owners, share_offsets
from ckpt_engine.plan.shards import Slice, piece_runs, runs_within, split_piece_name

# per bucket: (owner's buffer, byte offset in that buffer, byte offset in the bucket, bytes)
Reads = list[list[tuple[int, int, int, int]]]
# The buffer of a read from the owner's kept pieces (``kept_spans``), not from a buffer of its version.
KEPT = -1
# per bucket: (byte offset in the bucket, bytes, byte offset in its owner's kept pieces)
Spans = list[list[tuple[int, int, int]]]


def bucket_reads(layout: Layout, owners: Owners, cut_from: Layout | None = None, cut_owners: Owners | None = None,
                 cut_at: Sequence[Sequence[int]] | None = None, kept: bool = False) -> Reads:
    """The reads of every bucket of ``layout`` (owned as ``owners`` say). ``cut_from``: the layout the owners'
    buffers hold, with ``cut_owners``, when it is not ``layout``; ``cut_at``: where each of its tensors lies,
    [buffer, offset], in its order (default: buffer 0, as the shares are laid out). ``kept``: the owners keep
    the pieces that are not one run of their tensor (``kept_spans``), read from there (buffer ``KEPT``). A
    LayoutError for pieces that cannot come from there (a tensor it lacks or another rank owns, a slice that
    does not fit)."""
    if cut_from is None:
        at = share_offsets(layout, owners)
        return [[(0, at[b.index], 0, b.nbytes)] for b in layout.buckets]
    cut_owners = cut_owners or Owners(1, (0,) * len(cut_from.buckets))
    cut_owners.check(cut_from)
    places = tensor_places(cut_from, cut_owners, cut_at)
    owner_of, specs = {s.name: cut_owners.of[s.bucket] for s in cut_from.slots}, cut_from.spec_of
    spans = kept_spans(layout, owners, cut_from) if kept else [[] for _ in layout.buckets]
    reads: Reads = []
    for bucket, bucket_kept in zip(layout.buckets, spans, strict=True):
        mine = [(KEPT, at, offset, nbytes) for offset, nbytes, at in bucket_kept]
        kept_offsets = {offset for offset, _, _ in bucket_kept}
        for slot in bucket.slots:
            name, part = split_piece_name(slot.name)
            if name not in owner_of or owner_of[name] != owners.of[bucket.index]:
                raise LayoutError(f"piece {slot.name} is not a tensor its bucket's owner holds")
            spec, (buffer, start) = specs[name], places[name]
            if (slot.dtype, slot.shape) != (spec.dtype, cut_shape(spec.shape, part)):
                raise LayoutError(f"piece {slot.name} ({slot.dtype} {slot.shape}) is not that slice of {name} "
                                  f"({spec.dtype} {spec.shape})")
            if slot.offset in kept_offsets:  # (one read, from the kept pieces: checked without its runs)
                if part is not None and part.end > spec.shape[part.dim]:
                    raise LayoutError(f"piece {slot.name}: slice {part} does not fit {name} {spec.shape}")
                continue
            runs = piece_runs(spec.shape, itemsize(spec.dtype), part)
            mine += [(buffer, start + src, slot.offset + dst, count)
                     for src, dst, count in runs_within(runs, slot.start, slot.nbytes)]
        reads.append(mine)
    return reads


def kept_spans(layout: Layout, owners: Owners, cut_from: Layout) -> Spans:
    """Where each owner keeps the pieces of ``layout`` (a class's wire layout, cut from tensors of
    ``cut_from``) that are not one run of their tensor (a range of columns): per bucket, each such piece's
    bytes in the bucket and their place in its owner's kept pieces, which hold them back to back in layout
    order. Both sides compute it: the owner's send copies each there (send/sender.py ``Keep``), the puller
    reads each in one read. Empty for a layout of whole tensors or ranges of rows only."""
    specs, held = cut_from.spec_of, [0] * owners.ranks
    spans: Spans = []
    for bucket in layout.buckets:
        owner, mine = owners.of[bucket.index], []
        for slot in bucket.slots:
            name, part = split_piece_name(slot.name)
            spec = specs.get(name)
            if spec is None or not strided(spec.shape, part) or not slot.nbytes:
                continue
            mine.append((slot.offset, slot.nbytes, held[owner]))
            held[owner] += slot.nbytes
        spans.append(mine)
    return spans


def whole_spans(layout: Layout, owners: Owners) -> Spans:
    """Every bucket of ``layout``, whole, where its owner's share holds it: what a pulled bypass_cpu version's
    send keeps (its pullers read the share as they read a cached one)."""
    at = share_offsets(layout, owners)
    return [[(0, bucket.nbytes, at[bucket.index])] for bucket in layout.buckets]


def kept_nbytes(spans: Spans, owners: Owners, rank: int) -> int:
    """The bytes owner ``rank`` keeps of ``spans``."""
    return sum(nbytes for index, bucket in enumerate(spans) if owners.of[index] == rank for _, nbytes, _ in bucket)


def strided(shape: tuple[int, ...], part: Slice | None) -> bool:
    """Whether ``part`` of a row-major tensor of ``shape`` is more than one run of its bytes: a range of some
    dimension past the first, narrower than that dimension, in a tensor of more than one row of it."""
    if part is None or part.dim >= len(shape) or part.length >= shape[part.dim]:
        return False
    return math.prod(shape[: part.dim]) > 1 and math.prod(shape[part.dim + 1 :]) > 0


def cut_shape(shape: tuple[int, ...], part: Slice | None) -> tuple[int, ...]:
    """The shape of ``part`` of a tensor of ``shape`` (its own shape for a whole tensor, or a slice that does
    not fit: ``piece_runs`` refuses that)."""
    if part is None or part.dim >= len(shape):
        return shape
    return (*shape[: part.dim], part.length, *shape[part.dim + 1 :])


def tensor_places(layout: Layout, owners: Owners, cut_at: Sequence[Sequence[int]] | None) -> dict[str, tuple[int, int]]:
    """Each tensor's (buffer, byte offset) in its owner's buffers: as ``cut_at`` says, or where its bucket lies in
    its owner's share (buffer 0)."""
    if cut_at is not None:
        if len(cut_at) != len(layout.slots) or any(len(at) != 2 or min(at) < 0 for at in cut_at):
            raise LayoutError(f"{len(cut_at)} tensor places for {len(layout.slots)} tensors")
        return {slot.name: (at[0], at[1]) for slot, at in zip(layout.slots, cut_at, strict=True)}
    at = share_offsets(layout, owners)
    return {slot.name: (0, at[slot.bucket] + slot.offset) for slot in layout.slots}
