"""A rollout worker's side of verl's contract: it receives the sync's version on a thread of its own (from
every actor rank's group), verifies it, and yields it to verl's loader through the async generator (staged:
the whole version once verified; streamed: each bucket once verified); its own outcome is told to the daemon from the
receiving thread, whatever verl does with the generator."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from ckpt_engine.device import synchronize
from ckpt_engine.errors import ApplyRefused, CkptEngineError
from ckpt_engine.plan.shards import spec_to_wire
from ckpt_engine.receive.assembly import VersionAssembler, VersionPayload
from ckpt_engine.receive.collective import Receiver, ReceiveResult
from ckpt_engine.workers.adapters.vllm.shards import placed_items

from .shards import WorkerShards, tp_rank_of_this_worker, worker_shards
from .sync import _PEER, BACKEND, VerificationFailed, VerlSync

log = logging.getLogger(__name__)


class VerlRollout(VerlSync):
    def __init__(self, bucket_size: int | None, **options: Any) -> None:
        super().__init__(bucket_size, None, **options)
        self._assembler: VersionAssembler | None = None
        self._handoff = _Handoff(self.load_timeout_s)
        self.shards: WorkerShards | None = None  # sharded: this worker's TP rank's slices (shards.py)
        self.last_bytes = 0  # what the last version brought this worker (its class's bytes, when sharded)
        self._shards()  # (a model it cannot slice is refused as verl builds the backend)

    def prepare(self) -> dict[str, Any]:
        shards = self._shards()
        # the daemon knows this worker by its agent id (build_topology passes it on)
        held = self._assembler.manifest if self._assembler is not None else None
        # (checked with the daemon: after a restart the id held is unknown there, and verl names it)
        agent_id = (self._daemon("receiver", 0).current_id(time.monotonic() + min(self._daemon_s, 5.0))
                    if self.endpoint else None)
        return {"role": _PEER, "agent_id": agent_id, "holds": held.version if held is not None else None,
                "shard": spec_to_wire(shards.spec) if shards is not None else None}

    def _shards(self) -> WorkerShards | None:
        options = self.options
        if options.sharded and self.shards is None:  # derived once: the model and the TP rank do not change
            size = options.tensor_parallel_size or 1
            self.shards = worker_shards(options.model_path or "", tp_rank_of_this_worker(size), size)
            log.info("%s: TP rank %d of %d keeps slices of %d tensors (%d whole)", BACKEND, self.shards.tp_rank,
                     size, len(self.shards.spec), len(self.shards.whole))
        return self.shards

    def _shard_wire(self) -> dict | None:
        shards = self._shards()
        return spec_to_wire(shards.spec) if shards is not None else None

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yields the version's (name, tensor) once verified: staged, all of it after the whole version
        verified; streamed, each bucket's tensors once that bucket verified, ending after the trailer verified.
        The tensors are views into this worker's staging: valid until the generator is resumed past the next
        bucket (verl's adapters copy or clone them)."""
        topology = self._require("rollout")
        version = topology["version"]
        receiver = Receiver(self._groups, self._handoff.load, assembler=self._assembler_for())
        loop = asyncio.get_running_loop()
        handed = self._handoff.expect(loop)
        received = asyncio.ensure_future(asyncio.to_thread(self._receive_and_report, receiver, version))
        try:
            await asyncio.wait([handed, received], return_when=asyncio.FIRST_COMPLETED)
            if handed.done():
                async for name, tensor in self._handed(handed.result()):
                    yield name, tensor
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

    async def _handed(self, payload: VersionPayload) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The payload's tensors; a streamed one read off the event loop (each step receives and verifies)."""
        if not payload.streamed:
            for name, tensor in self._placed(iter(payload.tensors.items()), payload):
                yield name, tensor
            self._settle()
            return
        items = self._placed(payload.items(), payload)
        while True:
            try:
                item = await asyncio.to_thread(_next_or_none, items)
            except Exception as exc:  # the stream failed part way: the receiving thread reports it, torn
                self._handoff.consumed(whole=False, error=exc)
                raise VerificationFailed(f"{BACKEND}: version {payload.version} failed part way: {exc}") from exc
            if item is None:
                return
            yield item
            self._settle()  # verl's copy out of this bucket is done before the stream may let it go

    def _placed(self, items: Iterator[tuple[str, torch.Tensor]],
                payload: VersionPayload) -> Iterator[tuple[str, torch.Tensor]]:
        """Sharded: each piece at its place in a tensor of the checkpoint's full shape, under the checkpoint's
        name (vLLM's loaders read this rank's range of it, as from a checkpoint file; the rest is never read)."""
        if self.shards is None:
            return items
        return placed_items(items, self.shards.shapes, payload.aliases)

    def _settle(self) -> None:
        if self.device.kind != "cpu":
            synchronize(self.device)  # verl's copies out of staging may be non-blocking

    def _receive_and_report(self, receiver: Receiver, version: int) -> ReceiveResult:
        """On the receiving thread: the outcome, told to the daemon from here, so it is told whatever verl does
        with the generator (it may close it part way, or drop it)."""
        try:
            result = _outcome(version, receiver.receive(self.timeout_s))
        except Exception as exc:  # told like any other failure: the daemon must not wait for this worker
            log.exception("version %d: receiving failed", version)
            result = ReceiveResult(version, False, f"{type(exc).__name__}: {exc}")
        self.last_bytes = result.bytes_received if result.ok else 0
        if result.staging is not None:  # what verl's loader was given, and why (also in the daemon's record)
            log.info("version %d: staging %s (policy %s: %s)", version, result.staging, self.staging,
                     result.staging_why)
        if self._agent is not None:  # said before verl goes on: the history holds it when verl's sync ends
            self._agent.received(version, result)
            self._agent.flush_reports(self._report_wait_s)
        return result

    def _assembler_for(self) -> VersionAssembler:
        if self._assembler is None:  # kept across syncs: staging and the version held carry over
            self._assembler = VersionAssembler(self.device, self._handoff.load, staging=self.staging, streams=True)
        assembler, settled = self._assembler, self.settled  # (this sync's staging policy: verl's, or the daemon's)
        assembler.staging, assembler.staging_share, assembler.budget = (settled.staging, settled.staging_share,
                                                                        settled.staging_budget)
        return assembler


def _outcome(version: int, result: ReceiveResult | None) -> ReceiveResult:
    """This worker's outcome of the announced ``version``."""
    if result is None:
        return ReceiveResult(version, False, "the trainer closed the sync before the version")
    if result.ok and result.version != version:
        result.ok, result.reason = False, f"received version {result.version}, announced {version}"
    return result


class _Handoff:
    """Hands a verified version from the receiving thread (inside ``load``) to the async generator, and holds
    the thread in ``load`` until verl consumed it: the views point into staging, which the next version reuses."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._future: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = threading.Event()
        self._whole = False
        self._error: BaseException | None = None  # what ended a streamed version part way

    def expect(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        self._loop, self._future = loop, loop.create_future()
        self._done.clear()
        self._whole, self._error = False, None
        return self._future

    def load(self, payload: VersionPayload) -> None:
        loop, future = self._loop, self._future
        if loop is None or future is None:
            raise ApplyRefused("no receive_weights() is waiting for this version")
        loop.call_soon_threadsafe(_set_once, future, payload)
        if not self._done.wait(self.timeout_s):
            raise CkptEngineError(f"verl did not consume version {payload.version} within {self.timeout_s:.0f}s "
                                  "(engine_kwargs.ckpt_engine.load_timeout_s)")
        if self._error is not None:
            raise self._error
        if not self._whole:  # verl's loader took part of it: the rollout's weights are torn
            raise CkptEngineError(f"verl stopped reading version {payload.version} part way")

    def consumed(self, *, whole: bool, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self._whole, self._error = whole, error
            self._done.set()


def _next_or_none(items: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    return next(items, None)


def _set_once(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)
