"""A verl job's processes as agents of a ckpt-engine daemon (``engine_kwargs.ckpt_engine.endpoint``).

verl decides when a sync happens and its own groups carry it (sync.py); the daemon numbers each sync as a
version, keeps its history and metrics, judges it by the rollout workers' own reports (each with the digest
it computed), and holds rollbacks: ``POST /push`` on a verl job queues a cached version, which verl's next
sync sends in place of its new weights. Every actor rank registers as a trainer rank (it caches its share),
every rollout worker as a receiver, all with ``framework: verl``: the daemon assigns them nothing but
evictions.

No verl import here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt_engine.control.auth import client_token
from ckpt_engine.control.client import ControlClient, ControlReplyError
from ckpt_engine.control.messages import Assignment
from ckpt_engine.device import DeviceInfo
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.receive.collective import ReceiveResult
from ckpt_engine.retry import Backoff
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.send.sender import TransferResult
from ckpt_engine.workers.agent import Agent, registration_lost
from ckpt_engine.workers.rollout_agent import received_fields
from ckpt_engine.workers.trainer_agent import done_fields, evict

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

log = logging.getLogger(__name__)
FRAMEWORK = "verl"


class DaemonRefused(CkptEngineError):
    """The daemon would not start this sync's version (another in flight, storage degraded, a receiver it
    does not know), or would not register this process (another live verl job's rank 0): verl's sync fails
    with the daemon's reason and nothing is sent."""


class DaemonUnavailable(CkptEngineError):
    """The daemon did not answer in time (down, restarting, unreachable): verl's sync fails naming it."""


class VerlAgent(Agent):
    """One actor rank (role ``trainer``) or rollout worker (role ``receiver``) of a verl job."""

    def __init__(self, role: str, endpoint: str, *, rank: int = 0, credentials: str | None = None,
                 device: DeviceInfo | None = None, trainer_ranks: int | None = None,
                 publisher: Callable[[], Publisher | None] = lambda: None, timeout_s: float = 10.0,
                 shard_spec: dict | None = None) -> None:
        """``shard_spec``: a rollout worker's (wire form), when it receives only its TP rank's slices."""
        if role not in ("trainer", "receiver"):
            raise CkptEngineError(f"a verl agent is a trainer or a receiver, not {role!r}")
        self.role = role
        self.trainer_ranks = trainer_ranks
        self._publisher = publisher
        self.serving: int | None = None  # receivers: the version verl's loader took last
        self.credentials = credentials
        self.shard_spec = shard_spec
        super().__init__(endpoint, rank=rank, device=device, request_timeout_s=timeout_s)
        # A sync's own requests go on a client of their own: the shared one may be held by a report retrying
        # on a daemon that is gone (up to the request timeout each), and a sync must fail within its bound.
        self._sync_client = ControlClient(endpoint, timeout_s=timeout_s, token=self.token)

    def start(self) -> Self:
        """Registers (retrying for up to the request timeout while the daemon says a previous run's rank 0 is
        still alive: a job restarted at once), then starts polling."""
        deadline = time.monotonic() + self.request_timeout_s
        backoff = Backoff(initial_s=0.5, max_s=2.0)
        while True:
            try:
                super().start()
                return self
            except ControlReplyError as exc:
                delay = backoff.next_delay()
                if exc.error == "conflict" and time.monotonic() + delay < deadline:
                    time.sleep(delay)
                    continue
                self._close_clients()
                raise DaemonRefused(f"the daemon at {self.endpoint} refused to register this verl {self.role}: "
                                    f"{exc}") from exc
            except CkptEngineError as exc:
                self._close_clients()
                raise DaemonUnavailable(f"the daemon at {self.endpoint} did not register this verl {self.role}: "
                                        f"{exc}") from exc

    def close(self) -> None:
        super().close()
        self._sync_client.close()

    def _close_clients(self) -> None:
        self._client.close()
        self._sync_client.close()

    def _sync_request(self, kind: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        self._sync_client.token = self.token  # (the poll thread may have taken a new token)
        return self._sync_client.request(kind, body, timeout_s=max(deadline - time.monotonic(), 0.05))

    def _resolve_token(self) -> str | None:
        return client_token("trainer" if self.role == "trainer" else "rollout", None, self.credentials)

    def register_extra(self) -> dict:
        ranks = {"trainer_ranks": self.trainer_ranks} if self.role == "trainer" and self.rank == 0 else {}
        spec = {"shard_spec": self.shard_spec} if self.role == "receiver" and self.shard_spec else {}
        return {"framework": FRAMEWORK, **ranks, **spec}

    def versions_held(self) -> list[int]:
        if self.role == "receiver":
            return [] if self.serving is None else [self.serving]
        publisher = self._publisher()
        return publisher.cache.versions() if publisher is not None else []

    def forget_versions(self) -> None:
        publisher = self._publisher()
        if publisher is not None:
            publisher.forget()
        self.serving = None

    def handle(self, assignment: Assignment) -> None:
        publisher = self._publisher()
        if assignment.kind == "evict" and publisher is not None:
            evict(self, publisher, assignment.version)
        elif assignment.kind == "evict":
            self.report(assignment.version, "evicted", cache_versions=[], cache_bytes=0)
        else:  # the daemon sends a framework's agents nothing else; a newer daemon might: say so, do nothing
            log.warning("verl agent: ignoring a %s assignment for version %d", assignment.kind, assignment.version)

    # ---- the daemon's side of one verl sync --------------------------------------------------------------
    def open_version(self, receivers: list[str], *, knobs: dict[str, Any], limit_s: float,
                     deadline: float) -> dict[str, Any]:
        """Actor rank 0: the daemon's version for this sync (its record: id, source_version for a queued
        rollback, owners, and ``knobs``: what the sync runs with, verl's ``knobs`` settled against the daemon's
        deployment), by ``deadline``; ``limit_s``: how long the daemon gives it (this sync's own timeouts). A
        daemon that restarted since this rank registered: registers again and asks once more."""
        body = {"receivers": receivers, "knobs": knobs, "limit_s": limit_s}
        for attempt in (1, 2):
            opener = self.agent_id
            try:
                return self._sync_request("sync", {**self._identity(), **body}, deadline)
            except ControlReplyError as exc:
                if attempt == 1 and registration_lost(exc) and self._try_register(self._sync_client, failed_as=opener):
                    continue
                raise DaemonRefused(f"the daemon at {self.endpoint} refused this sync: {exc}") from exc
            except CkptEngineError as exc:
                raise DaemonUnavailable(f"the daemon at {self.endpoint} did not open this sync's version: {exc}"
                                        ) from exc
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def current_id(self, deadline: float) -> str:
        """A rollout worker's agent id as the daemon knows it now (verl names it in the sync's quorum): after a
        daemon restart, registered again first. A daemon that does not answer by ``deadline``: the id held
        (the sync's opening then fails, naming the daemon)."""
        # this worker's outcome of the last sync first (see VerlSync._announce): delivered, or given up on
        self.flush_reports(max(deadline - time.monotonic(), 0.0))
        polled_as = self.agent_id
        try:  # a poll that waits for nothing: it changes nothing but the heartbeat
            self._sync_request("poll", {**self._identity(), "versions": self.versions_held(), "wait_s": 0.0},
                               deadline)
        except ControlReplyError as exc:
            if registration_lost(exc):
                self._try_register(self._sync_client, failed_as=polled_as)
        except CkptEngineError as exc:
            log.info("verl %s: the daemon at %s did not answer a registration check: %s", self.role,
                     self.endpoint, exc)
        return self.agent_id

    def status_of(self, version: int, deadline: float) -> str | None:
        """``version``'s status in the daemon's history (``unknown`` if the history has no such version: it was
        lost or replaced); None if the daemon did not say."""
        try:
            return self._sync_request("version", {"version": version}, deadline).get("status")
        except CkptEngineError as exc:
            if isinstance(exc, ControlReplyError) and exc.error == "not found":
                return "unknown"
            log.info("verl: the status of version %d is unknown: %s", version, exc)
            return None

    def sent(self, result: TransferResult, publisher: Publisher, held: float) -> None:
        self.report(result.version, "done", **done_fields(result, publisher, held))

    def abandoned(self, version: int, reason: str) -> None:
        """Actor rank 0: verl's sync ended before this version was sent (it failed elsewhere)."""
        publisher = self._publisher()
        self.report(version, "done", ok=False, reason=reason,
                    cache_versions=publisher.cache.versions() if publisher is not None else None)

    def received(self, version: int, result: ReceiveResult) -> None:
        if result.ok:
            self.serving = version
        self.report(version, "received", **received_fields(result), serving=self.serving)

    def verdict(self, version: int, report_s: float, wait_s: float) -> dict[str, Any] | None:
        """Actor rank 0: the daemon's verdict on ``version`` (its record once ended), after this rank's report
        reached it (``report_s``) and within ``wait_s`` more; None if the daemon did not give one."""
        if not self.flush_reports(report_s):
            return None
        return self.wait_ended(version, time.monotonic() + wait_s)
