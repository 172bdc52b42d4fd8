"""The controller: every operation of the daemon, under one lock, in one order of events.

It is the shell around the decisions in server/decisions/: who may register as what, who takes a version,
what committed, who is repaired with which version, plain versus framework syncs. The shell reads the clock
once per operation, writes the history, counts the metrics and queues the agents' assignments. ``Flights``
(server/flights.py) owns the version in flight; ``CacheBook`` owns what the trainer's caches hold.

One version is in flight at a time. A request while one is in flight is refused (409 naming it) rather than
queued, except that a framework's next sync supersedes its own abandoned one. Every outcome, including a
refusal for lack of agents, is a history row. What committed is decided by the receivers' own reports, never
by the trainer's claim alone.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Set
from typing import Any

from ckpt_engine.config import EngineConfig
from ckpt_engine.config.knobs import settle
from ckpt_engine.control.auth import TOKEN_OF_AGENT
from ckpt_engine.control.messages import (
    FrameworkSyncRequest,
    Poll,
    PollReply,
    Register,
    RegisterReply,
    Report,
    SyncRequest,
    longest_poll_wait,
)
from ckpt_engine.errors import ConfigError, ProtocolError
from ckpt_engine.plan.modes import resolve
from ckpt_engine.server.agents import AgentRegistry
from ckpt_engine.server.cache_book import CacheBook
from ckpt_engine.server.decisions import quorum as rules
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.cadence import CatchUpPause, offer
from ckpt_engine.server.decisions.policy import FRAMEWORK, policy_of
from ckpt_engine.server.decisions.repair import plan_catch_up
from ckpt_engine.server.decisions.tick_health import TickHealth
from ckpt_engine.server.errors import BadRequest, Conflict, Forbidden, NotFound, Unavailable
from ckpt_engine.server.flights import Flights
from ckpt_engine.server.framework import FrameworkSyncs
from ckpt_engine.server.history import HistoryStore, StorageUnavailable, VersionRecord
from ckpt_engine.server.metrics import Metrics
from ckpt_engine.server.quorum_view import QuorumView
from ckpt_engine.server.receivers_view import receiver_rows_of
from ckpt_engine.server.registrar import Registrar
from ckpt_engine.server.state_view import StateView

log = logging.getLogger(__name__)
_EVENTS_OF = {"trainer": {"snapshotting", "transferring", "verifying", "offered", "done", "evicted"},
              "receiver": {"staged", "received"}, "driver": {"applied"}}


class Controller:
    def __init__(self, config: EngineConfig, history: HistoryStore, metrics: Metrics, *, store_host: str,
                 store_port: int, group_name: str, clock: Callable[[], float] = time.monotonic,
                 engine_secret: bytes | None = None) -> None:
        """``engine_secret``: what engines' worker keys derive from; by default random, for this run only."""
        self.config, self.history, self.metrics, self.clock = config, history, metrics, clock
        # read when scraped, so the metric says what /health and /status say at that moment
        metrics.storage_degraded.set_function(lambda: float(history.degraded))
        metrics.watch_receivers(lambda: receiver_rows_of(self))
        self.store_host, self.store_port, self.group_name = store_host, store_port, group_name
        self.agents = AgentRegistry(config.timeouts.heartbeat_s, clock)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.book = CacheBook(history, self.agents, metrics)
        self.flights = Flights(config, history, metrics, self.agents, self.book, clock, self._version_ended)
        self.registrar = Registrar(config, history, self.agents, self.book, group_name=group_name,
                                   store_host=store_host, store_port=store_port,
                                   engine_secret=engine_secret or secrets.token_bytes(32))
        self.framework = FrameworkSyncs(history, metrics, self.agents, self.book, self.flights, self._create,
                                        self._require_storage)
        self._last_tick = clock()
        self._catch_up_pause = CatchUpPause()
        self.tick_health = TickHealth(clock())  # the daemon's ticker reports here how its calls of tick() went
        self._kept: list[int] = []  # what the trainer was last told to keep in its cache for repairs
        self.started_at = time.time()
        self.quorum = QuorumView(config, history, self.agents, self.book, self.flights)
        self.view = StateView(config, history, self.agents, self.book, self.flights, self.framework,
                              config.timeouts.heartbeat_s, self.quorum.repair_source)

    @property
    def heartbeat_s(self) -> float:
        return self.config.timeouts.heartbeat_s

    # ---- agents -------------------------------------------------------------------------------------
    def register(self, message: Register) -> RegisterReply:
        with self._lock:
            agent, replaced = self.registrar.admit(message, self.clock())
            for old in replaced:
                self._gone(old, f"trainer agent {old.agent_id} was replaced by a restarted process")
            if agent.role == "trainer":
                self.book.update()
            self.view.show_gauges(self.metrics)
            return self.registrar.reply(agent)

    def _gone(self, agent: AgentRecord, reason: str) -> None:
        """Remove an agent that left (unregistered, expired, replaced), with its share of the caches and its
        version."""
        self.agents.remove(agent.agent_id)
        self.flights.group_dirty = True
        if agent.role == "trainer":
            self.book.update()
            if agent.framework:  # its next sync will not come, so a queued push must be asked for again
                self.framework.cancel_queued(f"the {agent.framework} trainer {agent.agent_id} left before its next "
                                             f"sync ({reason}); push the version again")
        flight = self.flights.current
        if flight is not None and flight.trainer == agent.agent_id:
            self.flights.fail(flight, reason)

    def acknowledge(self, message: Poll, roles: Set[str]) -> None:
        """Take in a poll: the agent is alive, holds ``versions``, and got the assignment it names."""
        with self._lock:
            agent = self._agent(message.agent_id, message.session, roles)
            longest = longest_poll_wait(self.heartbeat_s)
            if message.wait_s > longest:  # a longer wait would let the agent expire while it waits
                if agent.poll_wait_s != longest:
                    log.warning("agent %s polls with a wait of %.1fs, longer than the heartbeat (%.1fs) allows: "
                                "its polls wait %.1fs", agent.agent_id, message.wait_s, self.heartbeat_s, longest)
                message.wait_s = longest
            agent.versions, agent.poll_wait_s = self.book.known(message.versions), message.wait_s
            if agent.pending and message.received == agent.pending[0].key():
                agent.pending.popleft()
            now = self.clock()
            if message.unable and agent.role == "receiver" and agent.model.able(now):
                delay = agent.model.benched(message.unable, now)
                log.warning("receiver %s cannot receive for now (%s); out of the quorum for %.0fs", agent.agent_id,
                            message.unable, delay)

    def poll(self, message: Poll, roles: Set[str]) -> PollReply:
        """The agent's next assignment, if any (it stays queued until a later poll acknowledges it), and the
        version in flight now."""
        with self._lock:
            agent = self._agent(message.agent_id, message.session, roles)
            flight = self.flights.current
            return PollReply(assignment=agent.pending[0] if agent.pending else None,
                             in_flight=flight.version if flight is not None else None)

    def has_pending(self, agent_id: str) -> bool:
        with self._lock:
            agent = self.agents.get(agent_id)
            return agent is None or bool(agent.pending)  # a vanished agent's poll is answered at once

    def report(self, message: Report, roles: Set[str]) -> bool:
        """Take an agent's report. True when it is the trainer's outcome of the version in flight and the
        version is still in flight after it: its pullers may then load it (the lead posts its digests only
        then: workers/trainer_agent.py)."""
        with self._lock:
            agent = self._agent(message.agent_id, message.session, roles)
            if message.event not in _EVENTS_OF[agent.role]:
                raise BadRequest(f"a {agent.role} agent cannot report {message.event!r}")
            # Cache bookkeeping may name versions of an older history file; anything else must be a known one.
            if message.event != "evicted" and self.history.get(message.version) is None:
                raise NotFound(f"version {message.version} is unknown")
            if agent.role == "trainer":
                self.book.trainer_reported(agent, message)
            flight = self.flights.current
            current = flight if flight is not None and message.version == flight.version else None
            if message.event == "received":
                self.flights.receiver_outcome(agent, message, current)
            elif message.event == "staged" and current is not None:
                self.flights.staged(agent, message, current)
            elif message.event == "applied":
                self.flights.applied(agent, message, current)
            elif current is not None and agent.agent_id == current.trainer:
                self.flights.trainer_event(current, message)
            elif current is not None and agent.role == "trainer" and message.event == "offered":
                self.flights.offered(current, agent.rank, message)  # (another owner rank's share)
            elif current is not None and agent.role == "trainer" and message.event == "done" and message.ok is False:
                current.owner_failures[agent.rank] = message.reason or "failed"
                self.flights.maybe_finish(current)  # (its pullers may now wait for nothing)
            elif agent.role == "trainer" and message.event == "done" and message.ok is False and agent.rank > 0:
                self.flights.late_owner_failure(agent.rank, message)
            elif message.event not in ("evicted", "staged"):
                log.info("ignoring %s report for version %d (not in flight)", message.event, message.version)
            self._changed.notify_all()
            return current is not None and current.done is message and self.flights.current is current

    def unregister(self, agent_id: str, session: str, roles: Set[str]) -> None:
        """Remove an agent that leaves cleanly now, rather than after the heartbeat timeout."""
        with self._lock:
            agent = self._agent(agent_id, session, roles)
            self._gone(agent, f"trainer agent {agent.agent_id} left during the version")
            self.view.show_gauges(self.metrics)
        log.info("agent %s (%s rank %d) left", agent.agent_id, agent.role, agent.rank)

    def agents_public(self) -> list[dict]:
        """Every agent as GET /receivers shows it, a receiver also with whether it joins the next version and
        why not. Its lag is added outside the lock (server/receivers_view.py)."""
        with self._lock:
            now = self.clock()
            return self.view.agents_public({r.agent_id for r in self.quorum.candidates(now)}, now)

    # ---- versions -----------------------------------------------------------------------------------
    def request_sync(self, request: SyncRequest) -> VersionRecord:
        """A new version as ``request`` asks, with the deployment's defaults where it says nothing."""
        try:
            mode, sparse = resolve(request.bypass_cpu, request.sparse, default_bypass_cpu=self.config.bypass_cpu,
                                   default_sparse=self.config.sparse)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        with self._lock:
            trainer = self._open_slot()
            now = self.clock()
            receivers = self.quorum.candidates(now)
            due = offer(receivers)
            if receivers and not due:
                record = self._create(mode=mode, step=request.step)
                return self.history.update(record.id, status="cancelled",
                                           reason="no receiver is due for this version (sync_every)")
            record = self._create(mode=mode, step=request.step)
            self._start(record, trainer, due, now, sparse=sparse)
            return record

    def push(self, version: int) -> VersionRecord:
        """Send cached ``version`` again (rollback), now or at a framework's next sync."""
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        if record.status != "committed":
            raise Conflict(f"version {version} is {record.status}: only a committed version can be pushed")
        with self._lock:
            if not record.cached:
                raise Conflict(f"version {version} is not in the trainer's cache{self.book.why_not_cached(record)}")
            trainer = self.agents.trainer()
            if trainer is not None and policy_of(trainer.framework).queues_rollbacks:
                self._require_storage()
                return self.framework.queue_push(record, trainer)
            trainer = self._open_slot()
            pushed = self._create(mode="cached", step=record.step, source_version=version)
            self._start(pushed, trainer, self.quorum.candidates(self.clock()), self.clock(), source=record)
            return pushed

    def framework_sync(self, request: FrameworkSyncRequest, roles: Set[str]) -> dict:
        """A framework's own sync (verl's update_weights) as a version (server/framework.py)."""
        with self._lock:
            if request.agent_id is None or request.session is None:
                raise BadRequest("a framework's sync names the trainer agent opening it (agent_id, session)")
            opener = self._agent(request.agent_id, request.session, roles)
            # An older framework agent says bypass_cpu and sparse in the request's own fields.
            given: dict[str, Any] = {k: v for k, v in (("bypass_cpu", request.bypass_cpu), ("sparse", request.sparse))
                                     if v is not None}
            given.update((k, v) for k, v in (request.knobs or {}).items())
            try:  # the one place a framework's knobs meet the deployment's: ckpt_engine/config/knobs.py
                settled = settle(given, self.config, framework=opener.framework or "framework")
            except ConfigError as exc:
                raise BadRequest(str(exc)) from None
            self._kept = self.book.kept_for_repairs(settled.keep_versions)
            return self.framework.open(request, opener, settled, self._kept,
                                       lambda trainer, quorum: self.quorum.problem(trainer, quorum, self.clock()))

    def _open_slot(self) -> AgentRecord | None:
        """The trainer, or None, once it is checked that nothing is in flight, the history is writable and the
        daemon drives the trainer. Raises Conflict or Unavailable otherwise."""
        flight = self.flights.current
        if flight is not None:
            if flight.purpose in ("catch_up", "repair"):
                self._catch_up_pause.sync_refused(self.clock(), self.config.timeouts.connect_s)
            raise Conflict(f"version {flight.version} is in flight ({flight.purpose}); retry when it has ended",
                           {"in_flight": flight.version, "purpose": flight.purpose})
        self._require_storage()
        trainer = self.agents.trainer()
        if trainer is not None and not policy_of(trainer.framework).assigns:
            raise Conflict(f"the trainer is driven by {trainer.framework}: its versions start at "
                           f"{trainer.framework}'s own syncs (POST /push queues a rollback for its next one)")
        return trainer

    def _start(self, record: VersionRecord, trainer: AgentRecord | None, receivers: list[AgentRecord], now: float, *,
               sparse: bool = False, source: VersionRecord | None = None) -> None:
        """Start a version the daemon drives, or record why it cannot and raise 503 with the failed record."""
        receivers = rules.within_class_limit(receivers)
        problem = self.quorum.problem(trainer, receivers, now)
        if problem is None:
            owners, colocated, pulling, problem = self.quorum.routes(trainer, receivers, source,  # type: ignore[arg-type]
                                                                     record.mode, now)
        if problem:
            raise Unavailable(problem, self.flights.fail_unstarted(record.id, problem).to_dict())
        # (pullers read a sparse version's changes out of one owner's delta; with several owners and any puller
        # the version goes whole, to every receiver)
        sparse = sparse and source is None and not (pulling and owners > 1)
        self._launch(record, trainer, receivers, colocated, pulling, owners, source=source,  # type: ignore[arg-type]
                     sparse_base=rules.sparse_base(receivers) if sparse else None, sparse=sparse,
                     purpose="push" if source is not None else "sync")

    def _launch(self, record: VersionRecord, trainer: AgentRecord, receivers: list[AgentRecord],
                colocated: list[AgentRecord], pulling: list[AgentRecord], owners: int, *,
                source: VersionRecord | None, sparse_base: int | None = None, sparse: bool = False,
                purpose: str) -> None:
        self._kept = self.book.kept_for_repairs(self.config.keep_versions)
        self.flights.start(record, trainer, receivers, colocated, pulling, source=source, sparse_base=sparse_base,
                           sparse=sparse, owners=owners, keep=self._kept, purpose=purpose)

    def request_evict(self, version: int) -> VersionRecord:
        """Ask the trainer ranks to drop ``version`` from their caches. Returns at once; the history's
        ``cached`` flag turns false once they confirm."""
        with self._lock:
            flight = self.flights.current
            sending = self.history.get(flight.version) if flight is not None and flight.purpose == "push" else None
            return self.book.ask_evict(version, sending)

    def status(self) -> dict:
        with self._lock:
            return self.view.status(self.clock(), self.started_at)

    # ---- the periodic work --------------------------------------------------------------------------
    def tick(self) -> None:
        """Called periodically: expire silent agents, end versions past their time limit, write what storage
        still owes, and bring a version to receivers that hold none."""
        self.history.flush()
        with self._lock:
            now = self.clock()
            stalled, self._last_tick = now - self._last_tick, now
            if stalled > self.heartbeat_s / 2:  # SIGSTOP, swap, a long GC: the daemon was silent, not the agents
                log.warning("the daemon itself did not run for %.1fs; agents get a new heartbeat window", stalled)
                self.agents.refresh()
            for agent in self.agents.expire():
                log.warning("agent %s (%s rank %d) missed heartbeats; marked gone", agent.agent_id, agent.role,
                            agent.rank)
                self._gone(agent, f"trainer agent {agent.agent_id} went away during the version")
            flight = self.flights.current
            if flight is not None:
                self.flights.maybe_finish(flight)
            flight = self.flights.current
            limit = (flight.limit_s or self.config.timeouts.version_s) if flight else 0.0
            if flight and now - flight.started > limit:
                state = self.history.get(flight.version)
                self.flights.fail(flight, f"timed out in state {state.status if state else '?'} after {limit:.0f}s")
            if self.flights.current is None and not self.history.degraded:
                self._catch_up(now)
            self.view.show_gauges(self.metrics)

    def shutdown(self, grace_s: float) -> None:
        """Give the in-flight version ``grace_s`` to end, then end it, so history is never left dangling."""
        with self._lock:
            flight = self.flights.current
            if flight is None:
                log.warning("shutting down: no version in flight")
            else:
                log.warning("shutting down: giving version %d, in flight, up to %.0fs to end", flight.version, grace_s)
            deadline = self.clock() + grace_s
            while self.flights.current is not None and self.clock() < deadline:
                self._changed.wait(0.2)
            if self.flights.current is not None:  # receivers may have applied it, so its outcome is unknown
                log.warning("version %d did not end within %.0fs: recorded interrupted", self.flights.current.version,
                            grace_s)
                self.flights.fail(self.flights.current, "the daemon stopped before this version's outcome was "
                                  "known; receivers may hold it (they are sent a whole version again)", "interrupted")
            self.framework.cancel_queued("the daemon stopped before the framework's next sync")

    def _catch_up(self, now: float) -> None:
        """Send receivers that hold no whole version one from the trainer's cache, without the training loop.
        decisions/repair.py decides who gets which version."""
        trainer = self.agents.trainer()
        if trainer is None or not policy_of(trainer.framework).catches_up or self._catch_up_pause.holds(now):
            return
        latest = self.history.latest(status="committed")
        plan = plan_catch_up(self.quorum.candidates(now, regular=False), now, latest.id if latest else None,
                             self.book.cached_source)
        source = self.history.get(plan.source) if plan is not None else None
        if plan is None or source is None or not rules.heard(trainer, now, self.heartbeat_s):
            return
        receivers = rules.within_class_limit(plan.receivers)
        owners, colocated, pulling, problem = self.quorum.routes(trainer, receivers, source, "cached", now)
        if problem:
            return
        try:
            record = self._create(mode="cached", step=source.step, source_version=source.id)
        except Unavailable:
            return
        log.info("%s: version %d to %d receiver(s) as version %d", plan.purpose, source.id, len(receivers), record.id)
        self._launch(record, trainer, receivers, colocated, pulling, owners, source=source, purpose=plan.purpose)

    # ---- internals ----------------------------------------------------------------------------------
    def _version_ended(self) -> None:
        """Called under the lock when a version ended. The trainer ranks drop what no longer earns a cache slot:
        a failed version at once, the oldest committed one past keep_versions. Then the waiters are woken."""
        trainer = self.agents.trainer()
        queued = self.framework.queued
        protected = {queued.source_version} if queued is not None and queued.source_version is not None else set()
        limit = trainer.keep_versions if trainer is not None and trainer.keep_versions else self.config.keep_versions
        dropped = self.book.trim(limit, protected)
        if dropped:
            log.info("trainer caches: dropping version(s) %s (not committed, or past the newest %d committed)",
                     dropped, limit)
        self._changed.notify_all()

    def _agent(self, agent_id: str, session: str, roles: Set[str]) -> AgentRecord:
        agent = self.agents.get(agent_id, session)
        if agent is None:
            # One answer for an unknown id and a wrong secret, so a peer learns nothing about other agents.
            raise ProtocolError(f"unregistered agent {agent_id!r} (or not this agent's session): register first")
        if TOKEN_OF_AGENT[agent.role] not in roles:
            raise Forbidden(f"agent {agent_id} is a {agent.role}: its messages need a "
                            f"{TOKEN_OF_AGENT[agent.role]} token")
        self.agents.seen(agent)
        return agent

    def _create(self, **fields) -> VersionRecord:
        try:
            record = self.history.create(**fields)
        except StorageUnavailable as exc:
            raise Unavailable(str(exc)) from exc
        self.book.max_issued = max(self.book.max_issued, record.id)
        return record

    def _require_storage(self) -> None:
        storage = self.history.storage()
        if not storage.ok and not self.history.flush():  # flush retries at most once per backoff: no stall
            raise Unavailable(f"history storage is degraded ({storage.error}); no new version until it can be "
                              "written (reads still work)")


__all__ = ["FRAMEWORK", "Controller"]
