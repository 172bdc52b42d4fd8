"""What GET /status and GET /receivers say about the daemon's state: read-only views of the controller's parts,
built under the controller's lock by the callers (server/controller.py), the rules being decisions/quorum.py's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckpt_engine.config import EngineConfig
from ckpt_engine.server.agents import AgentRegistry
from ckpt_engine.server.cache_book import CacheBook
from ckpt_engine.server.decisions import quorum as rules
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.flights import Flights
from ckpt_engine.server.framework import FrameworkSyncs
from ckpt_engine.server.history import HistoryStore
from ckpt_engine.server.metrics import Metrics


@dataclass(frozen=True)
class StateView:
    """The parts a view reads (the controller's own, never copies)."""

    config: EngineConfig
    history: HistoryStore
    agents: AgentRegistry
    book: CacheBook
    flights: Flights
    framework: FrameworkSyncs
    heartbeat_s: float
    repair_source: Callable[[AgentRecord], int | None]

    def agents_public(self, regular: set[str], now: float) -> list[dict]:
        """Every agent; a receiver also with whether it joins the next regular version (``regular``: those that
        would), and why not."""
        return [{**a.public(now), **(self._joins_next(a, regular, now) if a.role == "receiver" else {})}
                for a in self.agents.all()]

    def _joins_next(self, receiver: AgentRecord, regular: set[str], now: float) -> dict:
        if receiver.agent_id in regular:
            return {"joins_next": True, "waits_because": None}
        gate = self.flights.gate
        why = rules.why_out(receiver, self.agents.receivers(), self.agents.drivers(), now, self.heartbeat_s,
                            self.repair_source, None if gate.admits(now) else gate.reason)
        return {"joins_next": False, "waits_because": why}

    def status(self, now: float, started_at: float) -> dict:
        flight, trainer, storage = self.flights.current, self.agents.trainer(), self.history.storage()
        receivers = self.agents.receivers()
        return {
            "in_flight": flight.version if flight else None,
            "queued_push": self.framework.queued.id if self.framework.queued else None,
            "generation": self.flights.generation,
            "trainer": trainer.agent_id if trainer else None,
            "receivers": len(receivers),
            "versions": self.history.counts(),
            "cache_versions": trainer.versions if trainer else [],
            "cache_kept_for_repairs": self.kept_now(trainer),
            "started_at": started_at,
            "history_id": self.history.history_id,
            "degraded": not storage.ok,
            "storage": storage.to_dict(),
            "torn": [a.agent_id for a in receivers if a.model.torn is not None],
            "unable": [a.agent_id for a in receivers if a.state(now) == "unable"],
            **self.flights.gate.public(now),
        }

    def show_gauges(self, metrics: Metrics) -> None:
        """The agent gauges: receivers, trainer ranks, torn receivers."""
        receivers = self.agents.receivers()
        metrics.receivers.set(len(receivers))
        metrics.trainers.set(sum(1 for a in self.agents.all() if a.role == "trainer"))
        metrics.torn_receivers.set(sum(1 for a in receivers if a.model.torn is not None))

    def kept_now(self, trainer: AgentRecord | None) -> list[int]:
        """The cached versions kept for repairs now (docs/glossary.md): those receivers may need, that it holds."""
        held = set(trainer.versions) if trainer else set()
        return [v for v in self.book.kept_for_repairs(self.config.keep_versions) if v in held]
