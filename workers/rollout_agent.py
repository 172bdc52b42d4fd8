"""Rollout agent: runs inside an inference worker, receives the versions the daemon assigns to it, verifies
them and applies them through ``load`` (an adapter), then reports the outcome with its recomputed digest.

    agent = RolloutAgent(load, "tcp://127.0.0.1:8766").start()

``load`` gets a verified version (``VersionPayload``) and must copy what it needs during the call. With
``streams=True`` it may be given a streamed one (staging ``stream``): it then iterates ``payload.items()``,
each tensor valid until it asks for the next (see receive/streamed.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Literal

from ckpt_engine.control.messages import Assignment, parse_shard_spec
from ckpt_engine.device import DeviceInfo
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.plan.modes import Staging
from ckpt_engine.plan.shards import ShardSpec, spec_to_wire
from ckpt_engine.receive.assembly import VersionAssembler
from ckpt_engine.receive.collective import LoadFn, Receiver, ReceiveResult
from ckpt_engine.receive.colocated import IpcReceiver
from ckpt_engine.receive.pulled import pull
from ckpt_engine.transport.nixl import NixlEndpoint
from ckpt_engine.workers.agent import Agent
from ckpt_engine.workers.threads import supervised

log = logging.getLogger(__name__)
_UNABLE_SAID_S = 10.0  # how long a dead receive loop's reason rides along with the polls


class RolloutAgent(Agent):
    role = "receiver"

    def __init__(self, load: LoadFn, endpoint: str, *, token: str | None = None, device: DeviceInfo | None = None,
                 poll_wait_s: float = 1.0, host_id: str | None = None, sync_every: int = 1,
                 engine: str | None = None, driven: bool = False, members: int | None = None,
                 whole_versions: bool = False, discard: Callable[[int, str], None] | None = None,
                 engine_key: str | None = None, register_wait_s: float = 30.0, staging: Staging | None = None,
                 streams: bool = False, shard_spec: ShardSpec | None = None,
                 transport: Literal["nixl"] | None = None) -> None:
        """``sync_every``: take only every N-th version (a slow engine); rollbacks and catch-ups still come.
        ``engine``/``members``: this receiver is one of ``members`` workers of an engine that apply versions
        together; ``driven``: the engine's driver applies them (``load`` only stages, see staged.py), and
        ``discard(version, reason)`` drops a staged version the driver could not apply.
        ``whole_versions``: the engine cannot take sparse versions (the daemon sends it whole ones).
        ``engine_key``: a driven worker's admission, the key its engine's driver was issued (``driver.engine_key``).
        ``staging``: this receiver's staging policy (default: the deployment's); ``streams``: ``load`` iterates
        ``payload.items()`` and so can take a streamed version.
        ``shard_spec``: the slices of tensors this receiver keeps (a tensor-parallel rank, plan/shards.py); it then
        receives only those, each slice as a piece named ``<tensor>@<dim>:<start>:<length>``
        (``split_piece_name``), and every tensor the spec does not name whole.
        ``transport``: ``"nixl"``: pull every version over NIXL whatever the deployment's transport (the
        deployment must set ``nixl_trust_receivers: true``)."""
        super().__init__(endpoint, token=token, device=device, poll_wait_s=poll_wait_s, host_id=host_id,
                         register_wait_s=register_wait_s)
        self.sync_every = sync_every
        self.engine, self.driven, self.members, self.engine_key = engine, driven, members, engine_key
        self.whole_versions, self.discard = whole_versions, discard
        self.load, self.staging, self.streams = load, staging, streams
        self.shard_spec = parse_shard_spec(shard_spec) if shard_spec else None  # (checked, sorted)
        self.transport = transport
        self.current_version: int | None = None
        self.results: list[ReceiveResult] = []
        self._work: queue.Queue[Assignment | None] = queue.Queue()
        self._receiver: Receiver | None = None
        self._ipc: IpcReceiver | None = None
        self._nixl: NixlEndpoint | None = None  # this process's NIXL agent (see _nixl_endpoint)
        self._nixl_lock = threading.Lock()
        self._ipc_name: str | None = None
        self._shared_assembler: VersionAssembler | None = None
        self._worker = supervised(self._work_loop, "ckpt-receiver", self._work_loop_died)
        self._receiving: int | None = None  # the version the receive loop is on
        self._unable: tuple[str | None, float] = (None, 0.0)  # said with polls until then
        self.applied = threading.Condition()

    def register_extra(self) -> dict:
        extra = ({"engine": self.engine, "driven": self.driven, "members": self.members, "engine_key": self.engine_key}
                 if self.engine else {})
        if self.staging is not None:
            extra["staging"] = self.staging
        if self.shard_spec:
            extra["shard_spec"] = spec_to_wire(self.shard_spec)
        if self.transport is not None:
            extra["transport"] = self.transport
        return {**extra, "whole_versions": True} if self.whole_versions else extra

    def on_registered(self) -> None:
        if not self._worker.is_alive():
            self._worker.start()
        pulls = self.transport == "nixl" or (self.settings is not None and self.settings.transport == "nixl")
        if pulls and self._nixl is None:
            threading.Thread(target=self._start_nixl, name="ckpt-nixl-start", daemon=True).start()

    def versions_held(self) -> list[int]:
        return [] if self.current_version is None else [self.current_version]

    def forget_versions(self) -> None:
        # The model keeps its weights; only their label meant something to the old history. Holding no known
        # version, this receiver gets a whole one next.
        if self._shared_assembler is not None:
            self._shared_assembler.forget()
        with self.applied:
            self.current_version = None

    def handle(self, assignment: Assignment) -> None:
        if assignment.kind == "receive":
            self._work.put(assignment)
        elif assignment.kind == "discard" and self.discard is not None:
            self.discard(assignment.version, assignment.reason or "its engine's driver did not apply it")

    def close(self) -> None:
        self._work.put(None)
        if self._worker.is_alive():  # let a version being received finish and report first
            settings = self.settings
            self._worker.join(settings.version_timeout_s if settings else 10.0)
        if self._ipc is not None:
            self._ipc.close()
        super().close()
        with self._nixl_lock:
            if self._nixl is not None:
                self._nixl.close()

    def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Block until ``version`` (or a newer one) has been applied; for scripts and tests."""
        with self.applied:
            return self.applied.wait_for(
                lambda: self.current_version is not None and self.current_version >= version, timeout_s)

    def unable_now(self) -> str | None:
        reason, until = self._unable
        return reason if reason is not None and time.monotonic() < until else None

    def _work_loop(self) -> None:
        while (assignment := self._work.get()) is not None:
            if self._superseded(assignment):
                continue
            self._receiving = assignment.version
            try:
                result = self._receive(assignment)
            except Exception as exc:  # whatever it was, this receiver reports it and takes the next version
                log.exception("version %d: receiving failed", assignment.version)
                result = ReceiveResult(assignment.version, False, f"{type(exc).__name__}: {exc}")
            self._record(assignment, result)
            self._receiving = None

    def _work_loop_died(self, exc: BaseException) -> None:
        """The receive loop ended unexpectedly (its own handling failed): leave the quorum with the reason (the
        outcome of the version it was on, and the next polls), and run a new loop so later versions are
        received again."""
        reason = f"the receive thread died: {type(exc).__name__}: {exc}"
        self._unable = (reason, time.monotonic() + _UNABLE_SAID_S)
        version = self._receiving
        if self.settings is not None and version is not None:
            self.report(version, "received", ok=False, reason=reason, unable=reason, serving=self.current_version)
        if not self._stop.is_set():
            self._worker = supervised(self._work_loop, "ckpt-receiver", self._work_loop_died)
            self._worker.start()

    def _superseded(self, assignment: Assignment) -> bool:
        """Skip a version that will not come (see ``_will_not_come``) before starting on it."""
        reason = self._will_not_come(assignment)
        if reason is not None:
            log.warning("version %d skipped: %s", assignment.version, reason)
        return reason is not None

    def _will_not_come(self, assignment: Assignment) -> str | None:
        """Why the daemon has ended this version, if it has: the agent registered again since (the daemon that
        assigned it is gone), or a newer version is queued (one version is in flight at a time). Waiting for
        it would make this receiver miss the next one. Asked before and while waiting for it to begin."""
        if self.from_earlier_registration(assignment):
            return "it was assigned before the daemon restarted"
        newer = [a.version for a in list(self._work.queue) if a is not None and a.version > assignment.version]
        return f"superseded by version {max(newer)}" if newer else None

    def _receive(self, assignment: Assignment) -> ReceiveResult:
        settings = self.settings
        if settings is None:
            raise CkptEngineError("not registered")
        if assignment.transport == "ipc":
            result = self._receive_colocated(assignment, settings)
        elif assignment.transport == "nixl":
            result = self._pull(assignment, settings)
        else:
            result = self._collective_receiver(assignment, settings).receive(
                begin_timeout_s=settings.version_timeout_s, abandon=lambda: self._will_not_come(assignment))
        if result is None:
            return ReceiveResult(assignment.version, False, "the sender closed the channel")
        if result.version is not None and result.version != assignment.version:
            result.ok, result.reason = False, f"received version {result.version}, expected {assignment.version}"
        return result

    def _receive_colocated(self, assignment: Assignment, settings) -> ReceiveResult | None:
        """Over the same-host channel; one that the trainer's hub closed meanwhile (e.g. it dropped this
        receiver as too slow last time) is found closed only now: connect again once, for this version."""
        result = None
        for _ in range(2):
            ipc = self._ipc_receiver(assignment, settings)
            result = ipc.receive(begin_timeout_s=settings.version_timeout_s,
                                 abandon=lambda: self._will_not_come(assignment))
            if result is not None or ipc.broken is None:
                return result
            log.info("version %d: the same-host channel was closed (%s); connecting again", assignment.version,
                     ipc.broken)
        return result

    def _pull(self, assignment: Assignment, settings) -> ReceiveResult:
        """Read the version from the trainer's offer over NIXL; verified and loaded as every version is."""
        if assignment.offer is None:
            return ReceiveResult(assignment.version, False, "a nixl assignment came without the trainer's offer")
        return pull(self._assembler(settings), self._nixl_endpoint(), assignment.offer, settings.version_timeout_s)

    def _nixl_endpoint(self) -> NixlEndpoint:
        """This process's NIXL agent, started once (at registration under ``transport: nixl``)."""
        with self._nixl_lock:
            if self._nixl is None:
                self._nixl = NixlEndpoint("rollout")
            return self._nixl

    def _start_nixl(self) -> None:
        try:
            self._nixl_endpoint()
        except CkptEngineError as exc:  # each pull says it again, in its result
            log.warning("the nixl transport cannot start here: %s", exc)

    def _collective_receiver(self, assignment: Assignment, settings) -> Receiver:
        group = self.group_for(assignment)
        if group is None:
            raise CkptEngineError("a collective receive needs a sync group of at least two ranks")
        if self._receiver is None or self._receiver.groups != self.groups:  # (one group per owner of the version)
            self._receiver = Receiver(list(self.groups), self.load, verify=settings.verify,
                                      assembler=self._assembler(settings))
        return self._receiver

    def _ipc_receiver(self, assignment: Assignment, settings) -> IpcReceiver:
        """The same-host receiver for the trainer's hub, reconnected when the hub changed or the channel broke."""
        current = self._ipc
        if (current is not None and current.broken is None and self._ipc_name == assignment.ipc_name
                and current.agent_id == self.agent_id):  # the hub knows the channel by the id it said hello with
            # The rank is per version (the quorum changes with cadence and membership); the channel is per agent.
            # Reconnecting for a new rank would race the hub, which may still hand out the old channel.
            current.rank = assignment.rank
            return current
        if current is not None:
            current.close()
        self._ipc = IpcReceiver(assignment.ipc_name or "", self.agent_id, assignment.rank, self.load,
                                device=self.device, verify=settings.verify,
                                timeout_s=settings.collective_timeout_s, connect_timeout_s=settings.connect_timeout_s,
                                assembler=self._assembler(settings))
        self._ipc_name = assignment.ipc_name
        return self._ipc

    def _assembler(self, settings) -> VersionAssembler:
        """One per agent, whatever the transport: it knows which version the model holds (sparse bases); its
        staging follows the latest registration's settings."""
        assembler = self._shared_assembler
        if assembler is None:
            assembler = self._shared_assembler = VersionAssembler(self.device, self.load, verify=settings.verify,
                                                                  streams=self.streams)
        assembler.verify = settings.verify
        assembler.staging, assembler.staging_share = settings.staging, settings.staging_share
        assembler.budget = settings.staging_budget
        return assembler

    def _record(self, assignment: Assignment, result: ReceiveResult) -> None:
        self.results.append(result)
        held = self._shared_assembler.manifest if self._shared_assembler is not None else None
        with self.applied:
            # What the model now holds for sure: after a load that failed part way it is torn, so nothing.
            self.current_version = held.version if held is not None else None
            self.applied.notify_all()
        self.report(assignment.version, "received", **received_fields(result), group_broken=self.group_broken,
                    serving=self.current_version)


def received_fields(result: ReceiveResult) -> dict:
    """A receiver's ``received`` report: its own outcome, with the digest it computed."""
    return dict(ok=result.ok, reason=result.reason, version_digest=result.version_digest,
                bytes=result.bytes_received, stages=result.seconds, torn=result.torn, unable=result.unable,
                staging=result.staging, staging_why=result.staging_why)
