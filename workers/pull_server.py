"""A trainer rank's side of the ``nixl`` transport: it offers cached versions (or its share of them) for
receivers to pull.

The daemon joins the owner ranks' offers into one and hands it on to the version's pullers. Each offered
version stays leased (its buffer is not reused) until the daemon moves on to a newer version or the version's
time is up, whichever comes first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from ckpt_engine.control.messages import Assignment, RegisterReply
from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import CacheError, CkptEngineError
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.class_senders import PulledClass
from ckpt_engine.send.kept_pieces import KeptPieces
from ckpt_engine.send.own_digests import OwnDigests
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.send.pull_offer import Offered, offer_version, whole_layout, whole_plan
from ckpt_engine.send.transfer import TransferResult, WirePlan
from ckpt_engine.transport.messages import PullOffer
from ckpt_engine.transport.nixl import NixlEndpoint
from ckpt_engine.workers.reports import Reply

log = logging.getLogger(__name__)
_MIN_SLOT = 64 << 10
_SLOTS_KEPT = 16  # at least (a sharded version's lead takes a descriptor and a board per pulled class)
_RELEASES_COOLING = 2  # releases a released offer's memory waits before reuse


class PullServer:
    """One NIXL agent per trainer rank, started on the first offer; a lease per offered version."""

    def __init__(self) -> None:
        self._endpoint: NixlEndpoint | None = None
        # version -> (offered at, release by: time.monotonic(); its lease)
        self._leases: dict[int, tuple[float, float, contextlib.ExitStack]] = {}
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []  # descriptor and board slots no offered version holds (registered)
        self._released: list[torch.Tensor] = []  # memory of offers being released now: see _close_all
        self._cooling: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # the last releases': see _cool
        self._released_kept: list[torch.Tensor] = []  # kept pieces the offers being released now named
        self._dropped: list[torch.Tensor] = []  # cache buffers the cache let go of (registered: see _cool)
        self._retiring: list[tuple[float, torch.Tensor]] = []  # (forgotten from, registered memory): see _cool
        self._hold_s = 0.0  # the longest an offer was held: a straggler's read ends within it
        self._watched: list[VersionCache] = []  # the caches whose dropped buffers are deregistered
        self._kept_now: tuple[torch.Tensor, ...] = ()  # the kept pieces the latest offer named
        self._peak = 0  # the most slots one offer took
        self._closed = False
        self._offered: dict[int, Offered] = {}  # by version, while leased: where its digests are posted

    def offer(self, cache: VersionCache, version: int, source_version: int | None, algo: DigestAlgo,
              hold_s: float, own: OwnDigests, *, rank: int = 0, plans: Mapping[str, WirePlan] | None = None,
              kept: CachedVersion | None = None, pieces: KeptPieces | None = None) -> PullOffer:
        """Owner rank ``rank``'s offer of ``version`` (a re-push: ``source_version``'s cached bytes under
        ``version``); its buffer is held for at most ``hold_s``. ``plans``: what goes on the wire, by board key
        (see ``offer_version``; default: the whole version). ``own``: where its sends leave the digests of this
        rank's pieces; each is posted for the pullers as soon as the send has it (now, if it already has).
        ``kept``: a bypass_cpu version's share as its send kept it, offered in place of a cached one.
        ``pieces``: where the sends of the classes in ``plans`` keep their column pieces, for their pullers."""
        stack = contextlib.ExitStack()
        self._watch(cache)
        if kept is not None:  # (bypass_cpu's send slots: held by the publisher until its next pulled version)
            cached = kept
        else:
            cached = stack.enter_context(cache.lease(source_version if source_version is not None else version))
        try:
            endpoint = self._endpoint_now()
            plans = plans or {"": whole_plan(cached)}
            classes = {key: plan for key, plan in plans.items() if key}
            served = pieces.offered(classes, whole_layout(cached), rank) if pieces is not None and classes else {}
            offered = offer_version(endpoint, cached, plans, rank=rank, version=version, algo=algo,
                                    descriptor_into=self._slot, kept=served)
        except BaseException:
            stack.close()
            raise
        stack.callback(self._close_offer, version, offered, own)  # (before the lease: runs first)
        with self._lock:
            closed = self._closed
            earlier = None if closed else self._leases.pop(version, None)
            if not closed:
                now = time.monotonic()
                self._leases[version] = (now, now + hold_s, stack)
                self._hold_s = max(self._hold_s, hold_s)
                self._offered[version] = offered
                self._kept_now = offered.served
        if closed:  # (closed while this offer was made)
            stack.close()
            raise CkptEngineError(f"version {version}: the trainer's pull server closed while offering it")
        if earlier is not None:
            self._close_all([earlier[2]])
        for key, board in offered.boards.items():
            own.wanted(version, key, board)
        endpoint.serve_for(hold_s)  # (pullers may read it until then: the agent is driven at its busy rate)
        return offered.offer

    def fail(self, version: int, reason: str) -> None:
        """Tell offered ``version``'s pullers that it failed, and why (nothing if it is not offered here)."""
        with self._lock:
            offered = self._offered.get(version)
        if offered is not None:
            offered.fail(reason)

    def release_when_taken(self, version: int, reply: Reply, own: OwnDigests, bound_s: float) -> None:
        """(The lead's) Post this rank's digests of ``version`` once ``reply``, the daemon's to the trainer's
        report of it, says it was taken with the version still in flight. Pullers need every owner's post, so a
        lead that stalls or dies before that leaves them on what they hold, and the daemon fails a version
        nobody loaded. A report refused, dropped (registered again since), taken too late or not answered
        within ``bound_s`` fails it for the pullers."""
        answer = reply.wait(bound_s)
        if answer is not None and answer.get("taken") is True:
            own.release(version)
            return
        why = "was not answered" if not reply.done else "was refused or given up on" if answer is None \
            else "came after the version ended"
        self.fail(version, f"the trainer's report of version {version} {why}")

    def posted(self, version: int) -> bool:
        """Whether this rank has posted the digests of offered ``version`` (or its failure)."""
        with self._lock:
            offered = self._offered.get(version)
        return offered is not None and all(board.posted for board in offered.boards.values())

    def _digested(self, version: int, own: OwnDigests) -> bool:
        """Whether this rank's digests of every board of offered ``version`` are known (posted, or held back
        until the lead's report: send/own_digests.py), or a failure was posted."""
        with self._lock:
            offered = self._offered.get(version)
        return offered is not None and all(board.posted or own.known(version, key)
                                           for key, board in offered.boards.items())

    def offer_for(self, assignment: Assignment, publisher: Publisher, settings: RegisterReply | None, rank: int,
                  sent: TransferResult | None = None) -> PullOffer:
        """What trainer rank ``rank`` offers of ``assignment`` (a send with pullers), held for the version's
        time limit at most: before its send (``sent`` None; where :func:`offers_before_send`) or once its send
        ``sent`` ended, with what that send put on the wire (e.g. a sparse version's changes)."""
        cache, hold_s = publisher.cache, settings.version_timeout_s if settings is not None else 600.0
        kept = publisher.kept(assignment.version) if assignment.mode == "bypass_cpu" else None
        plans: Mapping[str, WirePlan] | None = None
        if assignment.classes:
            specs = {lane.key: lane.spec for lane in assignment.classes if lane.pullers}
            if sent is not None and rank == 0:  # (what its send put on each class's wire: a sparse one's changes)
                plans = {k: c.plan for k, c in _sent_classes(assignment, publisher, specs).items()}
            else:
                source = assignment.source_version if assignment.source_version is not None else assignment.version
                with cache.lease(source) as cached:
                    plans = publisher.classes.wire_plans(cached, specs)
        elif sent is not None and sent.wire_plan is not None:
            plans = {"": sent.wire_plan}
        offer = self.offer(cache, assignment.version, assignment.source_version, publisher.device.digest_algo,
                           hold_s, publisher.own_digests, rank=rank, plans=plans, kept=kept,
                           pieces=publisher.classes.kept)
        if sent is not None and not self._digested(assignment.version, publisher.own_digests):  # (none will come)
            reason = f"version {assignment.version}: its send kept no digests of trainer rank {rank}'s pieces"
            self.fail(assignment.version, reason)
            raise CacheError(reason)
        return offer

    def start(self) -> None:
        """Start the NIXL agent now (importing and starting it takes a second or two), not at the first offer."""
        try:
            self._endpoint_now()
        except CkptEngineError as exc:  # each offer says it again
            log.warning("the nixl transport cannot start here: %s", exc)

    def release(self, *, before: int | None = None) -> None:
        """Release the leases of versions older than ``before`` (the daemon has moved on from them) and of those
        whose time is up."""
        now = time.monotonic()
        self._release(lambda v, offered_at, until: now >= until or (before is not None and v < before))

    def ended(self, in_flight: int | None, asked_at: float) -> None:
        """The daemon had ``in_flight`` in flight (None: none) when it answered a question asked at
        ``asked_at``: the versions offered before that and no longer in flight have ended, and nothing pulls
        them any more."""
        self._release(lambda v, offered_at, until: v != in_flight and offered_at < asked_at)

    def _release(self, done: Callable[[int, float, float], bool]) -> None:
        with self._lock:
            stacks = [self._leases.pop(v)[2] for v in [v for v, (at, until, _) in self._leases.items()
                                                        if done(v, at, until)]]
            endpoint, idle = self._endpoint, not self._leases
        self._close_all(stacks)
        if endpoint is not None and idle:
            endpoint.serve_for(0.0)

    def close(self) -> None:
        """Release every offer; an offer under way or asked for later is refused (no agent starts again)."""
        with self._lock:
            self._closed = True
            stacks = [stack for _, _, stack in self._leases.values()]
            self._leases.clear()
            endpoint, self._endpoint = self._endpoint, None
            watched, self._watched = self._watched, []
        for cache in watched:  # (outside attack: a closed server held every buffer its caches let go of)
            cache.on_drop = [hook for hook in cache.on_drop if hook != self._on_drop]
        self._close_all(stacks)
        with self._lock:
            self._dropped, self._retiring, self._cooling, self._free = [], [], [], []
        if endpoint is not None:
            endpoint.close()  # (its agent gone, nothing of its memory is read any more)

    def _slot(self, nbytes: int) -> torch.Tensor:
        """Registered memory for a descriptor, reused once its version is released: the agent's metadata then
        stays the same from version to version, and pullers need not load it again."""
        with self._lock:
            fitting = [t for t in self._free if t.numel() >= nbytes]
            if fitting:
                slot = min(fitting, key=torch.Tensor.numel)
                self._free = [t for t in self._free if t is not slot]
                return slot
        return torch.empty(max(_MIN_SLOT, 1 << (nbytes - 1).bit_length()), dtype=torch.uint8)

    def _close_all(self, stacks: Sequence[contextlib.ExitStack]) -> None:
        """Close released offers together: their memory cools as one group (see ``_cool``)."""
        for stack in stacks:
            stack.close()
        with self._lock:
            released, self._released = self._released, []
            kept, self._released_kept = self._released_kept, []
            dropped, self._dropped = self._dropped, []
        self._cool(released, [*kept, *dropped])

    def _cool(self, memory: Sequence[torch.Tensor], kept: Sequence[torch.Tensor]) -> None:
        """A release's memory (its offers' descriptors and boards) cools for two more releases: a puller of
        those versions still polling its board reads its last post (the version ended) rather than a later
        version's. Then it is free for reuse; beyond what three offers as large as the largest yet need, it is
        forgotten. So are the kept pieces its offers named that no offer names now (a class no longer pulled,
        or grown), and the cache buffers the cache let go of since. Forgotten memory is freed, and over TCP
        UCX reads an owner's memory by its address: so it is forgotten only once a straggler's pull has ended
        too, the longest an offer is held after it cooled (outside attack: a stopped puller resumed after two
        quick releases and crashed its owner)."""
        with self._lock:
            if memory or kept:
                self._cooling.append((list(memory), list(kept)))
            unserved: list[torch.Tensor] = []
            while len(self._cooling) > _RELEASES_COOLING:
                free, served = self._cooling.pop(0)
                self._free.extend(free)
                unserved += [t for t in served if not self._names(t)]
            slots = max(_SLOTS_KEPT, 3 * self._peak)
            drop = sorted(self._free, key=torch.Tensor.numel)[:-slots] if len(self._free) > slots else []
            self._free = [t for t in self._free if all(t is not d for d in drop)]
            drop += [t for i, t in enumerate(unserved) if all(t is not u for u in unserved[:i])]
            now = time.monotonic()
            self._retiring += [(now + self._hold_s, t) for t in drop]
            due = [t for at, t in self._retiring if at <= now and not self._names(t)]  # (named again: in use)
            self._retiring = [(at, t) for at, t in self._retiring if at > now]
            endpoint = self._endpoint
        for slot in due:
            if endpoint is not None:
                endpoint.forget(slot)

    def _close_offer(self, version: int, offered: Offered, own: OwnDigests) -> None:
        """A version released: a puller still at it is told it ended; its descriptors and boards go back to the
        pool once they have cooled (no send writes on them any more: see ``Board.close``)."""
        with self._lock:
            if self._offered.get(version) is offered:
                del self._offered[version]
        own.forget(version)
        offered.close("the version has ended")  # (a straggling puller stops at once)
        with self._lock:
            self._peak = max(self._peak, len(offered.memory))
            self._released.extend(offered.memory)
            self._released_kept.extend(offered.served)

    def _watch(self, cache: VersionCache) -> None:
        """Deregister the buffers ``cache`` lets go of (a delta's, a layout's gone), once cooled: registered,
        they would stay allocated."""
        with self._lock:
            if all(watched is not cache for watched in self._watched):
                self._watched.append(cache)
                cache.on_drop.append(self._on_drop)

    def _on_drop(self, buffer: torch.Tensor) -> None:
        """(Called under the cache's lock: this server never takes the cache's lock under its own.)"""
        with self._lock:
            self._dropped.append(buffer)

    def _names(self, kept: torch.Tensor) -> bool:
        """(Under the lock) Whether the latest offer, one still leased or one still cooling names ``kept``."""
        named = [*self._kept_now, *(t for offered in self._offered.values() for t in offered.served),
                 *(t for _, served in self._cooling for t in served)]
        return any(t is kept for t in named)

    @property
    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._leases)

    def _endpoint_now(self) -> NixlEndpoint:
        with self._lock:
            if self._closed:
                raise CkptEngineError("the trainer's pull server is closed")
            if self._endpoint is None:
                self._endpoint = NixlEndpoint("trainer")
            return self._endpoint


def offers_before_send(assignment: Assignment, rank: int) -> bool:
    """Whether trainer rank ``rank`` offers ``assignment`` to its pullers as soon as its snapshot is cached,
    before its send digests it: a cached version, whole (a sparse one is known only once its changes are
    found) and new (a re-push checks its cached bytes first). Other versions are offered once their send ended."""
    return (assignment.pullers > 0 and assignment.mode == "cached" and not assignment.sparse
            and assignment.sparse_base is None and assignment.source_version is None and rank < assignment.owners)


def _sent_classes(assignment: Assignment, publisher: Publisher, specs: Mapping[str, object]) -> dict[str, PulledClass]:
    """The pulled classes of ``assignment`` as its send put them on their wires."""
    classes = publisher.classes.pulled(assignment.version)
    if missing := sorted(set(specs) - set(classes)):
        raise CkptEngineError(f"class(es) {[key[:12] for key in missing]} of version {assignment.version} were not "
                              "sent: nothing to offer their pullers")
    return {key: classes[key] for key in specs}

