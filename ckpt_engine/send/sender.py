"""The sending side of a version: fills buckets (from the cache or straight from live tensors), digests them,
and broadcasts them double-buffered, so bucket k+1 is being filled while bucket k is on the wire.

A transfer runs on a background thread. ``Transfer.params_released`` is set as soon as the source tensors
are no longer read: right away for a cached version (the cache holds the bytes), after the last bucket has
been filled for a live (``bypass_cpu``) version.

A version of several owners (plan/owners.py): every trainer rank sends the buckets it owns on its own sync
group (it is rank 0 there; the receivers are the same ranks in every group). Rank 0 leads: it sends the
version's header and trailer and collects the acknowledgements on its group. The owners vote twice on their
own group (``owners_group``): before the first bucket (all ready; a sparse version's digests, so every owner
plans the same changes) and after their last (all sent; every bucket's digests, for the trailer). A failure
of any owner makes the lead end the version with an abort, so receivers never load it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import xxhash

from ckpt_engine.device import DeviceInfo, DigestAlgo, comm_empty, current_stream, new_stream, on_stream, set_current
from ckpt_engine.errors import CkptEngineError, ConfigError, ProtocolError, SyncTimeoutError
from ckpt_engine.plan.hashing import bucket_digests, layout_digests, version_digest
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.modes import MODES, Mode
from ckpt_engine.plan.owners import Owners, single_owner
from ckpt_engine.plan.sparse import Manifest, SparsePlan, manifest_of, plan_sparse
from ckpt_engine.plan.tensors import (
    BucketTensors,
    TensorsOrProvider,
    check_matches_layout,
    fill_bucket,
    forget_fill_views,
    provider_of,
)
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.outlets import CollectiveOutlet, IpcOutlet, LayoutSent, Outlet
from ckpt_engine.transport.framing import Channel, Frame, FrameKind
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.messages import AbortMessage, Ack, LayoutMessage, VersionHeader, VersionTrailer, encode
from ckpt_engine.transport.same_host import IpcHub

log = logging.getLogger(__name__)
_MANIFESTS_KEPT = 8

# Called with (bucket index, bucket bytes) after the digests are taken; returns the bytes to put on the wire.
# Fault injection for tests and chaos runs: the source (cache or live tensors) is never modified by it.
WireHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class TransferResult:
    version: int
    mode: Mode
    ok: bool
    reason: str | None
    version_digest: str | None
    receivers: list[Ack]
    bytes_sent: int  # by this rank (an owner's share of the version)
    buckets: int
    tensors: int
    seconds: dict[str, float] = field(default_factory=dict)
    finished_at: float = 0.0  # time.perf_counter() when every acknowledgement was in (or the transfer failed)
    tensors_skipped: int = 0  # sparse: unchanged tensors not sent
    bytes_skipped: int = 0  # sparse: their bytes
    base_version: int | None = None  # sparse: the version the receivers held
    absent_ranks: list[int] = field(default_factory=list)  # receivers that never joined the rendezvous
    version_bytes: int = 0  # of the whole version on the wire (every owner's share), once all were sent

    @property
    def committed_ranks(self) -> list[int]:
        return [ack.rank for ack in self.receivers if ack.ok]


class Transfer:
    """Handle of one version being sent."""

    def __init__(self, version: int, mode: Mode) -> None:
        self.version = version
        self.mode = mode
        self.gathered_bytes = 0  # bytes of full tensors this rank assembled for it (gathers of a sharded model)
        self.params_released = threading.Event()
        self._done = threading.Event()
        self._result: TransferResult | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> TransferResult:
        if not self._done.wait(timeout_s):
            raise SyncTimeoutError(f"version {self.version} still in transfer after {timeout_s}s")
        if self._result is None:
            raise CkptEngineError(f"version {self.version}: transfer ended without a result")
        return self._result

    def _finish(self, result: TransferResult) -> None:
        self._result = result
        self.params_released.set()
        self._done.set()


class _Source(Protocol):
    """Where a version's bucket bytes come from: live tensors, the cache, or the cache's changes (sparse)."""

    mode: Mode
    layout: Layout  # what goes on the wire (after plan)
    owners: Owners  # who sends each bucket of ``layout``
    version: int
    step: int | None
    aliases: Mapping[str, str]
    header_extra: dict
    skipped: int
    skipped_bytes: int
    base_version: int | None
    needs_slot: bool  # bucket() must be given a send slot to fill (else it returns views of the source)

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        """Work before the first bucket; returns what this owner tells the others (see ``plan``)."""

    def plan(self, told: list[list[int]] | None) -> None:
        """Fix ``layout`` and ``owners`` from what every owner told (None: this rank is the only one)."""

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest: ...

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor: ...

    def all_filled(self) -> None: ...


class _Full:
    """What every full source shares: nothing to prepare, the wire digest is the version digest."""

    header_extra: dict = {}
    skipped = 0
    skipped_bytes = 0
    base_version: int | None = None

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        return []

    def plan(self, told: list[list[int]] | None) -> None:
        pass

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest:
        return manifest_of(version, algo, self.layout, wire_digests)  # type: ignore[attr-defined]


class _LiveSource(_Full):
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


class _CacheSource(_Full):
    """cached: bucket bytes are read from the version cache (copied to the device when the wire needs it;
    assembled from its own and its parent's bytes for a delta version)."""

    mode: Mode = "cached"

    def __init__(self, cached: CachedVersion, on_host_wire: bool, as_version: int | None = None,
                 segment=None, expected_digest: str | None = None, drop: Callable[[], None] | None = None) -> None:
        """``as_version``: a re-send (rollback, catch-up, repair), checked against the version's identity first
        (``expected_digest``: the digest the daemon recorded for it); ``drop`` evicts a copy that fails it."""
        self.cached, self.as_version = cached, as_version
        self.expected_digest, self._drop = expected_digest, drop
        # gloo sends host memory: a whole cached version goes on the wire without any copy
        self.needs_slot = not (on_host_wire and cached.is_whole)
        # the cache buffer's shareable segment: colocated receivers read it in place
        self.segment = segment if not self.needs_slot else None
        self.layout, self.owners = cached.version_layout, cached.owners  # type: ignore[assignment]
        self.aliases, self.step = cached.aliases, cached.step
        self.version = cached.version if as_version is None else as_version

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
        if not self.cached.is_whole:
            return self.cached.fill(local, _need(slot))
        return _placed(self.cached.bucket(local), _need(slot) if self.needs_slot else slot)

    def all_filled(self) -> None:
        pass


class StaleCopy(CkptEngineError):
    """A cached version no longer is what it was when it was sent (its bytes or its record changed)."""


def check_identity(cached: CachedVersion, algo: DigestAlgo, device: torch.device, rank: int,
                   expected_digest: str | None) -> None:
    """Raise StaleCopy, naming the tensors, unless this rank's cached bytes of the version are exactly what was
    sent when it was first sent (and, given ``expected_digest``, what the daemon recorded): a re-send is
    verified against the version's identity, never against digests recomputed from what is stored now."""
    identity, version = cached.identity, cached.version
    if identity is None:
        raise StaleCopy(f"owner rank {rank} holds no record of what version {version} was when it was sent, so it "
                        "cannot vouch for its cached copy")
    if expected_digest is not None and identity.version_digest != expected_digest:
        raise StaleCopy(f"version {version} is recorded with digest {expected_digest}, but owner rank {rank}'s "
                        f"cached copy was sent as {identity.version_digest}")
    if identity.algo != algo:
        raise StaleCopy(f"version {version} was digested with {identity.algo}, this sender uses {algo}")
    scratch = None if cached.is_whole else torch.empty(cached.layout.max_bucket_bytes, dtype=torch.uint8)
    read = cached.bucket if cached.is_whole else (lambda b: cached.fill(b, scratch))  # type: ignore[arg-type]
    digests = layout_digests(cached.layout, lambda b: read(b.index), algo, device)
    recorded = dict(zip(identity.names, identity.digests))
    changed = [slot.name for slot, digest in zip(cached.layout.slots, digests) if recorded.get(slot.name) != digest]
    if changed:
        raise StaleCopy(f"owner rank {rank}'s cached copy of version {version} no longer matches what was sent: "
                        f"{len(changed)} tensor(s) changed ({', '.join(changed[:5])}); dropped from the cache")


class _SparseCacheSource:
    """cached and sparse: only tensors whose digest differs from the base version's are sent, laid out in
    their own buckets; the header tells receivers the base and the whole model's digest."""

    mode: Mode = "cached"

    def __init__(self, cached: CachedVersion, base: Manifest | None, bucket_size: int, alignment: int,
                 on_host_wire: bool, parent: Manifest | None = None) -> None:
        """``parent``: the manifest of the version a delta ``cached`` shares its unchanged tensors with, when
        known; then only the delta's own tensors are digested."""
        self.cached, self.base, self.parent = cached, base, parent
        self.version, self.aliases, self.step = cached.version, cached.aliases, cached.step
        self.layout, self.owners = cached.version_layout, cached.owners  # type: ignore[assignment]
        self.bucket_size, self.alignment = bucket_size, alignment
        self.full: Manifest | None = None
        self.plan_: SparsePlan | None = None
        self._algo = ""
        self._on_host_wire = on_host_wire
        self._own_wire = False  # the changes are exactly the delta's own buffer, already in wire layout

    @property
    def needs_slot(self) -> bool:
        in_place = self._own_wire if self.plan_ is not None else self.cached.is_whole
        return not (self._on_host_wire and in_place)

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

    def prepare(self, algo: DigestAlgo, device: torch.device, rank: int) -> list[int]:
        """Digest what this rank caches of the version (only a delta's own tensors when its parent's digests
        are known and the version is this rank's alone). With several owners, returns (tensor index in the
        version, digest) pairs of this rank's share, for every owner to build the same manifest."""
        cached, parent, self._algo = self.cached, self.parent, algo
        if (self.owners.ranks == 1 and not cached.is_whole and parent is not None and parent.algo == algo
                and parent.layout_digest == cached.layout.digest):
            # Per-tensor digests do not depend on the layout, so the delta's own buckets give the changed ones.
            own = cached.own_layout
            changed = dict(zip(cached.changed, layout_digests(own, lambda b: cached.buffer[b.flat_offset:], algo,
                                                              device)))
            self.full = parent.updated(self.version, changed)
            return []
        scratch = None if cached.is_whole else torch.empty(cached.layout.max_bucket_bytes, dtype=torch.uint8)
        read = cached.bucket if cached.is_whole else (lambda b: cached.fill(b, scratch))  # type: ignore[arg-type]
        digests = layout_digests(cached.layout, lambda b: read(b.index), algo, device)
        if self.owners.ranks == 1:
            self.full = manifest_of(self.version, algo, cached.layout, digests)
            return []
        position = {slot.name: slot.index for slot in self.layout.slots}
        return [_base_word(self.base), *(value for slot, digest in zip(cached.layout.slots, digests)
                                         for value in (position[slot.name], digest))]

    def plan(self, told: list[list[int]] | None) -> None:
        """What changed against the base; with several owners, from every owner's share of the digests, and
        against the base only when every owner holds the same one (an owner that did not send it, e.g. silent
        when the owner count changed, has no manifest of it): else every owner plans the full version."""
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
            self._own_wire = (self.owners.ranks == 1 and not self.cached.is_whole
                              and self.plan_.layout.digest == self.cached.own_layout.digest)

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest:
        if self.plan_ is None or self.full is None:
            return manifest_of(version, algo, self.layout, wire_digests)
        return self.full

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

    def all_filled(self) -> None:
        pass


def _record_identity(source: _Source, manifest: Manifest) -> None:
    """The first send of a cached version fixes what it is: every later re-send is checked against this."""
    cached = getattr(source, "cached", None)
    if isinstance(cached, CachedVersion) and cached.identity is None and source.version == cached.version:
        cached.identity = manifest


def _evict_quietly(cache: VersionCache, version: int) -> None:
    try:
        cache.evict(version)
    except CkptEngineError:  # evicted meanwhile
        pass
    log.error("version %d dropped from the cache: its cached copy no longer matches what was sent", version)


def _base_word(base: Manifest | None) -> int:
    """A sparse base as one int64 word for the owners' vote (0: none)."""
    if base is None:
        return 0
    text = f"{base.version}|{base.algo}|{base.layout_digest}|{base.version_digest}"
    return (xxhash.xxh3_64_intdigest(text.encode()) >> 2) or 1


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


class Sender:
    """Sends versions as the source (rank 0) of a sync group, to colocated receivers through an IPC hub, or
    both in the same version. ``ipc_peers`` maps the colocated receivers' agent ids to their ranks."""

    def __init__(self, group: SyncGroup | None, *, device: DeviceInfo | None = None, hub: IpcHub | None = None,
                 ipc_peers: Mapping[str, int] | None = None, digest_algo: DigestAlgo | None = None,
                 ack_timeout_s: float | None = None, wire_hook: WireHook | None = None,
                 on_stage: Callable[[int, str], None] | None = None, timeout_s: float = 60.0,
                 manifests: dict[int, Manifest] | None = None, owners_group: SyncGroup | None = None) -> None:
        """``owners_group``: the trainer ranks that own shares of this sender's versions (this rank is
        ``owners_group.rank``; rank 0 leads); None: this rank sends every bucket itself."""
        if group is None and not ipc_peers:
            raise ConfigError("a sender needs a sync group, colocated receivers, or both")
        if owners_group is not None and ipc_peers:
            raise ConfigError("versions of several owners go on sync groups only (no colocated receivers)")
        self.owners_group = owners_group
        self.rank = owners_group.rank if owners_group is not None else 0
        self.lead = self.rank == 0
        if ipc_peers and hub is None:
            raise ConfigError("colocated receivers need an IPC hub")
        self.group = group
        self.channel = Channel(group) if group is not None else None
        if self.channel is not None and not self.channel.is_src:
            raise ProtocolError(f"rank {group.rank} cannot send: the sender is rank {self.channel.src}")  # type: ignore[union-attr]
        self.device: DeviceInfo = group.device if group is not None else device  # type: ignore[assignment]
        if self.device is None:
            raise ConfigError("a sender without a sync group needs a device")
        self.hub, self.ipc_peers = hub, dict(ipc_peers or {})
        self.timeout_s = group.timeout_s if group is not None else timeout_s
        self.digest_algo: DigestAlgo = digest_algo or self.device.digest_algo
        self.ack_timeout_s = ack_timeout_s if ack_timeout_s is not None else 2 * self.timeout_s
        self.wire_hook = wire_hook
        self.on_stage = on_stage  # called with (version, "transferring" | "verifying") from the send thread
        self._slots: list[torch.Tensor] = []
        self._layout_sent = LayoutSent()  # what this group's receivers hold
        self._stream: Any | None = None  # the send thread's own device stream (made on first use)
        self._busy = threading.Lock()
        # Per-tensor digests of recently sent versions: the bases of sparse versions (shared across senders).
        self.manifests: dict[int, Manifest] = manifests if manifests is not None else {}

    def send_cached(self, cache: VersionCache, version: int, *, as_version: int | None = None,
                    expected_digest: str | None = None) -> Transfer:
        """Send a version held in ``cache`` (labelled ``as_version`` on the wire when given, e.g. a rollback,
        after checking the cached bytes against what was sent the first time and, given ``expected_digest``,
        against the digest the daemon recorded); the cache keeps its buffer alive until the transfer ends."""
        hold = contextlib.ExitStack()
        cached = self._lease(hold, cache, version, as_version if as_version is not None else version)
        drop = lambda: _evict_quietly(cache, version)  # noqa: E731
        source = _CacheSource(cached, self.device.comm_device.type == "cpu", as_version, cache.shared_segment(cached),
                              expected_digest, drop)
        transfer = Transfer(source.version, "cached")
        transfer.params_released.set()
        return self._start(source, transfer, hold)

    def send_sparse(self, cache: VersionCache, version: int, base_version: int, *, bucket_size: int,
                    alignment: int) -> Transfer:
        """Send a cached version as the changes against ``base_version`` (a version this sender sent and the
        receivers hold); a full version when that base is unknown or has another layout."""
        hold = contextlib.ExitStack()
        cached = self._lease(hold, cache, version, version)
        parent = self.manifests.get(cached.parent) if cached.parent is not None else None
        source = _SparseCacheSource(cached, self.manifests.get(base_version), bucket_size, alignment,
                                    self.device.comm_device.type == "cpu", parent)
        transfer = Transfer(version, "cached")
        transfer.params_released.set()
        return self._start(source, transfer, hold)

    def send_live(self, version: int, layout: Layout, tensors: TensorsOrProvider, *,
                  aliases: Mapping[str, str] | None = None, step: int | None = None, check: bool = True,
                  owners: Owners | None = None) -> Transfer:
        """Send live tensors without a host copy; read them until ``params_released`` is set. With ``owners``,
        only this rank's buckets are read (``tensors`` is asked for those alone, in order).
        ``check=False`` skips re-checking tensors against the layout (for callers that planned it from them)."""
        if check and not callable(tensors):
            check_matches_layout(layout, tensors)
        transfer = Transfer(version, "bypass_cpu")
        source = _LiveSource(version, layout, tensors, aliases or {}, step, transfer.params_released, owners)
        return self._start(source, transfer, contextlib.ExitStack())

    def _lease(self, hold: contextlib.ExitStack, cache: VersionCache, version: int, label: int) -> CachedVersion:
        """``version`` from the cache for the transfer's lifetime; when this rank does not hold it, the other
        owners hear so in the votes they wait in (and the lead tells the receivers)."""
        try:
            return hold.enter_context(cache.lease(version))
        except CkptEngineError as exc:
            if self.owners_group is not None:
                self.abort_before_start(label, f"owner rank {self.rank} cannot send version {version}: {exc}")
            raise

    def abort_before_start(self, version: int, reason: str) -> None:
        """Tell receivers waiting for ``version`` that it will not come (e.g. the snapshot failed), so they
        stop waiting now instead of at their timeout. Only valid while no version is on the wire. With several
        owners every owner must call it or send the version: they vote first, and the lead aborts for all."""
        with self._busy:
            if self.owners_group is not None:  # the two votes every owner takes part in, per version
                try:
                    self._vote(version, False, [], "ready")
                except CkptEngineError as exc:  # the lead still tells the receivers below
                    log.warning("version %d: the owners' ready vote failed: %s", version, exc)
                else:
                    self._vote_failed(version, reason)
            if not self.lead:
                return
            raw = encode(AbortMessage(version=version, reason=reason))
            for outlet in self._outlets():
                outlet.abort(version, 0, raw)
                outlet.release()

    def close(self) -> None:
        """Tell receivers on the sync group that it is closing, then release it (the IPC hub stays)."""
        with self._busy:
            if self.group is not None and self.channel is not None:
                if self.group.broken is None:
                    try:
                        self.channel.frame(Frame(FrameKind.CLOSE), 0, "close")
                    except CkptEngineError as exc:
                        log.warning("could not announce close: %s", exc)
                self.group.close()

    def _start(self, source: _Source, transfer: Transfer, hold: contextlib.ExitStack) -> Transfer:
        """Run the transfer on a background thread; ``hold`` (e.g. a cache lease) is released when it ends."""
        if not self._busy.acquire(blocking=False):
            hold.close()
            raise CkptEngineError(f"version {source.version}: another version is still being sent")
        origin = current_stream(self.device)  # where the caller queued the work that produced its tensors

        def run() -> None:
            try:
                set_current(self.device)  # the current device is per thread on CUDA/NPU
                if self._stream is None:
                    self._stream = new_stream(self.device)
                # Not the caller's stream: the copies, digests and collective waits of a background transfer
                # would otherwise queue behind the training loop's kernels and hold them up in turn.
                with on_stream(self.device, self._stream, after=origin):
                    transfer._finish(self._run(source))
            finally:
                hold.close()
                self._busy.release()

        threading.Thread(target=run, name=f"ckpt-send-v{source.version}", daemon=True).start()
        return transfer

    def _outlets(self, source: _Source | None = None) -> list[Outlet]:
        outlets: list[Outlet] = []
        if self.channel is not None:
            outlets.append(CollectiveOutlet(self.channel, self._layout_sent))
        if self.ipc_peers and self.hub is not None:
            peers, missing = self.hub.peers(self.ipc_peers, self.timeout_s)
            in_place = source.segment if isinstance(source, _CacheSource) else None
            outlets.append(IpcOutlet(self.hub, peers, missing, self.timeout_s, in_place=in_place))
        return outlets

    def _run(self, source: _Source) -> TransferResult:
        timer = _Timer()
        result = TransferResult(source.version, source.mode, False, None, None, [], 0, 0, 0)
        outlets: list[Outlet] = []
        voted = [False]  # this rank's vote after sending is in (with several owners there is one per version)
        try:
            with timer.stage("digest"):
                told = self._ready(source)
                source.plan(told)
            layout, owners = source.layout, source.owners
            mine = owners.buckets_of(self.rank)
            result.buckets, result.tensors = len(layout.buckets), layout.num_tensors
            result.tensors_skipped, result.base_version = source.skipped, source.base_version
            result.bytes_skipped = source.skipped_bytes
            slots = self._ensure_slots(layout, source)
            outlets = self._outlets(source)
            if self.lead:
                with timer.stage("header"):
                    full, slim = self._headers(source)
                    for outlet in outlets:
                        outlet.begin(source.version, layout.digest, full, slim)
            self._stage(source.version, "transferring")
            digests = self._send_buckets(source, outlets, slots, timer, result, mine)
            digests = self._gather_digests(source, digests, timer, voted)
            result.version_bytes = layout.total_bytes  # every owner sent its buckets: the version's bytes went out
            self._stage(source.version, "verifying")
            manifest = source.manifest(source.version, self.digest_algo, digests)
            result.version_digest = manifest.version_digest  # of the whole model, also for sparse versions
            if self.lead:
                wire_digest = version_digest(self.digest_algo, layout.digest, digests)
                trailer = encode(VersionTrailer(version=source.version, version_digest=wire_digest))
                with timer.stage("control"):
                    for outlet in outlets:
                        outlet.end(source.version, trailer)
                with timer.stage("ack"):
                    self._collect_acks(source.version, manifest.version_digest, outlets, result)
            else:
                result.ok = True  # this owner's part; what the receivers made of it is the lead's to report
            self._remember(manifest)
            _record_identity(source, manifest)
        except CkptEngineError as exc:  # includes _Aborted: receivers were told
            result.reason = str(exc)
        except Exception as exc:  # a bug must still end the transfer with a reason, never leave it pending
            log.exception("version %d: unexpected error while sending", source.version)
            result.reason = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            # First release what the source reads (bypass_cpu: the live tensors, and the training loop waiting on
            # them, which must join the trainer's gathers before its own process-group timeout), then the votes.
            source.all_filled()
            if not result.ok:  # a receiver may have dropped the version's header: the next one sends the layout
                self._layout_sent.digest = None
            if not voted[0] and self.owners_group is not None:  # the other owners wait for this rank's vote
                self._vote_failed(source.version, result.reason or "failed")
            for outlet in outlets:
                outlet.release()
        result.seconds = timer.finish()
        result.finished_at = time.perf_counter()
        log.info("version %d %s: %s in %.3fs (%d bytes, %d buckets)", source.version, source.mode,
                 "committed" if result.ok else f"failed ({result.reason})", result.seconds["total"],
                 result.bytes_sent, result.buckets)
        return result

    # ---- several owners ------------------------------------------------------------------------------
    def _ready(self, source: _Source) -> list[list[int]] | None:
        """Prepare, and with several owners vote that every one is ready (and share what ``plan`` needs);
        when one is not, the lead aborts the version for the receivers before any bucket went out."""
        if self.owners_group is None:
            if source.owners.ranks != 1:  # before anything goes out: receivers would wait for other owners
                reason = (f"version {source.version} is planned for {source.owners.ranks} owner ranks, but this "
                          "sender has no owners' group (attach one, or publish without ownership)")
                self._abort_receivers(source, reason)
                raise ConfigError(reason)
            try:
                source.prepare(self.digest_algo, self.device.comm_device, self.rank)
            except Exception as exc:  # nothing went out: tell the receivers now, not at their timeout
                self._abort_receivers(source, f"version {source.version} could not be prepared: "
                                              f"{type(exc).__name__}: {exc}")
                raise
            return None
        try:
            if source.owners.ranks != self.owners_group.world_size:
                raise ConfigError(f"it is planned for {source.owners.ranks} owner ranks, the owners' group has "
                                  f"{self.owners_group.world_size}")
            told = source.prepare(self.digest_algo, self.device.comm_device, self.rank)
        except Exception as exc:
            self.owners_group.say(f"why/{source.version}", f"{type(exc).__name__}: {exc}")
            self._vote_or_abort(source, False, [], "ready")
            raise _NotReady(f"owner rank {self.rank} could not prepare version {source.version}: "
                            f"{type(exc).__name__}: {exc}") from exc
        plan = _plan_words(source)
        votes = self._vote_or_abort(source, True, [*plan, *told], "ready")
        self._end_if_failed(source, votes, "could not prepare", _NotReady)
        differ = [rank for rank, (_, values) in enumerate(votes) if values[: len(plan)] != plan]
        if differ:  # each owner would send its buckets of another plan: refused before any bucket goes out
            reason = (f"owner rank(s) {differ} planned version {source.version} differently from owner rank "
                      f"{self.rank} (tensor names, order, dtypes or shapes, the owner count, or the mode differ)")
            self._abort_receivers(source, reason)
            raise _NotReady(reason)
        return [values[len(plan):] for _, values in votes]

    def _gather_digests(self, source: _Source, mine: list[int], timer: _Timer, voted: list[bool]) -> list[int]:
        """Every bucket's digests in the version's order: this rank's own, or with several owners everyone's
        (after they all sent their buckets). When an owner failed, the lead aborts the version."""
        if self.owners_group is None:
            return mine
        with timer.stage("control"):
            voted[0] = True  # whatever the vote's outcome, this rank took part in it
            votes = self._vote_or_abort(source, True, mine, "sent")
        self._end_if_failed(source, votes, "could not send their buckets of", _Aborted)
        layout, owners = source.layout, source.owners
        cursors = [0] * owners.ranks
        digests: list[int] = []
        for bucket in layout.buckets:
            owner = owners.of[bucket.index]
            values = votes[owner][1]
            digests.extend(values[cursors[owner] : cursors[owner] + len(bucket.slots)])
            cursors[owner] += len(bucket.slots)
        return digests

    def _end_if_failed(self, source: _Source, votes: list[tuple[bool, list[int]]], what: str,
                       error: type[CkptEngineError]) -> None:
        """When an owner voted no, the lead aborts the version for the receivers; every owner raises."""
        failed = [rank for rank, (ok, _) in enumerate(votes) if not ok]
        if not failed:
            return
        why = self.owners_group.heard(f"why/{source.version}", failed) if self.owners_group is not None else {}
        said = "".join(f"; owner rank {rank}: {text}" for rank, text in sorted(why.items()))
        reason = f"owner rank(s) {failed} {what} version {source.version}{said}"
        self._abort_receivers(source, reason)
        raise error(reason)

    def _abort_receivers(self, source: _Source, reason: str) -> None:
        """The lead tells the receivers that the version will not complete, and why (best effort)."""
        source.all_filled()  # nothing more is read from the source: release it before any wait
        if not self.lead:
            return
        raw = encode(AbortMessage(version=source.version, reason=reason))
        for outlet in self._outlets(source):
            try:
                outlet.abort(source.version, 0, raw)
            except CkptEngineError as exc:
                log.warning("version %d: could not tell the receivers it was aborted (%s): %s", source.version,
                            reason, exc)

    def _vote_or_abort(self, source: _Source, ok: bool, values: list[int],
                       what: str) -> list[tuple[bool, list[int]]]:
        """A vote among the owners; when the vote itself fails (an owner died, stalled or left), the lead
        tells the receivers why instead of leaving them to their timeout."""
        try:
            return self._vote(source.version, ok, values, what)
        except CkptEngineError as exc:
            absent = getattr(exc, "absent_ranks", [])
            who = f"owner rank(s) {absent} did not come" if absent else "an owner rank died, stalled or left"
            reason = f"the owners' {what} vote of version {source.version} failed ({who}): {exc}"
            self._abort_receivers(source, reason)
            raise _Aborted(reason) from exc

    def _vote(self, version: int, ok: bool, values: list[int], what: str) -> list[tuple[bool, list[int]]]:
        """One exchange among the owners: each says whether it is fine, with its values."""
        group = self.owners_group
        if group is None:
            return [(ok, values)]
        told = group.exchange_ints([version, int(ok), *values], f"version {version}: owners {what}",
                                   round_id=(what, version))
        out = []
        for rank, entry in enumerate(told):
            if len(entry) < 2 or entry[0] != version:
                raise ProtocolError(f"owner rank {rank} voted on version {entry[0] if entry else '?'}, not {version}")
            out.append((bool(entry[1]), entry[2:]))
        return out

    def _vote_failed(self, version: int, reason: str) -> None:
        """This rank failed between the votes: say so in the vote the others wait in (best effort)."""
        if self.owners_group is not None:
            self.owners_group.say(f"why/{version}", reason)
        try:
            self._vote(version, False, [], "sent")
        except CkptEngineError as exc:
            log.warning("version %d: could not tell the other owners that this one failed (%s): %s", version,
                        reason, exc)

    def _stage(self, version: int, stage: str) -> None:
        if self.on_stage is not None:
            try:
                self.on_stage(version, stage)
            except Exception:  # a progress observer must never break a transfer
                log.exception("on_stage callback failed")

    def _headers(self, source: _Source) -> tuple[Callable[[], bytes], bytes]:
        """The version header without the layout (for receivers that hold it), and a function that builds
        the one with the layout only if some receiver needs it (at 20k tensors that costs ~70 ms)."""
        layout, owners = source.layout, source.owners
        several = {"owner_ranks": owners.ranks, "owners": list(owners.of)} if owners.ranks > 1 else {}
        fields = dict(version=source.version, mode=source.mode, digest_algo=self.digest_algo,
                      layout_digest=layout.digest, step=source.step, aliases=dict(source.aliases),
                      created_at=time.time(), **source.header_extra, **several)
        built: list[bytes] = []

        def full() -> bytes:
            if not built:
                built.append(encode(VersionHeader(layout=LayoutMessage.of(layout), **fields)))
            return built[0]

        return full, encode(VersionHeader(**fields))

    def _send_buckets(self, source: _Source, outlets: list[Outlet], slots: list[torch.Tensor], timer: _Timer,
                      result: TransferResult, mine: tuple[int, ...]) -> list[int]:
        """Send the buckets ``mine`` (indices in the version's layout, in order); their digests, in order."""
        layout = source.layout
        digests: list[int] = []
        if not mine:  # this owner has no bucket of the version: its source is not read at all
            source.all_filled()
        for position, k in enumerate(mine):
            bucket = layout.buckets[k]
            slot_index = position % 2
            with timer.stage("broadcast"):
                for outlet in outlets:
                    outlet.reclaim(slot_index, k)
            try:
                with timer.stage("fill"):
                    buf = source.bucket(k, slots[slot_index] if slots else None)
                with timer.stage("digest"):
                    values = bucket_digests(bucket, buf, self.digest_algo, layout.digest).cpu()
                if self.wire_hook is not None:
                    buf = self.wire_hook(k, buf)
            except Exception as exc:  # anything that stops us preparing a bucket aborts the version for all
                source.all_filled()  # nothing more is read: the training loop goes on while receivers are told
                self._abort(source.version, outlets, len(bucket.slots), f"bucket {k} could not be prepared: {exc}")
            if position == len(mine) - 1:
                source.all_filled()
            with timer.stage("control"):
                for outlet in outlets:
                    outlet.bucket(k, bucket, buf, values, slot_index)
            digests.extend(values.tolist())
            result.bytes_sent += bucket.nbytes
        with timer.stage("broadcast"):
            for outlet in outlets:
                outlet.flush()
        return digests

    def _abort(self, version: int, outlets: list[Outlet], extra_len: int, reason: str) -> None:
        """Tell receivers at the position they expect a frame that this version is abandoned, then stop."""
        raw = encode(AbortMessage(version=version, reason=reason))
        for outlet in outlets:
            outlet.abort(version, extra_len, raw)
        raise _Aborted(reason)

    def _collect_acks(self, version: int, digest: str, outlets: list[Outlet], result: TransferResult) -> None:
        own = Ack(version=version, rank=0, ok=True, version_digest=digest)
        problems = []
        for outlet in outlets:
            for ack in outlet.acks(version, own, self.ack_timeout_s):
                if ack.ok and ack.version_digest != digest:
                    ack = ack.model_copy(update={"ok": False, "reason": f"digest {ack.version_digest} != {digest}"})
                result.receivers.append(ack)
                if not ack.ok:
                    problems.append(f"rank {ack.rank}: {ack.reason}")
        result.ok = not problems
        result.reason = "; ".join(problems) or None

    def _remember(self, manifest: Manifest) -> None:
        self.manifests[manifest.version] = manifest
        for old in sorted(self.manifests)[:-_MANIFESTS_KEPT]:
            del self.manifests[old]

    def _ensure_slots(self, layout: Layout, source: _Source) -> list[torch.Tensor]:
        need = max(layout.max_bucket_bytes, 1)
        if self.hub is not None and self.ipc_peers:
            # Colocated receivers read the send slots themselves (fills land in shared memory directly) unless
            # the version sits in a shareable cache buffer they read in place.
            shared = self.hub.ensure_slots(need)
            return [] if isinstance(source, _CacheSource) and source.segment is not None else shared
        if not source.needs_slot:
            return []
        if not self._slots or self._slots[0].numel() < need:
            for slot in self._slots:
                forget_fill_views(slot)
            self._slots = [comm_empty(need, self.device) for _ in range(2)]
        return self._slots


class _Aborted(CkptEngineError):
    pass


def _plan_words(source: _Source) -> list[int]:
    """What every owner of a version must have planned alike, as int64 words for the owners' vote."""
    def word(text: str) -> int:
        return xxhash.xxh3_64_intdigest(text.encode()) >> 2  # fits int64
    return [word(source.layout.digest), source.owners.ranks, word(source.owners.digest), MODES.index(source.mode)]


class _NotReady(CkptEngineError):
    """An owner could not prepare the version: nothing of it went out (the lead told the receivers)."""


class _Timer:
    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def finish(self) -> dict[str, float]:
        self.seconds["total"] = time.perf_counter() - self._start
        return self.seconds
