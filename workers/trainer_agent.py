"""Trainer agent: runs inside every trainer rank (FSDP2 or a plain single-rank module) and serves the
daemon's sync assignments at step boundaries, so parameters are never read mid-update.

    agent = TrainerAgent(model, "tcp://127.0.0.1:8766").start()   # in every rank
    for step in ...:
        loss.backward(); optimizer.step()
        agent.step(step)          # one tiny broadcast on the trainer group when sharded; else near-free

Rank 0 of the trainer's process group talks to the daemon and is the sender of the sync group; at a step
boundary it tells the other ranks (one small broadcast) whether a version is due, and then every rank
gathers full tensors bucket by bucket, in registration order, so memory stays at about two buckets.

Cached mode holds the loop for the gather + device->host snapshot only; the broadcast runs in the
background from the cache. bypass_cpu holds it until every bucket has been read from the live parameters.
Re-pushes of cached versions (rollback) need no parameters and run in the background at once.

Sparse versions (cached mode): every rank digests its own shards, and one all-reduce gives all ranks the
same set of tensors that changed since the previous cached version. Only those are gathered and snapshotted;
the cache shares the unchanged ones with the previous version (see sparse.py and cache.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.plan.changes import ChangeTracker
from ckpt_engine.control.messages import TERMINAL, Assignment
from ckpt_engine.device import DeviceInfo
from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.retry import Backoff
from ckpt_engine.send.sender import Transfer, TransferResult
from ckpt_engine.plan.tensors import NamedTensors, NameMap
from ckpt_engine.workers.agent import Agent
from ckpt_engine.workers.fsdp import sharded_tensors_of

log = logging.getLogger(__name__)
TensorSource = Callable[[], NamedTensors]
_MODES = {"cached": 1, "bypass_cpu": 2}


class TrainerAgent(Agent):
    role = "trainer"

    def __init__(self, model: nn.Module | TensorSource, endpoint: str, *, process_group: dist.ProcessGroup | None = None,
                 token: str | None = None, device: DeviceInfo | None = None, poll_wait_s: float = 1.0,
                 name_map: NameMap | None = None, include_buffers: bool = True) -> None:
        self.process_group = process_group if process_group is not None else (
            dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        sharded = self.process_group is not None
        super().__init__(endpoint, rank=dist.get_rank(self.process_group) if sharded else 0, token=token,
                         device=device, poll_wait_s=poll_wait_s)
        self.world_size = dist.get_world_size(self.process_group) if sharded else 1
        if isinstance(model, nn.Module):
            self._tensors: TensorSource = lambda: sharded_tensors_of(model, include_buffers=include_buffers,
                                                                    name_map=name_map)
        else:
            self._tensors = model
        self._pending: collections.deque[Assignment] = collections.deque()
        self._background: threading.Thread | None = None
        self.publisher: Publisher | None = None
        self.held_seconds: list[float] = []  # per served version: how long step() held the training loop
        self.gathered: dict[int, int] = {}  # per served version: bytes of full tensors assembled on this rank
        self.served: list[int] = []  # versions this rank served (rank 0: sent), oldest first
        self._changes_seen: ChangeTracker | None = None

    def register_extra(self) -> dict:
        hub = self.publisher.hub if self.publisher is not None else None
        return {"ipc_name": hub.name} if hub is not None else {}  # keep serving receivers where they connect

    def on_registered(self) -> None:
        settings = self.settings
        if settings is None:
            raise CkptEngineError("registration returned no settings")
        if self.publisher is not None:  # registering again (daemon restart): keep the cache and the hub
            return
        self.publisher = Publisher(device=self.device, bucket_size=settings.bucket_size, alignment=settings.alignment,
                                   keep_versions=settings.keep_versions, ack_timeout_s=settings.ack_timeout_s,
                                   on_stage=self._on_stage, timeout_s=settings.collective_timeout_s,
                                   ipc_hub_name=settings.ipc_name if self.rank == 0 else None)

    def versions_held(self) -> list[int]:
        return self.publisher.cache.versions() if self.publisher else []

    def forget_versions(self) -> None:
        # Their ids mean nothing to the daemon's history: they could never be asked for again.
        if self.publisher is not None:
            for version in self.publisher.cache.versions():
                self.publisher.cache.evict(version)
            self.publisher.manifests.clear()

    def handle(self, assignment: Assignment) -> None:
        if assignment.kind == "evict":
            self._evict(assignment.version)
        elif assignment.kind == "send" and assignment.source_version is not None:
            self.served.append(assignment.version)
            self._in_background(assignment, self._republish)
        elif assignment.kind == "send":
            self._pending.append(assignment)
            # Rendezvous with the receivers now, while the loop runs on to its next step boundary.
            threading.Thread(target=self._prepare_group, args=(assignment,), daemon=True).start()

    def step(self, step: int) -> int | None:
        """Call once per training step on every rank, after ``optimizer.step()``: serves a due sync.
        Returns the version served at this boundary (on every rank), or None."""
        assignment = self._agree()
        if assignment is None:
            return None
        started = time.perf_counter()
        if self.rank == 0:
            self._serve(assignment, step, started)
        else:
            self._assist(assignment)
        self.served.append(assignment.version)
        return assignment.version

    def push(self, step: int, *, bypass_cpu: bool | None = None, timeout_s: float = 10.0) -> int | None:
        """Ask the daemon for a new version from the training loop and serve it now (call on every rank);
        returns the version id on rank 0."""
        version = None
        if self.rank == 0:
            try:
                version = self._request_version(step, bypass_cpu, timeout_s)
            except CkptEngineError as exc:  # e.g. 409 while a version is in flight: this step syncs nothing
                log.info("push at step %d: %s", step, exc)
        self.step(step)  # every rank, also when the request failed: the ranks' agreement stays matched
        return version

    def _request_version(self, step: int, bypass_cpu: bool | None, timeout_s: float) -> int:
        version = int(self._client.request("sync", {"step": step, "bypass_cpu": bypass_cpu})["id"])
        deadline = time.monotonic() + timeout_s
        while not any(a.version == version for a in self._pending):
            if time.monotonic() > deadline:
                raise SyncTimeoutError(f"the daemon did not hand version {version} over within {timeout_s}s")
            time.sleep(0.005)
        return version

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until the background transfer (if any) has ended, the daemon has been told its outcome, and it
        has ended that version (it also waits for the receivers' own reports), so a version requested next is
        not refused as overlapping; for clean shutdowns and tests. Only rank 0 asks the daemon."""
        deadline = time.monotonic() + timeout_s
        if self._background is not None:
            self._background.join(timeout_s)
        self.flush_reports(max(0.0, deadline - time.monotonic()))
        if self.rank == 0 and self.served and self.settings is not None:
            self._wait_ended(self.served[-1], deadline)

    def _wait_ended(self, version: int, deadline: float) -> None:
        backoff = Backoff(initial_s=0.02, max_s=0.5)
        while time.monotonic() < deadline:
            try:
                if self._client.request("version", {"version": version}, timeout_s=2.0).get("status") in TERMINAL:
                    return
            except CkptEngineError as exc:  # the daemon may be restarting: the deadline bounds this
                log.debug("waiting for version %d to end: %s", version, exc)
            backoff.wait()

    # ---- agreement between trainer ranks -------------------------------------------------------------
    def _agree(self) -> Assignment | None:
        """Rank 0 decides whether a version is due at this boundary and tells the others (one broadcast)."""
        if self.world_size == 1:
            return self._next_due()
        mine = self._next_due() if self.rank == 0 else None
        flag = torch.zeros(3, dtype=torch.int64, device=_group_device(self.process_group))
        if mine is not None:
            flag[0], flag[1], flag[2] = mine.version, _MODES[mine.mode], int(mine.sparse)
        dist.broadcast(flag, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        version, mode, sparse = flag.tolist()
        if mode == 0:
            return None
        return mine or Assignment(kind="send", version=version, mode="cached" if mode == 1 else "bypass_cpu",
                                  sparse=bool(sparse))

    def _next_due(self) -> Assignment | None:
        """The next version to serve, once the previous transfer has ended. While that one still runs (e.g. it
        waits out a receiver's timeout after the daemon already failed it), the new version is served at a
        later boundary: announcing it now would leave the other ranks waiting in its gathers, past their
        collective timeout."""
        if not self._pending or (self._background is not None and self._background.is_alive()):
            return None
        for stale in [a for a in list(self._pending) if self.from_earlier_registration(a)]:
            self._pending.remove(stale)
            log.warning("version %d was assigned before the daemon restarted; skipping it", stale.version)
        if not self._pending:
            return None
        while len(self._pending) > 1:  # the daemon has one version in flight: older ones have ended there
            stale = self._pending.popleft()
            log.warning("version %d was superseded by version %d before it could be served; skipping it",
                        stale.version, self._pending[-1].version)
        return self._pending.popleft()

    def _changes(self, assignment: Assignment, named: NamedTensors, layout: Layout) -> tuple[int, Layout] | None:
        """Sparse versions: (parent version, layout of the tensors changed since it) as all ranks agree, or None
        for a full snapshot. Every rank calls this for the same versions (one all-reduce when sharded)."""
        if not (assignment.sparse and assignment.mode == "cached"):
            return None
        publisher = self._publisher()
        if self._changes_seen is None:
            self._changes_seen = ChangeTracker(self.device.digest_algo, publisher.bucket_size, publisher.alignment)
        # rank 0 caches: its parent may be gone (evicted, or its snapshot failed), then nothing is shared
        vector = self._changes_seen.vector(assignment.version, named, layout,
                                           lambda parent: self.rank != 0 or parent in publisher.cache)
        if self.world_size > 1:
            reduced = torch.tensor(vector, dtype=torch.int64, device=_group_device(self.process_group))
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.process_group)
            vector = reduced.tolist()
        return self._changes_seen.delta(vector, layout)

    def _assist(self, assignment: Assignment) -> None:
        """Ranks > 0: take part in every bucket's gather, in the order rank 0 reads them."""
        named = self._tensors()
        layout = self._publisher().layout_for(named)
        delta = self._changes(assignment, named, layout)
        layout = delta[1] if delta is not None else layout
        for bucket in layout.buckets:
            named.bucket_tensors(bucket)
        self.gathered[assignment.version] = layout.total_bytes

    # ---- serving on rank 0 ---------------------------------------------------------------------------
    def _serve(self, assignment: Assignment, step: int, started: float) -> None:
        version = assignment.version
        self.report(version, "snapshotting", step=step)
        if self._background is not None:  # one version in flight (reports are not waited for: see wait_idle)
            self._background.join(self.settings.version_timeout_s if self.settings else 600)
        publisher = self._publisher()
        cursor: _GatherCursor | None = None
        transfer: Transfer | None = None
        try:
            named = self._tensors()
            layout = publisher.layout_for(named)
            delta = self._changes(assignment, named, layout)
            cursor = _GatherCursor(named, delta[1] if delta is not None else layout)
            self.gathered[version] = cursor.layout.total_bytes
            at_step = assignment.step if assignment.step is not None else step
            if delta is not None:  # only what changed is gathered and stored; the rest is shared in the cache
                publisher.cache.snapshot_delta(version, delta[0], cursor.layout, cursor.bucket_tensors,
                                               aliases=named.aliases, step=at_step)
                held = time.perf_counter() - started
                self._in_background(assignment, lambda a: self._send_cached(a, held))
            elif assignment.mode == "cached":
                publisher.cache.snapshot(version, cursor.layout, cursor.bucket_tensors, aliases=named.aliases,
                                         step=at_step, check=False)
                held = time.perf_counter() - started
                self._in_background(assignment, lambda a: self._send_cached(a, held))
            else:
                transfer = self._send_live(assignment, cursor, step)
                transfer.params_released.wait()
                held = time.perf_counter() - started
                self._in_background(assignment, lambda a: self._finish(transfer, held))
        except Exception as exc:  # every failure ends the version with a reason in history
            log.exception("version %d failed on the trainer", version)
            reason = f"{type(exc).__name__}: {exc}"
            if transfer is None:  # nothing went on the wire: release the waiting receivers
                self._abort_before_start(assignment, reason)
            self._report_failure(version, reason)
            held = time.perf_counter() - started
        finally:
            if cursor is not None:
                cursor.drain()  # other ranks wait in the gathers rank 0 did not reach: let them through
        self.held_seconds.append(held)

    def _send_live(self, assignment: Assignment, cursor: "_GatherCursor", step: int) -> Transfer:
        publisher = self._publisher()
        publisher.attach(self.group_for(assignment), assignment.ipc_peers)
        return publisher.sender.send_live(  # type: ignore[union-attr]
            assignment.version, cursor.layout, cursor.bucket_tensors, aliases=cursor.named.aliases,
            step=assignment.step if assignment.step is not None else step, check=False)

    def _abort_before_start(self, assignment: Assignment, reason: str) -> None:
        try:
            publisher = self._publisher()
            publisher.attach(self.group_for(assignment), assignment.ipc_peers)
            publisher.sender.abort_before_start(assignment.version, reason)  # type: ignore[union-attr]
        except CkptEngineError as exc:  # receivers then fall back on their own timeout
            log.warning("could not tell receivers that version %d is abandoned: %s", assignment.version, exc)

    def _prepare_group(self, assignment: Assignment) -> None:
        try:
            self.group_for(assignment)
        except CkptEngineError as exc:
            log.warning("sync group for version %d not ready yet: %s", assignment.version, exc)

    def _send_cached(self, assignment: Assignment, held: float) -> None:
        publisher = self._publisher()
        publisher.attach(self.group_for(assignment), assignment.ipc_peers)
        if assignment.sparse_base is not None:
            transfer = publisher.send_sparse(assignment.version, assignment.sparse_base)
        else:
            transfer = publisher.sender.send_cached(publisher.cache, assignment.version)  # type: ignore[union-attr]
        self._finish(transfer, held)

    def _republish(self, assignment: Assignment) -> None:
        publisher = self._publisher()
        publisher.attach(self.group_for(assignment), assignment.ipc_peers)
        transfer = publisher.republish(assignment.source_version, as_version=assignment.version)  # type: ignore[arg-type]
        self._finish(transfer, 0.0)

    def _finish(self, transfer: Transfer, held: float) -> None:
        settings = self.settings
        self._report_result(transfer.result(timeout_s=settings.version_timeout_s if settings else None), held)

    def _report_result(self, result: TransferResult, held: float) -> None:
        publisher = self._publisher()
        stages = {k: v for k, v in result.seconds.items() if k != "total"}
        stages["snapshot" if result.mode == "cached" else "held"] = held
        self.report(result.version, "done", ok=result.ok, reason=result.reason, version_digest=result.version_digest,
                    bytes=result.bytes_sent, buckets=result.buckets, tensors=result.tensors,
                    tensors_skipped=result.tensors_skipped, bytes_skipped=result.bytes_skipped, stages=stages,
                    receivers=[ack.model_dump() for ack in result.receivers],
                    cache_versions=publisher.cache.versions(), cache_bytes=publisher.cache.bytes_held,
                    group_broken=self.group is not None and self.group.broken is not None)

    def _in_background(self, assignment: Assignment, work: Callable[[Assignment], None]) -> None:
        def run() -> None:
            try:
                work(assignment)
            except Exception as exc:  # every failure ends the version with a reason in history
                log.exception("version %d failed on the trainer", assignment.version)
                self._report_failure(assignment.version, f"{type(exc).__name__}: {exc}")

        self._background = threading.Thread(target=run, name=f"ckpt-trainer-v{assignment.version}", daemon=True)
        self._background.start()

    def _report_failure(self, version: int, reason: str) -> None:
        publisher = self.publisher
        self.report(version, "done", ok=False, reason=reason,
                    cache_versions=publisher.cache.versions() if publisher else None,
                    group_broken=self.group is not None and self.group.broken is not None)

    def _evict(self, version: int) -> None:
        publisher = self._publisher()
        try:
            publisher.cache.evict(version)
        except CkptEngineError as exc:
            log.warning("evict %d: %s", version, exc)
        self.report(version, "evicted", cache_versions=publisher.cache.versions(),
                    cache_bytes=publisher.cache.bytes_held)

    def _on_stage(self, version: int, stage: str) -> None:
        self.report(version, stage)

    def _publisher(self) -> Publisher:
        if self.publisher is None:
            raise CkptEngineError("trainer agent not started")
        return self.publisher


class _GatherCursor:
    """Hands out full tensors bucket by bucket and remembers how far it got, so that after a failure rank 0
    can still take part in the remaining gathers the other trainer ranks are waiting in."""

    def __init__(self, named: NamedTensors, layout: Layout) -> None:
        self.named, self.layout = named, layout
        self._next = 0
        self._lock = threading.Lock()

    def bucket_tensors(self, bucket: Bucket):
        with self._lock:
            if bucket.index != self._next:
                raise CkptEngineError(f"bucket {bucket.index} requested out of order (expected {self._next})")
            self._next += 1
            return self.named.bucket_tensors(bucket)

    def drain(self) -> None:
        with self._lock:
            for bucket in self.layout.buckets[self._next :]:
                self.named.bucket_tensors(bucket)
            self._next = len(self.layout.buckets)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective on the trainer's group must live (NCCL/HCCL: the current device)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")
