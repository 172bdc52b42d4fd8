"""Trainer agent: runs inside the training process and serves the daemon's sync assignments at step
boundaries, so parameters are never read mid-update.

    agent = TrainerAgent(model, "tcp://127.0.0.1:8766").start()
    for step in ...:
        loss.backward(); optimizer.step()
        agent.step(step)          # almost free when nothing is pending

Cached mode holds the loop only for the device->host snapshot; the broadcast runs in the background.
bypass_cpu holds it until every bucket has been read from the live parameters. Re-pushes of cached versions
(rollback) need no parameters and run in the background at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from torch import nn

from ckpt_engine.control import Assignment
from ckpt_engine.device import DeviceInfo
from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.publisher import Publisher
from ckpt_engine.sender import Transfer, TransferResult
from ckpt_engine.tensors import NamedTensors, named_tensors_of
from ckpt_engine.workers.agent import Agent

log = logging.getLogger(__name__)
TensorSource = Callable[[], NamedTensors]


class TrainerAgent(Agent):
    role = "trainer"

    def __init__(self, model: nn.Module | TensorSource, endpoint: str, *, rank: int = 0, token: str | None = None,
                 device: DeviceInfo | None = None, poll_wait_s: float = 1.0) -> None:
        super().__init__(endpoint, rank=rank, token=token, device=device, poll_wait_s=poll_wait_s)
        self._tensors: TensorSource = (lambda: named_tensors_of(model)) if isinstance(model, nn.Module) else model
        self._pending: collections.deque[Assignment] = collections.deque()
        self._background: threading.Thread | None = None
        self.publisher: Publisher | None = None
        self.held_seconds: list[float] = []  # per served version: how long step() held the training loop

    def on_registered(self) -> None:
        settings = self.settings
        if settings is None:
            raise CkptEngineError("registration returned no settings")
        self.publisher = Publisher(device=self.device, bucket_size=settings.bucket_size, alignment=settings.alignment,
                                   keep_versions=settings.keep_versions, ack_timeout_s=settings.ack_timeout_s,
                                   on_stage=self._on_stage)

    def versions_held(self) -> list[int]:
        return self.publisher.cache.versions() if self.publisher else []

    def handle(self, assignment: Assignment) -> None:
        if assignment.kind == "evict":
            self._evict(assignment.version)
        elif assignment.kind == "send" and assignment.source_version is not None:
            self._in_background(assignment, self._republish)
        elif assignment.kind == "send":
            self._pending.append(assignment)
            # Rendezvous with the receivers now, while the loop runs on to its next step boundary.
            threading.Thread(target=self._prepare_group, args=(assignment,), daemon=True).start()

    def step(self, step: int) -> None:
        """Call once per training step, after ``optimizer.step()``: serves a pending sync, if any."""
        while self._pending:
            self._serve(self._pending.popleft(), step)

    def push(self, step: int, *, bypass_cpu: bool | None = None, timeout_s: float = 10.0) -> int:
        """Ask the daemon for a new version from the training loop itself and serve it now; returns its id."""
        body = {"step": step, "bypass_cpu": bypass_cpu}
        version = int(self._client.request("sync", body)["id"])
        deadline = time.monotonic() + timeout_s
        while not any(a.version == version for a in self._pending):
            if time.monotonic() > deadline:
                raise SyncTimeoutError(f"the daemon did not hand version {version} to this agent in {timeout_s}s")
            time.sleep(0.005)
        self.step(step)
        return version

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until the background transfer (if any) has ended; for clean shutdowns and tests."""
        if self._background is not None:
            self._background.join(timeout_s)

    # ---- serving --------------------------------------------------------------------------------------
    def _serve(self, assignment: Assignment, step: int) -> None:
        version = assignment.version
        self.report(version, "snapshotting", step=step)
        started = time.perf_counter()
        self.wait_idle(self.settings.version_timeout_s if self.settings else 600)  # one version in flight
        publisher = self._publisher()
        try:
            named = self._tensors()
            if assignment.mode == "cached":
                publisher.snapshot(version, named, step=assignment.step if assignment.step is not None else step)
                held = time.perf_counter() - started
                self._in_background(assignment, lambda a: self._send_cached(a, held))
            else:
                publisher.attach(self.group_for(assignment))
                transfer = publisher.publish(version, named, bypass_cpu=True, step=assignment.step or step)
                transfer.params_released.wait()
                held = time.perf_counter() - started
                self._in_background(assignment, lambda a: self._finish(a, transfer, held))
        except CkptEngineError as exc:
            self._report_failure(version, f"{type(exc).__name__}: {exc}")
            return
        self.held_seconds.append(held)

    def _prepare_group(self, assignment: Assignment) -> None:
        try:
            self.group_for(assignment)
        except CkptEngineError as exc:
            log.warning("sync group for version %d not ready yet: %s", assignment.version, exc)

    def _send_cached(self, assignment: Assignment, held: float) -> None:
        publisher = self._publisher()
        publisher.attach(self.group_for(assignment))
        self._finish(assignment, publisher.sender.send_cached(publisher.cache, assignment.version), held)  # type: ignore[union-attr]

    def _republish(self, assignment: Assignment) -> None:
        publisher = self._publisher()
        publisher.attach(self.group_for(assignment))
        transfer = publisher.republish(assignment.source_version, as_version=assignment.version)  # type: ignore[arg-type]
        self._finish(assignment, transfer, 0.0)

    def _finish(self, assignment: Assignment, transfer: Transfer, held: float) -> None:
        settings = self.settings
        result = transfer.result(timeout_s=settings.version_timeout_s if settings else None)
        self._report_result(result, held)

    def _report_result(self, result: TransferResult, held: float) -> None:
        publisher = self._publisher()
        stages = {k: v for k, v in result.seconds.items() if k != "total"}
        stages["snapshot" if result.mode == "cached" else "held"] = held
        self.report(result.version, "done", ok=result.ok, reason=result.reason, version_digest=result.version_digest,
                    bytes=result.bytes_sent, buckets=result.buckets, tensors=result.tensors, stages=stages,
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
