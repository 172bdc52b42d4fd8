"""A framework's own syncs (verl's update_weights) as versions of the same lifecycle, under the FRAMEWORK
policy (decisions/policy.py). Such a sync is opened by the framework's trainer rank 0, checked by its
registration and not only its token. It is carried by the framework's groups, so nothing is assigned, and
judged by the workers it names. A rollback queued by ``POST /push`` takes the place of the framework's next
sync. Not thread-safe by itself: the controller calls it under its lock."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckpt_engine.config.knobs import Settled
from ckpt_engine.control.messages import FrameworkSyncRequest
from ckpt_engine.server.agents import AgentRegistry
from ckpt_engine.server.cache_book import CacheBook
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.policy import FRAMEWORK
from ckpt_engine.server.errors import BadRequest, Conflict, NotFound, Unavailable
from ckpt_engine.server.flights import Flights, InFlight
from ckpt_engine.server.history import HistoryStore, VersionRecord
from ckpt_engine.server.metrics import Metrics

log = logging.getLogger(__name__)
QuorumProblem = Callable[[AgentRecord | None, list[AgentRecord]], "str | None"]


class FrameworkSyncs:
    def __init__(self, history: HistoryStore, metrics: Metrics, agents: AgentRegistry, book: CacheBook,
                 flights: Flights, create: Callable[..., VersionRecord], require_storage: Callable[[], None]) -> None:
        self.history, self.metrics, self.agents, self.book, self.flights = history, metrics, agents, book, flights
        self._create, self._require_storage = create, require_storage
        self.queued: VersionRecord | None = None  # a rollback waiting for the framework's next sync
        self._told: set[str] = set()  # knob overrides already logged, so each is logged once

    def open(self, request: FrameworkSyncRequest, opener: AgentRecord, settled: Settled, keep: list[int],
             quorum_problem: QuorumProblem) -> dict:
        """Open this sync's version, or the queued rollback in its place. Returns its record, with what a send
        assignment would say: ``expected_digest``, a rollback's source digest as recorded, and ``keep``, the
        cached versions no snapshot may evict because the workers serve them. Also ``knobs``, what the sync
        runs with: ``settled``, the framework's knobs over the deployment's (ckpt_engine/config/knobs.py),
        which the version's record keeps too."""
        mode = settled.mode
        trainer = self.agents.trainer()
        if opener is trainer and not opener.framework:
            raise Conflict(f"agent {opener.agent_id} is a plain trainer: 'receivers' names the workers of a "
                           "framework's own sync, which only a framework's trainer rank 0 opens")
        if opener is not trainer:
            raise Conflict(f"agent {opener.agent_id} is not the framework trainer rank 0 this daemon serves "
                           f"(that is {trainer.agent_id if trainer else 'nobody'})")
        flight = self.flights.current
        if flight is not None and not flight.policy.supersedes_open:
            raise Conflict(f"version {flight.version} is in flight ({flight.purpose}); retry when it has ended",
                           {"in_flight": flight.version, "purpose": flight.purpose})
        # Every check before the open sync is superseded: a request refused leaves it as it was.
        self._require_storage()
        quorum = self._quorum(trainer, request.receivers or [])
        problem = quorum_problem(trainer, quorum)
        if problem:  # a queued rollback stays queued
            failed = self.flights.fail_unstarted(self._create(mode=mode, step=request.step).id, problem)
            raise Unavailable(problem, failed.to_dict())
        if flight is not None:
            self._supersede(flight)
        record = self._take_queued()
        # A rollback's step is the framework's at delivery (verl's global_steps), as for any sync. It is given
        # now, or with the first report.
        if record is not None:
            record = self.history.update(record.id, step=request.step)
        record = record or self._create(mode=mode, step=request.step)
        record = self.history.update(record.id, knobs=settled.record)
        trainer.keep_versions = settled.keep_versions  # what the daemon's trims keep (cache_book.py)
        for line in settled.overrides:  # once per distinct override, not every sync
            if line not in self._told:
                self._told.add(line)
                log.warning("version %d: %s", record.id, line)
        source = self.history.get(record.source_version) if record.source_version else None
        opened = self.flights.open(record, trainer, quorum, policy=FRAMEWORK, limit_s=request.limit_s,
                                   owners=source.owners if source is not None else trainer.trainer_ranks)
        return {**opened.to_dict(), "expected_digest": source.version_digest if source is not None else None,
                "keep": list(keep), "knobs": settled.to_wire()}

    def queue_push(self, record: VersionRecord, trainer: AgentRecord) -> VersionRecord:
        """Queue a rollback: recorded now, sent at the framework's next sync in place of that sync's new
        weights, because the daemon cannot start the framework's transfer. A newer push replaces one still
        waiting."""
        queued = self._create(mode="cached", step=record.step, source_version=record.id)
        previous, self.queued = self.queued, self.history.update(queued.id, purpose="push", reason=(
            f"queued: the trainer is driven by {trainer.framework}; sent at its next sync"))
        if previous is not None:
            self.history.update(previous.id, status="cancelled",
                                reason=f"replaced by version {queued.id} (a push of version {record.id})")
        return self.queued

    def cancel_queued(self, reason: str) -> None:
        queued, self.queued = self.queued, None
        if queued is not None:
            self.history.update(queued.id, status="cancelled", reason=reason)

    def _supersede(self, flight: InFlight) -> None:
        """End an open sync, as interrupted, when the framework opens its next one. The framework runs one
        sync at a time, so the open one was abandoned (verl failed elsewhere, or gave up waiting on a stalled
        daemon for the reply that opened it), or its last reports have not arrived yet. Those reports come on
        other connections than the next sync's opening, so a stalled daemon may see them after it. Waiting for
        the time limit would refuse every sync until then, and the outcome is unknown. A rollback nothing was
        heard of yet is queued again, because the operator asked for it; this sync takes it, and at worst the
        same weights arrive twice."""
        reason = ("superseded: the framework opened its next sync before this version's outcome reached the "
                  "daemon (abandoned, or delivered with its reports still on the way)")
        record = self.history.get(flight.version)
        untouched = record is not None and record.status == "requested" and flight.done is None and not flight.reports
        source = self.history.get(record.source_version) if record is not None and record.source_version else None
        trainer = self.agents.trainer()
        if source is not None and untouched and self.queued is None and trainer is not None:
            # Queued as a new version: reports of the abandoned one may still arrive, and must not count for it.
            try:
                again = self.queue_push(source, trainer)
                reason += f"; the rollback is queued again as version {again.id}"
            except Unavailable as exc:  # the history cannot be written, so the operator pushes it again later
                reason += f"; the rollback could not be queued again ({exc.detail})"
        self.flights.fail(flight, reason, "interrupted")

    def _take_queued(self) -> VersionRecord | None:
        """Take the queued rollback if its source can still be sent; otherwise end it failed, saying why."""
        queued, self.queued = self.queued, None
        if queued is None:
            return None
        source = self.history.get(queued.source_version)  # type: ignore[arg-type]
        if source is not None and source.cached and not self.book.evicting(source.id):
            return queued
        self.flights.fail_unstarted(queued.id, f"version {queued.source_version} is no longer in the trainer's cache "
                                    "(evicted before the framework's next sync)")
        return None

    def _quorum(self, trainer: AgentRecord, receivers: list[str]) -> list[AgentRecord]:
        if len(set(receivers)) != len(receivers):
            raise BadRequest("'receivers' names an agent twice")
        quorum = []
        for agent_id in receivers:
            agent = self.agents.get(agent_id)
            if agent is None:
                raise NotFound(f"receiver {agent_id!r} is not registered (it left, or the daemon restarted)")
            if agent.role != "receiver" or agent.framework != trainer.framework:
                raise Conflict(f"{agent_id!r} is not a {trainer.framework} receiver")
            quorum.append(agent)
        return quorum
