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
- receive_weights: an async generator; the version is received and verified on a thread. Staged (device or
  host), only a whole, verified version is yielded to verl's loader; streamed, each bucket's tensors are
  yielded once that bucket verified, and the generator ends only after the last bucket and the trailer
  verified (a failure part way raises into verl's loader: the rollout is torn, which the daemon repairs).
  A failed verification raises, naming the tensors;
- finalize: the groups and the store close (a new topology comes with every sync).

Actor rank 0 announces each sync's version on its store (so every rank and worker learns it, and whether it
is a rollback). With ``endpoint`` (a ckpt-engine daemon), that version is the daemon's (daemon.py): history,
metrics, ``/versions``, the rollout workers' own verdicts, and rollbacks queued with ``POST /push``.

This module holds what both sides share (``VerlSync``); actor.py is an actor rank's side, rollout.py a rollout
worker's, and backend.py verl's class, which opens the side verl asks for.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from ckpt_engine.codec import decode
from ckpt_engine.config import EngineConfig
from ckpt_engine.config.knobs import Settled, check_knobs, settle
from ckpt_engine.control.messages import MAX_KEPT, parse_shard_spec
from ckpt_engine.device import DeviceInfo, detect_device
from ckpt_engine.errors import CkptEngineError, ConfigError, ProtocolError, SyncTimeoutError
from ckpt_engine.plan.modes import Staging
from ckpt_engine.plan.shards import spec_key, spec_to_wire
from ckpt_engine.send.class_senders import Lane
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.transport.group import SyncGroup, open_store, owner_part, wait_for_key

from .daemon import VerlAgent
from .options import BACKEND, MAX_WAIT_S, WHERE, VerlOptions

log = logging.getLogger(__name__)
_MASTER, _PEER = "master", "peer"
_ANNOUNCEMENT = "ckpt-engine/verl/version"  # on actor rank 0's store: this sync's version (or why none)


class SyncAnnouncement(BaseModel):
    """What actor rank 0 tells every actor rank and rollout worker about one sync, on its store, in the one wire
    form (``ckpt_engine.codec``): the version and how to send it, or why there is none (``error``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # (a newer rank 0's fields: ignored, as everywhere)
    version: int | None = None
    source_version: int | None = None  # a rollback: the cached version sent again under ``version``
    expected_digest: str | None = Field(None, max_length=64)
    keep: list[int] = Field(default_factory=list, max_length=MAX_KEPT)
    knobs: dict[str, Any] = Field(default_factory=dict)  # Settled.to_wire(): what every rank runs this sync with
    drop: list[int] = Field(default_factory=list, max_length=1 << 16)  # versions every cache drops (failed)
    error: str | None = None


class ChangeFlags(BaseModel):
    """A sparse version: one actor rank's change flag per planned tensor, for the others to merge (on the store)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    flags: list[int] = Field(max_length=1 << 24)

_CHANGES = "ckpt-engine/verl/changes"  # sparse versions: each actor rank's change flags
_DAEMON_WAIT_S = 30.0  # at most, per step of a sync that asks the daemon (registering, opening its version)
_REPORT_WAIT_S = 30.0  # how long an outcome may take to reach the daemon (it retries with backoff meanwhile)


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


_MAX_WAIT_S = MAX_WAIT_S


class VerlSync:
    """What both sides of verl's checkpoint-engine contract share (options, the topology, the rendezvous, the
    groups, the daemon's agent); ``VerlActor`` (actor.py) and ``VerlRollout`` (rollout.py) are the two sides,
    and backend.py opens the one verl asks for (``is_master`` given: an actor rank)."""

    wire_format = "named_tensors"  # verl's adapters get (name, tensor) pairs

    def __init__(self, bucket_size: int | None, is_master: bool | None = None, **options: Any) -> None:
        """``bucket_size``: verl's (``update_weights_bucket_megabytes``; None: verl's default, left to the
        deployment, see backend.py); ``is_master`` verl gives actor ranks only (True on rank 0): without it this
        is a rollout worker. ``options`` are ``engine_kwargs.ckpt_engine`` (options.py ``VerlOptions``):
        ``bypass_cpu`` (mode), ``sparse`` (send only the tensors that changed since the version every rollout
        worker holds; cached mode), ``staging`` (how a rollout worker holds a version before verl's loader gets
        it: auto, device, host or stream; see docs/workers.md) and ``keep_versions`` (cached versions kept in
        host memory on each actor rank): unset, the daemon's (or the deployment's default; ckpt_engine/config/knobs.py
        decides each sync's values); ``host`` (where actor rank 0 serves the rendezvous; default this node's Ray
        address), ``device`` (auto: cuda/npu/cpu), ``timeout_s`` (every wait of the transfer),
        ``load_timeout_s`` (how long verl's loader may take to consume a version), ``endpoint`` (a ckpt-engine
        daemon's control endpoint, ``tcp://host:port``), ``credentials`` (the daemon's credentials file as these
        processes see it: each takes its role's token, trainer on actor ranks and rollout on rollout workers;
        default ``$CKPT_ENGINE_TOKEN``, else ``$CKPT_ENGINE_CREDENTIALS``, else ~/.ckpt-engine/credentials.json)
        and ``sharded`` with ``tensor_parallel_size`` and ``model_path`` (rollout workers receive only the
        slices their TP rank keeps: shards.py)."""
        if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int)
                                        or bucket_size <= 0):
            raise ConfigError(f"bucket_size must be a positive int, got {bucket_size!r}")
        self.options = VerlOptions.parse(options)
        # the knobs verl set (the rest are the daemon's, or the deployment's defaults): settled every sync
        self.knobs: dict[str, Any] = {**self.options.knobs,
                                      **({"bucket_size_mb": bucket_size / (1 << 20)} if bucket_size else {})}
        check_knobs(self.knobs, WHERE)  # (the bucket size as the deployment's bucket_size_mb is checked)
        self.is_master = bool(is_master)
        self.is_actor = is_master is not None
        self.endpoint, self.credentials = self.options.endpoint, self.options.credentials
        self._agent: VerlAgent | None = None
        self._take_knobs(settle(self.knobs, EngineConfig()))  # until a sync says otherwise
        self.host = self.options.host
        self.device_name = self.options.device
        self.timeout_s, self.load_timeout_s = self.options.timeout_s, self.options.load_timeout_s
        self.group_name = self.options.group_name
        self._device: DeviceInfo | None = None
        self._store: Any = None
        self._topology: dict[str, Any] | None = None
        self._groups: list[SyncGroup] = []
        self._owners_group: SyncGroup | None = None
        self._lanes: tuple[Lane, ...] = ()  # a sharded sync's classes (actor ranks)
        self.last_version: int | None = None

    def _take_knobs(self, settled: Settled) -> None:
        """This sync's knobs (ckpt_engine/config/knobs.py: verl's over the daemon's), on every rank and worker alike."""
        self.settled = settled
        self.bypass_cpu, self.mode, self.sparse = settled.bypass_cpu, settled.mode, settled.sparse
        self.staging: Staging = settled.staging
        self.bucket_size, self.keep_versions = settled.bucket_size, settled.keep_versions

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
                                  "sparse_base": held.pop() if len(held) == 1 else None,
                                  "classes": _classes(metadata[actors:])}
        actor_kwargs: dict[str, list] = {"role": ["actor"] * actors, "rank": list(range(actors)),
                        **{key: [value] * actors for key, value in common.items()}}
        rollout_kwargs: dict[str, list] = {"role": ["rollout"] * rollouts, "rank": list(range(rollouts)),
                          **{key: [value] * rollouts for key, value in common.items()}}
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, *, role: str, rank: int, host: str, port: int, actors: int, rollouts: int,
                           receivers: list[str] | None = None, sparse_base: int | None = None,
                           classes: list[dict[str, Any]] | None = None) -> None:
        """``classes``: with sharded rollout workers, the workers with one shard spec each (build_topology):
        every actor rank sends each class only its pieces, on a group of its own with the class's workers."""
        if role not in ("actor", "rollout"):
            raise ConfigError(f"unknown role {role!r}")
        if self.is_master != (role == "actor" and rank == 0) or self.is_actor != (role == "actor"):
            raise ConfigError(f"is_master={self.is_master} (actor: {self.is_actor}) but this is {role} rank {rank}")
        if (receivers is not None) != (self.endpoint is not None):
            raise ConfigError(f"engine_kwargs.{BACKEND}.endpoint must be set in every verl process or in none")
        self._close_groups()
        self._topology = None
        store = self._store_for(host, port)
        self._store = store
        sync = self._join(store, rank, receivers, actors)
        version = sync.version
        if version is None:  # (an announcement without one carries its error: _announced raised it)
            raise CkptEngineError(f"{BACKEND}: actor rank 0 announced no version for this sync")
        try:
            self._take_knobs(Settled.from_wire(sync.knobs))
        except (KeyError, TypeError, ConfigError) as exc:
            raise CkptEngineError(f"{BACKEND}: actor rank 0 announced no usable knobs for version {version}: "
                                  f"{exc}") from None
        self._topology = {"role": role, "rank": rank, "version": version, "actors": actors, "rollouts": rollouts,
                          "source_version": sync.source_version, "sparse_base": sparse_base,
                          "expected_digest": sync.expected_digest, "keep": sync.keep}

        # (rollout worker r is rank 1 + r of every group, and so receiver 1 + r of the version: how the daemon's
        # reasons, its page and the CLI name it)
        me = f"actor rank {rank}" if role == "actor" else f"receiver {1 + rank} (verl rollout worker {rank})"

        def group(part: str, group_rank: int, size: int) -> SyncGroup:
            return SyncGroup(store, name=self.group_name, generation=version, rank=group_rank, world_size=size,
                             device=self.device, timeout_s=self.timeout_s, part=part, label=me)

        self._lanes = ()
        if classes:  # sharded: as below, per class (rollout r is its class's member k, rank k of the class's groups)
            self._class_groups(group, role, rank, actors, classes)
            return
        # Actor a is rank 0 of its own group; rollout r is rank 1 + r in every actor's group (in owner order,
        # which is the order every actor builds its own group before the owners group: no one waits in a circle).
        if role == "actor":
            self._groups = [group(owner_part(rank), 0, 1 + rollouts)]
            if actors > 1:
                self._owners_group = group("owners/", rank, actors)
        else:
            self._groups = [group(owner_part(owner), 1 + rank, 1 + rollouts) for owner in range(actors)]

    def _class_groups(self, group: Callable[[str, int, int], SyncGroup], role: str, rank: int, actors: int,
                      classes: list[dict[str, Any]]) -> None:
        """A sharded sync's groups: per class, every actor rank's group with the class's workers (the actor is rank
        0, the class's k-th worker rank k) and, with several actor ranks, the class's owners' group. Actors build
        theirs class by class, then the owners' groups; a worker its class's in owner order: no one waits in a
        circle."""
        parts = [f"class-{index}/" for index in range(len(classes))]
        if role == "actor":
            sends = [group(part + owner_part(rank), 0, 1 + len(c["members"])) for part, c in zip(parts, classes)]
            owners = [group(part + "owners/", rank, actors) for part in parts] if actors > 1 else [None] * len(parts)
            self._groups = sends + [g for g in owners if g is not None]
            self._lanes = tuple(Lane(c["key"], parse_shard_spec(c["spec"]), send, tuple(1 + m for m in c["members"]),
                                     owners_group=owner) for c, send, owner in zip(classes, sends, owners))
            return
        index = next((i for i, c in enumerate(classes) if rank in c["members"]), None)
        if index is None:
            raise ConfigError(f"rollout worker {rank} is in none of this sync's classes")
        seat, size = 1 + classes[index]["members"].index(rank), 1 + len(classes[index]["members"])
        self._groups = [group(parts[index] + owner_part(owner), seat, size) for owner in range(actors)]

    def finalize(self) -> None:
        self._close_groups()
        self._store = None
        self._topology = None

    def close(self) -> None:
        """Leave the daemon (verl has no such step; a process that exits just stops heartbeating)."""
        self.finalize()
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ---- the daemon, and this sync's version --------------------------------------------------------------
    # ---- what each side does (actor.py, rollout.py) -------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        raise CkptEngineError(f"{BACKEND}: open an actor rank's or a rollout worker's side (backend.py does)")

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, Any]:
        raise CkptEngineError(f"{BACKEND}: this is a rollout worker; only an actor rank sends weights")

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        raise CkptEngineError(f"{BACKEND}: this is an actor rank; only a rollout worker receives weights")
        yield  # (an async generator, as verl's contract has it)

    def _join(self, store: Any, rank: int, receivers: list[str] | None, actors: int) -> SyncAnnouncement:
        """This side's part of init_process_group: the sync's announcement (the version and what goes with it)."""
        return self._announced(store)

    def _store_for(self, host: str, port: int) -> Any:
        return self._open_rank_0_store(host, port)

    def _cache_publisher(self) -> Publisher | None:
        return None

    def _shard_wire(self) -> dict | None:
        """A sharded rollout worker's spec (wire form), which it registers with the daemon."""
        return None

    def _daemon(self, role: str, rank: int, ranks: int | None = None) -> VerlAgent:
        """This process's agent, registered with the daemon the first time it is needed."""
        if self._agent is None:
            self._agent = VerlAgent(role, self.endpoint or "", rank=rank, credentials=self.credentials,
                                    device=self.device,
                                    trainer_ranks=ranks, publisher=self._cache_publisher,
                                    timeout_s=self._daemon_s, shard_spec=self._shard_wire()).start()
        return self._agent

    def _open_rank_0_store(self, host: str, port: int) -> Any:
        try:
            return open_store(host, port, timeout_s=self.timeout_s)
        except SyncTimeoutError as exc:
            raise CkptEngineError(f"{BACKEND}: actor rank 0's rendezvous store for this sync did not answer (is "
                                  f"actor rank 0 alive?): {exc}") from exc

    def _announced(self, store: Any) -> SyncAnnouncement:
        # rank 0 may take its daemon bound (registering, then opening the version) on top of the rendezvous
        wait_s = self.timeout_s + (2 * self._daemon_s + 5.0 if self.endpoint else 0.0)
        try:
            raw = wait_for_key(store, _ANNOUNCEMENT, wait_s)
        except (RuntimeError, SyncTimeoutError) as exc:
            raise CkptEngineError(f"{BACKEND}: actor rank 0 did not announce this sync's version within "
                                  f"{wait_s:.0f}s (is it alive?): {exc}") from exc
        try:
            sync = decode(SyncAnnouncement, raw)
        except ProtocolError as exc:
            raise CkptEngineError(f"{BACKEND}: actor rank 0's announcement of this sync is unreadable "
                                  f"(another ckpt-engine version?): {exc}") from exc
        if sync.error is not None or sync.version is None:
            raise CkptEngineError(f"{BACKEND}: no version for this sync: {sync.error or 'none announced'}")
        return sync

    # ---- internals -------------------------------------------------------------------------------------
    def _require(self, role: str) -> dict[str, Any]:
        topology = self._topology
        if topology is None:
            raise CkptEngineError(f"{BACKEND}: init_process_group was not called before this sync")
        if topology["role"] != role:
            raise CkptEngineError(f"{BACKEND}: this is a {topology['role']}; only a(n) {role} does that")
        return topology

    def _close_groups(self) -> None:
        # Closed without a CLOSE frame: every member is in finalize, nobody would take it.
        for group in [*self._groups, *([self._owners_group] if self._owners_group is not None else [])]:
            group.close()
        self._groups, self._owners_group = [], None


def _classes(rollouts: list[Any]) -> list[dict[str, Any]] | None:
    """The rollout workers grouped by the shard spec each declared in prepare (in rank order of their first
    member, as the daemon groups them: decisions/receiver_classes.py); None when none declared one (every worker takes
    the whole version). Workers without a spec are the class of whole tensors."""
    shards = [meta.get("shard") if isinstance(meta, dict) else None for meta in rollouts]
    if not any(shards):
        return None
    grouped: dict[str, dict[str, Any]] = {}
    for rank, shard in enumerate(shards):
        spec = parse_shard_spec(shard or {})
        key = spec_key(spec)
        grouped.setdefault(key, {"key": key, "spec": spec_to_wire(spec), "members": []})["members"].append(rank)
    return list(grouped.values())


def _step(global_steps: int | None) -> int | None:
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise ConfigError(f"global_steps must be a non-negative int or None, got {global_steps!r}")
    return global_steps
