"""Sending a sharded version: each class of receivers (plan/shards.py) gets only its pieces, on a sync group of
its own. The pieces are cut from the version as the cache holds it or, with bypass_cpu, from each owner's
buckets as they are gathered (send/fanout.py). Either way an FSDP model is gathered once, whatever the classes.

With several trainer ranks owning shares of the version (plan/owners.py), every owner sends each class the
pieces of the tensors it owns, on its own group with the class's receivers. Each bucket of a class's layout
holds pieces of one bucket of the version, so of one owner's tensors. The owners of each class vote and merge
their digests on the class's owners' group, as for any version of several owners.

The version keeps one identity: the per-tensor digests of its full tensors. It is computed on the first send,
from the cache or, with bypass_cpu, from the gathered buckets; each owner hashes its share, merged on the
owners' group. Every re-send is checked against it, as for any cached version. Each class's stream carries its
own digests, which its receivers verify before anything is applied and which the daemon compares with theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ckpt_engine.device import DeviceInfo, mark, wait_for
from ckpt_engine.errors import CkptEngineError, ConfigError, ProtocolError, ReceiversAbsent
from ckpt_engine.plan.hashing import bucket_digests, tensor_digests
from ckpt_engine.plan.layout import Bucket, Layout, TensorSpec, plan_layout
from ckpt_engine.plan.modes import Mode
from ckpt_engine.plan.owners import Owners, share_of, single_owner
from ckpt_engine.plan.shards import (
    PIECE_MARK,
    Piece,
    ShardSpec,
    check_spec,
    class_aliases,
    cut_view,
    pieces_of,
    resolve_aliases,
    spec_key,
)
from ckpt_engine.plan.sparse import Manifest, manifest_of
from ckpt_engine.plan.tensors import fill_bucket
from ckpt_engine.ranks import GroupRank, QuorumRank
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.fanout import Assembler, GatheredWindow, Tensors, ready_at
from ckpt_engine.send.kept_pieces import KeptPieces
from ckpt_engine.send.owners_vote import OwnersVote
from ckpt_engine.send.sender import Sender, Transfer, TransferResult
from ckpt_engine.send.sources import PiecesChangesSource, StaleCopy, cached_digests, check_identity, evict_quietly
from ckpt_engine.send.transfer import WirePlan
from ckpt_engine.transport.group import SyncGroup, absent_of
from ckpt_engine.transport.same_host import IpcHub

Gather = Callable[[int], Tensors]  # gathers this owner's bucket of the version's layout; called in layout order

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lane:
    """One class of a sharded version. ``key``: the class. ``spec``: what its receivers keep. ``group``: this
    owner's sync group with them, where the owner is rank 0; None when all of them are colocated, or when the
    group did not form (``unreachable`` says why). ``ranks``: its receivers' ranks in the version's quorum;
    group rank k is ``ranks[k - 1]``. ``owners_group``: with several owners, the class's owners' group.
    ``ipc_peers``: its colocated receivers (agent id -> quorum rank), which read its pieces from shared slots
    of the class's own. ``pulls``: it has receivers that pull its pieces (then it may have no group at all: its
    send only digests them, for the offer)."""

    key: str
    spec: ShardSpec
    group: SyncGroup | None
    ranks: tuple[QuorumRank, ...]
    owners_group: SyncGroup | None = None
    ipc_peers: Mapping[str, int] = field(default_factory=dict)
    unreachable: Exception | None = None
    pulls: bool = False  # some of its receivers pull its pieces over nixl (once its digests are known)

    def quorum_rank(self, rank: GroupRank) -> QuorumRank:
        """The quorum rank of the class group's member ``rank``; rank k >= 1 is the class's k-th receiver."""
        if not 1 <= rank <= len(self.ranks):
            raise ProtocolError(f"class {self.key[:12]} has no receiver at group rank {rank}")
        return self.ranks[rank - 1]

    def absent(self) -> list[QuorumRank]:
        """The receivers that never joined the class's group. A failed owners' group names none."""
        named = absent_of(self.unreachable) if self.unreachable is not None else ()
        return [self.quorum_rank(rank) for rank in named if 1 <= rank <= len(self.ranks)]


class SpecUnfit(ConfigError):
    """A class's shard spec does not fit the version: a tensor it names is not there, a slice is out of range,
    or a tied name asks for other slices than its tensor. Its receivers must fix it; the other classes go on."""


class ClassSenders:
    """One sender per class group, kept while the group lives because it knows what its receivers hold."""

    def __init__(self, device: DeviceInfo, *, bucket_size: int, alignment: int, options: Mapping,
                 hub: IpcHub | None = None) -> None:
        """``hub``: the publisher's hub, where colocated receivers of a class connect."""
        self.device, self.bucket_size, self.alignment, self.hub = device, bucket_size, alignment, hub
        # A class's per-piece digests are not the version's, so each class keeps its own (below).
        self._options = {k: v for k, v in options.items() if k != "manifests"}
        self._senders: dict[str, Sender] = {}  # by class key
        self._plans: dict[tuple, _ClassPlan] = {}
        # Per class key, its pieces' digests of recently sent versions: the bases of its sparse versions.
        # They outlive the class's sync groups, because a receiver joining regroups every class.
        self._manifests: dict[str, dict[int, Manifest]] = {}
        self._identities: dict[int, Manifest] = {}  # the identities of recent versions, by version
        self._pullable: dict[str, PulledClass] = {}  # by class key: its latest send, for pullers (the lead's)
        self.kept = KeptPieces(device)  # the column pieces of pulled classes, for their pullers

    def send(self, cache: VersionCache, version: int, lanes: Sequence[Lane], *, as_version: int | None = None,
             expected_digest: str | None = None, sparse_base: int | None = None) -> Transfer:
        """Send this rank's share of cached ``version`` to every class at once. Returns when every class has
        ended. A re-send is labelled ``as_version`` and first checked against the version's identity.
        ``sparse_base``: a version every receiver holds. Each class then gets only its pieces that changed
        since, or all of them when the class's digests of that version are not known here."""
        label = version if as_version is None else as_version
        self._forget_senders(lanes)
        self._pullable.clear()
        transfer = Transfer(label, "cached")
        transfer.params_released.set()
        with cache.lease(version) as cached:
            transfer._finish(self._send_leased(cache, cached, label, lanes, expected_digest,
                                               sparse_base if as_version is None else None))
        return transfer

    def pulled(self, label: int) -> dict[str, PulledClass]:
        """The classes of version ``label`` that its pullers may now read, by class key: each with what its send
        put on the wire (on the lead owner; another owner has none)."""
        return {key: pulled for key, pulled in self._pullable.items() if pulled.version == label}

    def wire_plans(self, cached: CachedVersion, specs: Mapping[str, ShardSpec]) -> dict[str, WirePlan]:
        """What the send of cached ``cached`` will put on each class's wire (by class key, from its spec), before
        it starts: a sharded version is offered to its pullers while its pieces are still being digested."""
        plans = {}
        for key, spec in specs.items():
            plan = self._plan_of(spec, cached.version_layout, cached.owners, cached.aliases)  # type: ignore[arg-type]
            plans[key] = WirePlan(plan.layout, plan.owners or single_owner(plan.layout), dict(plan.aliases),
                                  cached.step, {})
        return plans

    def send_live(self, version: int, layout: Layout, owners: Owners, rank: int, gather: Gather,
                  lanes: Sequence[Lane], *, aliases: Mapping[str, str], step: int | None) -> Transfer:
        """bypass_cpu: gather this owner's buckets of ``layout`` once (``gather``, in layout order), and send
        every class its pieces cut from them while they are held (send/fanout.py). Returns once every class has
        read them; ``params_released`` then lets the trainer change its tensors. The sends end in the background.
        The version's identity is hashed from the gathered tensors, as a cached copy of them would give it."""
        started = time.perf_counter()
        self._forget_senders(lanes)
        transfer = Transfer(version, "bypass_cpu")
        plans: dict[str, _ClassPlan | ConfigError] = {}
        for lane in lanes:
            try:
                plans[lane.key] = self._plan_of(lane.spec, layout, owners, aliases)
            except ConfigError as exc:  # raised again on the class's thread, so only its receivers fail
                plans[lane.key] = exc
        needs = {key: plan.sources_of(rank) if isinstance(plan, _ClassPlan) else set() for key, plan in plans.items()}
        window = GatheredWindow(needs, WINDOW_DEPTH, float(self._options.get("timeout_s") or 60.0))
        results: dict[str, TransferResult] = {}
        threads = [self._start_thread(
            f"ckpt-send-v{version}-{lane.key[:8]}", self._send_class, lane, version, results,
            lambda lane=lane: self._start_live(lane, plans[lane.key], window, version, step),
            lambda lane=lane: window.done(lane.key)) for lane in lanes]
        digests: list[int] | None = None
        try:
            digests = self._gather_into(window, gather, layout, owners, rank)
            window.wait_empty()
        except Exception as exc:  # noqa: BLE001 - a failed gather of the job's group is raised by the caller's cursor
            log.error("version %d: gathering this owner's buckets failed: %s: %s", version, type(exc).__name__, exc)
            window.fail(f"version {version}: the trainer rank's gather failed: {type(exc).__name__}: {exc}")
        transfer.params_released.set()
        self._start_thread(f"ckpt-send-v{version}-end", self._finish_live, transfer, threads, results, lanes,
                           layout, owners, digests, started)
        return transfer

    def abort(self, lane: Lane, label: int, reason: str) -> None:
        """Tell a class's receivers that the version will not come. With several owners, every owner calls this:
        they vote, and the lead tells the receivers. A class whose group did not form has no receiver to tell;
        only its other owners hear it, in the votes they wait in."""
        try:
            if lane.group is None and not lane.ipc_peers:
                OwnersVote(lane.owners_group, _nobody).stand_down(label, reason)
                return
            self._sender(lane).abort_before_start(label, reason)
        except CkptEngineError as exc:  # its receivers then fall back on their own timeout
            log.warning("version %d: could not tell class %s it will not come: %s", label, lane.key, exc)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()

    # ---- internals -----------------------------------------------------------------------------------
    def forget_layouts(self) -> None:
        """Called when a plain version went out, since a receiver of a class may have been sent its layout."""
        for sender in self._senders.values():
            sender.forget_layouts()

    def _forget_senders(self, lanes: Sequence[Lane]) -> None:
        """Drop the senders of classes no longer sent, or of an earlier generation whose groups were closed with
        it, and the hub's slots of classes gone."""
        current = {lane.key: lane for lane in lanes}
        self.kept.keep_only({lane.key for lane in lanes if lane.pulls})
        for key in [k for k, sender in self._senders.items() if not _serves(sender, current.get(k))]:
            del self._senders[key]
        if self.hub is not None:
            self.hub.keep_slot_sets({lane.key for lane in lanes if lane.ipc_peers})

    def _send_leased(self, cache: VersionCache, cached: CachedVersion, label: int, lanes: Sequence[Lane],
                     expected_digest: str | None, sparse_base: int | None) -> TransferResult:
        started = time.perf_counter()
        try:
            identity = self._identity(cache, cached, label, expected_digest, _owners_group(lanes))
        except CkptEngineError as exc:
            for lane in lanes:
                self.abort(lane, label, str(exc))
            return _failed(label, str(exc), started)
        results: dict[str, TransferResult] = {}
        threads = [self._start_thread(f"ckpt-send-v{label}-{lane.key[:8]}", self._send_class, lane, label, results,
                                      lambda lane=lane: self._start_cached(lane, cached, label, sparse_base))
                   for lane in lanes]
        for thread in threads:
            thread.join()  # each class's send is bounded by its group's timeouts
        merged = _merged(label, identity, lanes, results, started, cached.version_layout)  # type: ignore[arg-type]
        if sparse_base is not None and results and all(r.base_version == sparse_base for r in results.values()):
            _count_skipped(merged, cached.identity, self._identities.get(sparse_base), cached.version_layout)  # type: ignore[arg-type]
        return merged

    def _identity(self, cache: VersionCache, cached: CachedVersion, label: int, expected_digest: str | None,
                  owners_group: SyncGroup | None) -> str:
        """The version digest of the full tensors. A re-send returns the recorded one once this rank's cached
        bytes are checked against it. The first send computes it from the cache, each owner its share merged
        on the owners' group, and keeps it as the version's identity."""
        if label != cached.version:
            try:
                check_identity(cached, self._algo(), self.device.comm_device,
                               owners_group.rank if owners_group else 0, expected_digest)
            except StaleCopy:
                evict_quietly(cache, cached.version)
                raise
            return cached.identity.version_digest  # type: ignore[union-attr]
        if cached.identity is None:
            digests = cached_digests(cached, self._algo(), self.device.comm_device)
            cached.identity = self._merged_identity(label, cached.version_layout, cached.owners, digests,  # type: ignore[arg-type]
                                                    owners_group)
            if cached.identity is None:
                raise CkptEngineError(f"version {label}: another owner could not hash its share")
        return cached.identity.version_digest

    def _merged_identity(self, label: int, layout: Layout, owners: Owners | None, digests: list[int] | None,
                         owners_group: SyncGroup | None) -> Manifest | None:
        """The version's manifest from this owner's per-tensor digests of its share, merged on the owners'
        group with the other owners' when there are several. ``digests`` is None when this owner could not hash
        its share. Returns None unless every owner hashed its share. Every owner takes part, whatever its
        classes' outcomes."""
        if owners is not None and owners.ranks > 1:
            if owners_group is None:
                raise ConfigError(f"version {label} has {owners.ranks} owners but no owners' group to merge its "
                                  "identity on")
            told = owners_group.exchange_ints([label, int(digests is not None), *(digests or [])],
                                              f"version {label}: identity", round_id=("identity", label))
            if not all(len(values) > 1 and values[1] for values in told):
                return None
            digests = merged_by_owner(layout, owners, [values[2:] for values in told])
        if digests is None:
            return None
        manifest = manifest_of(label, self._algo(), layout, digests)
        self._identities[label] = manifest  # a later sparse version's record counts unchanged tensors against it
        for old in sorted(self._identities)[:-_IDENTITIES_KEPT]:
            del self._identities[old]
        return manifest

    def _algo(self):
        return self._options.get("digest_algo") or self.device.digest_algo

    @staticmethod
    def _start_thread(name: str, target: Callable, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    def _send_class(self, lane: Lane, label: int, results: dict[str, TransferResult], start: Callable[[], Transfer],
                    on_end: Callable[[], None] | None = None) -> None:
        """Run one class's send, started by ``start``, to its end. Every failure ends the class with a reason.
        Its receivers that never joined its group are named by quorum rank, whatever the outcome."""
        started = time.perf_counter()
        try:
            if lane.group is None and not lane.ipc_peers and not lane.pulls:  # its group did not form: nobody can
                raise ReceiversAbsent(f"its sync group did not form: {lane.unreachable}", lane.absent())
            result = start().result()
        except (ConfigError, ReceiversAbsent) as exc:  # an unfit spec or absent receivers fail this class only
            self.abort(lane, label, str(exc))
            result = _failed(label, str(exc), started)
            result.classes = [{"spec_unfit": isinstance(exc, SpecUnfit),
                               "rendezvous_failed": isinstance(exc, ReceiversAbsent)}]
        except Exception as exc:
            log.exception("version %d: sending class %s failed", label, lane.key)
            result = _failed(label, f"{type(exc).__name__}: {exc}", started)
        finally:
            if on_end is not None:
                on_end()
        result.absent_ranks += lane.absent()
        if lane.pulls and result.ok and result.wire_plan is not None:  # (the lead's: every owner's pieces)
            self._pullable[lane.key] = PulledClass(label, result.wire_plan)
        if result.rendezvous_failed and not result.classes:  # its group formed, then never carried a frame
            result.classes = [{"spec_unfit": False, "rendezvous_failed": True}]
        results[lane.key] = result

    def _start_cached(self, lane: Lane, cached: CachedVersion, label: int, sparse_base: int | None) -> Transfer:
        """Send the class's pieces, as views of this rank's cached tensors, on this thread. With
        ``sparse_base``, only those that changed since that version, by the class's digests of it."""
        plan = self._plan_of(lane.spec, cached.version_layout, cached.owners, cached.aliases)  # type: ignore[arg-type]
        views = cached.views()  # with several owners, this rank's share
        mine = {p.spec.name: cut_view(views[p.tensor], p.part) for p in plan.pieces if p.tensor in views}
        sender = self._sender(lane)
        rank = lane.owners_group.rank if lane.owners_group is not None else 0
        keep = self.kept.keep_for(lane.key, cached.version_layout, rank) if lane.pulls else None  # type: ignore[arg-type]
        if sparse_base is not None:
            source = PiecesChangesSource(label, cached.step, plan.aliases, plan.layout,
                                         plan.owners or single_owner(plan.layout), mine,
                                         sender.manifests.get(sparse_base), self.bucket_size, self.alignment)
            source.keep = keep
            return sender.send_changes(source, inline=True)
        return sender.send_live(label, plan.layout, mine, aliases=plan.aliases, step=cached.step,
                                check=False, owners=plan.owners, inline=True, keep=keep)

    def _start_live(self, lane: Lane, plan: _ClassPlan | ConfigError, window: GatheredWindow, label: int,
                    step: int | None) -> Transfer:
        """Send the class's pieces, cut from the gathered buckets in ``window`` as its send asks for them. Once
        all are in its send buffers, the class lets go of the window."""
        if isinstance(plan, ConfigError):
            raise plan

        def provide(bucket: Bucket) -> Tensors:
            tensors, point = window.take(lane.key, plan.sources[bucket.index])
            wait_for(self.device, point, host=False)  # the gather's device work must precede this send's copies
            pieces = [plan.by_name[slot.name] for slot in bucket.slots]
            return {p.spec.name: cut_view(tensors[p.tensor], p.part) for p in pieces}

        transfer = self._sender(lane).send_live(label, plan.layout, provide, aliases=plan.aliases, step=step,
                                                check=False, owners=plan.owners)
        transfer.params_released.wait()  # set when every bucket is filled, or when the send ends
        window.done(lane.key)
        return transfer

    def _gather_into(self, window: GatheredWindow, gather: Gather, layout: Layout, owners: Owners,
                     rank: int) -> list[int]:
        """Gather this owner's buckets in order into ``window``, hashing each on the way. Returns the per-tensor
        digests of its share, as a cached copy of it would give them."""
        share = share_of(layout, owners, rank)
        scratch = torch.empty(max(share.layout.max_bucket_bytes, 1), dtype=torch.uint8, device=self.device.comm_device)
        assembler, parts = Assembler(), []
        for local, index in enumerate(share.wire):
            tensors = gather(index)
            bucket = share.layout.buckets[local]
            fill_bucket(scratch, bucket.slots, tensors, bucket.nbytes)
            parts.append(bucket_digests(bucket, scratch, self._algo(), share.layout.digest))
            window.put(index, assembler.take(layout.buckets[index], tensors), mark(self.device))
        return tensor_digests(share.layout, torch.cat(parts).cpu().tolist() if parts else [])

    def _finish_live(self, transfer: Transfer, threads: Sequence[threading.Thread], results: dict[str, TransferResult],
                     lanes: Sequence[Lane], layout: Layout, owners: Owners, digests: list[int] | None,
                     started: float) -> None:
        """Once every class has ended, merge the version's identity across its owners and finish ``transfer``
        with one result. Every owner takes part whatever its classes' outcomes, so that a class that failed for
        some receivers does not leave the others' copies unverifiable."""
        label, identity = transfer.version, None
        try:
            for thread in threads:
                thread.join()  # each class's send is bounded by its group's timeouts
            several = owners if owners.ranks > 1 else None
            manifest = self._merged_identity(label, layout, several, digests, _owners_group(lanes))
            identity = manifest.version_digest if manifest is not None else None
            result = _merged(label, identity, lanes, results, started, layout, "bypass_cpu")
        except Exception as exc:  # the transfer ends with why, whatever failed
            log.exception("version %d: ending the classes' sends failed", label)
            result = _failed(label, f"{type(exc).__name__}: {exc}", started, "bypass_cpu")
        transfer._finish(result)

    def _plan_of(self, spec: ShardSpec, version_layout: Layout, owners: Owners | None,
                 aliases: Mapping[str, str]) -> _ClassPlan:
        """The class's plan for versions of this layout, owners, tied names and spec. It is made once, not per
        version, so a spec is checked and its pieces laid out only when one of those changes."""
        key = (version_layout.digest, owners.digest if owners is not None else None,
               tuple(sorted(aliases.items())), spec_key(spec))
        plan = self._plans.get(key)
        if plan is None:
            plan = _plan_class(spec, version_layout, owners, aliases, self.bucket_size, self.alignment)
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def _class_manifests(self, key: str) -> dict[int, Manifest]:
        if key not in self._manifests and len(self._manifests) >= _CLASSES_REMEMBERED:
            self._manifests.pop(next(iter(self._manifests)))  # the class seen longest ago
        return self._manifests.setdefault(key, {})

    def _sender(self, lane: Lane) -> Sender:
        sender = self._senders.get(lane.key)
        if not _serves(sender, lane):
            if lane.ipc_peers and self.hub is None:
                raise ConfigError(f"class {lane.key[:12]} has colocated receivers but this trainer serves no "
                                  "same-host hub")
            sender = Sender(lane.group, device=self.device, owners_group=lane.owners_group,
                            hub=self.hub if lane.ipc_peers else None, ipc_peers=lane.ipc_peers, slots_key=lane.key,
                            seats=lane.quorum_rank,
                            manifests=self._class_manifests(lane.key), **self._options)
            self._senders[lane.key] = sender
        return sender  # type: ignore[return-value]


def _serves(sender: Sender | None, lane: Lane | None) -> bool:
    """Whether ``sender`` sends to ``lane``'s receivers as they are now: its group and its colocated ones."""
    return (sender is not None and lane is not None and sender.group is lane.group
            and sender.ipc_peers == dict(lane.ipc_peers) and sender.owners_group is lane.owners_group)


WINDOW_DEPTH = 2  # gathered buckets an owner holds for its classes: one being read, the next one gathered
_REASONS_LISTED = 8  # classes whose failure a version's reason names; each class's entry has its own

_IDENTITIES_KEPT = 8
_CLASSES_REMEMBERED = 512  # classes whose digests are kept; a deployment has at most 256 at once
_PLANS_KEPT = 64  # class plans remembered, for classes × layouts in use; a layout rarely changes


@dataclass(frozen=True)
class PulledClass:
    """A class's send of one version, for its pullers: what went on its wire (its pieces, or a sparse version's
    changed pieces)."""

    version: int
    plan: WirePlan


@dataclass(frozen=True)
class _ClassPlan:
    layout: Layout
    owners: Owners | None
    pieces: tuple[Piece, ...]
    aliases: dict[str, str]
    sources: tuple[int, ...]  # per bucket of the class's layout, the bucket of the version's its pieces are cut from
    by_name: Mapping[str, Piece]  # the pieces by wire name

    def sources_of(self, rank: int) -> set[int]:
        """The version's buckets whose pieces this class takes from owner ``rank``."""
        return {source for bucket, source in enumerate(self.sources)
                if (self.owners.of[bucket] if self.owners is not None else 0) == rank}


def _plan_class(wanted: ShardSpec, version_layout: Layout, owners: Owners | None, aliases: Mapping[str, str],
                bucket_size: int, alignment: int) -> _ClassPlan:
    """A class's pieces of a version of ``version_layout``, laid out so that each bucket holds pieces of one
    bucket of the version (``sources``), so of one owner. The class's layout, and so its digests (a sparse
    version's base), are then the same whether pieces are cut from the cache or, under bypass_cpu, from the
    bucket as it is gathered. Raises SpecUnfit when the spec does not fit the version, and ConfigError when the
    version cannot be sent sharded at all."""
    specs: list[TensorSpec] = [slot.spec for slot in version_layout.slots]
    marked = [name for name in [*(t.name for t in specs), *aliases] if PIECE_MARK in name]
    if marked:  # a receiver would take such a name for a piece of another tensor
        raise ConfigError(f"tensor names with {PIECE_MARK!r} cannot be sent sharded (e.g. {marked[0]!r}): "
                          "rename them (the trainer agent's name_map)")
    try:
        spec = check_spec(resolve_aliases(wanted, aliases), specs)
    except ConfigError as exc:
        raise SpecUnfit(str(exc)) from None
    pieces = pieces_of(specs, spec)
    ready = ready_at(version_layout)
    layout = plan_layout([p.spec for p in pieces], bucket_size, alignment, groups=[ready[p.tensor] for p in pieces])
    sources = tuple(layout.groups[b.slots[0].index] if b.slots else 0 for b in layout.buckets)  # type: ignore[index]
    several = owners is not None and owners.ranks > 1
    class_owners = Owners(owners.ranks, tuple(owners.of[s] for s in sources)) if several else None  # type: ignore[union-attr]
    return _ClassPlan(layout, class_owners, tuple(pieces), class_aliases(aliases, spec), sources,
                      {p.spec.name: p for p in pieces})


def merged_by_owner(layout: Layout, owners: Owners, told: Sequence[Sequence[int]]) -> list[int]:
    """Per-tensor values of a version several ranks own, in its layout's order, from each owner's values of its
    own tensors in that order."""
    cursors = [0] * owners.ranks
    out = []
    for slot in layout.slots:
        owner = owners.of[slot.bucket]
        if cursors[owner] >= len(told[owner]):
            raise CkptEngineError(f"owner rank {owner} told {len(told[owner])} digests; its tensors need more")
        out.append(told[owner][cursors[owner]])
        cursors[owner] += 1
    return out


def _owners_group(lanes: Sequence[Lane]) -> SyncGroup | None:
    """The owners' group a version's identity is merged on: that of the first class whose group formed."""
    return next((lane.owners_group for lane in lanes if lane.owners_group is not None), None)


def _nobody(*_: object) -> None:
    """Tells no receiver: the abort callback of a class whose group did not form."""


def _failed(version: int, reason: str, started: float, mode: Mode = "cached") -> TransferResult:
    return TransferResult(version, mode, False, reason, None, [], 0, 0, 0,
                          seconds={"total": time.perf_counter() - started}, finished_at=time.perf_counter())


def _count_skipped(result: TransferResult, identity: Manifest | None, base: Manifest | None, layout: Layout) -> None:
    """Count, in the record of a sharded version whose every class went sparse, the tensors unchanged since the
    base (by the two identities), and count its bytes as those of the changed ones, as for any sparse version."""
    if identity is None or base is None or base.names != identity.names:
        return
    sizes = {slot.name: slot.nbytes for slot in layout.slots}
    same = {name for name, old, new in zip(base.names, base.digests, identity.digests) if old == new}
    result.base_version = base.version
    result.tensors_skipped, result.bytes_skipped = len(same), sum(sizes[name] for name in same)
    result.version_bytes = sum(nbytes for name, nbytes in sizes.items() if name not in same)  # no padding
    result.tensors -= result.tensors_skipped


def _merged(version: int, identity: str | None, lanes: Sequence[Lane], results: Mapping[str, TransferResult],
            started: float, layout: Layout, mode: Mode = "cached") -> TransferResult:
    """One result for the version, counting the bytes and tensors of ``layout``'s full tensors. It is ok when
    every class is and its identity is known. Acknowledgements and absent ranks are in quorum ranks; each
    class's digest and bytes are listed beside."""
    acks: list = []
    absent: list[QuorumRank] = []
    classes, reasons = [], []
    seconds: dict[str, float] = {}
    for lane in lanes:
        result = results.get(lane.key) or _failed(version, "the class's send did not end", started)
        acks += result.receivers  # already in quorum ranks: each class's outlets seat them (Sender ``seats``)
        absent += result.absent_ranks
        unfit = any(c.get("spec_unfit") for c in result.classes)
        unformed = any(c.get("rendezvous_failed") for c in result.classes)
        classes.append({"key": lane.key, "ok": result.ok, "reason": (result.reason or "")[:2000] or None,
                        "spec_unfit": unfit, "rendezvous_failed": unformed,
                        "version_digest": result.version_digest, "bytes": result.version_bytes or result.bytes_sent})
        if not result.ok:
            reasons.append(f"class {lane.key[:12]}: {result.reason}")
        for stage, value in result.seconds.items():
            seconds[stage] = max(seconds.get(stage, 0.0), value)
    if len(reasons) > _REASONS_LISTED:  # with hundreds of classes, keeps the report readable and within its bounds
        reasons[_REASONS_LISTED:] = [f"and {len(reasons) - _REASONS_LISTED} more classes failed (see classes)"]
    if identity is None and not reasons:
        reasons.append("the version's identity is not known (its owners did not all hash it)")
    merged = TransferResult(version, mode, not reasons, "; ".join(reasons) or None, identity, acks,
                            sum(r.bytes_sent for r in results.values()), sum(r.buckets for r in results.values()),
                            layout.num_tensors, seconds=seconds, finished_at=time.perf_counter(),
                            absent_ranks=sorted(set(absent)), version_bytes=layout.total_bytes, classes=classes)
    merged.seconds["total"] = time.perf_counter() - started
    return merged
