"""Trainer-side front of the library. :meth:`Publisher.publish` is the one way a version leaves a trainer
rank, whatever its kind:

- cached: snapshot into the versioned host cache, then send in the background;
- bypass_cpu: send straight from the live tensors;
- sparse: cache and send only what changed;
- re-push: send a cached version again under a new id.

The cache outlives sync groups. When receivers come and go, the caller gives a new route (sync group and
colocated receivers), and cached versions can still be re-sent on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from ckpt_engine.device import DeviceInfo, DigestAlgo, comm_empty
from ckpt_engine.errors import (
    CacheError,
    CkptEngineError,
    ConfigError,
    ReceiversAbsent,
    TrainerGroupError,
    absent_receivers,
)
from ckpt_engine.plan.changes import ChangeTracker
from ckpt_engine.plan.hashing import warm_up
from ckpt_engine.plan.layout import DEFAULT_ALIGNMENT, Bucket, Layout, plan_layout
from ckpt_engine.plan.modes import Mode, check_mode, check_sparse, overlaps_snapshot
from ckpt_engine.plan.owners import Owners, Share, owners_by_group, plan_owners, share_of, single_owner
from ckpt_engine.plan.pull_reads import whole_spans
from ckpt_engine.plan.sparse import Manifest
from ckpt_engine.plan.tensors import NamedTensors, specs_of
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.class_senders import ClassSenders, Lane
from ckpt_engine.send.own_digests import OwnDigests
from ckpt_engine.send.sender import Sender, Transfer, TransferResult, WireHook
from ckpt_engine.send.transfer import KeepFor, Kept
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.same_host import IpcHub

log = logging.getLogger(__name__)
MAX_VERSION = (1 << 53) - 1  # ids travel as JSON numbers and int64 frames: both hold them exactly
# How long a send waits for what is done before it (publish's before_send: an offer to pullers, whose first one
# registers the cache's memory with NIXL, a second or two); past it the send goes on beside it
BEFORE_SEND_WAIT_S = 10.0

# All-reduce (MAX) of this rank's change-agreement vector with the other trainer ranks', for sparse versions.
# A single process passes None: its own vector is the answer.
Agree = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class Route:
    """Where a version goes. ``group``: this rank's sync group with the receivers, None when there are only
    colocated receivers. ``ipc_peers``: the colocated receivers (agent id -> rank). ``owners_group``: when
    several trainer ranks own shares of the version, the group of those ranks; this rank's rank in it is its
    rank among the owners."""

    group: SyncGroup | None
    ipc_peers: Mapping[str, int]
    owners_group: SyncGroup | None = None
    # A sharded version sends each class of receivers on its own group (send/class_senders.py); ``group`` is None.
    lanes: tuple[Lane, ...] = ()


@dataclass(frozen=True)
class Ownership:
    """This trainer rank's place among the ranks that own shares of a version. ``global_rank(owner)``: the
    global rank of the process that gathers an owner's buckets, for sharded models."""

    rank: int = 0
    ranks: int = 1
    global_rank: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.rank < 0:  # a rank at or beyond ``ranks`` only takes part in the gathers
            raise ConfigError(f"ownership: rank {self.rank} of {self.ranks} owner ranks (need ranks >= 1, rank >= 0)")

    def of(self, layout: Layout) -> Owners:
        return plan_owners(layout, self.ranks)


class Publisher:
    def __init__(
        self,
        group: SyncGroup | None = None,
        *,
        device: DeviceInfo | None = None,
        bucket_size: int,
        alignment: int = DEFAULT_ALIGNMENT,
        keep_versions: int = 2,
        digest_algo: DigestAlgo | None = None,
        ack_timeout_s: float | None = None,
        wire_hook: WireHook | None = None,
        on_stage: Callable[[int, str], None] | None = None,
        ipc_hub_name: str | None = None,
        timeout_s: float = 60.0,
        overlap_snapshot: bool | None = None,
        external_trim: bool = False,
    ) -> None:
        """``ipc_hub_name``: serve colocated receivers through shared memory under this name (same_host.py).
        ``overlap_snapshot``: when a cached version's send starts. True: while its snapshot runs, each bucket
        as soon as it is cached, where plan/modes.py's overlaps_snapshot allows it. False: after the whole
        snapshot. None: overlap where the snapshot is a device→host copy (GPU/NPU trainers).
        ``external_trim``: the daemon evicts versions from the cache as they end (cache.py ``VersionCache``)."""
        if bucket_size <= 0:
            raise ConfigError(f"bucket_size must be positive, got {bucket_size}")
        if group is None and device is None:
            raise ConfigError("a Publisher needs a sync group or, until one is attached, a device")
        self.bucket_size = bucket_size
        self.alignment = alignment
        self.overlap_snapshot = overlap_snapshot
        self.device: DeviceInfo = group.device if group is not None else device  # type: ignore[assignment]
        # With colocated receivers the cache lives in shareable memory: cached versions reach them zero-copy.
        self.cache = VersionCache(self.device, keep_versions, shareable=ipc_hub_name is not None,
                                  external_trim=external_trim)
        self.hub = IpcHub(ipc_hub_name, self.device) if ipc_hub_name else None
        self.manifests: dict[int, Manifest] = {}  # per-tensor digests of recent versions: sparse bases
        self.own_digests = OwnDigests()  # what its sends digested of each version, for its pullers
        self._sender_options = dict(digest_algo=digest_algo, ack_timeout_s=ack_timeout_s, wire_hook=wire_hook,
                                    on_stage=on_stage, timeout_s=timeout_s, manifests=self.manifests,
                                    digested=self.own_digests.computed)
        self.sender: Sender | None = None
        self.classes = ClassSenders(self.device, bucket_size=bucket_size, alignment=alignment,
                                    options=self._sender_options, hub=self.hub)
        self._layout: Layout | None = None
        self._layout_key: list[tuple] = []
        self._pull_slots: torch.Tensor | None = None  # see _keep_for_pulls
        self._kept: CachedVersion | None = None
        self._changes = ChangeTracker(self.device.digest_algo, bucket_size, alignment)
        warm_up(self.device.comm_device)  # compile the device digest before the first version needs it
        if group is not None:
            self.attach(group)

    # ---- the one entry -------------------------------------------------------------------------------
    def publish(self, version: int, named: NamedTensors | Mapping[str, torch.Tensor] | None = None, *,
                mode: Mode = "cached",
                step: int | None = None, sparse: bool = False, sparse_base: int | None = None,
                source_version: int | None = None, agree: Agree | None = None,
                route: Callable[[], Route] | None = None, ownership: Ownership | None = None,
                expected_digest: str | None = None, keep: Iterable[int] | None = None,
                sharded: bool = False, pulled: bool = False,
                before_send: Callable[[], None] | None = None) -> Transfer:
        """Start sending ``version``. The returned transfer's ``params_released`` says when the tensors are no
        longer read, so the training loop may go on; its ``result()`` says how the send ended.

        - ``source_version``: send that cached version again as ``version`` (rollback, catch-up, repair). This
          rank's cached bytes are first checked against what was sent the first time and, when given, against
          ``expected_digest``, the digest the daemon recorded. A copy that changed is refused before anything
          goes out, and dropped from the cache.
        - ``keep``: versions the cache must not evict to make room, because receivers may need them for a repair.
        - ``mode="cached"``: snapshot ``named`` into the cache, then send from it in the background. With
          ``sparse``, only tensors changed since the previous cached version are gathered and stored; ``agree``
          makes every trainer rank take the same decision. With ``sparse_base``, only tensors changed since that
          version, which every receiver holds, are sent.
        - ``mode="bypass_cpu"``: send straight from ``named``, which is read until ``params_released``.
        - ``pulled``: receivers pull the version (transport nixl): what its send digests of this rank's pieces
          is kept for its offer (``own_digests``). Under bypass_cpu, each bucket this rank sends is then also
          kept in its device send slots (one buffer, reused) until the next version: ``kept``.
        - ``before_send``: a new cached version's, called once it is cached and waited for before its send starts,
          up to ``BEFORE_SEND_WAIT_S`` (where the send starts while the snapshot fills the cache: once the snapshot
          is done, beside the send, also if it failed part way: then it finds the version not cached); what it
          raises is logged. E.g. offering the version to its pullers: an offer made
          beside the send waits for the CPU behind the send's cutting and digesting, and the pullers with it.
        - ``sharded``: the route sends each class of receivers only its pieces (``Route.lanes``). They are cut
          from the cached version once the snapshot completes, or under bypass_cpu from this rank's buckets as
          they are gathered (send/fanout.py). With ``sparse_base``, each class gets the pieces that changed
          since that version, by its own digests of it.

        Cached versions return after the snapshot, bypass_cpu ones once every bucket has been read; the rest of
        the send goes on in the background. ``route()`` says where to send. It is called where the send starts:
        on the caller's thread for bypass_cpu, on the background thread otherwise. Without it, the attached
        group and receivers are used.
        ``ownership``: with several trainer ranks, each calling publish for the same versions in order, which
        buckets this rank stores and sends (plan/owners.py). A rank beyond ``ownership.ranks`` stores and sends
        nothing; it only takes part in the gathers. Whatever fails, the gathers of every bucket are done, so the
        other trainer ranks never wait in one."""
        check_version(version)
        check_sparse(check_mode(mode), sparse or sparse_base is not None)
        if before_send is not None and (mode != "cached" or source_version is not None):
            raise ConfigError(f"version {version}: only a new cached version is sent after a before_send call, "
                              f"not a {'re-push' if source_version is not None else mode + ' one'}")
        if pulled:
            self.own_digests.expect(version)
        mine = ownership or Ownership()
        if keep is not None:
            self.cache.pin(keep)
        if source_version is not None:
            if mode != "cached":
                raise ConfigError(f"version {version}: a re-push (source_version) is sent from the cache, so its "
                                  f"mode is cached, not {mode}")
            transfer = Transfer(version, "cached")
            transfer.params_released.set()
            return self._in_background(transfer, lambda: self._send_cached(
                route, source_version, as_version=version, expected_digest=expected_digest))
        named = _named(version, named)
        layout = self.layout_for(named)
        owners = mine.of(layout)
        sender = mine.rank < mine.ranks  # a rank beyond the owners only takes part in the gathers
        delta = self._delta(version, named, layout, owners, agree, sender) if sparse else None
        stored, stored_owners = layout, owners  # what the ranks gather and store: all of it, or what changed
        if delta is not None:
            stored = delta[1]
            stored_owners = owners_by_group(stored, owners.ranks) if owners.ranks > 1 else single_owner(stored)
        routed: Callable[[], Route | None] | None = route  # other modes ask for it on the send's thread
        if mode == "bypass_cpu":  # every rank finds (or fails) its route before any gather: see _bypass_route
            routed = _bypass_route(version, route if sender else None, agree)
        cursor = GatherCursor(named, stored, stored_owners, mine.global_rank)
        try:
            if not sender:
                return self._gather_only(version, mode, cursor)
            share = share_of(stored, stored_owners, mine.rank)
            if mode == "bypass_cpu" and sharded:  # each class cut from this rank's buckets as they are gathered
                self._sending_sharded()
                return self.classes.send_live(version, layout, owners, mine.rank,
                                              lambda index: cursor.through(index, mine.rank), _lanes(version, routed),
                                              aliases=named.aliases, step=step)
            if mode == "bypass_cpu":  # returns once every bucket of this rank has been read from the live tensors
                kept = self._keep_for_pulls(version, share, layout, owners, named.aliases, step) if pulled else None
                live = self._sender(routed).send_live(version, layout, cursor.provider(mine.rank),
                                                      aliases=named.aliases, step=step, check=False, owners=owners,
                                                      keep=kept)
                live.params_released.wait()
                live.gathered_bytes = cursor.gathered_bytes
                return live
            if not sharded and overlaps_snapshot(mode, delta=delta is not None, sparse_base=sparse_base is not None,
                                 owner_ranks=owners.ranks, gathers=named.gathers,
                                 host_wire=self.device.comm_device.type == "cpu",
                                 device_copy=self.device.kind != "cpu", wanted=self.overlap_snapshot):
                return self._send_while_snapshotting(version, named, cursor, share, step, layout, owners, routed,
                                                     before_send)
            self._snapshot(version, named, cursor, share, delta, step, layout, owners)
        finally:
            cursor.drain()  # the other ranks wait in the remaining gathers, also after a failure part way
        transfer = Transfer(version, "cached")
        transfer.params_released.set()
        transfer.gathered_bytes = cursor.gathered_bytes
        if sparse_base is not None and not sharded:
            def send() -> Transfer:
                _call(before_send, version)
                return self._sender(routed).send_sparse(self.cache, version, sparse_base, inline=True,
                                                        bucket_size=self.bucket_size, alignment=self.alignment)
        else:
            def send() -> Transfer:
                _call(before_send, version)
                return self._send_cached(routed, version, sparse_base=sparse_base)
        return self._in_background(transfer, send)

    def kept(self, version: int) -> CachedVersion:
        """This rank's share of bypass_cpu ``version`` as its send kept it for pullers (see ``publish``)."""
        kept = self._kept
        if kept is None or kept.version != version:
            raise CacheError(f"version {version} was not kept for pulling (bypass_cpu keeps the latest one only)")
        return kept

    def _keep_for_pulls(self, version: int, share: Share, layout: Layout, owners: Owners,
                        aliases: Mapping[str, str], step: int | None) -> KeepFor:
        """What a pulled bypass_cpu version's send keeps: every bucket of this rank's share, in device send slots
        (one buffer, reused from version to version, so registered once; the version before it forgotten)."""
        need = max(share.layout.total_bytes, 1)
        if self._pull_slots is None or self._pull_slots.numel() < need:
            self._pull_slots = comm_empty(need, self.device)
        slots = self._pull_slots
        self._kept = CachedVersion(version, share.layout, step, dict(aliases), time.time(), 0.0, slots,
                                   version_layout=layout, owners=owners, wire=share.wire)
        return lambda sent, sent_owners: Kept(slots, whole_spans(sent, sent_owners))

    def abort_before_start(self, version: int, reason: str, route: Callable[[], Route] | None = None) -> None:
        """Tell receivers waiting for ``version`` that it will not come (e.g. its snapshot failed)."""
        where = route() if route is not None else None
        if where is not None and where.lanes:
            for lane in where.lanes:
                self.classes.abort(lane, version, reason)
            return
        if where is not None and where.group is None and not where.ipc_peers:
            return  # no group formed for it, so nobody is waiting on one
        self._sender(lambda: where).abort_before_start(version, reason)

    def attach(self, group: SyncGroup | None, ipc_peers: Mapping[str, int] | None = None,
               owners_group: SyncGroup | None = None) -> None:
        """From now on, send on ``group`` and to the colocated ``ipc_peers`` (agent id -> rank), with the other
        owners in ``owners_group``. The caller closes the previous groups. Attaching the same again keeps the
        sender, and with it what it knows its receivers hold, such as the layout."""
        peers = dict(ipc_peers or {})
        current = self.sender
        if (current is not None and current.group is group and current.ipc_peers == peers
                and current.owners_group is owners_group):
            return
        self.sender = Sender(group, device=self.device, hub=self.hub, ipc_peers=peers, owners_group=owners_group,
                             **self._sender_options)  # type: ignore[arg-type]

    def layout_for(self, named: NamedTensors) -> Layout:
        """The layout of these tensors; re-planned only when names, dtypes or shapes changed. Either way the
        tensors match the returned layout, so the cache and sender need not check them again."""
        key = named.layout_key()  # cheap: no dtype-name lookups or spec objects
        if self._layout is None or key != self._layout_key:
            self._layout = plan_layout(specs_of(named.tensors), self.bucket_size, self.alignment)
            self._layout_key = key
            log.info("planned layout %s: %d tensors in %d buckets, %d bytes", self._layout.digest,
                     self._layout.num_tensors, len(self._layout.buckets), self._layout.total_bytes)
        return self._layout

    def forget(self) -> None:
        """Drop every cached version and what is known of sent ones (their ids belong to another history)."""
        for version in self.cache.versions():
            self.cache.evict(version)
        self.manifests.clear()
        self.own_digests.clear()

    def close(self) -> None:
        self.classes.close()
        if self.sender is not None:
            self.sender.close()
        if self.hub is not None:
            self.hub.close()

    # ---- internals -----------------------------------------------------------------------------------
    def _delta(self, version: int, named: NamedTensors, layout: Layout, owners: Owners, agree: Agree | None,
               stores: bool) -> tuple[int, Layout] | None:
        """(parent version, layout of the tensors changed since it) as every trainer rank agrees, or None for
        a full snapshot. Every rank that stores must still hold the parent, to share the unchanged rest with
        it. With several owners, a bucket of the changes holds tensors of one owner only."""
        can_share = (lambda parent: self._holds_share_of(parent, layout, owners)) if stores else (lambda parent: True)
        vector = self._changes.vector(version, named, layout, can_share)
        return self._changes.delta(agree(vector) if agree is not None else vector, layout, owners)

    def _holds_share_of(self, parent: int, layout: Layout, owners: Owners) -> bool:
        """Whether the cache holds ``parent`` as the share this rank stores of a version of ``layout`` and
        ``owners``, so that a delta can share its unchanged tensors. A parent cached under another owner count
        (planned while a rank was silent) holds other tensors, and a full snapshot is taken instead."""
        try:
            cached = self.cache.get(parent)
        except CacheError:
            return False
        return cached.owners == owners and cached.version_layout.digest == layout.digest  # type: ignore[union-attr]

    def _snapshot(self, version: int, named: NamedTensors, cursor: GatherCursor, share: Share,
                  delta: tuple[int, Layout] | None, step: int | None, layout: Layout, owners: Owners) -> None:
        provide = cursor.provider(share.rank, share)
        if delta is not None:  # only what changed is gathered and stored: the rest is shared in the cache
            self.cache.snapshot_delta(version, delta[0], share.layout, provide, aliases=named.aliases, step=step)
        else:
            self.cache.snapshot(version, share.layout, provide, aliases=named.aliases, step=step, check=False,
                                share=share, owners=owners, version_layout=layout)

    def _send_while_snapshotting(self, version: int, named: NamedTensors, cursor: GatherCursor, share: Share,
                                 step: int | None, layout: Layout, owners: Owners,
                                 route: Callable[[], Route | None] | None,
                                 before_send: Callable[[], None] | None) -> Transfer:
        """Snapshot ``version`` into the cache on this thread while its send, started first, sends each bucket
        as soon as it is cached. Returns once the snapshot is done. A snapshot that fails part way fails the
        transfer, and the receivers are told at the first bucket it did not fill. Only a failure of the
        trainer's own group is raised, so that the training loop ends."""
        cached = self.cache.begin(version, share.layout, aliases=named.aliases, step=step, share=share,
                                  owners=owners, version_layout=layout)
        transfer = Transfer(version, "cached")

        def send() -> Transfer:
            try:  # the send owns the begin lease, so the buffer stays until the send is over
                return self._sender(route).send_cached(self.cache, version, inline=True, filling=cached)
            finally:
                self.cache.unlease(cached)

        self._in_background(transfer, send)
        # Lend tensors held whole (no gathers) to the send while the snapshot holds the loop, so it fills device
        # slots from them instead of waiting for each bucket's device→host copy (send/filling.py LiveReads).
        live = named.tensors if type(named).bucket_tensors is NamedTensors.bucket_tensors else None
        try:
            self.cache.fill(cached, cursor.provider(share.rank, share), live=live)
        except TrainerGroupError:
            raise
        except Exception as exc:  # noqa: BLE001 - logged: the version's send stops there, the training loop goes on
            log.error("version %d: the snapshot failed part way (%s: %s); its send stops there", version,
                      type(exc).__name__, exc)
        finally:
            transfer.params_released.set()
        if before_send is not None:  # (the send runs already: nothing waits for it)
            _started(before_send, version)
        transfer.gathered_bytes = cursor.gathered_bytes
        return transfer

    def _gather_only(self, version: int, mode: Mode, cursor: GatherCursor) -> Transfer:
        """The finished transfer of a rank that owns no bucket. Its part is the gathers, which ``cursor.drain``
        does in the caller's finally."""
        transfer = Transfer(version, mode)
        transfer._finish(TransferResult(version, mode, True, "this rank sends no bucket of it", None, [], 0, 0, 0,
                                        finished_at=time.perf_counter()))
        return transfer

    def _send_cached(self, route: Callable[[], Route | None] | None, version: int, *, as_version: int | None = None,
                     expected_digest: str | None = None, sparse_base: int | None = None) -> Transfer:
        """Send a cached version, or re-send one, to the route's receivers. A route with classes gets each
        class its pieces (with ``sparse_base``, those changed since); otherwise the whole version goes on the
        route's group and to its colocated receivers."""
        where = route() if route is not None else None
        if where is not None and where.lanes:
            self._sending_sharded()
            return self.classes.send(self.cache, version, where.lanes, as_version=as_version,
                                     expected_digest=expected_digest, sparse_base=sparse_base)
        return self._sender(lambda: where).send_cached(
            self.cache, version, as_version=as_version, expected_digest=expected_digest, inline=True)

    def _sender(self, route: Callable[[], Route | None] | None) -> Sender:
        where = route() if route is not None else None
        if where is not None:
            if where.lanes:
                raise ConfigError("a sharded version is sent from the cache, class by class")
            self.attach(where.group, where.ipc_peers, where.owners_group)
        if self.sender is None:
            raise CkptEngineError("no sync group attached to this publisher yet")
        self.classes.forget_layouts()  # see _sending_sharded
        return self.sender

    def _sending_sharded(self) -> None:
        """Make the plain sender forget the layouts its receivers hold. A receiver holds the layout it was sent
        last, by whichever sender. One without a shard spec is on the plain sender's route for plain versions and
        in the class of whole tensors for sharded ones. So a version of one kind makes the other kind's senders
        forget what their receivers hold."""
        if self.sender is not None:
            self.sender.forget_layouts()

    @staticmethod
    def _in_background(transfer: Transfer, send: Callable[[], Transfer]) -> Transfer:
        """Run ``send()`` on this version's one thread; its transfer's outcome becomes ``transfer``'s. ``send``
        may first wait for its route (e.g. a rendezvous), then sends inline."""

        def run() -> None:
            try:
                result = send().result()
            except Exception as exc:  # the route or the start of the send failed: the version ends with why
                log.exception("version %d could not be sent", transfer.version)
                result = TransferResult(transfer.version, transfer.mode, False, f"{type(exc).__name__}: {exc}", None,
                                        [], 0, 0, 0, finished_at=time.perf_counter(),
                                        absent_ranks=absent_receivers(exc),
                                        rendezvous_failed=isinstance(exc, ReceiversAbsent))
            transfer._finish(result)

        threading.Thread(target=run, name=f"ckpt-send-v{transfer.version}", daemon=True).start()
        return transfer


def _call(before_send: Callable[[], None] | None, version: int) -> None:
    """Run ``before_send`` and wait for it up to ``BEFORE_SEND_WAIT_S``: one that stalls (e.g. a NIXL
    registration that hangs) does not hold the send, nor a pushed receiver of the same version."""
    if before_send is None:
        return
    thread = _started(before_send, version)
    thread.join(BEFORE_SEND_WAIT_S)
    if thread.is_alive():
        log.warning("version %d: what was to be done before its send still runs after %.0f s; the send goes on",
                    version, BEFORE_SEND_WAIT_S)


def _started(before_send: Callable[[], None], version: int) -> threading.Thread:
    """``before_send`` running on a thread of its own; what it raises is logged."""
    def run() -> None:
        try:
            before_send()
        except Exception:  # (the send goes on: what it was for is the caller's to say)
            log.exception("version %d: what was to be done before its send failed", version)

    thread = threading.Thread(target=run, name=f"ckpt-before-send-v{version}", daemon=True)
    thread.start()
    return thread


class GatherCursor:
    """Hands out full tensors bucket by bucket, each gathered to the bucket's owner, and remembers how far it
    got. Every trainer rank takes part in every bucket's gather in layout order, however many it owns. After a
    failure it can still join the gathers the other ranks are waiting in, but not after a gather itself failed:
    the ranks are then out of step in their group, and a further gather would pair this rank's collectives with
    the wrong ones of the others."""

    def __init__(self, named: NamedTensors, layout: Layout, owners: Owners,
                 global_rank: Callable[[int], int] | None = None) -> None:
        self.named, self.layout, self.owners = named, layout, owners
        self._global_rank = global_rank
        self._next = 0
        self._lock = threading.Lock()
        self.gathered_bytes = 0  # bytes of full tensors this rank assembled (its buckets)
        self._broken: TrainerGroupError | None = None

    def provider(self, rank: int, share: Share | None = None) -> Callable[[Bucket], Mapping[str, torch.Tensor]]:
        """The tensors of each bucket ``rank`` owns, asked for in order: by the layout's buckets, or by the
        buckets of ``share`` (this rank's share of the layout)."""
        def provide(bucket: Bucket) -> Mapping[str, torch.Tensor]:
            index = share.wire[bucket.index] if share is not None else bucket.index
            return self.through(index, rank)
        return provide

    def through(self, index: int, rank: int) -> Mapping[str, torch.Tensor]:
        """Take part in every gather up to bucket ``index`` (which ``rank`` owns) and return its tensors."""
        with self._lock:
            if index < self._next:
                raise CkptEngineError(f"bucket {index} requested out of order (next is {self._next})")
            if self.owners.of[index] != rank:
                raise CkptEngineError(f"bucket {index} belongs to owner {self.owners.of[index]}, not {rank}")
            while self._next < index:
                self._gather(self._next)
            tensors = self._gather(index)
            self.gathered_bytes += self.layout.buckets[index].nbytes
            return tensors

    def drain(self) -> None:
        """Take part in the remaining gathers. After a failed gather, raise that failure for the caller to end
        the training loop with; the gather may have failed on another thread, since a bypass_cpu send reads
        through this cursor."""
        with self._lock:
            while self._next < len(self.layout.buckets) and self._broken is None:
                self._gather(self._next)
            if self._broken is not None:
                raise self._broken

    def _gather(self, index: int) -> Mapping[str, torch.Tensor]:
        if self._broken is not None:
            raise self._broken
        bucket = self.layout.buckets[index]
        owner = self.owners.of[index]
        self._next = index + 1
        to = self._global_rank(owner) if self._global_rank is not None else None
        try:
            return self.named.bucket_tensors(bucket, to)
        except TrainerGroupError as exc:
            self._broken = exc
            raise


def _bypass_route(version: int, route: Callable[[], Route] | None, agree: Agree | None) -> Callable[[], Route | None]:
    """Find a bypass_cpu version's route before any gather, since bypass_cpu reads the live tensors as it sends
    them. The route is a rendezvous with the receivers, up to its timeout. Several trainer ranks then agree
    whether every one found its own; if one did not, none sends and none gathers. Otherwise a rank still in, or
    failed at, its rendezvous would leave the others in a gather past the job's collective timeout, which ends
    training."""
    where: Route | None = None
    failure: Exception | None = None
    if route is not None:
        try:
            where = route()
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            failure = exc
    if agree is not None and agree([int(failure is not None)])[0] and failure is None:
        failure = CkptEngineError(f"version {version}: another trainer rank could not reach its receivers "
                                  "(see its log); no rank sends this version")
    if failure is not None:
        raise failure
    return lambda: where


def _lanes(version: int, route: Callable[[], Route | None] | None) -> tuple[Lane, ...]:
    """A sharded version's classes, from its route. Under bypass_cpu the route is asked on the caller's thread."""
    where = route() if route is not None else None
    if where is None or not where.lanes:
        raise ConfigError(f"version {version} is sharded but its route has no classes of receivers")
    return where.lanes


def check_version(version: object) -> int:
    """A version id is an int within the wire's range (the daemon issues 1, 2, ...)."""
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise ConfigError(f"a version id is an int within 0..{MAX_VERSION}, got {version!r}")
    return version


def _named(version: int, named: NamedTensors | Mapping[str, torch.Tensor] | None) -> NamedTensors:
    """What publish sends, as NamedTensors. Takes NamedTensors (named_tensors_of(model)) or a plain name ->
    tensor mapping such as a state_dict. Raises ConfigError for anything else or for no tensors."""
    if named is None:
        raise ConfigError(f"version {version}: publish needs the tensors (or a source_version to re-send)")
    if not isinstance(named, NamedTensors):
        if not isinstance(named, Mapping) or not all(isinstance(t, torch.Tensor) for t in named.values()):
            raise ConfigError(f"version {version}: publish takes named_tensors_of(model) or a mapping of names to "
                              f"tensors, got {type(named).__name__}")
        named = NamedTensors(dict(named))
    if not named.tensors:
        raise ConfigError(f"version {version}: there are no tensors to send")
    return named


def version_digest_of(named: NamedTensors, *, bucket_size: int, alignment: int = DEFAULT_ALIGNMENT,
                      algo: DigestAlgo = "xxh3-64") -> str:
    """The version digest these tensors would be sent with. Any process can check with it that the weights it
    holds are exactly a version's (e.g. a rollout's model against the history's digest)."""
    from ckpt_engine.plan.hashing import layout_digests, version_digest
    from ckpt_engine.plan.tensors import fill_bucket

    layout = plan_layout(specs_of(named.tensors), bucket_size, alignment)
    scratch = torch.empty(max(layout.max_bucket_bytes, 1), dtype=torch.uint8)

    def read(bucket) -> torch.Tensor:
        fill_bucket(scratch, bucket.slots, {k: v.detach().cpu() for k, v in named.bucket_tensors(bucket).items()},
                    bucket.nbytes)
        return scratch

    return version_digest(algo, layout.digest, layout_digests(layout, read, algo))
