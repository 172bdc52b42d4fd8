"""The version in flight, from its start to its end: the shell around the commit rule.

    requested -> snapshotting -> transferring -> verifying -> committed | failed (reason) | cancelled | interrupted

One version is in flight at a time. ``Flights`` assigns its sends and receives (a plain version) or records
the quorum a framework named, takes the reports (the trainer's stages and outcome, the receivers' own
outcomes, the drivers' applies) and moves each receiver's model, ends the version once the trainer is done
and every receiver reported (or the acknowledgement time ran out), judges it (decisions/commit.py), writes the
history and benches the receivers that failed it for everyone. Not thread-safe by itself: the controller
calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt_engine.config import EngineConfig
from ckpt_engine.control.messages import Assignment, PullOffer, Report
from ckpt_engine.plan.modes import Mode
from ckpt_engine.server.agents import AgentRegistry
from ckpt_engine.server.cache_book import CacheBook
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.assignments import (
    joined_offer,
    offer_problem,
    pull_assignments,
    receive_assignments,
)
from ckpt_engine.server.decisions.commit import expected_digest, judge, staging_entry
from ckpt_engine.server.decisions.ending import (
    STAGE_ORDER,
    Benching,
    advances,
    benchings,
    engine_to_apply,
    ready_to_judge,
    to_discard,
    unoffered_pullers,
    waiting_for,
)
from ckpt_engine.server.decisions.newcomers import NewcomerGate, blamed_for_rendezvous
from ckpt_engine.server.decisions.policy import PLAIN, SyncPolicy
from ckpt_engine.server.decisions.receiver_classes import NO_CLASSES, ClassPlan, expected_by_receiver, plan_lanes
from ckpt_engine.server.history import HistoryStore, VersionRecord
from ckpt_engine.server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    version: int
    mode: Mode
    trainer: str
    quorum: dict[str, int]  # receiver agent id -> rank in the sync group
    engines: dict[str, list[str]]  # driven engines in the quorum -> their members' agent ids
    purpose: str
    started: float
    policy: SyncPolicy = PLAIN
    limit_s: float | None = None  # its own time limit (a framework's timeouts), else timeouts.version_s
    reports: dict[str, Report] = field(default_factory=dict)  # receivers' own outcomes, by agent id
    applied: dict[str, Report] = field(default_factory=dict)  # drivers' outcomes, by engine
    apply_sent: set[str] = field(default_factory=set)
    engines_failed: set[str] = field(default_factory=set)  # a worker failed it: its driver is never asked
    done: Report | None = None  # the trainer's
    done_at: float = 0.0
    owner_failures: dict[int, str] = field(default_factory=dict)  # other owner ranks' own failures, by rank
    classes: ClassPlan = NO_CLASSES  # a sharded version's receiver classes (none: a plain version)
    remote: tuple[str, ...] = ()  # receivers on the version's sync groups (not colocated)
    pullers: tuple[str, ...] = ()  # receivers that pull it over nixl once the trainer offers it
    offered: bool = False  # the trainer's offer went to the pullers
    owners: int = 1  # trainer ranks that own shares of it (each offers its own to the pullers)
    offers: dict[int, PullOffer] = field(default_factory=dict)  # the owner ranks' offers so far, by rank


class Flights:
    def __init__(self, config: EngineConfig, history: HistoryStore, metrics: Metrics, agents: AgentRegistry,
                 book: CacheBook, clock: Callable[[], float], on_end: Callable[[], None]) -> None:
        self.config, self.history, self.metrics, self.agents, self.book = config, history, metrics, agents, book
        self.clock, self.on_end = clock, on_end
        self.gate = NewcomerGate()  # newcomers' admission to regular versions (decisions/newcomers.py)
        self.current: InFlight | None = None
        self.generation = 0
        self.group_dirty = False  # the sync group must be rebuilt for the next version
        self._membership: tuple[str, ...] = ()

    # ---- starting ------------------------------------------------------------------------------------
    def start(self, record: VersionRecord, trainer: AgentRecord, receivers: list[AgentRecord],
              colocated: list[AgentRecord], pulling: list[AgentRecord], *, source: VersionRecord | None,
              sparse_base: int | None, sparse: bool, purpose: str, owners: int, keep: list[int]) -> None:
        """A version the daemon drives: every receiver and the trainer are assigned their part (a puller's comes
        with the trainer's offer: see :meth:`offered`)."""
        remote = [r for r in receivers if r not in colocated and r not in pulling]
        trainers = self.agents.trainers()
        owner_ids = [trainers[r].agent_id for r in range(owners) if r in trainers] if owners > 1 else [trainer.agent_id]
        # (with another number of owners the receivers join other groups: a new generation, fresh store keys)
        quorum = {r.agent_id: rank for rank, r in enumerate(remote + colocated + pulling, start=1)}
        classes = plan_lanes(receivers, quorum, {r.agent_id for r in colocated}, {r.agent_id for r in pulling})
        membership = (*owner_ids, f"owners={owners}", *(r.agent_id for r in remote), "|",
                      *(r.agent_id for r in colocated), "|", *(f"{a}:{s.part}" for a, s in classes.seats.items()))
        if membership != self._membership or self.group_dirty:
            self.generation += 1
            self._membership, self.group_dirty = membership, False
            log.info("sync group generation %d: trainer %s + %d remote and %d colocated receiver(s)",
                     self.generation, trainer.agent_id, len(remote), len(colocated))
        common = dict(version=record.id, mode=record.mode, step=record.step, generation=self.generation,
                      world_size=1 + len(remote), owners=owners)
        # every assignment is made before any is queued: one that cannot be made leaves nothing behind
        send = Assignment(
            kind="send", rank=0, source_version=source.id if source else None, sparse_base=sparse_base,
            sparse=sparse, expected_digest=source.version_digest if source else None, keep=keep,
            ipc_peers={r.agent_id: quorum[r.agent_id] for r in colocated}, classes=classes.lanes,
            pullers=len(pulling), **common)
        receives = receive_assignments(remote, colocated, quorum, classes, trainer.ipc_name, common)
        for receiver, assignment in receives:
            receiver.pending.append(assignment)
        trainer.pending.append(send)
        engines: dict[str, list[str]] = {}
        for receiver in receivers:
            if receiver.driven and receiver.engine is not None:
                engines.setdefault(receiver.engine, []).append(receiver.agent_id)
        self.current = InFlight(record.id, record.mode, trainer.agent_id, quorum, engines, purpose, self.clock(),
                                classes=classes, remote=tuple(r.agent_id for r in remote),
                                pullers=tuple(r.agent_id for r in pulling), owners=owners)
        how = {**{r.agent_id: "ipc" for r in colocated}, **{r.agent_id: "nixl" for r in pulling}}
        self.history.update(record.id, purpose=purpose, owners=owners, receivers=[
            {"rank": r, "agent_id": a, "transport": how.get(a, "collective"),
             **({"shard_class": classes.key_of(a)} if classes.keys else {})}
            for a, r in quorum.items()])
        self.metrics.in_flight.set(1)

    def open(self, record: VersionRecord, trainer: AgentRecord, receivers: list[AgentRecord], *, policy: SyncPolicy,
             owners: int, limit_s: float | None) -> VersionRecord:
        """A version a framework drives on its own groups: nothing is assigned, its named workers report."""
        purpose = "push" if record.source_version else "sync"
        quorum = {r.agent_id: rank for rank, r in enumerate(receivers, start=1)}
        # workers that declared shard specs get their classes' pieces (the framework sends each class its own,
        # grouped as here): each is judged by its class's digest
        classes = plan_lanes(receivers, quorum)
        self.current = InFlight(record.id, record.mode, trainer.agent_id, quorum, {}, purpose, self.clock(),
                                policy=policy, limit_s=limit_s, classes=classes)
        self.metrics.in_flight.set(1)
        return self.history.update(record.id, purpose=purpose, owners=owners, receivers=[
            {"rank": rank, "agent_id": agent_id, "transport": "collective",
             **({"shard_class": classes.key_of(agent_id)} if classes.keys else {})}
            for agent_id, rank in quorum.items()])

    # ---- reports -------------------------------------------------------------------------------------
    def trainer_event(self, flight: InFlight, message: Report) -> None:
        if message.group_broken:
            self.group_dirty = True
        if message.event in STAGE_ORDER:
            current = self.history.get(flight.version)
            if current and advances(current.status, message.event):
                step = {"step": message.step} if current.step is None and message.step is not None else {}
                self.history.update(flight.version, status=message.event, **step)
        elif message.event == "offered":
            self.offered(flight, 0, message)
        elif message.event == "done" and flight.done is None:
            flight.done, flight.done_at = message, self.clock()
            self.maybe_finish(flight)

    def offered(self, flight: InFlight, rank: int, message: Report) -> None:
        """Trainer rank ``rank`` holds its share of the version ready to be pulled. Once every owner rank has
        offered, each puller still here gets their offers joined into one (once)."""
        offer = message.offer
        problem = offer_problem(flight.version, flight.owners, rank, offer, set(flight.offers))
        if problem is not None or flight.offered:
            log.warning("ignoring trainer rank %d's offer for version %s: %s", rank, offer.version if offer else None,
                        problem or "offered already")
            return
        flight.offers[rank] = offer  # type: ignore[assignment]
        joined = joined_offer(flight.version, flight.owners, flight.offers)
        if joined is None:
            return
        flight.offered = True
        for agent_id, assignment in pull_assignments(flight.version, flight.mode, message.step,
                                                     {a: flight.quorum[a] for a in flight.pullers}, joined,
                                                     flight.classes.keys):
            if (puller := self.agents.get(agent_id)) is not None:
                puller.pending.append(assignment)

    def receiver_outcome(self, agent: AgentRecord, message: Report, flight: InFlight | None) -> None:
        """A receiver's own outcome: what its model holds now, and its vote on the version."""
        model, now = agent.model, self.clock()
        if message.staging is not None:
            agent.staged_last = staging_entry(message)
        if message.ok:
            model.took(message.version, driven=agent.driven)
        elif message.torn:
            self.tear([agent], message.reason or "its apply failed part way")
        else:  # refused or not verified: the model holds what the receiver says (nothing changed)
            held = message.serving if message.serving is not None and self.book.known([message.serving]) else None
            model.refused(held, driven=agent.driven)
        if message.unable:
            delay = model.benched(message.unable, now)
            log.warning("receiver %s cannot receive for now (%s); out of the quorum for %.0fs", agent.agent_id,
                        message.unable, delay)
        if flight is not None and agent.agent_id in flight.quorum:
            if message.group_broken:
                self.group_dirty = True
            flight.reports.setdefault(agent.agent_id, message)
            if not message.ok:
                self._engine_fails_together(flight, agent, message)
            self.maybe_finish(flight)
        elif flight is None:
            self._late_outcome(agent, message)

    def staged(self, agent: AgentRecord, message: Report, flight: InFlight) -> None:
        """A driven receiver verified the version; once every member of its engine has, the driver applies it."""
        if not agent.driven or agent.agent_id not in flight.quorum:  # (only an engine's workers wait for a driver)
            log.warning("ignoring %s's staged report for version %d: it is not a driven worker of its quorum",
                        agent.agent_id, message.version)
            return
        agent.model.staged_version(message.version)
        engine = agent.engine
        if engine is None:
            return
        staged = {a: m.model.staged for a in flight.engines.get(engine, ()) if (m := self.agents.get(a))}
        if engine_to_apply(engine, flight.engines, flight.apply_sent | flight.engines_failed, staged,
                           flight.version):
            driver = self.agents.driver(engine)
            if driver is not None:
                driver.applying = flight.version
                record = self.history.get(flight.version)
                driver.pending.append(Assignment(kind="apply", version=flight.version, mode=flight.mode,
                                                 step=record.step if record else None))
                flight.apply_sent.add(engine)

    def applied(self, driver: AgentRecord, message: Report, flight: InFlight | None) -> None:
        """A driver's outcome for its whole engine: members serve the version, or the engine is torn. Only the
        outcome of the apply the daemon asked this driver for counts."""
        if driver.engine is None or driver.applying != message.version:
            log.warning("ignoring driver %s's outcome of version %d: it was not asked to apply it", driver.agent_id,
                        message.version)
            return
        driver.applying = None
        members = self.agents.engine_members(driver.engine)
        if message.ok:
            for member in members:
                member.model.applied(message.version)
        elif message.torn:
            self.tear(members, f"engine {driver.engine}: {message.reason or 'apply failed part way'}")
        if not message.ok:  # workers still holding the version staged would wait for it in vain
            for member in members:
                if member.model.staged == message.version:
                    member.model.unstaged()
                    member.pending.append(Assignment(kind="discard", version=message.version,
                                                     reason=f"the engine's driver failed: {message.reason}"[:2000]))
        if flight is not None:
            flight.applied[driver.engine] = message
            self.maybe_finish(flight)

    def _engine_fails_together(self, flight: InFlight, agent: AgentRecord, message: Report) -> None:
        """A driven worker that failed the version fails its whole engine: the other workers drop what they
        staged now (not at their take timeout), and its driver is never asked to apply it."""
        engine = agent.engine
        discard = to_discard(engine, flight.engines, flight.apply_sent | flight.engines_failed, agent.agent_id,
                             flight.reports) if agent.driven else None
        if discard is None or engine is None:
            return
        flight.engines_failed.add(engine)
        why = f"worker {agent.agent_id} of engine {engine} failed it: {message.reason or 'failed'}"[:2000]
        for member_id in discard:
            member = self.agents.get(member_id)
            if member is None:
                continue
            member.model.unstaged()
            member.pending.append(Assignment(kind="discard", version=flight.version, reason=why))

    def tear(self, agents: list[AgentRecord], reason: str) -> None:
        for agent in agents:
            agent.model.tore(reason)
            log.warning("receiver %s is torn (%s); it will be repaired from the cache", agent.agent_id, reason)

    def late_owner_failure(self, rank: int, message: Report) -> None:
        """An owner rank's failure that arrived after its version ended: said in the version's reason."""
        record = self.history.get(message.version)
        if record is None or record.status not in ("committed", "failed"):
            return
        note = f"owner rank {rank} failed afterwards: {message.reason or 'failed'}"
        log.warning("version %d: %s", message.version, note)
        self.history.update(message.version, reason=f"{record.reason}; {note}" if record.reason else note)

    def _late_outcome(self, agent: AgentRecord, message: Report) -> None:
        """An outcome that arrived after its version ended: correct that receiver's entry in the history."""
        record = self.history.get(message.version)
        if record is None:
            return
        entries = [dict(e) for e in record.receivers]
        for entry in entries:
            if entry.get("agent_id") == agent.agent_id and entry.get("missing_report"):
                entry.update(ok=bool(message.ok), reason=message.reason, version_digest=message.version_digest,
                             missing_report=False, reported_late=True, **self._held_after(agent.agent_id))
                self.history.update(record.id, receivers=entries)
                return

    # ---- ending --------------------------------------------------------------------------------------
    def maybe_finish(self, flight: InFlight) -> None:
        """End the version once the trainer is done and every receiver of the quorum that is still registered
        has reported its own outcome (or the acknowledgement time has passed since the trainer was done)."""
        done = flight.done
        if done is None or self.current is not flight:
            return
        waiting = waiting_for(flight.quorum, flight.reports, set(done.absent_ranks),
                              {a for a in flight.quorum if self.agents.get(a) is not None}, flight.apply_sent,
                              flight.applied, {e for e in flight.apply_sent if self.agents.driver(e) is not None})
        never = self._unoffered(flight, done)
        waiting = [agent for agent in waiting if agent not in never]
        ack_s = self.config.timeouts.ack_s
        pull_s = (flight.limit_s or self.config.timeouts.version_s) - (flight.done_at - flight.started) - ack_s
        if ready_to_judge(done.version_digest is not None, waiting, self.clock() - flight.done_at, ack_s,
                          flight.pullers, pull_s):
            self._finish(flight, done)

    @staticmethod
    def _unoffered(flight: InFlight, done: Report) -> set[str]:
        return unoffered_pullers(flight.pullers, flight.offered, done.ok is False or bool(flight.owner_failures))

    def _finish(self, flight: InFlight, done: Report) -> None:
        record = self.history.get(flight.version)
        source = self.history.get(record.source_version) if record and record.source_version is not None else None
        expected, stale = expected_digest(done, source.version_digest if source else None,
                                          source.id if source else None)
        never = self._unoffered(flight, done)
        for agent_id in flight.quorum:  # what a receiver that never said holds is unknown: a full version next
            agent = self.agents.get(agent_id)
            if agent is not None and agent_id not in flight.reports and agent_id not in never:
                agent.model.lost_track()
        outcome = judge(flight.quorum, flight.reports, done, engines=flight.engines, applied=flight.applied,
                        unoffered=never,
                        owner_failures=flight.owner_failures,
                        transports={e["agent_id"]: e.get("transport") for e in (record.receivers if record else [])},
                        expected=expected, stale=stale, expected_for=self._class_digests(flight, done),
                        need=flight.policy.need(len(flight.quorum), self.config.min_receivers))
        for entry in outcome.entries:
            entry.update(self._held_after(entry["agent_id"]))
            if flight.classes.keys:
                own = flight.reports.get(entry["agent_id"])
                entry.update(shard_class=flight.classes.key_of(entry["agent_id"]), bytes=own.bytes if own else None,
                             received_fraction=round(own.bytes / done.bytes, 4) if own and done.bytes else None)
        # (other owners' shares: as far as their reports have come; each later report updates it)
        cached = (flight.mode == "cached" and done.cache_versions is not None and flight.version in done.cache_versions
                  and not self.book.missing_shares(flight.version))
        self.history.update(flight.version, status=outcome.status, reason=outcome.reason, bytes=done.bytes,
                            buckets=done.buckets, tensors_sent=done.tensors, tensors_skipped=done.tensors_skipped,
                            bytes_skipped=done.bytes_skipped, stages=outcome.stages, receivers=outcome.entries,
                            version_digest=done.version_digest, cached=cached)
        if outcome.status != "committed" or any(not e["ok"] for e in outcome.entries):
            self.group_dirty = True
        absent = self._blamed_for_rendezvous(flight, done)
        newcomers = [a for a in absent if (agent := self.agents.get(a)) is not None and not agent.model.proven]
        if newcomers and flight.purpose not in ("catch_up", "repair"):  # (a version of their own costs nobody)
            delay = self.gate.missed(self.clock(), f"receiver(s) {newcomers} never joined version {flight.version}")
            log.warning("newcomers wait %.0fs before joining regular versions: %s never joined version %d",
                        delay, newcomers, flight.version)
        unfit = [([a for a, key in flight.classes.keys.items() if key == c.key], c.reason or "")
                 for c in done.classes if c.spec_unfit]
        for bench in benchings(flight.version, heard_everyone=done.version_digest is not None,
                               silent=outcome.silent, unfit_classes=unfit, absent=absent):
            self._bench(bench)
        for agent_id in outcome.committed:  # it took a whole version under this registration
            agent = self.agents.get(agent_id)
            if agent is not None:
                if not agent.model.proven:
                    self.gate.proved()
                agent.model.proved()
        self._end(flight, outcome.status, done.bytes, outcome.stages)

    def _blamed_for_rendezvous(self, flight: InFlight, done: Report) -> list[str]:
        """Whom a sync group that did not form is laid at (decisions/newcomers.py ``blamed_for_rendezvous``):
        the receivers the trainer names absent, weighed against who proved themselves."""
        by_rank = {rank: agent_id for agent_id, rank in flight.quorum.items()}
        named = [by_rank[r] for r in done.absent_ranks if r in by_rank]
        if flight.classes.keys:
            unformed = {c.key for c in done.classes if c.rendezvous_failed}
            members = [a for a in flight.remote if flight.classes.keys.get(a) in unformed]
        else:
            members = list(flight.remote) if done.rendezvous_failed else []
        proven = {a for a in flight.quorum if (agent := self.agents.get(a)) is not None and agent.model.proven}
        return blamed_for_rendezvous(named, members, proven)

    @staticmethod
    def _class_digests(flight: InFlight, done: Report) -> dict[str, str | None] | None:
        """A sharded version's receivers each verify their class's pieces: the digest to compare is their
        class's, as the trainer sent it (see expected_by_receiver)."""
        if not flight.classes.keys:
            return None
        return expected_by_receiver(flight.classes, done.classes)

    def _bench(self, bench: Benching) -> None:
        for agent_id in bench.agents:
            agent = self.agents.get(agent_id)
            if agent is not None:
                delay = agent.model.benched(bench.why, self.clock(), unproven=bench.unproven)
                log.warning("receiver %s %s; out of the quorum for %.0fs", agent_id, bench.why, delay)

    def _held_after(self, agent_id: str) -> dict:
        """A receiver's history entry: what its model holds once the version ended (every entry says it)."""
        agent = self.agents.get(agent_id)
        return {"engine": agent.engine if agent else None, "serving_after": agent.model.serving if agent else None,
                "torn": agent is not None and agent.model.torn is not None}

    def fail_unstarted(self, version: int, reason: str) -> VersionRecord:
        """A version that could not start (no quorum, no route, its rollback source gone): failed, counted,
        and returned for the caller's answer. Nothing was assigned, so no receiver's state changes."""
        failed = self.history.update(version, status="failed", reason=reason)
        self.metrics.version_done("failed", 0, {})
        return failed

    def fail(self, flight: InFlight, reason: str, status: str = "failed") -> None:
        owners = [f"owner rank {rank}: {why}" for rank, why in sorted(flight.owner_failures.items())]
        if owners:  # what other owner ranks already said went wrong (e.g. before the lead went away)
            reason = "; ".join([reason, *owners])
        log.warning("version %d %s: %s", flight.version, status, reason)
        record = self.history.get(flight.version)
        receivers = [dict(e) for e in (record.receivers if record else [])]
        for agent_id in flight.quorum:
            agent = self.agents.get(agent_id)
            if agent is not None and agent_id not in flight.reports:
                agent.model.lost_track()  # it may still be applying the version: unknown until it reports
        for entry in receivers:  # (what a judged version's entries say too: judge() and _finish)
            own = flight.reports.get(entry.get("agent_id", ""))
            entry.update(ok=False, reason=(own.reason if own and not own.ok else None) or reason,
                         missing_report=own is None, staging=staging_entry(own) if own else None,
                         **self._held_after(entry.get("agent_id", "")))
        self.history.update(flight.version, status=status, reason=reason, receivers=receivers)
        self.group_dirty = True
        self._end(flight, "failed", 0, {})

    def _end(self, flight: InFlight, outcome: str, nbytes: int, stages: dict[str, float]) -> None:
        self.metrics.version_done(outcome, nbytes, stages)
        self.metrics.in_flight.set(0)
        if self.current is flight:
            self.current = None
        for agent_id in flight.quorum:
            agent = self.agents.get(agent_id)
            if agent is None:
                continue
            agent.model.unstaged()
            if not agent.model.whole() and flight.purpose in ("catch_up", "repair"):
                agent.model.catch_up_failed(self.clock())
        for agent in self.agents.all():  # drop leftovers of this version for agents that never picked them up
            agent.pending = type(agent.pending)(a for a in agent.pending if a.version != flight.version)
        self.on_end()
