"""Who owns which bucket of a version: a pure plan, the same on every trainer rank and every receiver.

With several trainer ranks, each bucket of a version has one owner. The owner alone keeps it in its host cache
and puts it on the wire (on a sync group of its own with the receivers); the other ranks only take part in
gathering it. So per-rank host memory is about the model's bytes divided by the ranks, and the copies,
digests and sends of a version run on every rank at once.

Owners are given in bucket order to the rank that owns the fewest bytes so far (the lowest rank on a tie):
deterministic, balanced within one bucket's bytes, and interleaved, so that consecutive buckets come from
different ranks and their transfers overlap. The pieces of a chunked tensor have one owner (its first
piece's), so every rank holds whole tensors: a rank's share is a layout like any other.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.layout import Bucket, Layout, layout_digest

MAX_OWNERS = 1 << 16


@dataclass(frozen=True)
class Owners:
    """The owner of every bucket of one layout."""

    ranks: int
    of: tuple[int, ...]  # per bucket, in layout order

    @property
    def digest(self) -> str:
        hasher = xxhash.xxh3_64()
        hasher.update(f"ckpt-owners-v1|{self.ranks}|{','.join(map(str, self.of))}".encode())
        return hasher.hexdigest()

    def buckets_of(self, rank: int) -> tuple[int, ...]:
        return tuple(index for index, owner in enumerate(self.of) if owner == rank)

    def bytes_of(self, layout: Layout, rank: int) -> int:
        return sum(layout.buckets[index].nbytes for index in self.buckets_of(rank))

    def check(self, layout: Layout) -> None:
        """Raise if these owners cannot belong to ``layout`` (e.g. from a peer's message)."""
        if not 1 <= self.ranks <= MAX_OWNERS:
            raise LayoutError(f"owner count {self.ranks} out of range 1..{MAX_OWNERS}")
        if len(self.of) != len(layout.buckets):
            raise LayoutMismatchError(f"{len(self.of)} bucket owners for {len(layout.buckets)} buckets")
        bad = [owner for owner in self.of if not 0 <= owner < self.ranks]
        if bad:
            raise LayoutError(f"bucket owner {bad[0]} is not one of {self.ranks} ranks")


def single_owner(layout: Layout) -> Owners:
    """Rank 0 owns everything (a trainer of one rank, or a version sent by one rank)."""
    return Owners(1, (0,) * len(layout.buckets))


def plan_owners(layout: Layout, ranks: int) -> Owners:
    if ranks == 1:
        return single_owner(layout)
    picker = OwnerPicker(ranks)
    of: list[int] = []
    for bucket in layout.buckets:
        owner = of[-1] if bucket.continues else picker.pick()
        picker.charge(owner, bucket.nbytes)
        of.append(owner)
    return Owners(ranks, tuple(of))


class OwnerPicker:
    """plan_owners one bucket at a time: a bucket's owner depends only on the buckets before it, so a stream
    (layout.Packer) knows it when the bucket opens. The one owner rule, so a streamed plan and plan_owners agree."""

    def __init__(self, ranks: int) -> None:
        if not 1 <= ranks <= MAX_OWNERS:
            raise LayoutError(f"owner count must be within 1..{MAX_OWNERS}, got {ranks}")
        self.held = [0] * ranks

    def pick(self) -> int:
        """The owner of the next bucket: the rank holding the fewest bytes so far (the lowest on a tie)."""
        return min(range(len(self.held)), key=lambda rank: (self.held[rank], rank))

    def charge(self, owner: int, nbytes: int) -> None:
        self.held[owner] += max(nbytes, 1)  # empty buckets still take turns


def owners_by_group(layout: Layout, ranks: int) -> Owners:
    """The owners of a layout planned with ``groups`` (every bucket holds tensors of one group: its owner)."""
    groups = layout.groups
    if groups is None:
        raise LayoutError("this layout was not planned by owner groups")
    return Owners(ranks, tuple(groups[bucket.slots[0].index] if bucket.slots else 0 for bucket in layout.buckets))


@dataclass(frozen=True)
class Share:
    """The buckets one rank owns, as a layout of their own (indices 0..m-1, offsets of a buffer holding only
    them) and where each sits in the version's layout (``wire[i]``: the version's index of local bucket i)."""

    rank: int
    layout: Layout
    wire: tuple[int, ...]

    def local_index(self, wire_index: int) -> int:
        return self.wire.index(wire_index)


# (layout digest, owners, rank) -> share: every version of a layout gets the same share object, so what is
# built once per share (the fill views of its buckets) is reused; a few layouts at a time.
_SHARES: collections.OrderedDict[tuple, Share] = collections.OrderedDict()
_SHARES_KEPT = 8
_SHARES_LOCK = threading.Lock()


def share_of(layout: Layout, owners: Owners, rank: int) -> Share:
    """Rank ``rank``'s share of ``layout``. With one owner, rank 0's share is the layout itself."""
    owners.check(layout)
    if owners.ranks == 1 and rank == 0:
        return Share(0, layout, tuple(range(len(layout.buckets))))
    key = (layout.digest, owners.ranks, owners.of, rank)
    with _SHARES_LOCK:
        share = _SHARES.get(key)
        if share is not None:
            _SHARES.move_to_end(key)
            return share
    share = _plan_share(layout, owners, rank)
    with _SHARES_LOCK:
        _SHARES[key] = share
        while len(_SHARES) > _SHARES_KEPT:
            _SHARES.popitem(last=False)
    return share


def _plan_share(layout: Layout, owners: Owners, rank: int) -> Share:
    mine = owners.buckets_of(rank)
    buckets: list[Bucket] = []
    flat = 0
    specs = []
    for local, wire in enumerate(mine):
        source = layout.buckets[wire]
        slots = []
        for slot in source.slots:
            if slot.part == 0:
                specs.append(slot.spec)
            slots.append(dataclasses.replace(slot, index=len(specs) - 1, bucket=local))
        buckets.append(Bucket(local, source.nbytes, flat, tuple(slots)))
        flat += source.nbytes
    digest = layout_digest(specs, layout.bucket_size, layout.alignment, salt=f"share|{layout.digest}|{rank}",
                           chunked=layout.chunked)
    return Share(rank, Layout(layout.bucket_size, layout.alignment, tuple(buckets), digest), mine)


def share_offsets(layout: Layout, owners: Owners) -> list[int]:
    """Where each bucket of ``layout`` starts in its owner's share (``share_of``'s flat offsets), in layout
    order: what a puller needs to read a bucket from the owner's buffer without building the owner's layout."""
    owners.check(layout)
    filled = [0] * owners.ranks
    out = []
    for bucket in layout.buckets:
        owner = owners.of[bucket.index]
        out.append(filled[owner])
        filled[owner] += bucket.nbytes
    return out


def tensor_owners(layout: Layout, owners: Owners) -> Sequence[int]:
    """The owner of every tensor of ``layout`` (that of its bucket), in layout order."""
    return [owners.of[slot.bucket] for slot in layout.slots]
