"""What the trainer ranks' caches hold, from their own reports, and what that means for the history: a
version is cached (can be sent again) while every trainer rank that owns a share of it holds its share. Not
thread-safe by itself: the controller calls it under its lock."""

from __future__ import annotations

from ckpt_engine.control.messages import Assignment, Report
from ckpt_engine.server.agents import AgentRegistry
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.repair import kept_for_repairs
from ckpt_engine.server.errors import Conflict, NotFound, Unavailable
from ckpt_engine.server.history import HistoryStore, VersionRecord
from ckpt_engine.server.metrics import Metrics


class CacheBook:
    def __init__(self, history: HistoryStore, agents: AgentRegistry, metrics: Metrics) -> None:
        self.history, self.agents, self.metrics = history, agents, metrics
        latest = history.latest()
        self.max_issued = latest.id if latest else 0  # the highest id this history issued
        self._cache_bytes: dict[str, int] = {}  # each trainer agent's report of what its share of the cache holds

    def known(self, versions: list[int]) -> list[int]:
        """The versions among ``versions`` this history has issued (a peer's others are its invention)."""
        return [v for v in versions if 1 <= v <= self.max_issued]

    def trainer_reported(self, agent: AgentRecord, message: Report) -> None:
        # Only a trainer holds the cache: a receiver's report must not rewrite which versions are cached.
        if message.cache_versions is not None:
            agent.versions = self.known(message.cache_versions)
            self.update()
        if message.cache_bytes is not None:
            self._cache_bytes[agent.agent_id] = message.cache_bytes
            self._show_cache_bytes()

    def _show_cache_bytes(self) -> None:
        """Set ckpt_engine_cache_bytes to the sum of the live trainer ranks' reports: each rank owns, caches and
        reports only its own share."""
        live = {agent.agent_id for agent in self.agents.trainers().values()}
        self._cache_bytes = {k: v for k, v in self._cache_bytes.items() if k in live}  # a rank gone took its share
        self.metrics.cache_bytes.set(sum(self._cache_bytes.values()))

    def update(self) -> None:
        """Tell the history which versions are whole in the caches now (a rank that restarted or went away
        took its share with it)."""
        lead = self.agents.trainers().get(0)
        held = list(lead.versions) if lead is not None else []
        self.history.set_cached({v for v in held if not self.missing_shares(v)})
        self._show_cache_bytes()

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
        """Whether an owner rank was told to evict ``version`` or no longer holds its share. Sending it now would
        fail part way; the history's ``cached`` turns false only once every eviction is confirmed."""
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

    def trim(self, limit: int, protected: set[int]) -> list[int]:
        """After a version ended, ask the trainer ranks to drop what no longer earns a place in their caches, so
        a failed version never costs a committed one its place. Kept: the cached sources of the newest ``limit``
        committed versions (a rollback's commit counts for its source), what receivers may need for a repair
        (``kept_for_repairs``), and ``protected`` (in flight, or a queued rollback's source). Every other version
        a rank holds is dropped, so one that failed goes at once. Until this runs, the trainer caches hold a new
        version beside the kept ones (send/cache.py ``external_trim``). Returns the versions asked to be dropped."""
        trainers = self.agents.trainers()
        held = {v for trainer in trainers.values() for v in trainer.versions}
        if not held:
            return []
        newest: list[int] = []  # the held sources of committed versions, newest commit first
        before: int | None = None
        while len(newest) < limit:
            page = self.history.list(limit=64, status="committed", before=before)
            for record in page:
                source = record.source_version if record.source_version is not None else record.id
                if source in held and source not in newest:
                    newest.append(source)
            # a record's source is never newer than itself: past the oldest held version nothing can be one
            if len(page) < 64 or page[-1].id <= min(held):
                break
            before = page[-1].id
        keep = set(newest[:limit]) | set(self.kept_for_repairs(limit)) | protected
        dropped = sorted(held - keep)
        for version in dropped:
            for trainer in trainers.values():
                if version in trainer.versions and not any(a.kind == "evict" and a.version == version
                                                           for a in trainer.pending):
                    trainer.pending.append(Assignment(kind="evict", version=version))
        return dropped

    def kept_for_repairs(self, limit: int) -> list[int]:
        latest = self.history.latest(status="committed")
        return kept_for_repairs(self.agents.receivers(), latest.id if latest else None, self.source_of, limit=limit)
