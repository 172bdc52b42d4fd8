"""An actor rank's side of verl's contract: every actor rank walks verl's generator (its gathers are
collective), keeps the tensors of the buckets it owns and publishes its share (cached or bypass_cpu; a queued
rollback instead, from the cache); actor rank 0 numbers the sync (its own counter, or the daemon's version)
and announces it on the rendezvous store it serves, with what every rank needs (a rollback's source and
expected digest, the versions to keep, the failed ones to drop)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ckpt_engine.codec import decode, encode
from ckpt_engine.config import EngineConfig
from ckpt_engine.config.knobs import Settled, settle
from ckpt_engine.errors import CkptEngineError, ConfigError, ProtocolError
from ckpt_engine.send.publisher import Ownership, Publisher, Route
from ckpt_engine.send.sender import Transfer, TransferResult, WireHook
from ckpt_engine.transport.group import bounded, serve_store, wait_for_key
from ckpt_engine.workers.trainer_agent import evict

from .daemon import VerlAgent
from .stream import collect_owned, drain
from .sync import (
    _ANNOUNCEMENT,
    _CHANGES,
    _MASTER,
    _MAX_WAIT_S,
    _PEER,
    BACKEND,
    ChangeFlags,
    SyncAnnouncement,
    VerificationFailed,
    VerlSync,
    _node_address,
    _step,
)

log = logging.getLogger(__name__)


class VerlActor(VerlSync):
    def __init__(self, bucket_size: int | None, is_master: bool = False, **options: Any) -> None:
        super().__init__(bucket_size, is_master, **options)
        self._open: int | None = None  # actor rank 0: the daemon's version of this sync, until it is sent
        # actor rank 0: versions that failed, for every rank to drop from its cache (a failed version must not
        # take the place of the last good one, the rollback target)
        self._failed: list[int] = []
        # actor rank 0: versions the daemon gave no verdict on (it was down or stalled); asked again at the next
        # sync, and dropped too unless it recorded them committed
        self._unjudged: list[int] = []
        self._versions = 0  # the master's counter: verl syncs become versions 1, 2, ...
        self._server: Any = None  # the rendezvous store actor rank 0 serves during a sync
        self._publisher: Publisher | None = None
        self._wire_hook: WireHook | None = None  # fault injection for tests (the library's own hook)
        self._overrides_logged: set[str] = set()  # actor rank 0: knob overrides logged (once each)

    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {"role": _PEER}
        self._abandon_open("verl started a new sync before this one's weights were sent")
        self._close_store()
        host = self.host or _node_address()
        self._server = serve_store(host, 0, timeout_s=self.timeout_s)
        self._versions += 1
        return {"role": _MASTER, "host": host, "port": int(self._server.port)}

    def _join(self, store: Any, rank: int, receivers: list[str] | None, actors: int) -> SyncAnnouncement:
        if self.endpoint and not self.is_master:  # (rank 0 registers as it announces)
            self._daemon("trainer", rank, actors)
        sync = self._announce(store, receivers, actors) if self.is_master else self._announced(store)
        self._drop(sync.drop)
        return sync

    def _store_for(self, host: str, port: int) -> Any:
        return self._server if self.is_master else self._open_rank_0_store(host, port)

    def _cache_publisher(self) -> Publisher | None:
        return self._publisher

    def finalize(self) -> None:
        self._abandon_open("verl ended the sync before its weights were sent")
        super().finalize()
        if self.is_master:
            self._close_store()

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, Any]:
        topology = self._require("actor")
        rank = topology["rank"]
        version, source = topology["version"], topology["source_version"]
        step = _step(global_steps)
        if self._agent is not None and self.is_master:
            self._agent.report(version, "snapshotting", step=step)  # verl's global_steps become the version's step
        started = time.perf_counter()
        publisher = self._publisher_for()
        if not self._lanes:  # (sharded: every class on its own groups, the route's lanes)
            publisher.attach(self._groups[0], owners_group=self._owners_group)
        weights = iter(weights)
        try:
            transfer, kept = self._publish(publisher, weights, topology, step)
        except Exception as exc:  # nothing went out: tell the rollout workers now, not after their timeout
            drain(weights)  # (the generator's gathers are collective: the other ranks are still in them)
            reason = f"actor rank {rank} could not send it: {type(exc).__name__}: {exc}"
            self._abort(publisher, version, reason)
            raise CkptEngineError(f"{BACKEND}: version {version} (global_steps {global_steps}): {reason}") from exc
        held = time.perf_counter() - started
        result = await asyncio.to_thread(transfer.result, self.timeout_s + self.load_timeout_s + self.timeout_s)
        # with a daemon, the version counts once it judged the rollout workers' own reports
        verdict = await asyncio.to_thread(self._told, result, publisher, held) if self._agent is not None else None
        if not result.ok or (verdict is not None and verdict.get("status") != "committed"):
            self._failed.append(version)  # dropped from every rank's cache at the next sync (announced)
        elif verdict is None and self._agent is not None and self.is_master:
            self._unjudged.append(version)
        if not result.ok:
            raise CkptEngineError(f"{BACKEND}: version {version} (global_steps {global_steps}) was not delivered by "
                                  f"actor rank {rank}: {result.reason}")
        if verdict is not None and verdict.get("status") != "committed":
            raise VerificationFailed(f"{BACKEND}: version {version} (global_steps {global_steps}) "
                                     f"{verdict.get('status')} on the daemon: {verdict.get('reason')}")
        self.last_version = version
        unjudged = {f"{BACKEND}/daemon_verdict_unknown": 1} if self.is_master and self._agent and not verdict else {}
        return {**unjudged, f"{BACKEND}/version": version, f"{BACKEND}/bytes_kept_rank{rank}": kept,
                f"{BACKEND}/bytes_sent_rank{rank}": result.bytes_sent,
                f"{BACKEND}/seconds_rank{rank}": sum(result.seconds.values()) if result.seconds else 0.0,
                f"{BACKEND}/tensors_skipped": result.tensors_skipped,  # (of the version: the same on every rank)
                **({f"{BACKEND}/rollback_of": source} if source is not None else {})}

    def _publish(self, publisher: Publisher, weights: Iterator[tuple[str, torch.Tensor]], topology: dict[str, Any],
                 step: int | None) -> tuple[Transfer, int]:
        """This rank's part of the sync's version (and the bytes it kept). The generator is walked here, on
        verl's thread, to the end on every rank: its gathers are collective."""
        rank, actors, version = topology["rank"], topology["actors"], topology["version"]
        if topology["source_version"] is not None:  # a rollback queued on the daemon: sent instead of new weights
            drain(weights)
            return publisher.publish(version, source_version=topology["source_version"],
                                     ownership=Ownership(rank, actors), expected_digest=topology["expected_digest"],
                                     keep=topology["keep"], route=self._route()), 0
        named, kept = collect_owned(weights, rank=rank, ranks=actors, bucket_size=self.bucket_size)
        agree = self._agree(rank, actors) if self.sparse and actors > 1 else None
        transfer = publisher.publish(version, named, mode=self.mode, step=step,
                                     ownership=Ownership(rank, actors), sparse=self.sparse, agree=agree,
                                     sparse_base=topology["sparse_base"] if self.sparse else None,
                                     keep=topology["keep"], route=self._route(), sharded=bool(self._lanes))
        return transfer, kept  # (the kept tensors: snapshotted, or read for bypass_cpu, by now)

    def _route(self) -> Callable[[], Route] | None:
        """A sharded sync's: each class of rollout workers on its groups (None: the attached group)."""
        lanes = self._lanes
        return (lambda: Route(None, {}, None, lanes)) if lanes else None

    def _abort(self, publisher: Publisher, version: int, reason: str) -> None:
        try:
            publisher.abort_before_start(version, reason, self._route())
        except CkptEngineError as exc:  # the rollout workers then fall back on their own timeout
            log.warning("could not tell the rollout workers that version %d is abandoned: %s", version, exc)
        if self._agent is not None:
            self._agent.abandoned(version, reason)
            self._open = None

    def _announce(self, store: Any, receivers: list[str] | None, actors: int) -> SyncAnnouncement:
        """Actor rank 0: this sync's version, from the daemon when there is one, told to every rank and worker
        on the store (with the reason when there is none, so everyone fails this sync alike)."""
        try:
            if receivers is None:  # (no daemon: the cache keeps the last version every worker took)
                fields: dict[str, Any] = {"version": self._versions,
                                          "keep": [self.last_version] if self.last_version is not None else []}
                settled = settle(self.knobs, EngineConfig())  # (the deployment's defaults where verl sets none)
            else:
                agent = self._daemon("trainer", 0, actors)  # (registered within the daemon bound)
                deadline = time.monotonic() + self._daemon_s
                # the last sync's outcome first: it goes on another connection, which a daemon that was stalled
                # may read after this one (the last version would be superseded with its outcome on the way)
                agent.flush_reports(max(deadline - time.monotonic(), 0.0))
                record = agent.open_version(receivers, knobs=self.knobs, deadline=deadline,
                                            limit_s=min(3 * self.timeout_s + self.load_timeout_s, _MAX_WAIT_S))
                fields = {"version": int(record["id"]), "source_version": record.get("source_version"),
                          "expected_digest": record.get("expected_digest"), "keep": record.get("keep") or []}
                self._open = fields["version"]
                settled = Settled.from_wire(record.get("knobs") or {})  # the daemon settled them (its YAML's)
                if fields["source_version"] is not None and record.get("owners") != actors:
                    raise ConfigError(f"version {fields['source_version']} was cached by {record.get('owners')} "
                                      f"actor ranks, this job has {actors}: it cannot be sent again")
                self._judge_unjudged(agent, deadline)
        except CkptEngineError as exc:
            self._abandon_open(str(exc))
            store.set(_ANNOUNCEMENT, encode(SyncAnnouncement(error=str(exc))))
            raise
        for line in settled.overrides:  # once each (the version's record says it every time)
            if line not in self._overrides_logged:
                self._overrides_logged.add(line)
                log.warning("%s: %s", BACKEND, line)
        sync = SyncAnnouncement(**fields, knobs=settled.to_wire(), drop=self._failed)
        self._failed = []
        store.set(_ANNOUNCEMENT, encode(sync))
        return sync

    def _judge_unjudged(self, agent: VerlAgent, deadline: float) -> None:
        """Versions the daemon gave no verdict on: dropped from the caches with the failed ones unless it has
        since recorded them committed (a killed daemon records them interrupted; they must not push the last
        committed version, the rollback target, out of the cache). Asked again next time if it does not say."""
        still: list[int] = []
        for version in self._unjudged:
            status = agent.status_of(version, deadline)
            if status is None:
                still.append(version)
            elif status != "committed":
                log.warning("%s: version %d is %s on the daemon; dropped from the caches", BACKEND, version, status)
                self._failed.append(version)
        self._unjudged = still

    def _agree(self, rank: int, actors: int) -> Callable[[list[int]], list[int]]:
        """Sparse versions: every actor rank's change flags merged (over this sync's store: each rank digests
        only the tensors it keeps, so one flag of each tensor comes from its owner)."""
        store = self._store

        def agree(vector: list[int]) -> list[int]:
            bounded(lambda: store.set(f"{_CHANGES}/{rank}", encode(ChangeFlags(flags=vector))), self.timeout_s,
                    "publishing this rank's change flags")
            merged = list(vector)
            for other in range(actors):
                if other != rank:
                    raw = wait_for_key(store, f"{_CHANGES}/{other}", self.timeout_s)
                    try:
                        theirs = decode(ChangeFlags, raw).flags
                    except ProtocolError as exc:
                        raise CkptEngineError(f"{BACKEND}: actor rank {other}'s change flags are unreadable "
                                              f"(another ckpt-engine version?): {exc}") from exc
                    if len(theirs) != len(merged):
                        raise CkptEngineError(f"actor rank {other} planned {len(theirs)} change flags, this rank "
                                              f"{len(merged)}: the ranks' generators yielded different tensors")
                    merged = [max(a, b) for a, b in zip(merged, theirs)]
            return merged

        return agree

    def _drop(self, versions: list[int]) -> None:
        publisher = self._publisher
        if publisher is None:
            return
        for version in versions:
            if version not in publisher.cache:
                continue
            if self._agent is not None:  # the daemon hears what this rank's cache holds now
                evict(self._agent, publisher, version)
            else:
                publisher.cache.evict(version)
            log.info("%s: version %d failed; dropped from this rank's cache", BACKEND, version)

    def _on_stage(self, version: int, stage: str) -> None:
        """The send's progress (transferring, verifying) in the daemon's record of the version."""
        if self._agent is not None and self.is_master:
            self._agent.report(version, stage)

    def _abandon_open(self, reason: str) -> None:
        if self._open is not None and self._agent is not None:
            self._agent.abandoned(self._open, reason)
        self._open = None

    def _told(self, result: TransferResult, publisher: Publisher, held: float) -> dict[str, Any] | None:
        """With a daemon: this rank's outcome told to it; on actor rank 0, the daemon's verdict (its record once
        it judged the rollout workers' own reports). None when the daemon did not answer in time: then what
        our own protocol verified stands (every worker acknowledged the digests); the daemon's record decides
        once it answers (a stalled daemon judges it as usual, a restarted one records it interrupted)."""
        agent = self._agent
        if agent is None:
            return None
        agent.sent(result, publisher, held)
        self._open = None
        if not self.is_master:
            agent.flush_reports(self._report_wait_s)
            return None
        verdict = agent.verdict(result.version, self._report_wait_s, self.timeout_s)
        if verdict is None and result.ok:
            log.error("%s: the daemon at %s gave no verdict on version %d within %.0fs; every rollout worker "
                      "acknowledged it, so verl goes on (the daemon's record decides once it answers: unless it "
                      "records the version committed, the next sync drops it from the caches)", BACKEND,
                      self.endpoint, result.version, self._report_wait_s + self.timeout_s)
        return verdict

    # ---- internals -------------------------------------------------------------------------------------
    def _publisher_for(self) -> Publisher:
        """This rank's publisher, for this sync's bucket size and keep_versions (a daemon restarted with other
        values changes them: another bucket size starts the cache afresh)."""
        publisher = self._publisher
        if publisher is not None and publisher.bucket_size != self.bucket_size:
            log.warning("%s: the bucket size changed from %d to %d bytes; the cached versions %s are dropped",
                        BACKEND, publisher.bucket_size, self.bucket_size, publisher.cache.versions())
            publisher.forget()
            publisher.close()
            publisher = self._publisher = None  # (the daemon hears what the cache holds with this sync's report)
        if publisher is None:
            # with a daemon, it drops each version as it ends: a failed one never costs a committed one its place
            publisher = self._publisher = Publisher(
                device=self.device, bucket_size=self.bucket_size, keep_versions=self.keep_versions,
                timeout_s=self.timeout_s, ack_timeout_s=self.timeout_s + self.load_timeout_s,
                wire_hook=self._wire_hook, on_stage=self._on_stage, external_trim=self.endpoint is not None)
        publisher.cache.keep_versions = self.keep_versions
        return publisher

    def _close_store(self) -> None:
        self._server = None  # the TCPStore server stops when its last reference goes
