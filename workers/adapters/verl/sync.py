"""The verl checkpoint-engine contract, met with the library (no verl import here: backend.py adds verl's base
class and registers it).

verl's CheckpointEngineManager runs, on every sync: ``prepare`` on every actor rank and rollout worker ->
``build_topology`` in the driver -> ``init_process_group`` everywhere -> ``send_weights`` on every actor rank
and ``receive_weights`` on every rollout worker at once -> ``finalize`` everywhere. Here each sync is one of
our versions:

- prepare: actor rank 0 (verl's master) serves a fresh rendezvous store and numbers the version (a counter of
  its own, increasing across syncs; verl's ``global_steps`` travels as the version's step);
- build_topology: actor rank a owns a share of every version (plan/owners.py) and sends it on a sync group of
  its own with all rollout workers; the actor ranks also form the owners group (their votes);
- send_weights: every actor rank walks the whole generator (it is collective), keeps its buckets' tensors and
  publishes (cached or bypass_cpu); it returns once every rollout worker has acknowledged;
- receive_weights: an async generator; the version is received and verified on a thread, and only a whole,
  verified version is yielded to verl's loader (views into staging, valid until the generator moves past the
  last tensor). A failed verification yields nothing and raises, naming the tensors;
- finalize: the groups and the store close (a new topology comes with every sync).

Actor rank 0 announces each sync's version on its store (so every rank and worker learns it, and whether it
is a rollback). With ``endpoint`` (a ckpt-engine daemon), that version is the daemon's (daemon.py): history,
metrics, ``/versions``, the rollout workers' own verdicts, and rollbacks queued with ``POST /push``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import torch
from ckpt_engine.workers.trainer_agent import evict

from ckpt_engine.device import DeviceInfo, detect_device, synchronize
from ckpt_engine.errors import ApplyRefused, CkptEngineError, ConfigError, SyncTimeoutError
from ckpt_engine.plan.modes import check_sparse, mode_of
from ckpt_engine.receive.assembly import VersionAssembler, VersionPayload
from ckpt_engine.receive.collective import Receiver, ReceiveResult
from ckpt_engine.send.publisher import Ownership, Publisher
from ckpt_engine.send.sender import Transfer, TransferResult, WireHook
from ckpt_engine.transport.group import SyncGroup, bounded, open_store, owner_part, serve_store, wait_for_key

from .daemon import VerlAgent
from .stream import collect_owned, drain

log = logging.getLogger(__name__)
BACKEND = "ckpt_engine"
_MASTER, _PEER = "master", "peer"
_ANNOUNCEMENT = "ckpt-engine/verl/version"  # on actor rank 0's store: this sync's version (or why none)
_CHANGES = "ckpt-engine/verl/changes"  # sparse versions: each actor rank's change flags
_DAEMON_WAIT_S = 30.0  # at most, per step of a sync that asks the daemon (registering, opening its version)
_REPORT_WAIT_S = 30.0  # how long an outcome may take to reach the daemon (it retries with backoff meanwhile)
_KNOWN = ("bypass_cpu", "sparse", "host", "device", "timeout_s", "load_timeout_s", "keep_versions", "group_name", "endpoint",
          "credentials")


class VerificationFailed(CkptEngineError):
    """A version arrived but did not verify (or did not arrive whole): nothing of it was handed to verl."""


def _node_address() -> str:
    """Where the other ranks reach actor rank 0: Ray's idea of this node's address when under Ray (verl)."""
    try:
        import ray  # verl always brings Ray; without it (a plain test) everything is on this host

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


_MAX_WAIT_S = 7 * 86400.0


_MIN_WAIT_S = 1.0  # below this a sync cannot even rendezvous
_MAX_KEEP = 1024  # (the daemon's own keep_versions bound)


def _seconds(name: str, value: object) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not _MIN_WAIT_S <= value <= _MAX_WAIT_S):
        raise ConfigError(f"engine_kwargs.{BACKEND}.{name} must be a number of seconds from {_MIN_WAIT_S:.0f} to "
                          f"{_MAX_WAIT_S:.0f}, got {value!r}")
    return float(value)


def _check_names(host: object, group_name: object, keep_versions: object) -> None:
    if host is not None and not (isinstance(host, str) and re.fullmatch(r"[^\s*]{1,253}", host)):
        raise ConfigError(f"engine_kwargs.{BACKEND}.host must be a host name or address the other verl processes "
                          f"reach actor rank 0 at, got {host!r}")
    if not (isinstance(group_name, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", group_name)):
        raise ConfigError(f"engine_kwargs.{BACKEND}.group_name must be 1 to 64 letters, digits, '_', '.' or '-', "
                          f"got {group_name!r}")
    if (isinstance(keep_versions, bool) or not isinstance(keep_versions, int)
            or not 1 <= keep_versions <= _MAX_KEEP):
        raise ConfigError(f"engine_kwargs.{BACKEND}.keep_versions must be an int from 1 to {_MAX_KEEP}, got "
                          f"{keep_versions!r}")


def _check_daemon(endpoint: object, credentials: object) -> None:
    if endpoint is None:
        return
    # (a host to connect to: a bind wildcard such as * names none)
    match = re.fullmatch(r"tcp://([^:/\s*]+|\[[0-9a-fA-F:]+\]):(\d{1,5})", endpoint) if isinstance(endpoint, str) else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"engine_kwargs.{BACKEND}.endpoint must be the daemon's zmq endpoint, tcp://host:port, got "
                          f"{endpoint!r}")
    if credentials is not None and (not isinstance(credentials, str) or not os.path.isfile(credentials)):
        raise ConfigError(f"engine_kwargs.{BACKEND}.credentials: {credentials!r} is not a file this process can see "
                          "(the daemon's credentials file; each process takes its role's token from it)")


class VerlSync:
    """One actor rank's or rollout worker's side of verl's checkpoint-engine contract."""

    wire_format = "named_tensors"  # verl's adapters get (name, tensor) pairs

    def __init__(self, bucket_size: int, is_master: bool | None = None, *, bypass_cpu: bool = False,
                 sparse: bool = False, host: str | None = None, device: str = "auto", timeout_s: float = 120.0,
                 load_timeout_s: float = 600.0, keep_versions: int = 1, group_name: str = "verl",
                 endpoint: str | None = None, credentials: str | None = None, **unknown: Any) -> None:
        """``bucket_size`` is verl's (``update_weights_bucket_megabytes``); ``is_master`` verl gives actor ranks
        only (True on rank 0): without it this is a rollout worker. The rest are ``engine_kwargs.ckpt_engine``:
        ``bypass_cpu`` (mode), ``sparse`` (send only the tensors that changed since the version every rollout
        worker holds; cached mode), ``host`` (where actor rank 0 serves the rendezvous; default this node's Ray
        address), ``device`` (auto: cuda/npu/cpu), ``timeout_s`` (every wait of the transfer),
        ``load_timeout_s`` (how long verl's loader may take to consume a version), ``keep_versions`` (cached
        versions kept in host memory on each actor rank), ``endpoint`` (a ckpt-engine daemon's control endpoint,
        ``tcp://host:port``) and ``credentials`` (the daemon's credentials file as these processes see it: each
        takes its role's token, trainer on actor ranks and rollout on rollout workers; default
        ``$CKPT_ENGINE_TOKEN``, else ``$CKPT_ENGINE_CREDENTIALS``, else ~/.ckpt-engine/credentials.json)."""
        if unknown:
            raise ConfigError(f"unknown engine_kwargs.{BACKEND} option(s) {sorted(unknown)}; known: "
                              f"{', '.join(_KNOWN)}")
        _check_daemon(endpoint, credentials)
        if device not in ("auto", "cpu", "cuda", "npu"):
            raise ConfigError(f"engine_kwargs.{BACKEND}.device must be one of auto, cpu, cuda, npu; got {device!r}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ConfigError(f"bucket_size must be a positive int, got {bucket_size!r}")
        if not isinstance(bypass_cpu, bool):
            raise ConfigError(f"engine_kwargs.{BACKEND}.bypass_cpu must be true or false, got {bypass_cpu!r}")
        _check_names(host, group_name, keep_versions)
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.is_actor = is_master is not None
        self.endpoint, self.credentials = endpoint, credentials
        self._agent: VerlAgent | None = None
        self._open: int | None = None  # actor rank 0: the daemon's version of this sync, until it is sent
        # actor rank 0: versions that failed, for every rank to drop from its cache (a failed version must not
        # take the place of the last good one, the rollback target)
        self._failed: list[int] = []
        # actor rank 0: versions the daemon gave no verdict on (it was down or stalled); asked again at the next
        # sync, and dropped too unless it recorded them committed
        self._unjudged: list[int] = []
        self.bypass_cpu, self.mode = bypass_cpu, mode_of(bypass_cpu)
        if not isinstance(sparse, bool):
            raise ConfigError(f"engine_kwargs.{BACKEND}.sparse must be true or false, got {sparse!r}")
        try:
            check_sparse(mode_of(bypass_cpu), sparse)
        except ConfigError as exc:
            raise ConfigError(f"engine_kwargs.{BACKEND}: {exc}") from None
        self.sparse = sparse
        self.host = host
        self.device_name = device
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.load_timeout_s = _seconds("load_timeout_s", load_timeout_s)
        self.keep_versions = keep_versions
        self.group_name = group_name
        self._device: DeviceInfo | None = None
        self._versions = 0  # the master's counter: verl syncs become versions 1, 2, ...
        self._server: Any = None  # the rendezvous store actor rank 0 serves during a sync
        self._store: Any = None
        self._topology: dict[str, Any] | None = None
        self._groups: list[SyncGroup] = []
        self._owners_group: SyncGroup | None = None
        self._publisher: Publisher | None = None
        self._assembler: VersionAssembler | None = None
        self._handoff = _Handoff(self.load_timeout_s)
        self._wire_hook: WireHook | None = None  # fault injection for tests (the library's own hook)
        self.last_version: int | None = None

    @property
    def _report_wait_s(self) -> float:
        return min(_REPORT_WAIT_S, self.timeout_s)

    @property
    def _daemon_s(self) -> float:
        """How long one step of a sync may wait for the daemon (registering, opening the version)."""
        return min(self.timeout_s, _DAEMON_WAIT_S)

    @property
    def device(self) -> DeviceInfo:
        if self._device is None:
            self._device = detect_device(self.device_name)
        return self._device

    # ---- verl's lifecycle, every sync ------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        if not self.is_actor:  # a rollout worker: the daemon knows it by its agent id (build_topology passes it on)
            held = self._assembler.manifest if self._assembler is not None else None
            # (checked with the daemon: after a restart the id held is unknown there, and verl names it)
            agent_id = (self._daemon("receiver", 0).current_id(time.monotonic() + min(self._daemon_s, 5.0))
                        if self.endpoint else None)
            return {"role": _PEER, "agent_id": agent_id, "holds": held.version if held is not None else None}
        if not self.is_master:
            return {"role": _PEER}
        self._abandon_open("verl started a new sync before this one's weights were sent")
        self._close_store()
        host = self.host or _node_address()
        self._server = serve_store(host, 0, timeout_s=self.timeout_s)
        self._versions += 1
        return {"role": _MASTER, "host": host, "port": int(self._server.port)}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        actors, rollouts = actor_wg_world_size, rollout_world_size
        if actors < 1 or rollouts < 1:
            raise ConfigError(f"{BACKEND} needs at least one actor rank and one rollout worker, got {actors} and "
                              f"{rollouts}")
        if len(metadata) != actors + rollouts:
            raise ConfigError(f"{len(metadata)} prepare() results for {actors} actor ranks + {rollouts} rollout "
                              "workers")
        masters = [i for i, meta in enumerate(metadata) if isinstance(meta, dict) and meta.get("role") == _MASTER]
        if masters != [0]:
            raise ConfigError(f"exactly actor rank 0 must be the master (is_master), found it at {masters}")
        master = metadata[0]
        agent_ids = [meta.get("agent_id") if isinstance(meta, dict) else None for meta in metadata[actors:]]
        if any(agent_ids) and not all(agent_ids):
            raise ConfigError("some rollout workers have a daemon endpoint and some do not: engine_kwargs."
                              f"{BACKEND}.endpoint must be the same in every verl process")
        # the version every rollout worker holds whole: a sparse version sends only what changed since it
        held = {meta.get("holds") if isinstance(meta, dict) else None for meta in metadata[actors:]}
        common: dict[str, Any] = {"host": master["host"], "port": master["port"], "actors": actors,
                                  "rollouts": rollouts, "receivers": agent_ids if all(agent_ids) else None,
                                  "sparse_base": held.pop() if len(held) == 1 else None}
        actor_kwargs: dict[str, list] = {"role": ["actor"] * actors, "rank": list(range(actors)),
                        **{key: [value] * actors for key, value in common.items()}}
        rollout_kwargs: dict[str, list] = {"role": ["rollout"] * rollouts, "rank": list(range(rollouts)),
                          **{key: [value] * rollouts for key, value in common.items()}}
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, *, role: str, rank: int, host: str, port: int, actors: int, rollouts: int,
                           receivers: list[str] | None = None, sparse_base: int | None = None) -> None:
        if role not in ("actor", "rollout"):
            raise ConfigError(f"unknown role {role!r}")
        if self.is_master != (role == "actor" and rank == 0) or self.is_actor != (role == "actor"):
            raise ConfigError(f"is_master={self.is_master} (actor: {self.is_actor}) but this is {role} rank {rank}")
        if (receivers is not None) != (self.endpoint is not None):
            raise ConfigError(f"engine_kwargs.{BACKEND}.endpoint must be set in every verl process or in none")
        self._close_groups()
        self._topology = None
        store = self._server if self.is_master else self._open_rank_0_store(host, port)
        self._store = store
        if role == "actor" and self.endpoint and not self.is_master:  # (rank 0 registers as it announces)
            self._daemon("trainer", rank, actors)
        sync = self._announce(store, receivers, actors) if self.is_master else self._announced(store)
        if role == "actor":
            self._drop(sync.get("drop", []))
        version = sync["version"]
        self._topology = {"role": role, "rank": rank, "version": version, "actors": actors, "rollouts": rollouts,
                          "source_version": sync.get("source_version"), "sparse_base": sparse_base,
                          "expected_digest": sync.get("expected_digest"), "keep": sync.get("keep") or []}

        me = f"actor rank {rank}" if role == "actor" else f"rollout worker {rank}"

        def group(part: str, group_rank: int, size: int) -> SyncGroup:
            return SyncGroup(store, name=self.group_name, generation=version, rank=group_rank, world_size=size,
                             device=self.device, timeout_s=self.timeout_s, part=part, label=me)

        # Actor a is rank 0 of its own group; rollout r is rank 1 + r in every actor's group (in owner order,
        # which is the order every actor builds its own group before the owners group: no one waits in a circle).
        if role == "actor":
            self._groups = [group(owner_part(rank), 0, 1 + rollouts)]
            if actors > 1:
                self._owners_group = group("owners/", rank, actors)
        else:
            self._groups = [group(owner_part(owner), 1 + rank, 1 + rollouts) for owner in range(actors)]

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
                                     keep=topology["keep"]), 0
        named, kept = collect_owned(weights, rank=rank, ranks=actors, bucket_size=self.bucket_size)
        agree = self._agree(rank, actors) if self.sparse and actors > 1 else None
        transfer = publisher.publish(version, named, mode=self.mode, step=step,  # type: ignore[arg-type]
                                     ownership=Ownership(rank, actors), sparse=self.sparse, agree=agree,
                                     sparse_base=topology["sparse_base"] if self.sparse else None,
                                     keep=topology["keep"])
        return transfer, kept  # (the kept tensors: snapshotted, or read for bypass_cpu, by now)

    def _abort(self, publisher: Publisher, version: int, reason: str) -> None:
        try:
            publisher.abort_before_start(version, reason)
        except CkptEngineError as exc:  # the rollout workers then fall back on their own timeout
            log.warning("could not tell the rollout workers that version %d is abandoned: %s", version, exc)
        if self._agent is not None:
            self._agent.abandoned(version, reason)
            self._open = None

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yields the whole version's (name, tensor) only after it arrived and verified. The tensors are views
        into this worker's staging: valid until the generator is resumed after the last one (verl's adapters
        copy or clone them)."""
        topology = self._require("rollout")
        version = topology["version"]
        receiver = Receiver(self._groups, self._handoff.load, assembler=self._assembler_for())
        loop = asyncio.get_running_loop()
        handed = self._handoff.expect(loop)
        received = asyncio.ensure_future(asyncio.to_thread(self._receive_and_report, receiver, version))
        try:
            await asyncio.wait([handed, received], return_when=asyncio.FIRST_COMPLETED)
            if handed.done():
                payload: VersionPayload = handed.result()
                for name, tensor in payload.tensors.items():
                    yield name, tensor
                if self.device.kind != "cpu":
                    synchronize(self.device)  # verl's copies out of staging may be non-blocking
                self._handoff.consumed(whole=True)
            await received
        finally:
            self._handoff.consumed(whole=False)  # verl stopped reading part way: the receiving thread goes on
            if not received.done():
                await asyncio.wait([received], timeout=self.timeout_s)
        result = received.result() if received.done() else ReceiveResult(
            version, False, "still receiving when the sync's wait ran out")
        if not result.ok:
            what = "was handed to verl but did not complete" if handed.done() else "refused, nothing handed to verl"
            raise VerificationFailed(f"{BACKEND}: version {version} (global_steps {global_steps}) {what}: "
                                     f"{result.reason}")
        self.last_version = version

    def _receive_and_report(self, receiver: Receiver, version: int) -> ReceiveResult:
        """On the receiving thread: the outcome, told to the daemon from here, so it is told whatever verl does
        with the generator (it may close it part way, or drop it)."""
        try:
            result = _outcome(version, receiver.receive(self.timeout_s))
        except Exception as exc:  # told like any other failure: the daemon must not wait for this worker
            log.exception("version %d: receiving failed", version)
            result = ReceiveResult(version, False, f"{type(exc).__name__}: {exc}")
        if self._agent is not None:  # said before verl goes on: the history holds it when verl's sync ends
            self._agent.received(version, result)
            self._agent.flush_reports(self._report_wait_s)
        return result

    def finalize(self) -> None:
        self._abandon_open("verl ended the sync before its weights were sent")
        self._close_groups()
        self._store = None
        if self.is_master:
            self._close_store()
        self._topology = None

    def close(self) -> None:
        """Leave the daemon (verl has no such step; a process that exits just stops heartbeating)."""
        self.finalize()
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ---- the daemon, and this sync's version --------------------------------------------------------------
    def _daemon(self, role: str, rank: int, ranks: int | None = None) -> VerlAgent:
        """This process's agent, registered with the daemon the first time it is needed."""
        if self._agent is None:
            self._agent = VerlAgent(role, self.endpoint or "", rank=rank, credentials=self.credentials,
                                    device=self.device,
                                    trainer_ranks=ranks, publisher=lambda: self._publisher,
                                    timeout_s=self._daemon_s).start()
        return self._agent

    def _announce(self, store: Any, receivers: list[str] | None, actors: int) -> dict[str, Any]:
        """Actor rank 0: this sync's version, from the daemon when there is one, told to every rank and worker
        on the store (with the reason when there is none, so everyone fails this sync alike)."""
        try:
            if receivers is None:  # (no daemon: the cache keeps the last version every worker took)
                sync: dict[str, Any] = {"version": self._versions,
                                        "keep": [self.last_version] if self.last_version is not None else []}
            else:
                agent = self._daemon("trainer", 0, actors)  # (registered within the daemon bound)
                deadline = time.monotonic() + self._daemon_s
                # the last sync's outcome first: it goes on another connection, which a daemon that was stalled
                # may read after this one (the last version would be superseded with its outcome on the way)
                agent.flush_reports(max(deadline - time.monotonic(), 0.0))
                record = agent.open_version(receivers, bypass_cpu=self.bypass_cpu, deadline=deadline,
                                            limit_s=min(3 * self.timeout_s + self.load_timeout_s, _MAX_WAIT_S))
                sync = {"version": int(record["id"]), "source_version": record.get("source_version"),
                        "expected_digest": record.get("expected_digest"), "keep": record.get("keep") or []}
                self._open = sync["version"]
                if sync["source_version"] is not None and record.get("owners") != actors:
                    raise ConfigError(f"version {sync['source_version']} was cached by {record.get('owners')} actor "
                                      f"ranks, this job has {actors}: it cannot be sent again")
                self._judge_unjudged(agent, deadline)
        except CkptEngineError as exc:
            self._abandon_open(str(exc))
            store.set(_ANNOUNCEMENT, json.dumps({"error": str(exc)}))
            raise
        sync["drop"], self._failed = self._failed, []
        store.set(_ANNOUNCEMENT, json.dumps(sync))
        return sync

    def _open_rank_0_store(self, host: str, port: int) -> Any:
        try:
            return open_store(host, port, timeout_s=self.timeout_s)
        except SyncTimeoutError as exc:
            raise CkptEngineError(f"{BACKEND}: actor rank 0's rendezvous store for this sync did not answer (is "
                                  f"actor rank 0 alive?): {exc}") from exc

    def _announced(self, store: Any) -> dict[str, Any]:
        # rank 0 may take its daemon bound (registering, then opening the version) on top of the rendezvous
        wait_s = self.timeout_s + (2 * self._daemon_s + 5.0 if self.endpoint else 0.0)
        try:
            sync = json.loads(wait_for_key(store, _ANNOUNCEMENT, wait_s))
        except (RuntimeError, ValueError, SyncTimeoutError) as exc:
            raise CkptEngineError(f"{BACKEND}: actor rank 0 did not announce this sync's version within "
                                  f"{wait_s:.0f}s (is it alive?): {exc}") from exc
        if "error" in sync:
            raise CkptEngineError(f"{BACKEND}: no version for this sync: {sync['error']}")
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
            bounded(lambda: store.set(f"{_CHANGES}/{rank}", json.dumps(vector)), self.timeout_s,
                    "publishing this rank's change flags")
            merged = list(vector)
            for other in range(actors):
                if other != rank:
                    theirs = json.loads(wait_for_key(store, f"{_CHANGES}/{other}", self.timeout_s))
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
    def _require(self, role: str) -> dict[str, Any]:
        topology = self._topology
        if topology is None:
            raise CkptEngineError(f"{BACKEND}: init_process_group was not called before this sync")
        if topology["role"] != role:
            raise CkptEngineError(f"{BACKEND}: this is a {topology['role']}; only a(n) {role} does that")
        return topology

    def _publisher_for(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(device=self.device, bucket_size=self.bucket_size,
                                        keep_versions=self.keep_versions, timeout_s=self.timeout_s,
                                        ack_timeout_s=self.timeout_s + self.load_timeout_s,
                                        wire_hook=self._wire_hook, on_stage=self._on_stage)
        return self._publisher

    def _assembler_for(self) -> VersionAssembler:
        if self._assembler is None:  # kept across syncs: staging and the version held carry over
            self._assembler = VersionAssembler(self.device, self._handoff.load)
        return self._assembler

    def _close_groups(self) -> None:
        # Closed without a CLOSE frame: every member is in finalize, nobody would take it.
        for group in [*self._groups, *([self._owners_group] if self._owners_group is not None else [])]:
            group.close()
        self._groups, self._owners_group = [], None

    def _close_store(self) -> None:
        self._server = None  # the TCPStore server stops when its last reference goes


def _outcome(version: int, result: ReceiveResult | None) -> ReceiveResult:
    """This worker's outcome of the announced ``version``."""
    if result is None:
        return ReceiveResult(version, False, "the trainer closed the sync before the version")
    if result.ok and result.version != version:
        result.ok, result.reason = False, f"received version {result.version}, announced {version}"
    return result


def _step(global_steps: int | None) -> int | None:
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise ConfigError(f"global_steps must be a non-negative int or None, got {global_steps!r}")
    return global_steps


class _Handoff:
    """Hands a verified version from the receiving thread (inside ``load``) to the async generator, and holds
    the thread in ``load`` until verl consumed it: the views point into staging, which the next version reuses."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._future: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = threading.Event()
        self._whole = False

    def expect(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        self._loop, self._future = loop, loop.create_future()
        self._done.clear()
        self._whole = False
        return self._future

    def load(self, payload: VersionPayload) -> None:
        loop, future = self._loop, self._future
        if loop is None or future is None:
            raise ApplyRefused("no receive_weights() is waiting for this version")
        loop.call_soon_threadsafe(_set_once, future, payload)
        if not self._done.wait(self.timeout_s):
            raise CkptEngineError(f"verl did not consume version {payload.version} within {self.timeout_s:.0f}s "
                                  "(engine_kwargs.ckpt_engine.load_timeout_s)")
        if not self._whole:  # verl's loader took part of it: the rollout's weights are torn
            raise CkptEngineError(f"verl stopped reading version {payload.version} part way")

    def consumed(self, *, whole: bool) -> None:
        if not self._done.is_set():
            self._whole = whole
            self._done.set()


def _set_once(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)

