"""The controller owns the version lifecycle:

    requested -> snapshotting -> transferring -> verifying -> committed | failed (reason) | cancelled

One version is in flight at a time. A sync request that arrives while one is in flight is rejected
(HTTP 409 naming the in-flight id) rather than queued: the caller decides whether to retry, and a version
never interleaves with another. Every outcome, including a refusal for lack of agents, is a history row.

What committed is decided by the receivers' own reports (each with the digest it computed), never by the
trainer's claim alone. Receivers that joined late, or whose model a failed apply left torn, are brought a
whole version from the trainer's cache when nothing else is in flight (catch-up, repair).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ckpt_engine.server.agents import Agent, AgentRegistry
from ckpt_engine.server.claims import judge_registration
from ckpt_engine.server.errors import BadRequest, Conflict, Forbidden, NotFound, Unavailable
from ckpt_engine.server.history import TERMINAL, HistoryStore, StorageUnavailable, VersionRecord
from ckpt_engine.server.metrics import Metrics

from ckpt_engine.config import EngineConfig
from ckpt_engine.control.messages import (MAX_KEPT, Assignment, FrameworkSyncRequest, Poll, Register, RegisterReply,
                                          Report, longest_poll_wait)
from ckpt_engine.errors import ConfigError, ProtocolError
from ckpt_engine.plan.modes import Mode, check_sparse, mode_of

log = logging.getLogger(__name__)
_NEWCOMER_SETTLE_S = 1.0
_MAX_INHERITED_ID = 1 << 32  # a lost history's ids a new one numbers after, at most (far below exhaustion)
_TICK_FAILING_S = 5.0  # ticks failing this long make /health say not ok
_ORDER = {"requested": 0, "snapshotting": 1, "transferring": 2, "verifying": 3}
_TRAINER_EVENTS = {"snapshotting", "transferring", "verifying", "done", "evicted"}
_EVENTS_OF = {"trainer": _TRAINER_EVENTS, "receiver": {"staged", "received"}, "driver": {"applied"}}
# the credential an agent of each kind registers (and speaks) with
ROLE_OF_AGENT = {"trainer": "trainer", "receiver": "rollout", "driver": "rollout"}


@dataclass
class InFlight:
    version: int
    mode: Mode
    trainer: str
    quorum: dict[str, int]  # receiver agent id -> rank in the sync group
    engines: dict[str, list[str]]  # driven engines in the quorum -> their members' agent ids
    purpose: str
    started: float = field(default_factory=time.monotonic)
    reports: dict[str, Report] = field(default_factory=dict)  # receivers' own outcomes, by agent id
    applied: dict[str, Report] = field(default_factory=dict)  # drivers' outcomes, by engine
    apply_sent: set[str] = field(default_factory=set)
    done: Report | None = None  # the trainer's
    done_at: float = 0.0
    owner_failures: dict[int, str] = field(default_factory=dict)  # other owner ranks' own failures, by rank
    framework: bool = False  # a framework's own sync (verl): every receiver it named must take it
    limit_s: float | None = None  # its own time limit (the framework's timeouts), else timeouts.version_s


class Controller:
    def __init__(self, config: EngineConfig, history: HistoryStore, metrics: Metrics, *, store_host: str,
                 store_port: int, group_name: str) -> None:
        self.config = config
        self.history = history
        self.metrics = metrics
        # read when scraped: the metric says what /health and /status say at that moment
        metrics.storage_degraded.set_function(lambda: float(history.degraded))
        self.store_host, self.store_port, self.group_name = store_host, store_port, group_name
        self.agents = AgentRegistry(config.timeouts.heartbeat_s)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._in_flight: InFlight | None = None
        self._last_tick = time.monotonic()
        self._membership: tuple[str, ...] = ()
        self._generation = 0
        self._group_dirty = False
        # a sync was refused while a catch-up or repair was in flight: no new one starts before this, so the
        # caller's retry gets the slot (newcomers that keep failing theirs cannot starve regular versions)
        self._sync_wanted_until = 0.0
        self._tick_failing_since: float | None = None
        self._tick_error: str | None = None
        self._queued_push: VersionRecord | None = None  # a rollback waiting for a framework's next sync
        self._kept: list[int] = []  # what the trainer was last told to keep in its cache for repairs
        self._max_issued = (history.latest().id if history.latest() else 0)
        self.started_at = time.time()

    # ---- agents -------------------------------------------------------------------------------------
    def register(self, message: Register) -> RegisterReply:
        if message.role == "driver" and message.engine is None:
            raise BadRequest("a driver names its engine")
        if message.driven and (message.engine is None or message.members is None):
            raise BadRequest("a driven receiver names its engine and how many workers the engine has (members)")
        with self._lock:
            if len(self.agents.all()) >= self.config.max_agents:
                raise Unavailable(f"{self.config.max_agents} agents are registered (max_agents); unregister some "
                                  "or raise the limit")
            verdict = judge_registration(message, self.agents.all(), time.monotonic(), self.config.timeouts.heartbeat_s)
            if verdict.conflict is not None:
                raise Conflict(verdict.conflict, verdict.record())
            for silent in verdict.replaces:
                self._replace(silent, message)
            # Versions are numbered by one history: those of another mean nothing here (the file was lost or
            # replaced), and ids this history never issued are a peer's invention. Neither touches our numbering.
            held = self._known(message.versions) if message.history_id == self.history.history_id else []
            if message.role == "trainer" and message.versions and message.history_id != self.history.history_id:
                self._number_after_lost_history(message)
            agent = self.agents.add(message, held)
            agent.catch_up_due = time.monotonic() + _NEWCOMER_SETTLE_S  # one that vanishes at once costs nothing
            if agent.role == "trainer":
                self._update_cached()
            self._update_gauges()
        log.info("agent %s registered: %s rank %d on %s (%s)%s", agent.agent_id, agent.role, agent.rank,
                 agent.host, agent.device, f" engine {agent.engine}" if agent.engine else "")
        timeouts = self.config.timeouts
        return RegisterReply(
            agent_id=agent.agent_id, session=agent.session, history_id=self.history.history_id,
            ipc_name=self._ipc_name(agent) if agent.role == "trainer" else None,
            heartbeat_s=timeouts.heartbeat_s, group_name=self.group_name,
            store_host=self.store_host, store_port=self.store_port, bucket_size=self.config.bucket_size,
            alignment=self.config.alignment, keep_versions=self.config.keep_versions, verify=self.config.verify,
            connect_timeout_s=timeouts.connect_s, collective_timeout_s=timeouts.collective_s,
            ack_timeout_s=timeouts.ack_s, version_timeout_s=timeouts.version_s,
        )

    def _number_after_lost_history(self, message: Register) -> None:
        """A trainer holds versions of another history (this one was lost or replaced). While this one has
        issued nothing yet, its ids start after the trainer's, so logs and dashboards never show one id for two
        versions; the agent drops those versions either way (their ids mean nothing here). Only a trainer's
        word counts, and only for an empty history: nothing a peer says moves the numbering of a live one."""
        if self._max_issued > 0 or self.history.latest() is not None or message.history_id is None:
            return
        highest = max(message.versions)
        if 0 < highest <= _MAX_INHERITED_ID and self.history.number_after(highest):
            self._max_issued = 0  # (still nothing of ours: what agents hold stays unknown here)
            log.warning("the trainer holds versions up to %d of history %s, not this one (%s: lost or replaced); "
                        "new versions are numbered from %d", highest, message.history_id, self.history.history_id,
                        highest + 1)

    def _replace(self, agent_id: str, message: Register) -> None:
        """A silent agent whose place a new registration takes (a restarted process): gone now."""
        old = self.agents.get(agent_id)
        if old is None:
            return
        log.warning("%s %s (rank %d, silent for %.1fs) replaced by a new registration from pid %d on %s (a "
                    "restart)", old.role, old.agent_id, old.rank, time.monotonic() - old.last_seen, message.pid,
                    message.host)
        self.agents.remove(old.agent_id)
        self._group_dirty = True
        flight = self._in_flight
        if flight is not None and flight.trainer == old.agent_id:
            self._fail(flight, f"trainer agent {old.agent_id} was replaced by a restarted process")
        if old.role == "trainer":
            self._update_cached()

    def acknowledge(self, message: Poll, roles: set[str]) -> None:
        """A poll arrived: the agent is alive, holds ``versions``, and got the assignment it names."""
        with self._lock:
            agent = self._agent(message.agent_id, message.session, roles)
            longest = longest_poll_wait(self.config.timeouts.heartbeat_s)
            if message.wait_s > longest:  # waiting longer, it would expire while it waits
                if agent.poll_wait_s != longest:
                    log.warning("agent %s polls with a wait of %.1fs, longer than the heartbeat (%.1fs) allows: "
                                "its polls wait %.1fs", agent.agent_id, message.wait_s,
                                self.config.timeouts.heartbeat_s, longest)
                message.wait_s = longest
            agent.versions, agent.poll_wait_s = self._known(message.versions), message.wait_s
            if agent.pending and message.received == agent.pending[0].key():
                agent.pending.popleft()
            if message.unable and agent.role == "receiver" and agent.able(time.monotonic()):
                agent.unable = message.unable
                agent.unable_until = time.monotonic() + agent.unable_backoff.next_delay()
                log.warning("receiver %s cannot receive for now (%s); out of the quorum for %.0fs", agent.agent_id,
                            message.unable, agent.unable_until - time.monotonic())

    def poll(self, message: Poll, roles: set[str]) -> Assignment | None:
        """The agent's next assignment, if any; it stays queued until a later poll acknowledges it."""
        with self._lock:
            agent = self._agent(message.agent_id, message.session, roles)
            return agent.pending[0] if agent.pending else None

    def has_pending(self, agent_id: str) -> bool:
        with self._lock:
            agent = self.agents.get(agent_id)
            return agent is None or bool(agent.pending)  # a vanished agent's poll is answered at once

    def report(self, message: Report, roles: set[str]) -> None:
        with self._lock:
            agent = self._agent(message.agent_id, message.session, roles)
            if message.event not in _EVENTS_OF[agent.role]:
                raise BadRequest(f"a {agent.role} agent cannot report {message.event!r}")
            # Cache bookkeeping may name versions of an older history file; anything else must be a known one.
            if message.event != "evicted" and self.history.get(message.version) is None:
                raise NotFound(f"version {message.version} is unknown")
            if agent.role == "trainer":
                self._trainer_bookkeeping(agent, message)
            flight = self._in_flight
            current = flight is not None and message.version == flight.version
            if message.event == "received":
                self._receiver_outcome(agent, message, flight if current else None)
            elif message.event == "staged" and current:
                self._staged(agent, message, flight)  # type: ignore[arg-type]
            elif message.event == "applied":
                self._applied(agent, message, flight if current else None)
            elif current and agent.agent_id == flight.trainer:  # type: ignore[union-attr]
                self._trainer_event(flight, message)  # type: ignore[arg-type]
            elif current and agent.role == "trainer" and message.event == "done" and message.ok is False:
                flight.owner_failures[agent.rank] = message.reason or "failed"  # type: ignore[union-attr]
            elif message.event not in ("evicted", "staged"):
                log.info("ignoring %s report for version %d (not in flight)", message.event, message.version)
            self._changed.notify_all()

    def unregister(self, agent_id: str, session: str, roles: set[str]) -> None:
        """An agent leaving cleanly: gone now instead of after the heartbeat timeout."""
        with self._lock:
            agent = self._agent(agent_id, session, roles)
            self.agents.remove(agent.agent_id)
            self._group_dirty = True
            if agent.role == "trainer":
                self._update_cached()  # its share of the cached versions went with it
            flight = self._in_flight
            if flight and agent.agent_id == flight.trainer:
                self._fail(flight, f"trainer agent {agent.agent_id} left during the version")
            self._update_gauges()
        log.info("agent %s (%s rank %d) left", agent.agent_id, agent.role, agent.rank)

    def agents_public(self) -> list[dict]:
        with self._lock:
            regular = {r.agent_id for r in self._candidates()}
            return [{**a.public(), **({"joins_next": a.agent_id in regular} if a.role == "receiver" else {})}
                    for a in self.agents.all()]

    # ---- versions -----------------------------------------------------------------------------------
    def request_sync(self, *, step: int | None, bypass_cpu: bool | None, sparse: bool | None = None,
                     source_version: int | None = None) -> VersionRecord:
        # a re-push is always from the cache
        mode = "cached" if source_version is not None else mode_of(self.config.bypass_cpu if bypass_cpu is None
                                                                    else bypass_cpu)
        sparse = self.config.sparse if sparse is None else sparse
        try:
            check_sparse(mode, sparse)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        with self._lock:
            if self._in_flight is not None:
                flight = self._in_flight
                if flight.purpose in ("catch_up", "repair"):
                    self._sync_wanted_until = time.monotonic() + 2 * self.config.timeouts.connect_s + 5
                raise Conflict(f"version {flight.version} is in flight ({flight.purpose}); retry when it has ended",
                               {"in_flight": flight.version, "purpose": flight.purpose})
            self._require_storage()
            trainer = self.agents.trainer()
            if trainer is not None and trainer.framework:
                raise Conflict(f"the trainer is driven by {trainer.framework}: its versions start at "
                               f"{trainer.framework}'s own syncs (POST /push queues a rollback for its next one)")
            receivers = self._candidates()
            if source_version is None:  # per-receiver cadence applies to new versions, not to re-pushes
                due = [r for r in receivers if r.offered % r.sync_every == 0]
                for receiver in receivers:
                    receiver.offered += 1
                if receivers and not due:
                    record = self._create(mode=mode, step=step)
                    return self.history.update(record.id, status="cancelled",
                                               reason="no receiver is due for this version (sync_every)")
                receivers = due
            record = self._create(mode=mode, step=step, source_version=source_version)
            problem = self._quorum_problem(trainer, receivers)
            owners = 1
            if problem is None:
                owners = self._owners_for(trainer, self.history.get(source_version) if source_version else None)  # type: ignore[arg-type]
                colocated, problem = self._transports(trainer, receivers, owners)  # type: ignore[arg-type]
            if problem:
                failed = self.history.update(record.id, status="failed", reason=problem)
                self.metrics.version_done("failed", 0, {})
                raise Unavailable(problem, failed.to_dict())
            base = self._sparse_base(receivers) if sparse and source_version is None else None
            purpose = "push" if source_version is not None else "sync"
            self._start(record, trainer, receivers, colocated, source_version, base,  # type: ignore[arg-type]
                        sparse=sparse and source_version is None, purpose=purpose, owners=owners)
            return record

    def push(self, version: int) -> VersionRecord:
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        if record.status != "committed":
            raise Conflict(f"version {version} is {record.status}: only a committed version can be pushed")
        if not record.cached:
            with self._lock:
                missing = self._missing_shares(version) if record.mode == "cached" else []
            held = (f": owner rank(s) {missing} of its {record.owners} no longer hold their share (a rank that "
                    "restarted or went away takes its share with it)" if missing and record.owners > 1 else
                    " (it was evicted, never cached, or sent with bypass_cpu)")
            raise Conflict(f"version {version} is not in the trainer's cache{held}")
        with self._lock:
            trainer = self.agents.trainer()
            if trainer is not None and trainer.framework:
                return self._queue_push(record)
        return self.request_sync(step=record.step, bypass_cpu=False, source_version=version)

    # ---- framework-driven trainers (verl) -------------------------------------------------------------
    def framework_sync(self, request: FrameworkSyncRequest, roles: set[str]) -> dict:
        """A framework's own sync (verl's update_weights) as a version, opened by its trainer rank 0 (its
        registration, not only its token): the framework's groups carry it, so nothing is assigned; the
        receivers it names report their own outcomes as usual. A re-push queued by ``POST /push`` takes this
        sync's place (the framework's trainer sends it from its cache, checked against ``expected_digest``,
        the source's recorded digest). Its record, with what a send assignment would say: ``expected_digest``
        and ``keep`` (the cached versions no snapshot may evict: what the workers serve)."""
        if request.agent_id is None or request.session is None:
            raise BadRequest("a framework's sync names the trainer agent opening it (agent_id, session)")
        if request.sparse or (request.step is not None and request.step < 0):
            raise BadRequest("a framework's sync is never sparse here (its backend decides) and its step is >= 0")
        with self._lock:
            opener = self._agent(request.agent_id, request.session, roles)
            trainer = self.agents.trainer()
            if opener is not trainer or not opener.framework:
                raise Conflict(f"agent {opener.agent_id} is not the framework trainer rank 0 this daemon serves "
                               f"(that is {trainer.agent_id if trainer else 'nobody'})")
            flight = self._in_flight
            if flight is not None and flight.framework:
                self._supersede(flight)
            elif flight is not None:
                raise Conflict(f"version {flight.version} is in flight ({flight.purpose}); retry when it has ended",
                               {"in_flight": flight.version, "purpose": flight.purpose})
            self._require_storage()
            quorum = self._framework_quorum(trainer, request.receivers or [])
            problem = self._quorum_problem(trainer, quorum)
            if problem:  # (a queued rollback stays queued)
                failed = self.history.update(self._create(mode=mode_of(bool(request.bypass_cpu)), step=request.step).id,
                                             status="failed", reason=problem)
                self.metrics.version_done("failed", 0, {})
                raise Unavailable(problem, failed.to_dict())
            record = self._take_queued_push()
            if record is not None:  # its step is the framework's at delivery (verl's global_steps), as for any sync:
                record = self.history.update(record.id, step=request.step)  # given now, or with its first report
            record = record or self._create(mode=mode_of(bool(request.bypass_cpu)), step=request.step)
            source = self.history.get(record.source_version) if record.source_version else None
            owners = source.owners if source is not None else trainer.trainer_ranks
            self._in_flight = InFlight(record.id, record.mode, trainer.agent_id,
                                       {r.agent_id: rank for rank, r in enumerate(quorum, start=1)}, {},
                                       "push" if record.source_version else "sync", framework=True,
                                       limit_s=request.limit_s)
            self.metrics.in_flight.set(1)
            self._kept = self._kept_for_repairs()
            opened = self.history.update(record.id, purpose=self._in_flight.purpose, owners=owners, receivers=[
                {"rank": rank, "agent_id": r.agent_id, "transport": "collective"} for rank, r in enumerate(quorum, 1)])
            return {**opened.to_dict(), "expected_digest": source.version_digest if source is not None else None,
                    "keep": list(self._kept)}

    def _supersede(self, flight: InFlight) -> None:
        """The framework runs one sync at a time: one still open when it opens the next was abandoned (verl
        failed elsewhere, or gave up waiting for the reply that opened it: a stalled daemon), or its last
        reports have not arrived yet (they come on other connections than the next sync's opening, so a
        stalled daemon may see them after it). Waiting for its time limit would refuse every sync until then;
        its outcome is unknown: interrupted. A rollback nothing was heard of yet is queued again: the operator
        asked for it, and this sync takes it (at worst the same weights arrive twice)."""
        reason = ("superseded: the framework opened its next sync before this version's outcome reached the "
                  "daemon (abandoned, or delivered with its reports still on the way)")
        record = self.history.get(flight.version)
        untouched = record is not None and record.status == "requested" and flight.done is None and not flight.reports
        source = self.history.get(record.source_version) if record is not None and record.source_version else None
        if source is not None and untouched and self._queued_push is None:
            # as a new version: reports of the abandoned one may still arrive, and must not count for this one
            again = self._queue_push(source)
            reason += f"; the rollback is queued again as version {again.id}"
        self._fail(flight, reason, "interrupted")

    def _take_queued_push(self) -> VersionRecord | None:
        """The queued rollback, if its source can still be sent (else it ends failed, saying why)."""
        queued, self._queued_push = self._queued_push, None
        if queued is None:
            return None
        source = self.history.get(queued.source_version)  # type: ignore[arg-type]
        if source is not None and source.cached and not self._leaving_cache(source.id):
            return queued
        self.history.update(queued.id, status="failed", reason=f"version {queued.source_version} is no longer in the "
                            "trainer's cache (evicted before the framework's next sync)")
        self.metrics.version_done("failed", 0, {})
        return None

    def _leaving_cache(self, version: int) -> bool:
        """An owner rank was told to evict ``version`` or no longer holds its share (the history's ``cached``
        turns false only once every eviction is confirmed): sending it now would fail part way."""
        evicting = any(a.kind == "evict" and a.version == version for t in self.agents.trainers().values()
                       for a in t.pending)
        return evicting or bool(self._missing_shares(version))

    def _framework_quorum(self, trainer: Agent, receivers: list[str]) -> list[Agent]:
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

    def _queue_push(self, record: VersionRecord) -> VersionRecord:
        """A rollback for a framework-driven trainer: recorded now, sent at the framework's next sync in place
        of that sync's new weights (the daemon cannot start the framework's transfer). A newer push replaces
        one still waiting."""
        self._require_storage()
        queued = self._create(mode="cached", step=record.step, source_version=record.id)
        previous, self._queued_push = self._queued_push, self.history.update(queued.id, purpose="push", reason=(
            f"queued: the trainer is driven by {self.agents.trainer().framework}; sent at its next sync"))  # type: ignore[union-attr]
        if previous is not None:
            self.history.update(previous.id, status="cancelled",
                                reason=f"replaced by version {queued.id} (a push of version {record.id})")
        return self._queued_push

    def request_evict(self, version: int) -> VersionRecord:
        """Ask the trainer to drop ``version`` from its cache; the history's ``cached`` flag turns false once
        it confirms (see :meth:`evicted`). Returns at once."""
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        if not record.cached:
            raise Conflict(f"version {version} is not in the trainer's cache")
        with self._lock:
            flight = self._in_flight
            sending = self.history.get(flight.version) if flight is not None and flight.purpose == "push" else None
            if sending is not None and sending.source_version == version:
                # the trainer ranks read it from their caches as it is sent: evicted now, the sync would fail
                raise Conflict(f"version {version} is being sent again as version {sending.id} (a push in "
                               "flight); evict it once that has ended", {"in_flight": sending.id})
            trainers = self.agents.trainers()
            if 0 not in trainers:
                raise Unavailable("no trainer agent is registered to evict from")
            for trainer in trainers.values():  # every owner drops its share
                if not any(a.kind == "evict" and a.version == version for a in trainer.pending):
                    trainer.pending.append(Assignment(kind="evict", version=version))
        return record

    def evicted(self, version: int) -> VersionRecord | None:
        """The record once the trainer no longer caches ``version``, else None."""
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        return None if record.cached else record

    def terminal(self, version: int) -> VersionRecord | None:
        """The record once ``version`` has ended, else None."""
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        return record if record.status in TERMINAL else None

    def status(self) -> dict:
        with self._lock:
            flight = self._in_flight
            trainer = self.agents.trainer()
            storage = self.history.storage()
            return {
                "in_flight": flight.version if flight else None,
                "queued_push": self._queued_push.id if self._queued_push else None,
                "generation": self._generation,
                "trainer": trainer.agent_id if trainer else None,
                "receivers": len(self.agents.receivers()),
                "versions": self.history.counts(),
                "cache_versions": trainer.versions if trainer else [],
                "cache_kept_for_repairs": list(self._kept),
                "started_at": self.started_at,
                "history_id": self.history.history_id,
                "degraded": not storage.ok,
                "storage": storage.to_dict(),
                "torn": [a.agent_id for a in self.agents.receivers() if a.torn is not None],
                "unable": [a.agent_id for a in self.agents.receivers() if a.state() == "unable"],
            }

    def tick_failed(self, error: str) -> None:
        if self._tick_failing_since is None:
            self._tick_failing_since = time.monotonic()
        self._tick_error = error

    def tick_succeeded(self) -> None:
        self._tick_failing_since, self._tick_error = None, None

    def tick_problem(self) -> str | None:
        """Why the periodic work (expiry, timeouts, repairs) has kept failing for a while, if it has."""
        since = self._tick_failing_since
        if since is None or time.monotonic() - since < _TICK_FAILING_S:
            return None
        return f"the controller's periodic work has failed for {time.monotonic() - since:.0f}s: {self._tick_error}"

    def tick(self) -> None:
        """Expire silent agents, end versions past their time limit, write what storage still owes, and bring
        a version to receivers that hold none (called periodically)."""
        self.history.flush()
        with self._lock:
            now, heartbeat_s = time.monotonic(), self.config.timeouts.heartbeat_s
            stalled, self._last_tick = now - self._last_tick, now
            if stalled > heartbeat_s / 2:  # SIGSTOP, swap, a long GC: the agents were not the silent ones
                log.warning("the daemon itself did not run for %.1fs; agents get a new heartbeat window", stalled)
                self.agents.refresh()
            for agent in self.agents.expire():
                log.warning("agent %s (%s rank %d) missed heartbeats; marked gone", agent.agent_id, agent.role,
                            agent.rank)
                self._group_dirty = True
                if agent.role == "trainer":
                    self._update_cached()
                flight = self._in_flight
                if flight and agent.agent_id == flight.trainer:
                    self._fail(flight, f"trainer agent {agent.agent_id} went away during the version")
            flight = self._in_flight
            if flight is not None:
                self._maybe_finish(flight)
            flight = self._in_flight
            limit = (flight.limit_s or self.config.timeouts.version_s) if flight else 0.0
            if flight and time.monotonic() - flight.started > limit:
                state = self.history.get(flight.version)
                self._fail(flight, f"timed out in state {state.status if state else '?'} after {limit:.0f}s")
            if self._in_flight is None and not self.history.degraded:
                self._catch_up()
            self._update_gauges()

    def shutdown(self, grace_s: float) -> None:
        """Give the in-flight version ``grace_s`` to end, then fail it so history is never left dangling."""
        with self._lock:
            deadline = time.monotonic() + grace_s
            while self._in_flight is not None and time.monotonic() < deadline:
                self._changed.wait(0.2)
            if self._in_flight is not None:  # its receivers may have applied it: its outcome is unknown
                self._fail(self._in_flight, "the daemon stopped before this version's outcome was known; receivers "
                                            "may hold it (they are sent a whole version again)", "interrupted")
            queued, self._queued_push = self._queued_push, None
            if queued is not None:
                self.history.update(queued.id, status="cancelled",
                                    reason="the daemon stopped before the framework's next sync")

    # ---- reports ------------------------------------------------------------------------------------
    def _trainer_bookkeeping(self, agent: Agent, message: Report) -> None:
        # Only a trainer holds the cache: a receiver's report must not rewrite which versions are cached.
        if message.cache_versions is not None:
            agent.versions = self._known(message.cache_versions)
            self._update_cached()
        if message.cache_bytes is not None and agent.rank == 0:
            self.metrics.cache_bytes.set(message.cache_bytes)

    def _update_cached(self) -> None:
        """A version is cached (can be sent again) while every trainer rank that owns a share of it holds its
        share: a rank that restarted or went away took its share with it."""
        self.history.set_cached({v for v in self._lead_versions() if not self._missing_shares(v)})

    def _lead_versions(self) -> list[int]:
        lead = self.agents.trainers().get(0)
        return list(lead.versions) if lead is not None else []

    def _missing_shares(self, version: int) -> list[int]:
        """Owner ranks of ``version`` that do not hold their share of it (now)."""
        record = self.history.get(version)
        owners = record.owners if record is not None else 1
        trainers = self.agents.trainers()
        return [r for r in range(owners) if r not in trainers or version not in trainers[r].versions]

    def _trainer_event(self, flight: InFlight, message: Report) -> None:
        if message.group_broken:
            self._group_dirty = True
        if message.event in _ORDER:
            self._advance(flight.version, message.event, message.step)
        elif message.event == "done" and flight.done is None:
            flight.done, flight.done_at = message, time.monotonic()
            self._maybe_finish(flight)

    def _receiver_outcome(self, agent: Agent, message: Report, flight: InFlight | None) -> None:
        """A receiver's own outcome: what its model holds now, and its vote on the version."""
        agent.staged = None
        if message.ok and agent.driven:  # one worker of an engine: whole only once its driver says the engine is
            agent.torn, agent.unable = None, None
            agent.unable_backoff.reset()
        elif message.ok:
            agent.serving = agent.last_served = message.version
            agent.torn, agent.unable = None, None
            agent.unable_backoff.reset()
            agent.catch_up_attempts = 0
        elif message.torn:
            self._tear([agent], message.reason or "its apply failed part way")
        elif not agent.driven:  # refused or not verified: the model holds what the receiver says (nothing changed)
            agent.serving = message.serving if message.serving is not None and self._known([message.serving]) else None
        # (a driven member's model is its engine's: only the driver's report says what the engine serves)
        if message.unable:
            agent.unable = message.unable
            agent.unable_until = time.monotonic() + agent.unable_backoff.next_delay()
            log.warning("receiver %s cannot receive for now (%s); out of the quorum for %.0fs", agent.agent_id,
                        message.unable, agent.unable_until - time.monotonic())
        if flight is not None and agent.agent_id in flight.quorum:
            if message.group_broken:
                self._group_dirty = True
            flight.reports.setdefault(agent.agent_id, message)
            self._maybe_finish(flight)
        elif flight is None:
            self._late_outcome(agent, message)

    def _staged(self, agent: Agent, message: Report, flight: InFlight) -> None:
        """A driven receiver verified the version; once every member of its engine has, the driver applies it."""
        agent.staged = message.version
        engine = agent.engine
        if engine is None or engine not in flight.engines or engine in flight.apply_sent:
            return
        members = [self.agents.get(a) for a in flight.engines[engine]]
        if all(m is not None and m.staged == flight.version for m in members):
            driver = self.agents.driver(engine)
            if driver is not None:
                driver.applying = flight.version
                record = self.history.get(flight.version)
                driver.pending.append(Assignment(kind="apply", version=flight.version, mode=flight.mode,  # type: ignore[arg-type]
                                                 step=record.step if record else None))
                flight.apply_sent.add(engine)

    def _applied(self, driver: Agent, message: Report, flight: InFlight | None) -> None:
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
                member.serving = member.last_served = message.version
                member.torn, member.staged = None, None
        elif message.torn:
            self._tear(members, f"engine {driver.engine}: {message.reason or 'apply failed part way'}")
        if not message.ok:  # workers still holding the version staged would wait for it in vain
            for member in members:
                if member.staged == message.version:
                    member.staged = None
                    member.pending.append(Assignment(kind="discard", version=message.version,
                                                     reason=f"the engine's driver failed: {message.reason}"[:2000]))
        if flight is not None:
            flight.applied[driver.engine] = message
            self._maybe_finish(flight)

    def _tear(self, agents: list[Agent], reason: str) -> None:
        for agent in agents:
            if agent.torn is None:
                agent.catch_up_attempts, agent.catch_up_due = 0, 0.0
                agent.catch_up_backoff.reset()
            agent.torn, agent.serving, agent.staged = reason, None, None
            log.warning("receiver %s is torn (%s); it will be repaired from the cache", agent.agent_id, reason)

    def _late_outcome(self, agent: Agent, message: Report) -> None:
        """An outcome that arrived after its version ended: correct that receiver's entry in the history."""
        record = self.history.get(message.version)
        if record is None:
            return
        entries = [dict(e) for e in record.receivers]
        for entry in entries:
            if entry.get("agent_id") == agent.agent_id and entry.get("missing_report"):
                entry.update(ok=bool(message.ok), reason=message.reason, version_digest=message.version_digest,
                             missing_report=False, reported_late=True, serving_after=agent.serving,
                             torn=agent.torn is not None)
                self.history.update(record.id, receivers=entries)
                return

    # ---- finishing a version ------------------------------------------------------------------------
    def _maybe_finish(self, flight: InFlight) -> None:
        """End the version once the trainer is done and every receiver of the quorum that is still registered
        has reported its own outcome (or the acknowledgement time has passed since the trainer was done)."""
        if flight.done is None or self._in_flight is not flight:
            return
        if flight.done.version_digest is not None:  # without it nothing can commit: no need to hear receivers
            waiting = [a for a in flight.quorum if a not in flight.reports and self.agents.get(a) is not None]
            # and the drivers told to apply: what their engines serve afterwards goes into the record
            waiting += [e for e in flight.apply_sent if e not in flight.applied and self.agents.driver(e) is not None]
            if waiting and time.monotonic() - flight.done_at < self.config.timeouts.ack_s:
                return
        self._finish(flight, flight.done)

    def _finish(self, flight: InFlight, done: Report) -> None:
        expected, stale = self._identity(flight, done)
        receivers, stages = self._verdicts(flight, done, expected)
        committed = [r for r in receivers if r["ok"]]
        need = min(max(self.config.min_receivers, 1), len(flight.quorum))
        if flight.framework:  # the framework needs every worker it named (verl fails its sync otherwise)
            need = len(flight.quorum)
        ok = expected is not None and stale is None and len(committed) >= need
        # (a receiver told of the sender's abort repeats the sender's reason: said once, by the sender)
        failures = [f"rank {r['rank']}: " + ("aborted by the sender" if done.reason and r["reason"]
                                              and done.reason in r["reason"] else r["reason"])
                    for r in receivers if not r["ok"]]
        if ok:
            reason = (f"committed by {len(committed)} of {len(flight.quorum)} receivers; " + "; ".join(failures)
                      if failures else None)
        else:
            owners = [f"owner rank {rank}: {why}" for rank, why in sorted(flight.owner_failures.items())]
            # the trainer's reason may already name the same receivers' failures (as the wire saw them): their own
            # reports say it better, once each
            judged = {f"rank {r['rank']}:" for r in receivers if not r["ok"]}
            trainer = [part for part in (done.reason or "").split("; ") if not done.ok and part
                       and not any(part.startswith(prefix) for prefix in judged)]
            reason = "; ".join(dict.fromkeys(filter(None, [stale, *trainer, *owners, *failures]))) or \
                f"{len(committed)}/{len(flight.quorum)} receivers committed, {need} needed"
        status = "committed" if ok else "failed"
        # (other owners' shares: as far as their reports have come; each later report updates it)
        cached = (flight.mode == "cached" and done.cache_versions is not None and flight.version in done.cache_versions
                  and not self._missing_shares(flight.version))
        self.history.update(flight.version, status=status, reason=reason, bytes=done.bytes, buckets=done.buckets,
                            tensors_sent=done.tensors, tensors_skipped=done.tensors_skipped,
                            bytes_skipped=done.bytes_skipped, stages=stages, receivers=receivers,
                            version_digest=done.version_digest, cached=cached)
        if not ok or failures:
            self._group_dirty = True
        if done.version_digest is not None:  # then the daemon waited for every receiver's own report
            self._bench_the_silent(flight)
        self._bench_the_absent(flight, done.absent_ranks)
        if ok:
            for entry in committed:  # it took a whole version under this registration: regular versions again
                agent = self.agents.get(entry["agent_id"])
                if agent is not None:
                    agent.proven = True
        self._end(flight, status, done.bytes, stages)

    def _bench_the_absent(self, flight: InFlight, ranks: list[int]) -> None:
        """Receivers that never joined the version's rendezvous (cut off from the trainer, or claiming to be
        receivers without being one) failed it for everyone: out of the quorum for a while, longer each time,
        and back only through a version of their own (a catch-up), so they fail no one else's again."""
        by_rank = {rank: agent_id for agent_id, rank in flight.quorum.items()}
        for rank in ranks:
            agent = self.agents.get(by_rank.get(rank, ""))
            if agent is None:
                continue
            agent.proven = False
            agent.unable = f"did not join the sync group of version {flight.version}"
            agent.unable_until = time.monotonic() + agent.unable_backoff.next_delay()
            log.warning("receiver %s %s; out of the quorum for %.0fs", agent.agent_id, agent.unable,
                        agent.unable_until - time.monotonic())

    def _bench_the_silent(self, flight: InFlight) -> None:
        """Receivers silent about their own outcome (stalled, cut off, or not playing along) would fail the
        versions of the others too: out of the quorum for a while, longer each time."""
        for agent_id in flight.quorum:
            agent = self.agents.get(agent_id)
            if agent is not None and agent_id not in flight.reports:
                agent.unable = f"did not report its outcome of version {flight.version}"
                agent.unable_until = time.monotonic() + agent.unable_backoff.next_delay()
                log.warning("receiver %s %s; out of the quorum for %.0fs", agent_id, agent.unable,
                            agent.unable_until - time.monotonic())

    def _identity(self, flight: InFlight, done: Report) -> tuple[str | None, str | None]:
        """The digest receivers must have computed, and why the trainer's bytes are not the version's (None:
        they are). A new version is what the trainer sent; a re-push (rollback, catch-up, repair) is the
        version it names as recorded when it committed, never digests recomputed from the cache now."""
        record = self.history.get(flight.version)
        source = self.history.get(record.source_version) if record and record.source_version is not None else None
        if source is None:
            return done.version_digest, None
        if done.version_digest is not None and done.version_digest != source.version_digest:
            return source.version_digest, (f"the trainer re-sent version {source.id} with digest "
                                           f"{done.version_digest}, but it committed as {source.version_digest}: "
                                           "the cached copy changed since")
        return source.version_digest, None

    def _verdicts(self, flight: InFlight, done: Report, expected: str | None) -> tuple[list[dict], dict[str, float]]:
        """Each quorum member's entry for the history, judged by its own report against the version's digest
        (``expected``); members of a driven engine succeed or fail together."""
        wire = {ack.rank: ack for ack in done.receivers}
        planned = {r["agent_id"]: r for r in (self.history.get(flight.version).receivers or [])}  # type: ignore[union-attr]
        stages = dict(done.stages)
        entries = []
        for agent_id, rank in flight.quorum.items():
            own = flight.reports.get(agent_id)
            ok, reason = _judge(own, expected, wire.get(rank))
            agent = self.agents.get(agent_id)
            if own is None and agent is not None:
                agent.serving = None  # what it holds is unknown until it reports: a full version comes next
            entries.append({"rank": rank, "agent_id": agent_id, "transport": planned.get(agent_id, {}).get("transport"),
                            "engine": agent.engine if agent else None, "ok": ok, "reason": reason,
                            "version_digest": own.version_digest if own else None,
                            "seconds": own.stages if own else {}, "missing_report": own is None,
                            "serving_after": agent.serving if agent else None,
                            "torn": agent is not None and agent.torn is not None})
            for stage in ("load", "verify"):
                seconds = own.stages.get(stage) if own else None
                if seconds is not None:
                    stages[stage] = max(stages.get(stage, 0.0), seconds)
        self._engine_verdicts(flight, entries)
        return entries, stages

    def _engine_verdicts(self, flight: InFlight, entries: list[dict]) -> None:
        for engine, members in flight.engines.items():
            mine = [e for e in entries if e["agent_id"] in members]
            failed = [e for e in mine if not e["ok"]]
            applied = flight.applied.get(engine)
            if applied is not None and not applied.ok:
                why = f"engine {engine} driver: {applied.reason}"
            elif failed:
                why = f"engine {engine}: rank {failed[0]['rank']} failed"
            else:
                continue
            for entry in mine:
                if entry["ok"]:
                    entry.update(ok=False, reason=why)

    def _fail(self, flight: InFlight, reason: str, status: str = "failed") -> None:
        owners = [f"owner rank {rank}: {why}" for rank, why in sorted(flight.owner_failures.items())]
        if owners:  # what other owner ranks already said went wrong (e.g. before the lead went away)
            reason = "; ".join([reason, *owners])
        log.warning("version %d %s: %s", flight.version, status, reason)
        receivers = [dict(e) for e in (self.history.get(flight.version).receivers or [])]  # type: ignore[union-attr]
        for entry in receivers:
            own = flight.reports.get(entry.get("agent_id", ""))
            entry.update(ok=False, reason=(own.reason if own and not own.ok else None) or reason,
                         missing_report=own is None)
        self.history.update(flight.version, status=status, reason=reason, receivers=receivers)
        for agent_id in flight.quorum:
            agent = self.agents.get(agent_id)
            if agent is not None and agent_id not in flight.reports:
                agent.serving = None  # it may still be applying the version: unknown until it reports
        self._group_dirty = True
        self._end(flight, "failed", 0, {})

    def _end(self, flight: InFlight, outcome: str, nbytes: int, stages: dict[str, float]) -> None:
        self.metrics.version_done(outcome, nbytes, stages)
        self.metrics.in_flight.set(0)
        if self._in_flight is flight:
            self._in_flight = None
        for agent_id in flight.quorum:
            agent = self.agents.get(agent_id)
            if agent is None:
                continue
            agent.staged = None
            if (agent.serving is None or not agent.proven) and flight.purpose in ("catch_up", "repair"):
                agent.catch_up_attempts += 1
                agent.catch_up_due = time.monotonic() + agent.catch_up_backoff.next_delay()

        for agent in self.agents.all():  # drop leftovers of this version for agents that never picked them up
            agent.pending = type(agent.pending)(a for a in agent.pending if a.version != flight.version)
        self._changed.notify_all()

    # ---- catch-up and repair ------------------------------------------------------------------------
    def _catch_up(self) -> None:
        """Receivers that hold no whole version (new, torn by a failed apply, or of unknown state) get one from
        the trainer's cache as a re-push of their own, without the training loop: a torn one the version it
        served last (known to work on it), the others the newest committed one."""
        trainer = self.agents.trainer()
        now = time.monotonic()
        if trainer is None or trainer.framework or now < self._sync_wanted_until:
            return
        pool = self._candidates(regular=False)

        def due(receiver: Agent) -> bool:  # an engine's members are due together
            peers = [m for m in pool if receiver.driven and m.driven and m.engine == receiver.engine] or [receiver]
            return all(m.catch_up_due <= now for m in peers)

        waiting = [r for r in pool if self._needs_catch_up(r, pool) and due(r)]
        if not waiting:
            return
        latest = self.history.latest(status="committed")
        by_source: dict[int, list[Agent]] = {}
        engine_source: dict[str, VersionRecord | None] = {}
        for receiver in waiting:
            if receiver.driven:  # one model: every member takes the version its torn members served last
                if receiver.engine not in engine_source:  # its members served the same versions (the driver's)
                    engine_source[receiver.engine] = self._repair_source(receiver, latest)  # type: ignore[index]
                source = engine_source[receiver.engine]  # type: ignore[index]
            else:
                source = self._repair_source(receiver, latest)
            if source is not None:
                by_source.setdefault(source.id, []).append(receiver)
        if not by_source:
            return
        source_id, receivers = max(by_source.items(), key=lambda item: len(item[1]))
        source = self.history.get(source_id)
        if source is None:
            return
        owners = self._owners_for(trainer, source)
        colocated, problem = self._transports(trainer, receivers, owners)
        if problem:
            return
        purpose = "repair" if any(r.torn is not None for r in receivers) else "catch_up"
        try:
            record = self._create(mode="cached", step=source.step, source_version=source.id)
        except Unavailable:
            return
        log.info("%s: version %d to %d receiver(s) as version %d", purpose, source.id, len(receivers), record.id)
        self._start(record, trainer, receivers, colocated, source.id, purpose=purpose, owners=owners)

    def _repair_source(self, receiver: Agent, latest: VersionRecord | None) -> VersionRecord | None:
        if receiver.torn is not None and receiver.last_served is not None:
            own = self._cached_source(receiver.last_served)
            if own is not None:
                return own
        return self._cached_source(latest.id) if latest is not None else None

    def _cached_source(self, version: int) -> VersionRecord | None:
        """The cached record holding ``version``'s bytes (a re-push's source), if the trainer still caches it."""
        record = self.history.get(version)
        if record is not None and record.source_version is not None:
            record = self.history.get(record.source_version)
        return record if record is not None and record.cached else None

    # ---- internals ----------------------------------------------------------------------------------
    def _agent(self, agent_id: str, session: str, roles: set[str]) -> Agent:
        agent = self.agents.get(agent_id, session)
        if agent is None:
            # one answer for an unknown id and a wrong secret: a peer learns nothing about other agents
            raise ProtocolError(f"unregistered agent {agent_id!r} (or not this agent's session): register first")
        if ROLE_OF_AGENT[agent.role] not in roles:
            raise Forbidden(f"agent {agent_id} is a {agent.role}: its messages need a {ROLE_OF_AGENT[agent.role]} token")
        self.agents.seen(agent)
        return agent

    def _known(self, versions: list[int]) -> list[int]:
        """The versions among ``versions`` this history has issued."""
        return [v for v in versions if 1 <= v <= self._max_issued]

    def _create(self, **fields) -> VersionRecord:
        try:
            record = self.history.create(**fields)
        except StorageUnavailable as exc:
            raise Unavailable(str(exc)) from exc
        self._max_issued = max(self._max_issued, record.id)
        return record

    def _require_storage(self) -> None:
        storage = self.history.storage()
        if not storage.ok and not self.history.flush():  # a retry at most once per backoff: no stall per request
            raise Unavailable(f"history storage is degraded ({storage.error}); no new version until it can be "
                              "written (reads still work)")

    def _candidates(self, *, regular: bool = True) -> list[Agent]:
        """Receivers that can be put into a quorum now: heartbeating, able to receive, and, for a driven engine,
        all of its members together with its driver. A receiver that holds no whole version (new, torn, or of
        unknown state) joins ``regular`` versions only once the cache cannot bring it one: until then it is
        brought one alone (catch-up, repair), so one that cannot receive fails no one else's version. The
        members of an engine are one model: they are in or out together."""
        now, heartbeat_s = time.monotonic(), self.config.timeouts.heartbeat_s
        ready = [r for r in self.agents.receivers()  # (a framework's receivers take only its syncs)
                 if r.heartbeating(now, heartbeat_s) and r.able(now) and r.framework is None]
        whole = [r for r in ready if not r.driven or self._engine_ready(r, ready, now)]
        if not regular:
            return whole
        latest = self.history.latest(status="committed")
        return [r for r in whole if not (self._needs_catch_up(r, whole) and self._repair_source(r, latest))]

    def _engine_ready(self, receiver: Agent, ready: list[Agent], now: float) -> bool:
        driver = self.agents.driver(receiver.engine or "")
        members = [m for m in ready if m.engine == receiver.engine and m.driven]
        return (driver is not None and driver.heartbeating(now, self.config.timeouts.heartbeat_s)
                and len(members) == receiver.members)

    @staticmethod
    def _needs_catch_up(receiver: Agent, pool: list[Agent]) -> bool:
        """It holds no whole version, or has not taken one under this registration yet (what a newcomer says
        it holds is a claim: it proves it with a version of its own before it can fail anyone else's), or
        (a driven engine's member) one of its engine's members is so."""
        if not receiver.driven:
            return receiver.serving is None or not receiver.proven
        return any(m.serving is None or not m.proven for m in pool if m.engine == receiver.engine and m.driven)

    def _quorum_problem(self, trainer: Agent | None, receivers: list[Agent]) -> str | None:
        if trainer is None:
            return "no trainer agent (role trainer, rank 0) is registered"
        now, heartbeat_s = time.monotonic(), self.config.timeouts.heartbeat_s
        if not trainer.heartbeating(now, heartbeat_s):
            return (f"trainer agent {trainer.agent_id} has not been heard from for {now - trainer.last_seen:.1f}s "
                    "(stalled or cut off?)")
        if len(receivers) < max(self.config.min_receivers, 1):
            need = max(self.config.min_receivers, 1)
            out = self._why_out([r for r in self.agents.receivers() if r not in receivers], now)
            return (f"{len(receivers)} receiver(s) registered, heartbeating and able to receive, at least {need} "
                    f"needed (min_receivers); " + ("; ".join(out) if out else "no receiver is registered"))
        return None

    def _why_out(self, receivers: list[Agent], now: float) -> list[str]:
        """Why each of these registered receivers is not in the quorum (what an operator needs to act on)."""
        heartbeat_s = self.config.timeouts.heartbeat_s
        latest = self.history.latest(status="committed")
        reasons = []
        for r in receivers:
            if not r.heartbeating(now, heartbeat_s):
                why = f"silent for {now - r.last_seen:.1f}s"
            elif not r.able(now):
                why = f"out for {r.unable_until - now:.0f}s more: {r.unable}"
            elif r.framework is not None:
                why = f"a {r.framework} worker (takes only {r.framework}'s own syncs)"
            elif r.torn is not None:
                why = f"torn ({r.torn}); it is repaired from the cache first"
            elif r.driven and not self._engine_ready(r, [m for m in self.agents.receivers()
                                                         if m.heartbeating(now, heartbeat_s) and m.able(now)], now):
                driver = self.agents.driver(r.engine or "")
                live = sum(1 for m in self.agents.engine_members(r.engine or "") if m.heartbeating(now, heartbeat_s))
                why = (f"engine {r.engine} is incomplete: {live} of {r.members} worker(s) heartbeating, driver "
                       f"{'missing' if driver is None else 'silent' if not driver.heartbeating(now, heartbeat_s) else 'alive'}")
            elif self._needs_catch_up(r, [r]) and self._repair_source(r, latest):
                why = "new here: it takes a version of its own from the cache first (catch-up)"
            else:
                why = f"not due (sync_every {r.sync_every})"
            reasons.append(f"receiver {r.agent_id}: {why}")
        return reasons

    def _sparse_base(self, receivers: list[Agent]) -> int | None:
        """The version every receiver of the quorum serves whole, if they all serve the same one; else None (a
        new, torn, lagging or unsettled receiver makes it a full version, and so does an engine that takes
        whole versions only)."""
        if any(r.whole_versions for r in receivers):
            return None
        held = {r.serving for r in receivers}
        return held.pop() if len(held) == 1 else None

    def _owners_for(self, trainer: Agent, source: VersionRecord | None) -> int:
        """How many trainer ranks own shares of a version: a re-push, as many as its source had; a new one,
        every rank of the trainer job when each one's agent is heard from (else rank 0 sends everything and
        the others only gather), unless the deployment wants the same-host path only (``transport: ipc``)."""
        if source is not None:
            return source.owners
        ranks = trainer.trainer_ranks
        if ranks <= 1 or self.config.transport == "ipc":
            return 1
        now, heartbeat_s = time.monotonic(), self.config.timeouts.heartbeat_s
        trainers = self.agents.trainers()
        return ranks if all(r in trainers and trainers[r].heartbeating(now, heartbeat_s) for r in range(ranks)) else 1

    def _transports(self, trainer: Agent, receivers: list[Agent], owners: int = 1) -> tuple[list[Agent], str | None]:
        """Which receivers take the same-host path (shared memory / CUDA IPC), per ``transport``: none for a
        version several trainer ranks own (each sends on its own sync group)."""
        mode = self.config.transport
        if owners > 1:
            if mode == "ipc":
                return [], f"transport is ipc, but this version is owned by {owners} trainer ranks"
            return [], None
        colocated = [r for r in receivers if mode != "collective" and _colocatable(trainer, r)]
        if mode == "ipc" and len(colocated) < len(receivers):
            far = [r.agent_id for r in receivers if r not in colocated]
            return [], f"transport is ipc, but receiver(s) {far} are not on the trainer's host with its device kind"
        return colocated, None

    def _start(self, record: VersionRecord, trainer: Agent, receivers: list[Agent], colocated: list[Agent],
               source_version: int | None, sparse_base: int | None = None, *, sparse: bool = False,
               purpose: str = "sync", owners: int = 1) -> None:
        remote = [r for r in receivers if r not in colocated]
        # (with another number of owners the receivers join other groups: a new generation, fresh store keys)
        trainers = self.agents.trainers()
        owner_ids = [trainers[r].agent_id for r in range(owners) if r in trainers] if owners > 1 else [trainer.agent_id]
        membership = (*owner_ids, f"owners={owners}", *(r.agent_id for r in remote), "|",
                      *(r.agent_id for r in colocated))
        if membership != self._membership or self._group_dirty:
            self._generation += 1
            self._membership, self._group_dirty = membership, False
            log.info("sync group generation %d: trainer %s + %d remote and %d colocated receiver(s)",
                     self._generation, trainer.agent_id, len(remote), len(colocated))
        common = dict(version=record.id, mode=record.mode, step=record.step, generation=self._generation,
                      world_size=1 + len(remote), owners=owners)
        quorum = {r.agent_id: rank for rank, r in enumerate(remote + colocated, start=1)}
        for receiver in remote:
            receiver.pending.append(Assignment(kind="receive", rank=quorum[receiver.agent_id], **common))
        for receiver in colocated:
            receiver.pending.append(Assignment(kind="receive", rank=quorum[receiver.agent_id], transport="ipc",
                                               ipc_name=self._ipc_name(trainer), **common))
        source = self.history.get(source_version) if source_version is not None else None
        self._kept = self._kept_for_repairs()
        trainer.pending.append(Assignment(kind="send", rank=0, source_version=source_version, sparse_base=sparse_base,
                                          sparse=sparse, expected_digest=source.version_digest if source else None,
                                          keep=self._kept,
                                          ipc_peers={r.agent_id: quorum[r.agent_id] for r in colocated}, **common))
        engines: dict[str, list[str]] = {}
        for receiver in receivers:
            if receiver.driven and receiver.engine is not None:
                engines.setdefault(receiver.engine, []).append(receiver.agent_id)
        self._in_flight = InFlight(record.id, record.mode, trainer.agent_id, quorum, engines, purpose)
        self.history.update(record.id, purpose=purpose, owners=owners, receivers=[
            {"rank": r, "agent_id": a, "transport": "ipc" if any(c.agent_id == a for c in colocated) else "collective"}
            for a, r in quorum.items()])
        self.metrics.in_flight.set(1)

    def _kept_for_repairs(self) -> list[int]:
        """Cached versions receivers may need again, newest first (at most MAX_KEPT): the newest committed one
        (a catch-up sends it) and the one each receiver serves or served last (a repair re-applies it). The
        trainer's cache never evicts them to make room, so a run of failed versions cannot push them out."""
        wanted = {r.serving for r in self.agents.receivers()} | {r.last_served for r in self.agents.receivers()}
        latest = self.history.latest(status="committed")
        wanted.add(latest.id if latest is not None else None)
        sources = set()
        for version in wanted - {None}:
            record = self.history.get(version)  # type: ignore[arg-type]
            if record is not None:
                sources.add(record.source_version if record.source_version is not None else record.id)
        return sorted(sources, reverse=True)[:MAX_KEPT]

    def _ipc_name(self, trainer: Agent) -> str:
        if trainer.ipc_name is None:
            trainer.ipc_name = f"ckpt-engine/{self.group_name}/{trainer.agent_id}"
        return trainer.ipc_name

    def _advance(self, version: int, status: str, step: int | None) -> None:
        current = self.history.get(version)
        if current and _ORDER.get(status, 0) > _ORDER.get(current.status, 99):
            fields = {"step": step} if current.step is None and step is not None else {}
            self.history.update(version, status=status, **fields)

    def _update_gauges(self) -> None:
        self.metrics.receivers.set(len(self.agents.receivers()))
        self.metrics.trainers.set(sum(1 for a in self.agents.all() if a.role == "trainer"))
        receivers = self.agents.receivers()
        self.metrics.torn_receivers.set(sum(1 for a in receivers if a.torn is not None))


def _judge(own: Report | None, expected: str | None, wire_ack) -> tuple[bool, str | None]:
    """A receiver's verdict: its own report, with the digest it computed equal to the version's."""
    if own is None:
        seen = f" (the trainer saw: {wire_ack.reason or ('ok' if wire_ack.ok else 'failed')})" if wire_ack else ""
        return False, f"did not report its own outcome{seen}"
    if not own.ok:
        return False, own.reason or "failed"
    if expected is None:
        return False, "the trainer has no digest for this version"
    if own.version_digest != expected:
        return False, f"its digest {own.version_digest} differs from the version's {expected}"
    return True, None


def _colocatable(trainer: Agent, receiver: Agent) -> bool:
    """Same kernel and network namespace, and the same kind of device where IPC exists (CPU, CUDA)."""
    kind = trainer.device.split(":")[0]
    return (trainer.host_id is not None and receiver.host_id == trainer.host_id
            and receiver.device.split(":")[0] == kind and kind in ("cpu", "cuda"))
