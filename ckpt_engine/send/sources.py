"""Where a version's bucket bytes come from: live tensors (``bypass_cpu``), the cache, or the cache's changes
against a base (sparse). A re-send from the cache is first checked against the version's identity."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import xxhash

from ckpt_engine.device import DeviceInfo, DigestAlgo, mark, wait_for
from ckpt_engine.errors import CacheError, CkptEngineError, ProtocolError
from ckpt_engine.plan.hashing import layout_digests
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.plan.modes import Mode
from ckpt_engine.plan.owners import Owners, share_of, single_owner
from ckpt_engine.plan.sparse import Manifest, SparsePlan, manifest_of, plan_sparse, wire_manifest
from ckpt_engine.plan.tensors import BucketTensors, TensorsOrProvider, fill_bucket, provider_of
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.filling import LiveReads, SnapshotFailed
from ckpt_engine.send.transfer import KeepFor

log = logging.getLogger(__name__)


class Source(Protocol):
    """Where a version's bucket bytes come from: live tensors, the cache, or the cache's changes (sparse)."""

    # Read-only members: a source may hold each as a plain attribute, a class attribute or a property.
    @property
    def mode(self) -> Mode: ...

    @property
    def layout(self) -> Layout:
        """What goes on the wire (after ``plan``)."""

    @property
    def owners(self) -> Owners:
        """Who sends each bucket of ``layout``."""

    @property
    def version(self) -> int: ...

    @property
    def step(self) -> int | None: ...

    @property
    def aliases(self) -> Mapping[str, str]: ...

    @property
    def header_extra(self) -> dict: ...

    @property
    def skipped(self) -> int: ...

    @property
    def skipped_bytes(self) -> int: ...

    @property
    def base_version(self) -> int | None: ...

    @property
    def needs_slot(self) -> bool:
        """Whether bucket() must be given a send slot to fill; if not, it returns views of the source."""

    @property
    def plans_alone(self) -> bool:
        """Whether its layout is known before the owners' ready vote (a full version's; a sparse one's changes
        are planned from what every owner told)."""

    @property
    def keep(self) -> KeepFor | None:
        """What the send also keeps of its buckets for pullers (None: nothing; send/transfer.py ``Kept``)."""

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        """Work before the first bucket. Returns what this owner tells the others (see ``plan``)."""

    def plan(self, told: list[list[int]] | None) -> None:
        """Fix ``layout`` and ``owners`` from what every owner told; None when this rank is the only owner."""

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest: ...

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor: ...

    def all_filled(self) -> None: ...


class FullSource:
    """What every full source shares: there is nothing to prepare, and the wire digest is the version digest."""

    header_extra: dict = {}  # noqa: RUF012 - read only: spread into the header, never mutated
    keep: KeepFor | None = None
    plans_alone = True
    skipped = 0
    skipped_bytes = 0
    base_version: int | None = None

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        return []

    def plan(self, told: list[list[int]] | None) -> None:
        pass

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest:
        return wire_manifest(version, algo, self.layout, wire_digests)  # type: ignore[attr-defined]


class LiveSource(FullSource):
    """bypass_cpu: bucket bytes come straight from the live tensors into the send slot."""

    mode: Mode = "bypass_cpu"
    needs_slot = True

    def __init__(self, version: int, layout: Layout, tensors: TensorsOrProvider,
                 aliases: Mapping[str, str], step: int | None, released: threading.Event,
                 owners: Owners | None = None) -> None:
        self.version, self.layout, self.aliases, self.step = version, layout, aliases, step
        self.owners = owners or single_owner(layout)
        self._provide: BucketTensors | None = provider_of(tensors)
        self._released = released

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor:
        bucket = self.layout.buckets[index]
        if slot is None or self._provide is None:
            raise ValueError("a live source needs a send slot and its tensors")
        fill_bucket(slot, bucket.slots, self._provide(bucket), bucket.nbytes)
        return slot[: bucket.nbytes]

    def all_filled(self) -> None:
        self._provide = None  # drop references to the live tensors
        self._released.set()


class CacheSource(FullSource):
    """cached: bucket bytes are read from the version cache. They are copied to the device when the wire needs
    it, and a delta version's are assembled from its own and its parent's bytes. While the version's snapshot
    still holds the training loop, a bucket bound for a device slot is filled from the live tensors instead,
    device to device, so it neither waits for the bucket's device→host copy nor copies it back."""

    mode: Mode = "cached"

    def __init__(self, cached: CachedVersion, device: DeviceInfo, as_version: int | None = None,
                 segment=None, expected_digest: str | None = None, drop: Callable[[], None] | None = None,
                 fill_timeout_s: float = 60.0) -> None:
        """``as_version``: a re-send (rollback, catch-up, repair), first checked against the version's identity
        and ``expected_digest``, the digest the daemon recorded for it. ``drop`` evicts a copy that fails that.
        A version still being snapshotted is read bucket by bucket as it is filled. Each bucket is waited for at
        most ``fill_timeout_s``, its device copies ordered before the send's on ``device``."""
        self.cached, self.as_version = cached, as_version
        self._device, self._fill_timeout_s = device, fill_timeout_s
        self.expected_digest, self._drop = expected_digest, drop
        # gloo sends host memory, so a whole cached version goes on the wire without any copy
        self.needs_slot = not (device.comm_device.type == "cpu" and cached.is_whole)
        # the cache buffer's shareable segment, which colocated receivers read in place
        self.segment = segment if not self.needs_slot else None
        self.layout, self.owners = _version_layout(cached), _owners(cached)
        self.aliases, self.step = cached.aliases, cached.step
        self.version = cached.version if as_version is None else as_version
        self._after_ready = False  # this send's stream waits for the loop's work before its first live read
        self.live_buckets = 0  # buckets filled from the live tensors

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        if self.as_version is not None:
            try:
                check_identity(self.cached, algo, device, rank, self.expected_digest)
            except StaleCopy:
                if self._drop is not None:
                    self._drop()  # it can never be sent as that version again
                raise
        return []

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor:
        local = self.cached.local_index(index)
        live = self.cached.live
        if live is not None and slot is not None and self.as_version is None:
            filled = self._from_live(live, local, slot)
            if filled is not None:
                return filled
        filling = self.cached.filling
        if filling is not None:
            # Bytes read in place (a host wire, colocated receivers) or staged in a host slot are read by the CPU,
            # which must wait for the bucket's device→host copy itself, not only queue behind it.
            on_host = slot is None or slot.device.type == "cpu"
            wait_for(self._device, filling.wait(local, self._fill_timeout_s), host=on_host)
        if not self.cached.is_whole:
            return self.cached.fill(local, _need(slot))
        return _placed(self.cached.bucket(local), _need(slot) if self.needs_slot else slot)

    def _from_live(self, live: LiveReads, local: int, slot: torch.Tensor) -> torch.Tensor | None:
        """Bucket ``local`` filled into ``slot`` from the live tensors while the snapshot holds the loop. None
        when the loop went on or the tensors are not on the slot's device: the caller reads the cache."""
        bucket = self.cached.layout.buckets[local]
        with live.reading() as tensors:
            if tensors is None or (bucket.slots and tensors[bucket.slots[0].name].device != slot.device):
                return None
            if not self._after_ready:
                wait_for(self._device, live.ready, host=False)
                self._after_ready = True
            fill_bucket(slot, bucket.slots, tensors, bucket.nbytes)
            live.read(mark(self._device))
        self.live_buckets += 1
        filling = self.cached.filling
        error = filling.error if filling is not None else None
        if error is not None:  # it would go out but never be cached, so it fails as a read from the cache would
            raise SnapshotFailed(f"the snapshot of version {self.cached.version} failed: {error}")
        return slot[: bucket.nbytes]

    def all_filled(self) -> None:
        pass


class StaleCopy(CkptEngineError):
    """A cached version is no longer what it was when it was sent: its bytes or its record changed."""


def check_identity(cached: CachedVersion, algo: DigestAlgo, device: torch.device, rank: int,
                   expected_digest: str | None) -> None:
    """Raise StaleCopy, naming the tensors, unless this rank's cached bytes of the version are exactly what was
    first sent and, given ``expected_digest``, what the daemon recorded. A re-send is verified against the
    version's identity, never against digests recomputed from what is stored now."""
    identity, version = cached.identity, cached.version
    if identity is None:
        raise StaleCopy(f"owner rank {rank} holds no record of what version {version} was when it was sent, so it "
                        "cannot vouch for its cached copy")
    if expected_digest is not None and identity.version_digest != expected_digest:
        raise StaleCopy(f"version {version} is recorded with digest {expected_digest}, but owner rank {rank}'s "
                        f"cached copy was sent as {identity.version_digest}")
    if identity.algo != algo:
        raise StaleCopy(f"version {version} was digested with {identity.algo}, this sender uses {algo}")
    digests = cached_digests(cached, algo, device)
    recorded = dict(zip(identity.names, identity.digests))
    changed = [slot.name for slot, digest in zip(cached.layout.slots, digests) if recorded.get(slot.name) != digest]
    if changed:
        raise StaleCopy(f"owner rank {rank}'s cached copy of version {version} no longer matches what was sent: "
                        f"{len(changed)} tensor(s) changed ({', '.join(changed[:5])}); dropped from the cache")


def cached_digests(cached: CachedVersion, algo: DigestAlgo, device: torch.device) -> list[int]:
    """Per-tensor digests of this rank's cached bytes of a version, in its layout's order."""
    scratch = None if cached.is_whole else torch.empty(cached.layout.max_bucket_bytes, dtype=torch.uint8)
    read = cached.bucket if cached.is_whole else (lambda b: cached.fill(b, scratch))  # type: ignore[arg-type]
    return layout_digests(cached.layout, lambda b: read(b.index), algo, device)


class ChangesSource:
    """What every sparse source shares: the version's full manifest (``full``, set by ``prepare`` or
    ``plan``), what changed against ``base`` (a manifest the receivers hold), and the header that says so."""

    mode: Mode = "cached"
    keep: KeepFor | None = None
    plans_alone = False

    def __init__(self, version: int, step: int | None, aliases: Mapping[str, str], layout: Layout, owners: Owners,
                 base: Manifest | None, bucket_size: int, alignment: int) -> None:
        self.version, self.step, self.aliases = version, step, aliases
        self.layout, self.owners = layout, owners  # the full version's, until ``plan`` makes them the changes'
        self.base, self.bucket_size, self.alignment = base, bucket_size, alignment
        self.full: Manifest | None = None
        self.plan_: SparsePlan | None = None
        self._algo = ""

    @property
    def skipped(self) -> int:
        return self.plan_.skipped if self.plan_ else 0

    @property
    def skipped_bytes(self) -> int:
        return self.plan_.skipped_bytes if self.plan_ else 0

    @property
    def base_version(self) -> int | None:
        return self.base.version if self.plan_ and self.base else None

    @property
    def header_extra(self) -> dict:
        if self.plan_ is None or self.full is None:
            return {}
        return {"base_version": self.base_version, "full_layout_digest": self.full.layout_digest,
                "full_version_digest": self.full.version_digest, "skipped": self.plan_.skipped}

    def told(self, algo: str, share: Layout, digests: list[int]) -> list[int]:
        """What this owner tells the others, from its ``digests`` of the tensors of ``share``: its base, then
        (tensor index in the version, digest) for each of its tensors. A sole owner tells nothing and sets
        the version's manifest instead."""
        if self.owners.ranks == 1:
            self.full = manifest_of(self.version, algo, share, digests)
            return []
        position = {slot.name: slot.index for slot in self.layout.slots}
        return [_base_word(self.base), *(value for slot, digest in zip(share.slots, digests)
                                         for value in (position[slot.name], digest))]

    def plan(self, told: list[list[int]] | None) -> None:
        """Plan what changed against the base. With several owners, the plan uses every owner's share of the
        digests, and the base only when every owner holds the same one; otherwise every owner plans the full
        version. An owner that did not send the base (e.g. silent when the owner count changed) has no manifest
        of it."""
        full_layout = self.layout
        if told is not None:
            bases = {values[0] for values in told}
            if len(bases) != 1 or 0 in bases:
                if self.base is not None:
                    log.info("version %d: not every owner holds base version %d's digests; sending it whole",
                             self.version, self.base.version)
                self.base = None
            found = {index: digest for values in told for index, digest in zip(values[1::2], values[2::2])}
            if len(found) != full_layout.num_tensors:
                raise ProtocolError(f"the owners' digests cover {len(found)} of {full_layout.num_tensors} tensors")
            self.full = manifest_of(self.version, self._algo, full_layout, [found[i] for i in range(len(found))])
        self.plan_ = plan_sparse(full_layout, self.full, self.base, bucket_size=self.bucket_size,  # type: ignore[arg-type]
                                 alignment=self.alignment, owners=self.owners)
        if self.plan_ is not None:
            self.layout, self.owners = self.plan_.layout, self.plan_.owners

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest:
        if self.plan_ is None or self.full is None:
            return wire_manifest(version, algo, self.layout, wire_digests)
        return self.full

    def all_filled(self) -> None:
        pass


class SparseCacheSource(ChangesSource):
    """cached and sparse: only tensors whose digest differs from the base version's are sent, laid out in
    their own buckets. The header tells receivers the base and the whole model's digest."""

    def __init__(self, cached: CachedVersion, base: Manifest | None, bucket_size: int, alignment: int,
                 on_host_wire: bool, parent: Manifest | None = None) -> None:
        """``parent``: when known, the manifest of the version a delta ``cached`` shares its unchanged tensors
        with. Then only the delta's own tensors are digested."""
        super().__init__(cached.version, cached.step, cached.aliases, _version_layout(cached), _owners(cached),
                         base, bucket_size, alignment)
        self.cached, self.parent = cached, parent
        self._on_host_wire = on_host_wire
        self._own_wire = False  # the changes are exactly the delta's own buffer, already in wire layout

    @property
    def needs_slot(self) -> bool:
        in_place = self._own_wire if self.plan_ is not None else self.cached.is_whole
        return not (self._on_host_wire and in_place)

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        """Digest what this rank caches of the version: only a delta's own tensors when its parent's digests
        are known and the version is this rank's alone. With several owners, returns (tensor index in the
        version, digest) pairs of this rank's share, so that every owner builds the same manifest."""
        cached, parent, self._algo = self.cached, self.parent, algo
        if (self.owners.ranks == 1 and not cached.is_whole and parent is not None and parent.algo == algo
                and parent.layout_digest == cached.layout.digest):
            # Per-tensor digests do not depend on the layout, so the delta's own buckets give the changed ones.
            own = _own_layout(cached)
            changed = dict(zip(cached.changed, layout_digests(own, lambda b: cached.buffer[b.flat_offset:], algo,
                                                              device)))
            self.full = parent.updated(self.version, changed)
            return []
        scratch = None if cached.is_whole else torch.empty(cached.layout.max_bucket_bytes, dtype=torch.uint8)
        read = cached.bucket if cached.is_whole else (lambda b: cached.fill(b, scratch))  # type: ignore[arg-type]
        return self.told(algo, cached.layout, layout_digests(cached.layout, lambda b: read(b.index), algo, device))

    def plan(self, told: list[list[int]] | None) -> None:
        super().plan(told)
        if self.plan_ is not None:
            self._own_wire = (self.owners.ranks == 1 and not self.cached.is_whole
                              and self.plan_.layout.digest == _own_layout(self.cached).digest)

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor:
        bucket = self.layout.buckets[index]
        if self.plan_ is None:  # no usable base: the full version, from this rank's share
            local = self.cached.local_index(index)
            if not self.cached.is_whole:
                return self.cached.fill(local, _need(slot))
            return _placed(self.cached.bucket(local), slot)
        if self._own_wire:  # bytes already in wire layout in one cache buffer
            return _placed(self.cached.buffer[bucket.flat_offset : bucket.flat_offset + bucket.nbytes], slot)
        fill_bucket(_need(slot), bucket.slots, self.cached.views(), bucket.nbytes)
        return slot[: bucket.nbytes]  # type: ignore[index]


class PiecesChangesSource(ChangesSource):
    """A class's pieces of a sharded version (send/class_senders.py), as the changes against the version its
    receivers hold. Every piece this owner sends is digested and compared with ``base``, the class's manifest of
    that version, per piece. Those that differ go on the wire, cut from the cache."""

    needs_slot = True

    def __init__(self, version: int, step: int | None, aliases: Mapping[str, str], layout: Layout, owners: Owners,
                 pieces: Mapping[str, torch.Tensor], base: Manifest | None, bucket_size: int, alignment: int) -> None:
        """``layout`` and ``owners``: the class's. ``pieces``: this owner's pieces, as views of its cached tensors."""
        super().__init__(version, step, aliases, layout, owners, base, bucket_size, alignment)
        self._pieces = pieces

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        self._algo = algo
        share = share_of(self.layout, self.owners, rank).layout
        scratch = torch.empty(max(share.max_bucket_bytes, 1), dtype=torch.uint8)

        def read(bucket: Bucket) -> torch.Tensor:
            fill_bucket(scratch, bucket.slots, self._pieces, bucket.nbytes)
            return scratch

        return self.told(algo, share, layout_digests(share, read, algo, device))

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor:
        bucket = self.layout.buckets[index]
        fill_bucket(_need(slot), bucket.slots, self._pieces, bucket.nbytes)
        return slot[: bucket.nbytes]  # type: ignore[index]


def record_identity(source: Source, manifest: Manifest) -> None:
    """Record what a cached version is at its first send; every later re-send is checked against it."""
    cached = getattr(source, "cached", None)
    if isinstance(cached, CachedVersion) and cached.identity is None and source.version == cached.version:
        cached.identity = manifest


def evict_quietly(cache: VersionCache, version: int) -> None:
    try:
        cache.evict(version)
    except CkptEngineError:  # evicted meanwhile
        pass
    log.error("version %d dropped from the cache: its cached copy no longer matches what was sent", version)


def _base_word(base: Manifest | None) -> int:
    """A sparse base as one int64 word for the owners' vote; 0 means none."""
    if base is None:
        return 0
    text = f"{base.version}|{base.algo}|{base.layout_digest}|{base.version_digest}"
    return (xxhash.xxh3_64_intdigest(text.encode()) >> 2) or 1


# CachedVersion.__post_init__ fills in its optional layouts and owners, so None here is a broken record.
def _version_layout(cached: CachedVersion) -> Layout:
    if cached.version_layout is None:
        raise CacheError(f"cached version {cached.version} has no version layout")
    return cached.version_layout


def _owners(cached: CachedVersion) -> Owners:
    if cached.owners is None:
        raise CacheError(f"cached version {cached.version} has no owners")
    return cached.owners


def _own_layout(cached: CachedVersion) -> Layout:
    if cached.own_layout is None:
        raise CacheError(f"cached version {cached.version} has no own layout")
    return cached.own_layout


def _need(slot: torch.Tensor | None) -> torch.Tensor:
    if slot is None:
        raise ValueError("this source needs a send slot")
    return slot


def _placed(view: torch.Tensor, slot: torch.Tensor | None) -> torch.Tensor:
    """``view`` itself, or its bytes copied into ``slot`` when the wire reads from a send slot."""
    if slot is None:
        return view
    slot[: view.numel()].copy_(view, non_blocking=True)
    return slot[: view.numel()]
