"""The controller owns the version lifecycle:

    requested -> snapshotting -> transferring -> verifying -> committed | failed (reason) | cancelled

One version is in flight at a time. A sync request that arrives while one is in flight is rejected
(HTTP 409 naming the in-flight id) rather than queued: the caller decides whether to retry, and a version
never interleaves with another. Every outcome, including a refusal for lack of agents, is a history row.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ckpt_engine.config import EngineConfig
from ckpt_engine.control import Assignment, Poll, Register, RegisterReply, Report
from ckpt_engine.errors import ProtocolError
from ckpt_engine.server.agents import Agent, AgentRegistry
from ckpt_engine.server.errors import BadRequest, Conflict, NotFound, Unavailable
from ckpt_engine.server.history import TERMINAL, HistoryStore, VersionRecord
from ckpt_engine.server.metrics import Metrics

log = logging.getLogger(__name__)
_ORDER = {"requested": 0, "snapshotting": 1, "transferring": 2, "verifying": 3}


@dataclass
class InFlight:
    version: int
    mode: str
    trainer: str
    quorum: dict[str, int]  # receiver agent id -> rank in the sync group
    started: float = field(default_factory=time.monotonic)
    receiver_reports: dict[int, Report] = field(default_factory=dict)


class Controller:
    def __init__(self, config: EngineConfig, history: HistoryStore, metrics: Metrics, *, store_host: str,
                 store_port: int, group_name: str) -> None:
        self.config = config
        self.history = history
        self.metrics = metrics
        self.store_host, self.store_port, self.group_name = store_host, store_port, group_name
        self.agents = AgentRegistry(config.timeouts.heartbeat_s)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._in_flight: InFlight | None = None
        self._last_tick = time.monotonic()
        # Receivers of a version that did not commit and that never reported its outcome: they may still be
        # applying it (e.g. the trainer was expired while its send went on), so what they hold is unknown
        # until they report; a sparse version built on a guessed base would be refused.
        self._unsettled: set[str] = set()
        self._membership: tuple[str, ...] = ()
        self._generation = 0
        self._group_dirty = False
        self.started_at = time.time()

    # ---- agents -------------------------------------------------------------------------------------
    def register(self, message: Register) -> RegisterReply:
        with self._lock:
            agent = self.agents.add(message)
            # versions are WireInt (at most 2**53 - 1): a bogus one cannot use up the ids
            if message.versions and self.history.number_after(max(message.versions)):
                log.warning("agent %s holds versions up to %d that this history has not numbered yet (lost or "
                            "replaced history file?): new versions are numbered after them", agent.agent_id,
                            max(message.versions))
            self._update_gauges()
        log.info("agent %s registered: %s rank %d on %s (%s)", agent.agent_id, agent.role, agent.rank,
                 agent.host, agent.device)
        timeouts = self.config.timeouts
        return RegisterReply(
            agent_id=agent.agent_id, ipc_name=self._ipc_name(agent) if agent.role == "trainer" else None,
            heartbeat_s=timeouts.heartbeat_s, group_name=self.group_name,
            store_host=self.store_host, store_port=self.store_port, bucket_size=self.config.bucket_size,
            alignment=self.config.alignment, keep_versions=self.config.keep_versions, verify=self.config.verify,
            connect_timeout_s=timeouts.connect_s, collective_timeout_s=timeouts.collective_s,
            ack_timeout_s=timeouts.ack_s, version_timeout_s=timeouts.version_s,
        )

    def acknowledge(self, message: Poll) -> None:
        """A poll arrived: the agent is alive, holds ``versions``, and got the assignment it names."""
        with self._lock:
            agent = self._agent(message.agent_id)
            agent.versions, agent.poll_wait_s = list(message.versions), message.wait_s
            if agent.pending and message.received == agent.pending[0].key():
                agent.pending.popleft()

    def poll(self, message: Poll) -> Assignment | None:
        """The agent's next assignment, if any; it stays queued until a later poll acknowledges it."""
        with self._lock:
            agent = self._agent(message.agent_id)
            return agent.pending[0] if agent.pending else None

    def has_pending(self, agent_id: str) -> bool:
        with self._lock:
            agent = self.agents.get(agent_id)
            return agent is None or bool(agent.pending)  # a vanished agent's poll is answered at once

    def report(self, message: Report) -> None:
        with self._lock:
            agent = self._agent(message.agent_id)
            # Cache bookkeeping may name versions of an older history file; anything else must be a known one.
            if message.event != "evicted" and self.history.get(message.version) is None:
                raise NotFound(f"version {message.version} is unknown")
            # Only a trainer holds the cache: a receiver's report must not rewrite which versions are cached.
            if message.cache_versions is not None and agent.role == "trainer":
                agent.versions = list(message.cache_versions)
                self.history.set_cached(set(message.cache_versions))
            if message.cache_bytes is not None and agent.role == "trainer":
                self.metrics.cache_bytes.set(message.cache_bytes)
            if message.event == "received":
                self._unsettled.discard(agent.agent_id)
            flight = self._in_flight
            if flight is None or message.version != flight.version:
                if message.event not in ("evicted", "received"):
                    log.info("ignoring %s report for version %d (not in flight)", message.event, message.version)
                self._changed.notify_all()
                return
            if message.group_broken:
                self._group_dirty = True
            if message.event == "received":
                flight.receiver_reports[flight.quorum.get(agent.agent_id, -1)] = message
            elif agent.agent_id == flight.trainer and message.event in _ORDER:
                self._advance(flight.version, message.event, message.step)
            elif agent.agent_id == flight.trainer and message.event == "done":
                self._finish(flight, message)
            self._changed.notify_all()

    def unregister(self, agent_id: str) -> None:
        """An agent leaving cleanly: gone now instead of after the heartbeat timeout."""
        with self._lock:
            agent = self._agent(agent_id)
            self.agents.remove(agent.agent_id)
            self._group_dirty = True
            flight = self._in_flight
            if flight and agent.agent_id == flight.trainer:
                self._fail(flight, f"trainer agent {agent.agent_id} left during the version")
            self._update_gauges()
        log.info("agent %s (%s rank %d) left", agent.agent_id, agent.role, agent.rank)

    def agents_public(self) -> list[dict]:
        with self._lock:
            return [a.public() for a in self.agents.all()]

    # ---- versions -----------------------------------------------------------------------------------
    def request_sync(self, *, step: int | None, bypass_cpu: bool | None, sparse: bool | None = None,
                     source_version: int | None = None) -> VersionRecord:
        bypass = self.config.bypass_cpu if bypass_cpu is None else bypass_cpu
        sparse = self.config.sparse if sparse is None else sparse
        if sparse and bypass and source_version is None:
            raise BadRequest("sparse sync works from the cache: it cannot be combined with bypass_cpu")
        mode = "cached" if source_version is not None else ("bypass_cpu" if bypass else "cached")
        with self._lock:
            if self._in_flight is not None:
                raise Conflict(f"version {self._in_flight.version} is in flight; retry when it has ended",
                               {"in_flight": self._in_flight.version})
            trainer = self.agents.trainer()
            # the quorum: registered receivers that are heartbeating (a stalled one would fail the version)
            now = time.monotonic()
            receivers = [r for r in self.agents.receivers() if r.heartbeating(now, self.config.timeouts.heartbeat_s)]
            if source_version is None:  # per-receiver cadence applies to new versions, not to re-pushes
                due = [r for r in receivers if r.offered % r.sync_every == 0]
                for receiver in receivers:
                    receiver.offered += 1
                if receivers and not due:
                    record = self.history.create(mode=mode, step=step)
                    return self.history.update(record.id, status="cancelled",
                                               reason="no receiver is due for this version (sync_every)")
                receivers = due
            record = self.history.create(mode=mode, step=step, source_version=source_version)
            problem = self._quorum_problem(trainer, receivers)
            if problem is None:
                colocated, problem = self._transports(trainer, receivers)  # type: ignore[arg-type]
            if problem:
                failed = self.history.update(record.id, status="failed", reason=problem)
                self.metrics.version_done("failed", 0, {})
                raise Unavailable(problem, failed.to_dict())
            base = self._sparse_base(receivers) if sparse and source_version is None else None
            self._start(record, trainer, receivers, colocated, source_version, base,  # type: ignore[arg-type]
                        sparse=sparse and source_version is None)
            return record

    def _sparse_base(self, receivers: list[Agent]) -> int | None:
        """The version every receiver of the quorum holds, if they all hold the same one; else None (a new,
        reconnected or lagging receiver makes it a full version, as does one whose last outcome is unknown)."""
        if any(r.agent_id in self._unsettled for r in receivers):
            return None
        held = {r.versions[-1] if r.versions else None for r in receivers}
        return held.pop() if len(held) == 1 else None

    def push(self, version: int) -> VersionRecord:
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        if not record.cached:
            raise Conflict(f"version {version} is not in the trainer's cache (it was evicted, never cached, or "
                           f"sent with bypass_cpu)")
        return self.request_sync(step=record.step, bypass_cpu=False, source_version=version)

    def evict(self, version: int, timeout_s: float = 10.0) -> VersionRecord:
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        if not record.cached:
            raise Conflict(f"version {version} is not in the trainer's cache")
        with self._lock:
            trainer = self.agents.trainer()
            if trainer is None:
                raise Unavailable("no trainer agent is registered to evict from")
            trainer.pending.append(Assignment(kind="evict", version=version))
            deadline = time.monotonic() + timeout_s
            while (current := self.history.get(version)) is not None and current.cached:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(f"the trainer did not confirm eviction of version {version} in {timeout_s}s")
                self._changed.wait(remaining)
            return current  # type: ignore[return-value]

    def wait(self, version: int, timeout_s: float) -> VersionRecord:
        """Block until ``version`` is terminal or the timeout passes; returns its record either way."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                record = self.history.get(version)
                if record is None:
                    raise NotFound(f"version {version} is unknown")
                remaining = deadline - time.monotonic()
                if record.status in TERMINAL or remaining <= 0:
                    return record
                self._changed.wait(min(remaining, 1.0))

    def status(self) -> dict:
        with self._lock:
            flight = self._in_flight
            return {
                "in_flight": flight.version if flight else None,
                "generation": self._generation,
                "trainer": self.agents.trainer().agent_id if self.agents.trainer() else None,
                "receivers": len(self.agents.receivers()),
                "versions": self.history.counts(),
                "cache_versions": self.agents.trainer().versions if self.agents.trainer() else [],
                "started_at": self.started_at,
            }

    def tick(self) -> None:
        """Expire silent agents and versions past their time limit (called periodically)."""
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
                flight = self._in_flight
                if flight and agent.agent_id == flight.trainer:
                    self._fail(flight, f"trainer agent {agent.agent_id} went away during the version")
            flight = self._in_flight
            if flight and time.monotonic() - flight.started > self.config.timeouts.version_s:
                state = self.history.get(flight.version)
                self._fail(flight, f"timed out in state {state.status if state else '?'} after "
                                   f"{self.config.timeouts.version_s:.0f}s")
            if self._in_flight is None:
                self._catch_up_newcomers()
            self._update_gauges()

    def _catch_up_newcomers(self) -> None:
        """Receivers that joined after the latest committed version get it from the trainer's cache at once,
        as a re-push of their own; the training loop is not involved."""
        trainer = self.agents.trainer()
        newcomers = [r for r in self.agents.receivers() if not r.versions and not r.catch_up_tried]
        latest = self.history.latest(status="committed")
        if trainer is None or not newcomers or latest is None:
            return
        source = self.history.get(latest.source_version or latest.id)
        if source is None or not source.cached:
            return
        colocated, problem = self._transports(trainer, newcomers)
        for receiver in newcomers:
            receiver.catch_up_tried = True  # once per registration: a failing newcomer waits for the next sync
        if problem:
            return
        record = self.history.create(mode="cached", step=source.step, source_version=source.id)
        log.info("catching up %d new receiver(s) with version %d as version %d", len(newcomers), source.id,
                 record.id)
        self._start(record, trainer, newcomers, colocated, source.id)

    def shutdown(self, grace_s: float) -> None:
        """Give the in-flight version ``grace_s`` to end, then fail it so history is never left dangling."""
        with self._lock:
            deadline = time.monotonic() + grace_s
            while self._in_flight is not None and time.monotonic() < deadline:
                self._changed.wait(0.2)
            if self._in_flight is not None:
                self._fail(self._in_flight, "daemon stopped while the version was in flight")

    # ---- internals ----------------------------------------------------------------------------------
    def _agent(self, agent_id: str) -> Agent:
        agent = self.agents.get(agent_id)
        if agent is None:
            raise ProtocolError(f"unregistered agent {agent_id!r}: register first")
        self.agents.seen(agent)
        return agent

    def _quorum_problem(self, trainer: Agent | None, receivers: list[Agent]) -> str | None:
        if trainer is None:
            return "no trainer agent (role trainer, rank 0) is registered"
        now, heartbeat_s = time.monotonic(), self.config.timeouts.heartbeat_s
        if not trainer.heartbeating(now, heartbeat_s):
            return (f"trainer agent {trainer.agent_id} has not been heard from for {now - trainer.last_seen:.1f}s "
                    "(stalled or cut off?)")
        if len(receivers) < max(self.config.min_receivers, 1):
            need = max(self.config.min_receivers, 1)
            return f"{len(receivers)} receiver(s) registered and heartbeating, at least {need} needed (min_receivers)"
        return None

    def _transports(self, trainer: Agent, receivers: list[Agent]) -> tuple[list[Agent], str | None]:
        """Which receivers take the same-host path (shared memory / CUDA IPC), per ``transport``."""
        mode = self.config.transport
        colocated = [r for r in receivers if mode != "collective" and _colocatable(trainer, r)]
        if mode == "ipc" and len(colocated) < len(receivers):
            far = [r.agent_id for r in receivers if r not in colocated]
            return [], f"transport is ipc, but receiver(s) {far} are not on the trainer's host with its device kind"
        return colocated, None

    def _start(self, record: VersionRecord, trainer: Agent, receivers: list[Agent], colocated: list[Agent],
               source_version: int | None, sparse_base: int | None = None, *, sparse: bool = False) -> None:
        remote = [r for r in receivers if r not in colocated]
        membership = (trainer.agent_id, *(r.agent_id for r in remote), "|", *(r.agent_id for r in colocated))
        if membership != self._membership or self._group_dirty:
            self._generation += 1
            self._membership, self._group_dirty = membership, False
            log.info("sync group generation %d: trainer %s + %d remote and %d colocated receiver(s)",
                     self._generation, trainer.agent_id, len(remote), len(colocated))
        common = dict(version=record.id, mode=record.mode, step=record.step, generation=self._generation,
                      world_size=1 + len(remote))
        quorum = {r.agent_id: rank for rank, r in enumerate(remote + colocated, start=1)}
        for receiver in remote:
            receiver.pending.append(Assignment(kind="receive", rank=quorum[receiver.agent_id], **common))
        for receiver in colocated:
            receiver.pending.append(Assignment(kind="receive", rank=quorum[receiver.agent_id], transport="ipc",
                                               ipc_name=self._ipc_name(trainer), **common))
        trainer.pending.append(Assignment(kind="send", rank=0, source_version=source_version, sparse_base=sparse_base,
                                          sparse=sparse,
                                          ipc_peers={r.agent_id: quorum[r.agent_id] for r in colocated}, **common))
        self._in_flight = InFlight(record.id, record.mode, trainer.agent_id, quorum)
        self.history.update(record.id, receivers=[
            {"rank": r, "agent_id": a, "transport": "ipc" if any(c.agent_id == a for c in colocated) else "collective"}
            for a, r in quorum.items()])
        self.metrics.in_flight.set(1)

    def _ipc_name(self, trainer: Agent) -> str:
        if trainer.ipc_name is None:
            trainer.ipc_name = f"ckpt-engine/{self.group_name}/{trainer.agent_id}"
        return trainer.ipc_name

    def _advance(self, version: int, status: str, step: int | None) -> None:
        current = self.history.get(version)
        if current and _ORDER.get(status, 0) > _ORDER.get(current.status, 99):
            fields = {"step": step} if current.step is None and step is not None else {}
            self.history.update(version, status=status, **fields)

    def _finish(self, flight: InFlight, report: Report) -> None:
        agents_by_rank = {rank: agent for agent, rank in flight.quorum.items()}
        receivers, stages = [], dict(report.stages)
        planned = {r["rank"]: r for r in (self.history.get(flight.version).receivers or [])}  # type: ignore[union-attr]
        for ack in report.receivers:
            receivers.append({**ack.model_dump(), "agent_id": agents_by_rank.get(ack.rank),
                              "transport": planned.get(ack.rank, {}).get("transport")})
            for stage in ("load", "verify"):
                seconds = ack.seconds.get(stage)
                if seconds is not None:
                    stages[stage] = max(stages.get(stage, 0.0), seconds)
        for agent_id in flight.quorum:  # offered a version since joining: no catch-up needed any more
            member = self.agents.get(agent_id)
            if member is not None:
                member.catch_up_tried = True
        committed = [r for r in receivers if r.get("ok")]
        for entry in committed:  # known now, before the agents' next poll says so
            agent = self.agents.get(entry.get("agent_id") or "")
            if agent is not None and flight.version not in agent.versions:
                agent.versions = [*agent.versions, flight.version]
        need = min(max(self.config.min_receivers, 1), len(flight.quorum))
        # The version commits when enough receivers of the quorum committed it; the others are recorded with
        # their reasons (a collective that broke fails everyone, a colocated receiver fails alone).
        ok = report.version_digest is not None and len(committed) >= need
        failures = [f"rank {r.get('rank')}: {r.get('reason')}" for r in receivers if not r.get("ok")]
        if ok:
            reason = (f"committed by {len(committed)} of {len(flight.quorum)} receivers; " + "; ".join(failures)
                      if len(committed) < len(flight.quorum) else None)
        else:
            reason = report.reason or f"{len(committed)}/{len(flight.quorum)} receivers committed, {need} needed"
        status = "committed" if ok else "failed"
        cached = flight.mode == "cached" and report.cache_versions is not None and flight.version in report.cache_versions
        self.history.update(flight.version, status=status, reason=reason, bytes=report.bytes, buckets=report.buckets,
                            tensors_sent=report.tensors, tensors_skipped=report.tensors_skipped,
                            bytes_skipped=report.bytes_skipped, stages=stages,
                            receivers=receivers,
                            version_digest=report.version_digest, cached=cached)
        if not ok or failures:
            self._group_dirty = True
        self._end(flight, status, report.bytes, stages)

    def _fail(self, flight: InFlight, reason: str) -> None:
        log.warning("version %d failed: %s", flight.version, reason)
        self.history.update(flight.version, status="failed", reason=reason)
        self._group_dirty = True
        self._end(flight, "failed", 0, {})

    def _end(self, flight: InFlight, outcome: str, nbytes: int, stages: dict[str, float]) -> None:
        if outcome != "committed":
            self._unsettled |= {a for a, rank in flight.quorum.items() if rank not in flight.receiver_reports}
        self._unsettled &= {a.agent_id for a in self.agents.receivers()}
        self.metrics.version_done(outcome, nbytes, stages)
        self.metrics.in_flight.set(0)
        if self._in_flight is flight:
            self._in_flight = None
        for agent in self.agents.all():  # drop leftovers of this version for agents that never picked them up
            agent.pending = type(agent.pending)(a for a in agent.pending if a.version != flight.version)
        self._changed.notify_all()

    def _update_gauges(self) -> None:
        self.metrics.receivers.set(len(self.agents.receivers()))
        self.metrics.trainers.set(sum(1 for a in self.agents.all() if a.role == "trainer"))


def _colocatable(trainer: Agent, receiver: Agent) -> bool:
    """Same kernel and network namespace, and the same kind of device where IPC exists (CPU, CUDA)."""
    kind = trainer.device.split(":")[0]
    return (trainer.host_id is not None and receiver.host_id == trainer.host_id
            and receiver.device.split(":")[0] == kind and kind in ("cpu", "cuda"))
