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

import json
import logging
import math
import os
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

from ckpt_engine.device import DeviceInfo, detect_device
from ckpt_engine.errors import CkptEngineError, ConfigError, SyncTimeoutError
from ckpt_engine.plan.modes import STAGINGS, Staging, check_sparse, mode_of
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.transport.group import SyncGroup, open_store, owner_part, wait_for_key

from .daemon import VerlAgent

log = logging.getLogger(__name__)
BACKEND = "ckpt_engine"
_MASTER, _PEER = "master", "peer"
_ANNOUNCEMENT = "ckpt-engine/verl/version"  # on actor rank 0's store: this sync's version (or why none)
_CHANGES = "ckpt-engine/verl/changes"  # sparse versions: each actor rank's change flags
_DAEMON_WAIT_S = 30.0  # at most, per step of a sync that asks the daemon (registering, opening its version)
_REPORT_WAIT_S = 30.0  # how long an outcome may take to reach the daemon (it retries with backoff meanwhile)
_KNOWN = ("bypass_cpu", "sparse", "staging", "host", "device", "timeout_s", "load_timeout_s", "keep_versions", "group_name", "endpoint",
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
    """What both sides of verl's checkpoint-engine contract share (options, the topology, the rendezvous, the
    groups, the daemon's agent); ``VerlActor`` (actor.py) and ``VerlRollout`` (rollout.py) are the two sides,
    and backend.py opens the one verl asks for (``is_master`` given: an actor rank)."""

    wire_format = "named_tensors"  # verl's adapters get (name, tensor) pairs

    def __init__(self, bucket_size: int, is_master: bool | None = None, *, bypass_cpu: bool = False,
                 sparse: bool = False, staging: str = "auto", host: str | None = None, device: str = "auto", timeout_s: float = 120.0,
                 load_timeout_s: float = 600.0, keep_versions: int = 1, group_name: str = "verl",
                 endpoint: str | None = None, credentials: str | None = None, **unknown: Any) -> None:
        """``bucket_size`` is verl's (``update_weights_bucket_megabytes``); ``is_master`` verl gives actor ranks
        only (True on rank 0): without it this is a rollout worker. The rest are ``engine_kwargs.ckpt_engine``:
        ``bypass_cpu`` (mode), ``sparse`` (send only the tensors that changed since the version every rollout
        worker holds; cached mode), ``staging`` (how a rollout worker holds a version before verl's loader
        gets it: auto, device, host or stream; see docs/workers.md), ``host`` (where actor rank 0 serves the rendezvous; default this node's Ray
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
        self.bypass_cpu, self.mode = bypass_cpu, mode_of(bypass_cpu)
        if not isinstance(sparse, bool):
            raise ConfigError(f"engine_kwargs.{BACKEND}.sparse must be true or false, got {sparse!r}")
        try:
            check_sparse(mode_of(bypass_cpu), sparse)
        except ConfigError as exc:
            raise ConfigError(f"engine_kwargs.{BACKEND}: {exc}") from None
        self.sparse = sparse
        if staging not in STAGINGS:
            raise ConfigError(f"engine_kwargs.{BACKEND}.staging must be one of {', '.join(STAGINGS)}, got {staging!r}")
        self.staging: Staging = staging  # type: ignore[assignment]
        self.host = host
        self.device_name = device
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.load_timeout_s = _seconds("load_timeout_s", load_timeout_s)
        self.keep_versions = keep_versions
        self.group_name = group_name
        self._device: DeviceInfo | None = None
        self._store: Any = None
        self._topology: dict[str, Any] | None = None
        self._groups: list[SyncGroup] = []
        self._owners_group: SyncGroup | None = None
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
        store = self._store_for(host, port)
        self._store = store
        sync = self._join(store, rank, receivers, actors)
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

    def _join(self, store: Any, rank: int, receivers: list[str] | None, actors: int) -> dict[str, Any]:
        """This side's part of init_process_group: the sync's announcement (the version and what goes with it)."""
        return self._announced(store)

    def _store_for(self, host: str, port: int) -> Any:
        return self._open_rank_0_store(host, port)

    def _cache_publisher(self) -> Publisher | None:
        return None

    def _daemon(self, role: str, rank: int, ranks: int | None = None) -> VerlAgent:
        """This process's agent, registered with the daemon the first time it is needed."""
        if self._agent is None:
            self._agent = VerlAgent(role, self.endpoint or "", rank=rank, credentials=self.credentials,
                                    device=self.device,
                                    trainer_ranks=ranks, publisher=self._cache_publisher,
                                    timeout_s=self._daemon_s).start()
        return self._agent

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


def _step(global_steps: int | None) -> int | None:
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise ConfigError(f"global_steps must be a non-negative int or None, got {global_steps!r}")
    return global_steps
