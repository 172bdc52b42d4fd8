"""Trainer agent: runs inside every trainer rank (FSDP2 or a plain single-rank module) and serves the
daemon's sync assignments at step boundaries, so parameters are never read mid-update.

    agent = TrainerAgent(model, "tcp://127.0.0.1:8766").start()   # in every rank
    for step in ...:
        loss.backward(); optimizer.step()
        agent.step(step)          # one tiny broadcast on the trainer group when sharded; else near-free

Rank 0 of the trainer's process group talks to the daemon; at a step boundary it tells the other ranks (one
small broadcast) whether a version is due. Every bucket of a version has an owner among the ranks
(plan/owners.py): every rank takes part in gathering each bucket, in registration order, to its owner only,
and the owner alone stores it in its host cache and sends it, on its own sync group with the receivers. So
each rank holds about 1/ranks of every cached version and does 1/ranks of the copies, digests and sends.
(With receivers on the trainer's host that read shared memory, or when the daemon asks for it, rank 0 owns
every bucket and the others only gather.)

Cached mode holds the loop for the gather + device->host snapshot only; the broadcast runs in the
background from the cache. bypass_cpu holds it until every bucket has been read from the live parameters.
Re-pushes of cached versions (rollback) need no parameters and run in the background: at once when rank 0
holds the whole version, at the next step boundary when every owner must send its share.

Sparse versions (cached mode): every rank digests its own shards, and one all-reduce gives all ranks the
same set of tensors that changed since the previous cached version. Only those are gathered and snapshotted;
the cache shares the unchanged ones with the previous version (see sparse.py and cache.py).

A collective of the job's own process group that fails during a sync (a rank died, or stalled past the
group's timeout) raises TrainerGroupError out of step(), after the version is reported failed: the ranks are
out of step in their collectives, so the loop must end and the job be restarted as a whole (as torchrun
does), rather than run on until a later collective times out.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from ckpt_engine.control.messages import Assignment, RegisterReply
from ckpt_engine.device import DeviceInfo
from ckpt_engine.errors import CkptEngineError, ReceiversAbsent, TrainerGroupError, absent_receivers
from ckpt_engine.plan.tensors import NamedTensors, NameMap
from ckpt_engine.ranks import plain_seat
from ckpt_engine.send.publisher import BEFORE_SEND_WAIT_S, Ownership, Publisher, Route
from ckpt_engine.send.sender import Transfer, TransferResult, WireHook
from ckpt_engine.transport.group import MembersAbsent, SyncGroup, open_store, owner_part
from ckpt_engine.workers.agent import Agent
from ckpt_engine.workers.class_groups import ClassGroups, ClassGroupsKey
from ckpt_engine.workers.early_offers import EarlyOffers
from ckpt_engine.workers.fsdp import sharded_tensors_of
from ckpt_engine.workers.loop_push import LoopPushes
from ckpt_engine.workers.pull_server import PullServer, offers_before_send
from ckpt_engine.workers.reports import Reply
from ckpt_engine.workers.trainer_ranks import TrainerRanks

log = logging.getLogger(__name__)
TensorSource = Callable[[], NamedTensors]
_REPORT_BOUND_S = 30.0  # beyond the version's time, how long the lead waits for the answer to its report
_REPORT_BEFORE_EXIT_S = 2.0  # a daemon that answers takes milliseconds; one that does not must not hold the exit


class TrainerAgent(Agent):
    role = "trainer"

    def __init__(self, model: nn.Module | TensorSource, endpoint: str, *,
                 process_group: dist.ProcessGroup | None = None,
                 token: str | None = None, device: DeviceInfo | None = None, poll_wait_s: float = 1.0,
                 name_map: NameMap | None = None, include_buffers: bool = True, register_wait_s: float = 30.0,
                 wire_hook: WireHook | None = None) -> None:
        """``wire_hook``: fault injection for tests, as the Publisher's (a bucket's bytes as they go out)."""
        self._wire_hook = wire_hook
        self.process_group = process_group if process_group is not None else (
            dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        self.ranks = TrainerRanks(self.process_group)
        self.class_groups: ClassGroups | None = None  # a sharded version's groups (this generation's)
        super().__init__(endpoint, rank=self.ranks.rank, token=token, device=device, poll_wait_s=poll_wait_s,
                         register_wait_s=register_wait_s)
        self.world_size = self.ranks.size
        if isinstance(model, nn.Module):
            self._tensors: TensorSource = lambda: sharded_tensors_of(model, include_buffers=include_buffers,
                                                                    name_map=name_map)
        else:
            self._tensors = model
        self._pending: collections.deque[Assignment] = collections.deque()
        self._current: Transfer | None = None  # the version this rank sends now (one at a time)
        self.publisher: Publisher | None = None
        self.held_seconds: list[float] = []  # per served version: how long step() held the training loop
        self.gathered: dict[int, int] = {}  # per served version: bytes of full tensors assembled on this rank
        self.served: list[int] = []  # versions this rank served (rank 0: sent), oldest first
        self._pushes = LoopPushes()
        self.pulls = PullServer()  # the versions it offers receivers to pull (transport: nixl)
        self.early = EarlyOffers()  # versions offered before their send

    def register_extra(self) -> dict:
        hub = self.publisher.hub if self.publisher is not None else None
        extra = {"ipc_name": hub.name} if hub is not None else {}  # keep serving receivers where they connect
        return {**extra, "trainer_ranks": self.world_size} if self.rank == 0 else extra

    def on_registered(self) -> None:
        settings = self.settings
        if settings is None:
            raise CkptEngineError("registration returned no settings")
        if settings.transport == "nixl":  # (every rank may own a share of a version)
            threading.Thread(target=self.pulls.start, name="ckpt-nixl-start", daemon=True).start()
        if self.publisher is not None:  # registering again (daemon restart): keep the cache and the hub
            return
        self.publisher = Publisher(device=self.device, bucket_size=settings.bucket_size, alignment=settings.alignment,
                                   keep_versions=settings.keep_versions, ack_timeout_s=settings.ack_timeout_s,
                                   on_stage=self._on_stage, timeout_s=settings.collective_timeout_s,
                                   ipc_hub_name=settings.ipc_name if self.rank == 0 else None,
                                   wire_hook=self._wire_hook, external_trim=True)  # (the daemon's cache book)

    def close(self) -> None:
        super().close()
        self.pulls.close()

    def in_flight_now(self, version: int | None, asked_at: float) -> None:
        self.pulls.ended(version, asked_at)  # (what it offered of versions that ended: no pull reads it now)

    def versions_held(self) -> list[int]:
        return self.publisher.cache.versions() if self.publisher else []

    def forget_versions(self) -> None:
        # Their ids mean nothing to the daemon's history: they could never be asked for again.
        if self.publisher is not None:
            self.publisher.forget()

    def handle(self, assignment: Assignment) -> None:
        if assignment.kind == "evict":
            self._evict(assignment.version)
        elif assignment.kind == "send" and assignment.source_version is not None and assignment.owners == 1:
            self.pulls.release(before=assignment.version)  # (one version in flight: the daemon is done with those)
            self.served.append(assignment.version)  # rank 0 holds the whole version: no other rank is needed
            self._hold_lead_digests(assignment)
            self._track(assignment, lambda: self._publisher().publish(
                assignment.version, source_version=assignment.source_version, route=lambda: self._route(assignment),
                expected_digest=assignment.expected_digest, keep=assignment.keep, pulled=assignment.pullers > 0), 0.0)
        elif assignment.kind == "send":
            self.pulls.release(before=assignment.version)
            self._pending.append(assignment)
            # Rendezvous with the receivers now, while the loop runs on to its next step boundary.
            threading.Thread(target=self._prepare_group, args=(assignment,), name="ckpt-trainer-rendezvous",
                             daemon=True).start()

    def step(self, step: int) -> int | None:
        """Call once per training step on every rank, after ``optimizer.step()``: serves a due sync.
        Returns the version served at this boundary (on every rank), or None."""
        assignment = self._agree()
        if assignment is None:
            return None
        started = time.perf_counter()
        if self.rank < assignment.owners:
            self._serve(assignment, step, started)
        else:  # it owns no bucket of this version: its part is the gathers
            self._assist(assignment, step)
        self.served.append(assignment.version)
        return assignment.version

    def push(self, step: int, *, bypass_cpu: bool | None = None, timeout_s: float = 10.0) -> int | None:
        """Ask the daemon for a new version from the training loop and serve it now (call on every rank);
        returns the version requested on rank 0 and, on the other ranks, the version served at this step."""
        version = self._pushes.request(self._client, self._pending, step, bypass_cpu, timeout_s) \
            if self.rank == 0 else None
        served = self.step(step)  # every rank, also when the request failed: the ranks' agreement stays matched
        return version if self.rank == 0 else served

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until the background transfer (if any) has ended, the daemon has been told its outcome, and it
        has ended that version (it also waits for the receivers' own reports), so a version requested next is
        not refused as overlapping; for clean shutdowns and tests. Only rank 0 asks the daemon."""
        deadline = time.monotonic() + timeout_s
        self._wait_current(timeout_s)
        self.flush_reports(max(0.0, deadline - time.monotonic()))
        if self.rank == 0 and self.served and self.settings is not None:
            self.wait_ended(self.served[-1], deadline)

    # ---- agreement between trainer ranks -------------------------------------------------------------
    def _agree(self) -> Assignment | None:
        """Rank 0 decides whether a version is due at this boundary and tells the others the whole assignment."""
        if self.world_size == 1:
            return self._next_due()
        mine = self._next_due() if self.rank == 0 else None
        try:
            return self.ranks.broadcast_assignment(mine)
        except TrainerGroupError as exc:
            if mine is not None:  # taken off the queue: nobody else will say why it never came
                self._give_up(mine.version, exc)
            raise

    def _next_due(self) -> Assignment | None:
        """The next version to serve, once the previous transfer has ended. While that one still runs (e.g. it
        waits out a receiver's timeout after the daemon already failed it), the new version is served at a
        later boundary: announcing it now would leave the other ranks waiting in its gathers, past their
        collective timeout."""
        if not self._pending or (self._current is not None and not self._current.done()):
            return None
        for stale in [a for a in list(self._pending) if self.from_earlier_registration(a)]:
            self._pending.remove(stale)
            log.warning("version %d was assigned before the daemon restarted; skipping it", stale.version)
        if not self._pending:
            return None
        while len(self._pending) > 1:  # the daemon has one version in flight: older ones have ended there
            stale = self._pending.popleft()
            log.warning("version %d was superseded by version %d before it could be served; skipping it",
                        stale.version, self._pending[-1].version)
        return self._pending.popleft()

    def _publish(self, assignment: Assignment, step: int,
                 before_send: Callable[[], None] | None = None) -> Transfer:
        """This rank's part of a version, through the publisher's one entry: the buckets it owns it stores and
        sends, the others it helps gather (every rank calls this for the same versions, in order)."""
        ownership = Ownership(self.rank, assignment.owners, self.ranks.global_rank if self.world_size > 1 else None)
        self._hold_lead_digests(assignment)
        if assignment.source_version is not None:  # a re-push: every owner sends its share from its cache
            return self._publisher().publish(assignment.version, source_version=assignment.source_version,
                                             route=lambda: self._route(assignment), ownership=ownership,
                                             expected_digest=assignment.expected_digest, keep=assignment.keep,
                                             pulled=assignment.pullers > 0)
        return self._publisher().publish(
            assignment.version, self._tensors(), mode=assignment.mode,
            step=assignment.step if assignment.step is not None else step,
            sparse=assignment.sparse, sparse_base=assignment.sparse_base,
            agree=self.ranks.all_reduce_max if self.world_size > 1 else None,
            route=lambda: self._route(assignment), ownership=ownership, keep=assignment.keep,
            sharded=bool(assignment.classes), pulled=assignment.pullers > 0, before_send=before_send)

    def _owner_rank(self, assignment: Assignment) -> int | None:
        return self.rank  # a trainer rank sends (its own group; with several owners, also the owners' group)

    def _route(self, assignment: Assignment, *, build: bool = True) -> Route:
        """Where this rank sends ``assignment``: its groups, rendezvous first (``build=False``: only groups this
        generation already has; none are built, e.g. to tell receivers that a version will not come)."""
        if not build and not self._has_groups_for(assignment):
            return Route(None, {}, None)
        if assignment.classes:  # a sharded version: every class on its own group (see ClassGroups)
            self.group_for(assignment)
            classes = self.class_groups
            return Route(None, {}, None, classes.lanes(assignment.classes) if classes is not None else ())
        return Route(self.group_for(assignment), assignment.ipc_peers, self.owners_group)

    def _has_groups_for(self, assignment: Assignment) -> bool:
        if assignment.classes:
            return self.class_groups is not None and self.class_groups.key == self._classes_key(assignment)
        if assignment.world_size < 2 and assignment.owners <= 1:
            return True
        anchor = self.group if assignment.world_size >= 2 else self.owners_group  # (pulled only: the owners')
        return (anchor is not None and self.groups_built_as == self.agent_id
                and anchor.generation == assignment.generation and not self.group_broken)

    def _classes_key(self, assignment: Assignment) -> ClassGroupsKey:
        mine = owner_part(self.rank)
        parts = tuple(lane.part + mine if lane.ranks else None for lane in assignment.classes)
        several = assignment.owners > 1
        return ClassGroupsKey(assignment.generation, parts, self.rank if several else None, assignment.owners,
                              self.agent_id)

    def _group_for(self, assignment: Assignment, settings: RegisterReply) -> SyncGroup | None:
        """A sharded version's groups: per class, this owner rank's own with the class's receivers (rank 0 of
        it; none for a class of colocated receivers only) and, with several owners, the class's owners' group
        (this rank's rank in it is its owner rank). All built at once; a class whose group does not form
        is sent nothing, the others go on. A plain version's: its one group (see Agent)."""
        if not assignment.classes:
            try:
                return super()._group_for(assignment, settings)
            except MembersAbsent as exc:  # (the plain group of the receivers: ranks are quorum ranks)
                raise ReceiversAbsent(str(exc), [plain_seat(r) for r in exc.absent if r >= 1]) from exc
        key = self._classes_key(assignment)
        if self.class_groups is not None and self.class_groups.key == key:
            return None  # (built for this generation: a group that failed is not tried again before the next)
        self._refuse_older_generation(assignment, settings)
        self._close_groups()

        def build(part: str, rank: int, size: int) -> SyncGroup:
            store = open_store(settings.store_host, settings.store_port, timeout_s=settings.connect_timeout_s)
            return self._sync_group(store, settings, assignment, part, rank, size)

        self.class_groups = ClassGroups(key, assignment.classes, build)
        self.groups = [g for g in self.class_groups.groups if g is not None]
        return None

    @property
    def group_broken(self) -> bool:
        return super().group_broken or (self.class_groups is not None and self.class_groups.broken)

    def _close_groups(self) -> None:
        if self.class_groups is not None:
            self.class_groups.close()
            self.class_groups = None
        super()._close_groups()

    def _assist(self, assignment: Assignment, step: int) -> None:
        """Ranks > 0: take part in every bucket's gather, in the order rank 0 reads them."""
        try:
            self.gathered[assignment.version] = self._publish(assignment, step).gathered_bytes
        except TrainerGroupError:
            raise
        except CkptEngineError as exc:  # the owners agreed not to send it (bypass_cpu): nothing to gather
            log.warning("version %d: %s", assignment.version, exc)

    # ---- serving on rank 0 ---------------------------------------------------------------------------
    def _serve(self, assignment: Assignment, step: int, started: float) -> None:
        version = assignment.version
        if self.rank == 0:
            self.report(version, "snapshotting", step=step)
        self._wait_current(self.settings.version_timeout_s if self.settings else 600)  # one version at a time
        try:
            transfer = self._publish(assignment, step, self._offer_before_send(assignment))
        except TrainerGroupError as exc:
            self.early.forget(version)  # (never offered: its send did not start)
            # No abort to the receivers: it waits in the owners' vote for the ranks that failed (they time out)
            self._give_up(version, exc)
            raise
        except Exception as exc:  # every failure ends the version with a reason in history
            self.early.forget(version)
            log.exception("version %d failed on the trainer", version)
            reason = f"{type(exc).__name__}: {exc}"
            self._report_failure(version, reason, exc)  # the report first: nothing waits on it
            self._abort_before_start(assignment, reason)  # nothing went on the wire: release the receivers
        else:
            self.gathered[version] = transfer.gathered_bytes
            held = time.perf_counter() - started
            self._track(assignment, lambda: transfer, held)
        self.held_seconds.append(time.perf_counter() - started)

    def _offer_before_send(self, assignment: Assignment) -> Callable[[], None] | None:
        """What offers a version its pullers may read as soon as it is cached (``offers_before_send``), called
        by the publisher before its send starts, off the training loop: they read while its send digests it, and
        each owner posts its digests as its send takes them (offered beside the send, the offer waited for the
        CPU behind the send's cutting and digesting). Where it cannot be offered yet, it is offered after its
        send (``_report_result`` waits for this first)."""
        if not offers_before_send(assignment, self.rank):
            return None
        version = assignment.version
        return self.early.offering(
            version, lambda: self.pulls.offer_for(assignment, self._publisher(), self.settings, self.rank),
            lambda offered: self.report(version, "offered", offer=offered.model_dump()),
            lambda why: self.pulls.fail(version, why))

    def _give_up(self, version: int, exc: TrainerGroupError) -> None:
        """The job's own group failed serving ``version``: it fails with that reason, told (bounded) before the
        training loop ends the process."""
        log.error("version %d: %s; the training loop must end", version, exc)
        self._report_failure(version, f"{type(exc).__name__}: {exc}")
        self.flush_reports(_REPORT_BEFORE_EXIT_S)

    def _abort_before_start(self, assignment: Assignment, reason: str) -> None:
        """Tell the receivers on the groups this rank has that the version will not come: no rendezvous here
        (the report of why must not wait behind one)."""
        try:
            self._publisher().abort_before_start(assignment.version, reason,
                                                 lambda: self._route(assignment, build=False))
        except CkptEngineError as exc:  # receivers then fall back on their own timeout
            log.warning("could not tell receivers that version %d is abandoned: %s", assignment.version, exc)

    def _prepare_group(self, assignment: Assignment) -> None:
        try:
            self.group_for(assignment)
        except CkptEngineError as exc:
            log.warning("sync group for version %d not ready yet: %s", assignment.version, exc)
        except Exception:  # the step boundary tries again and reports the failure: this thread must not die mute
            log.exception("preparing the sync group for version %d failed", assignment.version)

    def _track(self, assignment: Assignment, start: Callable[[], Transfer], held: float) -> None:
        """The version this rank sends now: its outcome is reported when the send ends, by the thread that ends
        it (one thread per version: the send's own)."""
        version = assignment.version
        try:
            transfer = start()
        except Exception as exc:  # every failure ends the version with a reason in history
            log.exception("version %d failed on the trainer", version)
            self._report_failure(version, f"{type(exc).__name__}: {exc}", exc)
            return
        self._current = transfer
        transfer.on_done(lambda result: self._report_result(result, held, assignment))

    def _wait_current(self, timeout_s: float) -> None:
        current = self._current
        if current is not None:
            try:
                current.result(timeout_s)
            except CkptEngineError as exc:  # (its sends are bounded: this is a bug's safety net)
                log.warning("version %d still in transfer: %s", current.version, exc)

    def _report_result(self, result: TransferResult, held: float, assignment: Assignment) -> None:
        if not self.early.settled(result.version, BEFORE_SEND_WAIT_S):  # (its offer first)
            self._report_failure(result.version, f"its offer to its pullers did not finish within "
                                 f"{BEFORE_SEND_WAIT_S:.0f} s of its send's end")
            return
        if assignment.pullers and (result.ok or result.version in self.early.offered):
            # (before done: the daemon then waits for the pullers' reports)
            try:
                self._offer_after_send(assignment, result)
            except CkptEngineError as exc:  # the pullers would wait for it in vain: it fails now, saying why
                self._report_failure(result.version, f"the version could not be offered for pulling: {exc}")
                return
        try:
            fields = done_fields(result, self._publisher(), held)
        except Exception as exc:  # the daemon still hears of the version at once, not at its time limit
            log.exception("version %d: building its report failed", result.version)
            self._report_failure(result.version, f"the trainer could not report the outcome: {type(exc).__name__}: "
                                 f"{exc}")
            return
        reply = Reply() if self.rank == 0 and assignment.pullers else None
        self.report(result.version, "done", answered=reply, **fields, group_broken=self.group_broken)
        if reply is not None:  # (the version's time, and then some: the report is retried that long)
            bound = (self.settings.version_timeout_s if self.settings else 600.0) + _REPORT_BOUND_S
            self.pulls.release_when_taken(result.version, reply, self._publisher().own_digests, bound)

    def _hold_lead_digests(self, assignment: Assignment) -> None:
        """The lead posts its digests of a pulled version only once the daemon took its report of it
        (``PullServer.release_when_taken``)."""
        if self.rank == 0 and assignment.pullers:
            self._publisher().own_digests.expect(assignment.version, hold=True)

    def _offer_after_send(self, assignment: Assignment, result: TransferResult) -> None:
        """A version offered before its send: its pullers are told if the send failed. Else it is offered now,
        with what its send put on the wire."""
        if result.version in self.early.offered:
            self.early.offered.discard(result.version)
            if not result.ok:
                self.pulls.fail(result.version, result.reason or "its send failed")
            return
        offer = self.pulls.offer_for(assignment, self._publisher(), self.settings, self.rank, result)
        self.report(result.version, "offered", offer=offer.model_dump())

    def _report_failure(self, version: int, reason: str, exc: BaseException | None = None) -> None:
        """``exc``: what failed it; a sync group that did not form is said so, with whom it names absent. Its
        pullers, if it was offered, are told it failed."""
        self.early.offered.discard(version)
        self.pulls.fail(version, reason)
        publisher = self.publisher
        self.report(version, "done", ok=False, reason=reason,
                    cache_versions=publisher.cache.versions() if publisher else None,
                    group_broken=self.group_broken, absent_ranks=absent_receivers(exc) if exc else [],
                    rendezvous_failed=isinstance(exc, ReceiversAbsent))

    def _evict(self, version: int) -> None:
        evict(self, self._publisher(), version)

    def _on_stage(self, version: int, stage: str) -> None:
        self.report(version, stage)

    def _publisher(self) -> Publisher:
        if self.publisher is None:
            raise CkptEngineError("trainer agent not started")
        return self.publisher


def done_fields(result: TransferResult, publisher: Publisher, held: float) -> dict:
    """A trainer rank's ``done`` report: rank 0's outcome is the version's (with the receivers'
    acknowledgements); another owner's says how its share went; both say what the cache holds now."""
    stages = {k: v for k, v in result.seconds.items() if k != "total"}
    stages["snapshot" if result.mode == "cached" else "held"] = held
    return dict(ok=result.ok, reason=result.reason, version_digest=result.version_digest,
                bytes=result.version_bytes or result.bytes_sent,
                buckets=result.buckets, tensors=result.tensors, tensors_skipped=result.tensors_skipped,
                bytes_skipped=result.bytes_skipped, stages=stages,
                receivers=[ack.model_dump() for ack in result.receivers], cache_versions=publisher.cache.versions(),
                cache_bytes=publisher.cache.bytes_held, absent_ranks=result.absent_ranks, classes=result.classes,
                rendezvous_failed=result.rendezvous_failed)


def evict(agent: Agent, publisher: Publisher, version: int) -> None:
    """The daemon asked this trainer rank to drop its share of ``version``; it says what it holds now."""
    try:
        publisher.cache.evict(version)
    except CkptEngineError as exc:
        log.warning("evict %d: %s", version, exc)
    agent.report(version, "evicted", cache_versions=publisher.cache.versions(), cache_bytes=publisher.cache.bytes_held)
