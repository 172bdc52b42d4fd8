"""Sending a sharded version: each class of receivers (plan/shards.py) gets only its pieces, on a sync group of
its own, cut from the version as the cache holds it (so an FSDP model is gathered once, whatever the classes).

With several trainer ranks owning shares of the version (plan/owners.py), every owner sends each class the
pieces of the tensors it owns, on its own group with the class's receivers: a class's layout is planned by
owner groups (a bucket holds pieces of one owner's tensors), and the owners of each class vote and merge
their digests on the class's owners' group, as for any version of several owners.

The version keeps one identity, the per-tensor digests of its full tensors (computed from the cache on its
first send, every owner its share, merged on the owners' group; checked on every re-send like any cached
version's); each class's stream carries its own digests, which its receivers verify before anything is
applied and which the daemon compares with theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt_engine.device import DeviceInfo
from ckpt_engine.errors import CkptEngineError, ConfigError
from ckpt_engine.plan.layout import Layout, TensorSpec, plan_layout
from ckpt_engine.plan.owners import Owners, owners_by_group
from ckpt_engine.plan.shards import (PIECE_MARK, Piece, ShardSpec, check_spec, class_aliases, cut_view,
                                     pieces_of, resolve_aliases, spec_key)
from ckpt_engine.plan.sparse import manifest_of
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.sender import Sender, Transfer, TransferResult
from ckpt_engine.send.sources import StaleCopy, cached_digests, check_identity, evict_quietly
from ckpt_engine.transport.group import SyncGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lane:
    """One class of a sharded version: its key, what its receivers keep, this owner's sync group with them
    (the owner is rank 0), the ranks its receivers have in the version's quorum (group rank k is
    ``ranks[k - 1]``), and, with several owners, the class's owners' group."""

    key: str
    spec: ShardSpec
    group: SyncGroup
    ranks: tuple[int, ...]
    owners_group: SyncGroup | None = None


class SpecUnfit(ConfigError):
    """A class's shard spec does not fit the version (a tensor it names is not there, a slice is out of range,
    a tied name asks for other slices than its tensor): its receivers' to fix; the other classes go on."""


class ClassSenders:
    """One sender per class group, kept while the group lives (it knows what its receivers hold)."""

    def __init__(self, device: DeviceInfo, *, bucket_size: int, alignment: int, options: Mapping) -> None:
        self.device, self.bucket_size, self.alignment = device, bucket_size, alignment
        # (a class's per-tensor digests are not the version's: they never serve as sparse bases)
        self._options = {k: v for k, v in options.items() if k != "manifests"}
        self._senders: dict[int, Sender] = {}
        self._plans: dict[tuple, _ClassPlan] = {}

    def send(self, cache: VersionCache, version: int, lanes: Sequence[Lane], *, as_version: int | None = None,
             expected_digest: str | None = None) -> Transfer:
        """Send this rank's share of cached ``version`` (labelled ``as_version`` for a re-send, checked against
        its identity first) to every class at once; returns when every class has ended."""
        label = version if as_version is None else as_version
        for key in [k for k, sender in self._senders.items() if not any(sender.group is lane.group for lane in lanes)]:
            del self._senders[key]  # of an earlier generation (its groups were closed with it)
        transfer = Transfer(label, "cached")
        transfer.params_released.set()
        with cache.lease(version) as cached:
            transfer._finish(self._send_leased(cache, cached, label, lanes, expected_digest))
        return transfer

    def abort(self, lane: Lane, label: int, reason: str) -> None:
        """Tell a class's receivers that the version will not come (with several owners, every owner calls
        this: they vote, and the lead tells the receivers)."""
        try:
            self._sender(lane).abort_before_start(label, reason)
        except CkptEngineError as exc:  # its receivers then fall back on their own timeout
            log.warning("version %d: could not tell class %s it will not come: %s", label, lane.key, exc)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()

    # ---- internals -----------------------------------------------------------------------------------
    def _send_leased(self, cache: VersionCache, cached: CachedVersion, label: int, lanes: Sequence[Lane],
                     expected_digest: str | None) -> TransferResult:
        started = time.perf_counter()
        try:
            identity = self._identity(cache, cached, label, expected_digest, lanes[0].owners_group)
        except CkptEngineError as exc:
            for lane in lanes:
                self.abort(lane, label, str(exc))
            return _failed(label, str(exc), started)
        results: dict[str, TransferResult] = {}
        threads = [threading.Thread(target=self._send_class, args=(lane, cached, label, results),
                                    name=f"ckpt-send-v{label}-{lane.key[:8]}", daemon=True) for lane in lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()  # (each class's send is bounded by its group's timeouts)
        return _merged(label, identity, lanes, results, started, cached.version_layout.total_bytes)  # type: ignore[union-attr]

    def _identity(self, cache: VersionCache, cached: CachedVersion, label: int, expected_digest: str | None,
                  owners_group: SyncGroup | None) -> str:
        """The version digest of the full tensors: for a re-send, the recorded one once this rank's cached bytes
        are checked against it; on the first send, computed from the cache (every owner its share, merged on
        the owners' group) and kept as the version's identity."""
        algo = self._options.get("digest_algo") or self.device.digest_algo
        if label != cached.version:
            try:
                check_identity(cached, algo, self.device.comm_device, owners_group.rank if owners_group else 0,
                               expected_digest)
            except StaleCopy:
                evict_quietly(cache, cached.version)
                raise
            return cached.identity.version_digest  # type: ignore[union-attr]
        if cached.identity is None:
            digests = cached_digests(cached, algo, self.device.comm_device)
            owners = cached.owners
            if owners is not None and owners.ranks > 1:
                if owners_group is None:
                    raise ConfigError(f"version {label} has {owners.ranks} owners but no owners' group to merge "
                                      "its identity on")
                told = owners_group.exchange_ints([label, *digests], f"version {label}: identity",
                                                  round_id=("identity", label))
                digests = merged_by_owner(cached.version_layout, owners, [values[1:] for values in told])
            cached.identity = manifest_of(cached.version, algo, cached.version_layout, digests)  # type: ignore[arg-type]
        return cached.identity.version_digest

    def _send_class(self, lane: Lane, cached: CachedVersion, label: int, results: dict[str, TransferResult]) -> None:
        started = time.perf_counter()
        try:
            layout, owners, tensors, aliases = self._class_plan(lane, cached)
            transfer = self._sender(lane).send_live(label, layout, tensors, aliases=aliases, step=cached.step,
                                                    check=False, owners=owners, inline=True)
            result = transfer.result()
        except ConfigError as exc:  # (a spec that does not fit the version: only this class's receivers fail)
            self.abort(lane, label, str(exc))
            result = _failed(label, str(exc), started)
            result.classes = [{"spec_unfit": isinstance(exc, SpecUnfit)}]
        except Exception as exc:  # every failure ends the class with a reason
            log.exception("version %d: sending class %s failed", label, lane.key)
            result = _failed(label, f"{type(exc).__name__}: {exc}", started)
        results[lane.key] = result

    def _class_plan(self, lane: Lane, cached: CachedVersion) -> tuple[Layout, Owners | None, dict, dict]:
        """The class's layout (by owner groups with several owners), its owners, this rank's pieces as views of
        its cached tensors, and the class's tied names."""
        plan = self._plan_of(lane, cached)
        views = cached.views()  # (with several owners: this rank's share)
        mine = {p.spec.name: cut_view(views[p.tensor], p.part) for p in plan.pieces if p.tensor in views}
        return plan.layout, plan.owners, mine, plan.aliases

    def _plan_of(self, lane: Lane, cached: CachedVersion) -> _ClassPlan:
        """The class's plan for versions of this layout, owners, tied names and spec: made once, not per
        version (a class's spec is checked and its pieces laid out only when one of them changes)."""
        version_layout, owners = cached.version_layout, cached.owners
        key = (version_layout.digest, owners.digest if owners is not None else None,  # type: ignore[union-attr]
               tuple(sorted(cached.aliases.items())), spec_key(lane.spec))
        plan = self._plans.get(key)
        if plan is None:
            plan = _plan_class(lane.spec, version_layout, owners, cached.aliases, self.bucket_size,  # type: ignore[arg-type]
                               self.alignment)
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def _sender(self, lane: Lane) -> Sender:
        sender = self._senders.get(id(lane.group))
        if sender is None or sender.group is not lane.group:
            sender = Sender(lane.group, device=self.device, owners_group=lane.owners_group, **self._options)
            self._senders[id(lane.group)] = sender
        return sender


_PLANS_KEPT = 64  # class plans remembered (classes × layouts in use; a layout rarely changes)


@dataclass(frozen=True)
class _ClassPlan:
    layout: Layout
    owners: Owners | None
    pieces: tuple[Piece, ...]
    aliases: dict[str, str]


def _plan_class(wanted: ShardSpec, version_layout: Layout, owners: Owners | None, aliases: Mapping[str, str],
                bucket_size: int, alignment: int) -> _ClassPlan:
    """A class's pieces of a version of ``version_layout``, laid out in buckets of one owner each; SpecUnfit when
    the spec does not fit the version, a ConfigError when the version cannot be sent sharded at all."""
    specs: list[TensorSpec] = [slot.spec for slot in version_layout.slots]
    marked = [name for name in [*(t.name for t in specs), *aliases] if PIECE_MARK in name]
    if marked:  # a receiver would take it for a piece of another tensor
        raise ConfigError(f"tensor names with {PIECE_MARK!r} cannot be sent sharded (e.g. {marked[0]!r}): "
                          "rename them (the trainer agent's name_map)")
    try:
        spec = check_spec(resolve_aliases(wanted, aliases), specs)
    except ConfigError as exc:
        raise SpecUnfit(str(exc)) from None
    pieces = pieces_of(specs, spec)
    several = owners is not None and owners.ranks > 1
    owner_of = {slot.name: owners.of[slot.bucket] for slot in version_layout.slots} if several else {}  # type: ignore[union-attr]
    layout = plan_layout([p.spec for p in pieces], bucket_size, alignment,
                         groups=[owner_of[p.tensor] for p in pieces] if several else None)
    return _ClassPlan(layout, owners_by_group(layout, owners.ranks) if several else None,  # type: ignore[union-attr]
                      tuple(pieces), class_aliases(aliases, spec))


def merged_by_owner(layout: Layout, owners: Owners, told: Sequence[Sequence[int]]) -> list[int]:
    """Per-tensor values of a version several ranks own, in its layout's order, from each owner's values of its
    own tensors (in the same order)."""
    cursors = [0] * owners.ranks
    out = []
    for slot in layout.slots:
        owner = owners.of[slot.bucket]
        if cursors[owner] >= len(told[owner]):
            raise CkptEngineError(f"owner rank {owner} told {len(told[owner])} digests; its tensors need more")
        out.append(told[owner][cursors[owner]])
        cursors[owner] += 1
    return out


def _failed(version: int, reason: str, started: float) -> TransferResult:
    return TransferResult(version, "cached", False, reason, None, [], 0, 0, 0,
                          seconds={"total": time.perf_counter() - started}, finished_at=time.perf_counter())


def _merged(version: int, identity: str, lanes: Sequence[Lane], results: Mapping[str, TransferResult],
            started: float, version_bytes: int) -> TransferResult:
    """One result for the version (of ``version_bytes``, its full tensors): ok when every class is;
    acknowledgements and absent ranks in the quorum's ranks; each class's digest and bytes beside."""
    acks, absent, classes, reasons = [], [], [], []
    seconds: dict[str, float] = {}
    for lane in lanes:
        result = results.get(lane.key) or _failed(version, "the class's send did not end", started)
        quorum_rank = lambda rank: lane.ranks[rank - 1] if 1 <= rank <= len(lane.ranks) else rank  # noqa: E731
        acks += [ack.model_copy(update={"rank": quorum_rank(ack.rank)}) for ack in result.receivers]
        absent += [quorum_rank(rank) for rank in result.absent_ranks]
        unfit = any(c.get("spec_unfit") for c in result.classes)
        classes.append({"key": lane.key, "ok": result.ok, "reason": result.reason, "spec_unfit": unfit,
                        "version_digest": result.version_digest, "bytes": result.version_bytes or result.bytes_sent})
        if not result.ok:
            reasons.append(f"class {lane.key[:12]}: {result.reason}")
        for stage, value in result.seconds.items():
            seconds[stage] = max(seconds.get(stage, 0.0), value)
    merged = TransferResult(version, "cached", not reasons, "; ".join(reasons) or None, identity, acks,
                            sum(r.bytes_sent for r in results.values()), sum(r.buckets for r in results.values()),
                            sum(r.tensors for r in results.values()), seconds=seconds,
                            finished_at=time.perf_counter(), absent_ranks=sorted(set(absent)),
                            version_bytes=version_bytes, classes=classes)
    merged.seconds["total"] = time.perf_counter() - started
    return merged
