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
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

from ckpt_engine.device import DeviceInfo, detect_device, synchronize
from ckpt_engine.errors import ApplyRefused, CkptEngineError, ConfigError
from ckpt_engine.receive.assembly import VersionAssembler, VersionPayload
from ckpt_engine.receive.collective import Receiver
from ckpt_engine.send.publisher import Ownership, Publisher
from ckpt_engine.send.sender import WireHook
from ckpt_engine.transport.group import SyncGroup, open_store, owner_part, serve_store

from .stream import collect_owned

log = logging.getLogger(__name__)
BACKEND = "ckpt_engine"
_MASTER, _PEER = "master", "peer"


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


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"engine_kwargs.{BACKEND}.{name} must be a positive number, got {value!r}")
    return float(value)


class VerlSync:
    """One actor rank's or rollout worker's side of verl's checkpoint-engine contract."""

    wire_format = "named_tensors"  # verl's adapters get (name, tensor) pairs

    def __init__(self, bucket_size: int, is_master: bool = False, *, bypass_cpu: bool = False,
                 host: str | None = None, device: str = "auto", timeout_s: float = 120.0,
                 load_timeout_s: float = 600.0, keep_versions: int = 1, group_name: str = "verl",
                 **unknown: Any) -> None:
        """``bucket_size`` is verl's (``update_weights_bucket_megabytes``); the rest are
        ``engine_kwargs.ckpt_engine``: ``bypass_cpu`` (mode), ``host`` (where actor rank 0 serves the
        rendezvous; default this node's Ray address), ``device`` (auto: cuda/npu/cpu), ``timeout_s`` (every
        wait of the transfer), ``load_timeout_s`` (how long verl's loader may take to consume a version),
        ``keep_versions`` (cached versions kept in host memory on each actor rank)."""
        if unknown:
            raise ConfigError(f"unknown engine_kwargs.{BACKEND} option(s) {sorted(unknown)}; known: bypass_cpu, host, "
                              "device, timeout_s, load_timeout_s, keep_versions, group_name")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ConfigError(f"bucket_size must be a positive int, got {bucket_size!r}")
        if not isinstance(bypass_cpu, bool):
            raise ConfigError(f"engine_kwargs.{BACKEND}.bypass_cpu must be true or false, got {bypass_cpu!r}")
        if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 1:
            raise ConfigError(f"engine_kwargs.{BACKEND}.keep_versions must be an int >= 1, got {keep_versions!r}")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.mode = "bypass_cpu" if bypass_cpu else "cached"
        self.host = host
        self.device_name = device
        self.timeout_s = _positive("timeout_s", timeout_s)
        self.load_timeout_s = _positive("load_timeout_s", load_timeout_s)
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
    def device(self) -> DeviceInfo:
        if self._device is None:
            self._device = detect_device(self.device_name)
        return self._device

    # ---- verl's lifecycle, every sync ------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {"role": _PEER}
        self._close_store()
        host = self.host or _node_address()
        self._server = serve_store(host, 0, timeout_s=self.timeout_s)
        self._versions += 1
        return {"role": _MASTER, "host": host, "port": int(self._server.port), "version": self._versions}

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
        common: dict[str, Any] = {"host": master["host"], "port": master["port"], "version": master["version"],
                  "actors": actors, "rollouts": rollouts}
        actor_kwargs: dict[str, list] = {"role": ["actor"] * actors, "rank": list(range(actors)),
                        **{key: [value] * actors for key, value in common.items()}}
        rollout_kwargs: dict[str, list] = {"role": ["rollout"] * rollouts, "rank": list(range(rollouts)),
                          **{key: [value] * rollouts for key, value in common.items()}}
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, *, role: str, rank: int, host: str, port: int, version: int, actors: int,
                           rollouts: int) -> None:
        if role not in ("actor", "rollout"):
            raise ConfigError(f"unknown role {role!r}")
        if self.is_master != (role == "actor" and rank == 0):
            raise ConfigError(f"is_master={self.is_master} but this is {role} rank {rank}")
        self._close_groups()
        self._topology = {"role": role, "rank": rank, "version": version, "actors": actors, "rollouts": rollouts}
        store = self._server if self.is_master else open_store(host, port, timeout_s=self.timeout_s)
        self._store = store

        def group(part: str, group_rank: int, size: int) -> SyncGroup:
            return SyncGroup(store, name=self.group_name, generation=version, rank=group_rank, world_size=size,
                             device=self.device, timeout_s=self.timeout_s, part=part)

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
        rank, actors = topology["rank"], topology["actors"]
        version = topology["version"]
        # Walked here, on verl's thread, to the end on every rank: the generator's gathers are collective.
        named, kept = collect_owned(weights, rank=rank, ranks=actors, bucket_size=self.bucket_size)
        publisher = self._publisher_for()
        publisher.attach(self._groups[0], owners_group=self._owners_group)
        transfer = publisher.publish(version, named, mode=self.mode, step=_step(global_steps),  # type: ignore[arg-type]
                                     ownership=Ownership(rank, actors))
        del named  # the kept tensors: snapshotted (cached) or read (bypass_cpu) by now
        result = await asyncio.to_thread(transfer.result, self.timeout_s + self.load_timeout_s + self.timeout_s)
        if not result.ok:
            raise CkptEngineError(f"{BACKEND}: version {version} (global_steps {global_steps}) was not delivered by "
                                  f"actor rank {rank}: {result.reason}")
        self.last_version = version
        return {f"{BACKEND}/version": version, f"{BACKEND}/bytes_kept_rank{rank}": kept,
                f"{BACKEND}/bytes_sent_rank{rank}": result.bytes_sent,
                f"{BACKEND}/seconds_rank{rank}": sum(result.seconds.values()) if result.seconds else 0.0}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yields the whole version's (name, tensor) only after it arrived and verified. The tensors are views
        into this worker's staging: valid until the generator is resumed after the last one (verl's adapters
        copy or clone them)."""
        topology = self._require("rollout")
        version = topology["version"]
        receiver = Receiver(self._groups, self._handoff.load, assembler=self._assembler_for())
        loop = asyncio.get_running_loop()
        handed = self._handoff.expect(loop)
        received = asyncio.ensure_future(asyncio.to_thread(receiver.receive, self.timeout_s))
        try:
            await asyncio.wait([handed, received], return_when=asyncio.FIRST_COMPLETED)
            if handed.done():
                payload: VersionPayload = handed.result()
                for name, tensor in payload.tensors.items():
                    yield name, tensor
                if self.device.kind != "cpu":
                    synchronize(self.device)  # verl's copies out of staging may be non-blocking
                self._handoff.consumed(whole=True)
            result = await received
        finally:
            self._handoff.consumed(whole=False)  # verl stopped early: the receiving thread must not wait on
            if not received.done():
                await asyncio.wait([received], timeout=self.timeout_s)
        if result is None:
            raise VerificationFailed(f"{BACKEND}: the trainer closed the sync before version {version}")
        if not result.ok:
            what = "was handed to verl but did not complete" if handed.done() else "refused, nothing handed to verl"
            raise VerificationFailed(f"{BACKEND}: version {result.version} (global_steps {global_steps}) {what}: "
                                     f"{result.reason}")
        self.last_version = result.version

    def finalize(self) -> None:
        self._close_groups()
        self._store = None
        if self.is_master:
            self._close_store()
        self._topology = None

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
                                        wire_hook=self._wire_hook)
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

