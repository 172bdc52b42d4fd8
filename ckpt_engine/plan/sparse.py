"""Sparse sync, the pure part: per-tensor manifests of versions and the plan of what changed.

A sparse version carries only the tensors whose digest differs from the base version the receivers hold.
Receivers check that they hold that base, verify the changed tensors as usual, recompute the whole-model
digest from their own manifest with the changed digests put in, and load only if it equals the sender's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_engine.plan.hashing import tensor_digests, version_digest
from ckpt_engine.plan.layout import Layout, plan_layout
from ckpt_engine.plan.owners import Owners, owners_by_group, single_owner


@dataclass(frozen=True)
class Manifest:
    """A version as per-tensor digests in layout order."""

    version: int
    algo: str
    layout_digest: str
    names: tuple[str, ...]
    digests: tuple[int, ...]

    @functools.cached_property
    def version_digest(self) -> str:  # (kept: the sender and receiver each ask for it several times)
        return version_digest(self.algo, self.layout_digest, list(self.digests))

    def updated(self, version: int, changed: dict[str, int]) -> Manifest:
        """This manifest with some tensors' digests replaced, as ``version``."""
        unknown = set(changed) - set(self.names)
        if unknown:
            raise KeyError(f"tensors not in the base version: {sorted(unknown)[:3]}")
        digests = tuple(changed.get(name, digest) for name, digest in zip(self.names, self.digests))
        return Manifest(version, self.algo, self.layout_digest, self.names, digests)


@dataclass(frozen=True)
class SparsePlan:
    layout: Layout  # only the changed tensors, in the full layout's order
    changed: tuple[str, ...]
    skipped: int
    skipped_bytes: int
    owners: Owners  # who sends each bucket of ``layout``


def plan_sparse(full: Layout, new: Manifest, base: Manifest | None, *, bucket_size: int,
                alignment: int, owners: Owners | None = None) -> SparsePlan | None:
    """What to send instead of the full version, or None when a full sync is needed (no base, another
    layout, another digest algorithm). With several ``owners`` of ``full``, a bucket of the plan holds
    tensors of one owner only (the one that holds them sends it): see ``SparsePlan.owners``."""
    if base is None or base.layout_digest != full.digest or base.algo != new.algo or base.names != new.names:
        return None
    changed = {name for name, old, now in zip(base.names, base.digests, new.digests) if old != now}
    slots = [slot for slot in full.slots if slot.name in changed]
    skipped = [slot for slot in full.slots if slot.name not in changed]
    if owners is None or owners.ranks == 1:
        layout = plan_layout([slot.spec for slot in slots], bucket_size, alignment)
        wire_owners = single_owner(layout)
    else:
        groups = [owners.of[slot.bucket] for slot in slots]
        layout = plan_layout([slot.spec for slot in slots], bucket_size, alignment, groups)
        wire_owners = owners_by_group(layout, owners.ranks)
    return SparsePlan(layout, tuple(s.name for s in slots), len(skipped), sum(s.nbytes for s in skipped),
                      wire_owners)


def manifest_of(version: int, algo: str, layout: Layout, digests: Sequence[int]) -> Manifest:
    """From per-tensor digests in layout order."""
    return Manifest(version, algo, layout.digest, tuple(s.name for s in layout.slots), tuple(digests))


def wire_manifest(version: int, algo: str, layout: Layout, piece_digests: Sequence[int]) -> Manifest:
    """From the digests the buckets carried (per piece: chunked tensors' pieces are folded)."""
    return manifest_of(version, algo, layout, tensor_digests(layout, piece_digests))


# ---- trainer ranks agreeing on what changed --------------------------------------------------------------
# Each rank digests its own shards and compares them with its digests of the previous cached version. One
# all-reduce (MAX) of [cannot, parent, -parent, changed flags...] then gives every rank the same answer: the
# union of changed tensors, or "full" when any rank lacks comparable digests or ranks disagree on the parent.
_HEADER = 3


def agreement_vector(parent: int | None, previous: Sequence[int] | None, current: Sequence[int]) -> list[int]:
    """This rank's contribution: ``parent`` is the version ``previous`` digests belong to (None when this rank
    cannot build on one, e.g. rank 0 no longer caches it)."""
    if parent is None or previous is None or len(previous) != len(current):
        return [1, -1, 1] + [1] * len(current)
    return [0, parent, -parent] + [int(a != b) for a, b in zip(previous, current)]


def agreed_changes(reduced: Sequence[int]) -> tuple[int, list[int]] | None:
    """From the all-reduced vector: (parent, indices of changed tensors), or None for a full snapshot."""
    cannot, parent, negated = reduced[:_HEADER]
    if cannot or parent != -negated or parent < 0:
        return None
    return parent, [i for i, flag in enumerate(reduced[_HEADER:]) if flag]


def changed_layout(full: Layout, changed: Sequence[int], *, bucket_size: int, alignment: int,
                   owners: Owners | None = None) -> Layout:
    """The layout of the changed tensors, in the full layout's order (every rank plans the same one); with
    several ``owners`` of ``full``, planned by owner (a bucket holds tensors of one owner)."""
    slots = [full.slots[i] for i in sorted(changed)]
    groups = [owners.of[slot.bucket] for slot in slots] if owners is not None and owners.ranks > 1 else None
    return plan_layout([slot.spec for slot in slots], bucket_size, alignment, groups)
