"""What the trainer ranks' caches hold, from their own reports, and what that means for the history: a
version is cached (can be sent again) while every trainer rank that owns a share of it holds its share. Not
thread-safe by itself: the controller calls it under its lock."""

from __future__ import annotations

from ckpt_engine.server.agents import Agent, AgentRegistry
from ckpt_engine.server.decisions.repair import kept_for_repairs
from ckpt_engine.server.errors import Conflict, NotFound, Unavailable
from ckpt_engine.server.history import HistoryStore, VersionRecord
from ckpt_engine.server.metrics import Metrics

from ckpt_engine.control.messages import Assignment, Report


class CacheBook:
    def __init__(self, history: HistoryStore, agents: AgentRegistry, metrics: Metrics) -> None:
        self.history, self.agents, self.metrics = history, agents, metrics
        self.max_issued = history.latest().id if history.latest() else 0  # the highest id this history issued

    def known(self, versions: list[int]) -> list[int]:
        """The versions among ``versions`` this history has issued (a peer's others are its invention)."""
        return [v for v in versions if 1 <= v <= self.max_issued]

    def trainer_reported(self, agent: Agent, message: Report) -> None:
        # Only a trainer holds the cache: a receiver's report must not rewrite which versions are cached.
        if message.cache_versions is not None:
            agent.versions = self.known(message.cache_versions)
            self.update()
        if message.cache_bytes is not None and agent.rank == 0:
            self.metrics.cache_bytes.set(message.cache_bytes)

    def update(self) -> None:
        """Tell the history which versions are whole in the caches now (a rank that restarted or went away
        took its share with it)."""
        lead = self.agents.trainers().get(0)
        held = list(lead.versions) if lead is not None else []
        self.history.set_cached({v for v in held if not self.missing_shares(v)})

    def missing_shares(self, version: int) -> list[int]:
        """Owner ranks of ``version`` that do not hold their share of it (now)."""
        record = self.history.get(version)
        owners = record.owners if record is not None else 1
        trainers = self.agents.trainers()
        return [r for r in range(owners) if r not in trainers or version not in trainers[r].versions]

    def why_not_cached(self, record: VersionRecord) -> str:
        """Why ``record``'s version cannot be sent again, as the end of a sentence."""
        missing = self.missing_shares(record.id) if record.mode == "cached" else []
        trainers = self.agents.trainers()
        gone = [r for r in missing if r not in trainers]
        if gone and record.owners > 1:
            return (f": owner rank(s) {gone} of its {record.owners} went away or restarted since (a rank's share of "
                    "the cache goes with it)")
        if missing and len(missing) < record.owners:
            return (f": owner rank(s) {missing} of its {record.owners} no longer hold their share (evicted, or "
                    "dropped as a copy that changed)")
        return " (it was evicted, never cached, or sent with bypass_cpu)"

    def source_of(self, version: int) -> int | None:
        """The version holding ``version``'s bytes (itself, or a re-push's source); None when unknown."""
        record = self.history.get(version)
        if record is None:
            return None
        return record.source_version if record.source_version is not None else record.id

    def cached_source(self, version: int) -> int | None:
        """The cached version holding ``version``'s bytes (a re-push's source), if the trainer still caches it."""
        source = self.source_of(version)
        record = self.history.get(source) if source is not None else None
        return record.id if record is not None and record.cached else None

    def evicting(self, version: int) -> bool:
        """An owner rank was told to evict ``version`` or no longer holds its share (the history's ``cached``
        turns false only once every eviction is confirmed): sending it now would fail part way."""
        told = any(a.kind == "evict" and a.version == version for t in self.agents.trainers().values()
                   for a in t.pending)
        return told or bool(self.missing_shares(version))

    def ask_evict(self, version: int, sending: VersionRecord | None) -> VersionRecord:
        """Queue an eviction of ``version`` for every owner rank (``sending``: a re-push in flight, which reads
        its source from the caches)."""
        record = self.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        if not record.cached:
            raise Conflict(f"version {version} is not in the trainer's cache")
        if sending is not None and sending.source_version == version:
            # the trainer ranks read it from their caches as it is sent: evicted now, the sync would fail
            raise Conflict(f"version {version} is being sent again as version {sending.id} (a push in flight); "
                           "evict it once that has ended", {"in_flight": sending.id})
        trainers = self.agents.trainers()
        if 0 not in trainers:
            raise Unavailable("no trainer agent is registered to evict from")
        for trainer in trainers.values():  # every owner drops its share
            if not any(a.kind == "evict" and a.version == version for a in trainer.pending):
                trainer.pending.append(Assignment(kind="evict", version=version))
        return record

    def kept_for_repairs(self, limit: int) -> list[int]:
        latest = self.history.latest(status="committed")
        return kept_for_repairs(self.agents.receivers(), latest.id if latest else None, self.source_of, limit=limit)
