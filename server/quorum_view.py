"""The quorum rules (decisions/quorum.py, decisions/repair.py) read against the daemon's current state: which
receivers may take a version now, why a version cannot go, and by which routes. The controller asks, under its
lock; nothing here changes state."""

from __future__ import annotations

from ckpt_engine.config import EngineConfig
from ckpt_engine.server.agents import AgentRegistry
from ckpt_engine.server.cache_book import CacheBook
from ckpt_engine.server.decisions import quorum as rules
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.repair import repair_source
from ckpt_engine.server.flights import Flights
from ckpt_engine.server.history import HistoryStore, VersionRecord


class QuorumView:
    def __init__(self, config: EngineConfig, history: HistoryStore, agents: AgentRegistry, book: CacheBook,
                 flights: Flights) -> None:
        self.config, self.history, self.agents, self.book, self.flights = config, history, agents, book, flights

    @property
    def heartbeat_s(self) -> float:
        return self.config.timeouts.heartbeat_s

    def repair_source(self, receiver: AgentRecord) -> int | None:
        latest = self.history.latest(status="committed")
        return repair_source(receiver, latest.id if latest else None, self.book.cached_source)

    def candidates(self, now: float, *, regular: bool = True) -> list[AgentRecord]:
        return rules.candidates(self.agents.receivers(), self.agents.drivers(), now, self.heartbeat_s,
                                regular=regular, repair_source=self.repair_source,
                                admit_new=self.flights.gate.admits(now), min_receivers=self.config.min_receivers)

    def problem(self, trainer: AgentRecord | None, receivers: list[AgentRecord], now: float) -> str | None:
        gate = self.flights.gate
        return rules.quorum_problem(trainer, receivers, self.agents.receivers(), self.agents.drivers(),
                                    self.config.min_receivers, now, self.heartbeat_s, self.repair_source,
                                    None if gate.admits(now) else gate.reason)

    def routes(self, trainer: AgentRecord, receivers: list[AgentRecord], source: VersionRecord | None,
               mode: str, now: float) -> tuple[int, list[AgentRecord], list[AgentRecord], str | None]:
        """How many trainer ranks own the version, which receivers take the same-host path, which pull it, and
        why it cannot go (None: it can)."""
        owners = rules.owners_for(trainer, self.agents.trainers(), source.owners if source else None,
                                  self.config.transport, now, self.heartbeat_s)
        pulling, problem = rules.pullers(receivers, self.config.transport, mode)
        if problem is not None:
            return owners, [], [], problem
        pushed = [r for r in receivers if r not in pulling]
        colocated, problem = rules.transports(trainer, pushed, owners, self.config.transport)
        return owners, colocated, pulling, problem
