"""What trainer, rollout and driver agents share: registration, a long-polling heartbeat thread that receives
assignments, reports, and the sync group of the current generation.

The daemon issues each registration an agent id and a session secret; every later message carries both.
Every retry backs off with jitter and is logged once, then periodically; ``agent.problem`` says what is
failing right now. The agent's threads never die silently: an unexpected error is logged and the loop goes on.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ckpt_engine.control.auth import TOKEN_OF_AGENT, client_token
from ckpt_engine.control.client import ControlClient, ControlReplyError
from ckpt_engine.control.messages import TERMINAL, Assignment, RegisterReply, clip_reasons, longest_poll_wait
from ckpt_engine.device import DeviceInfo, detect_device
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.retry import Backoff, FailureLog
from ckpt_engine.transport.group import SyncGroup, open_store, owner_part
from ckpt_engine.transport.same_host import host_identity
from ckpt_engine.workers.reports import Answered, ReportOutbox
from ckpt_engine.workers.threads import supervised

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

log = logging.getLogger(__name__)


def registration_lost(exc: ControlReplyError) -> bool:
    """The daemon no longer knows this registration (it restarted, or its token changed): register again."""
    return "unregistered agent" in str(exc.detail) or exc.error == "unauthorized"


def registration_wait(register_wait_s: float, first_retry_after_s: float) -> float:
    """How long ``start()`` waits for a place its previous run holds: at least ``register_wait_s``, and long
    enough for the daemon's first answer (when that place could be taken: a long heartbeat makes it long), with
    room to spare; bounded (an hour), since a live holder keeps pushing that answer back."""
    return max(register_wait_s, 2 * min(first_retry_after_s, 3600.0) + 5.0)


class Agent:
    role: str
    sync_every = 1  # receivers may take only every N-th version

    def __init__(self, endpoint: str, *, rank: int = 0, token: str | None = None, device: DeviceInfo | None = None,
                 poll_wait_s: float = 1.0, request_timeout_s: float = 10.0, host_id: str | None = None,
                 register_wait_s: float = 30.0) -> None:
        """``token``: the credential of this agent's role (default: ``$CKPT_ENGINE_TOKEN``, else the role's entry
        of the local credentials file). ``host_id`` overrides the same-host identity (ipc.host_identity); a
        distinct value forces the collective path for this agent. ``register_wait_s``: how long ``start()``
        waits at least for a place held by a process that is falling silent (its previous run); longer when the
        daemon says that takes longer (a long heartbeat), never for a place a live agent keeps holding."""
        self.endpoint = endpoint
        self.rank = rank
        self._explicit_token = token
        self.token = self._resolve_token()
        self.device = device or detect_device()
        self.poll_wait_s = poll_wait_s
        self.host_id = host_id or host_identity()
        self.request_timeout_s = request_timeout_s
        self.register_wait_s = register_wait_s
        self.settings: RegisterReply | None = None
        self.history_id: str | None = None  # the history that numbers the versions this agent holds
        self._client = ControlClient(endpoint, timeout_s=request_timeout_s, token=self.token)
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._outbox = ReportOutbox(self._client, lambda: self.settings, self._stop, role=self.role, endpoint=endpoint)
        self._received: str | None = None  # key of the last assignment got, acknowledged by the next poll
        # (agent id, assignment key) of what was handled: delivery is at least once
        self._handled: collections.deque[tuple[str, str]] = collections.deque(maxlen=64)
        # This generation's sync groups: a receiver's ``groups[r]`` is owner rank r's; a trainer rank has its own
        # and ``owners_group`` with the other owners.
        self.groups: list[SyncGroup] = []
        self.owners_group: SyncGroup | None = None
        # (registration, generation, part, why) of the last failed rendezvous. Not tried again: its store keys
        # would let a second try pass the rendezvous and hang in the backend's connect.
        self._failed_rendezvous: tuple[str, int, str, Exception] | None = None
        # A restarted daemon has a new store and numbers generations afresh: groups of an earlier registration
        # are never reused.
        self.groups_built_as: str | None = None
        self._group_lock = threading.Lock()
        self._register_lock = threading.Lock()  # registering again: once, whichever thread notices first
        self._poll_failures = FailureLog(log, f"{self.role} agent: polling the daemon at {endpoint}")

    @property
    def agent_id(self) -> str:
        if self.settings is None:
            raise CkptEngineError("agent is not registered; call start() first")
        return self.settings.agent_id

    @property
    def problem(self) -> str | None:
        """What is failing right now (polling or reporting), or None when the agent works normally."""
        for failures in (self._poll_failures, self._outbox.failures):
            if failures.last_error is not None:
                return f"{failures.what}: {failures.last_error} (for {failures.failing_for_s:.0f}s)"
        return None

    def start(self) -> Self:
        self._register_when_free()
        self._outbox.start()
        self.on_registered()
        self._poller = supervised(self._poll_loop, f"ckpt-{self.role}-poll", self._poll_loop_died)
        self._poller.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(self.poll_wait_s + self.request_timeout_s)
        self._outbox.close(2 * self.request_timeout_s)
        if self.settings is not None:
            try:
                self._client.request("unregister", self._identity(), timeout_s=2.0)
            except CkptEngineError as exc:  # the daemon may be gone already; its heartbeat timeout covers us
                log.info("unregister: %s", exc)
        self._close_groups()
        self._client.close()

    def report(self, version: int, event: str, answered: Answered | None = None, **fields: Any) -> None:
        """Tell the daemon about progress, without waiting: reports are delivered in order by a background
        thread; one that cannot be delivered is logged, never raised. ``answered``: called with the daemon's
        reply, or None if the report was given up on."""
        self._outbox.put(clip_reasons({**self._identity(), "version": version, "event": event, **fields}), answered)

    def flush_reports(self, timeout_s: float) -> bool:
        """Wait until every queued report has been delivered (or given up on); False on timeout."""
        return self._outbox.flush(timeout_s)

    def wait_ended(self, version: int, deadline: float) -> dict[str, Any] | None:
        """``version``'s record once the daemon has ended it (committed, failed, ...); None at ``deadline``."""
        backoff = Backoff(initial_s=0.02, max_s=0.5)
        while time.monotonic() < deadline:
            try:
                record = self._client.request("version", {"version": version}, timeout_s=2.0)
                if record.get("status") in TERMINAL:
                    return record
            except CkptEngineError as exc:  # the daemon may be restarting: the deadline bounds this
                log.debug("waiting for version %d to end: %s", version, exc)
            backoff.wait()
        return None

    def _identity(self) -> dict[str, str]:
        settings = self.settings
        if settings is None:
            raise CkptEngineError("agent is not registered")
        return {"agent_id": settings.agent_id, "session": settings.session}

    def versions_held(self) -> list[int]:
        return []

    def forget_versions(self) -> None:
        """The daemon numbers versions by another history than the one this agent's versions came from (it lost
        or replaced its file): their ids mean nothing there, so drop them."""

    def from_earlier_registration(self, assignment: Assignment) -> bool:
        """Assigned by a daemon this agent has since registered with again (it restarted): that daemon is
        gone and the new one marked the version failed, so the version will not be served."""
        settings = self.settings
        return (assignment.received_as is not None and settings is not None
                and assignment.received_as != settings.agent_id)

    def register_extra(self) -> dict[str, Any]:
        """Role-specific fields of the Register message."""
        return {}

    def on_registered(self) -> None:
        """Set up what depends on the daemon's settings, before any assignment can arrive."""

    def handle(self, assignment: Assignment) -> None:
        raise NotImplementedError

    @property
    def group(self) -> SyncGroup | None:
        """The (first) sync group of the current generation: rank 0's, where versions begin and end."""
        return self.groups[0] if self.groups else None

    @property
    def group_broken(self) -> bool:
        groups = [*self.groups, *([self.owners_group] if self.owners_group is not None else [])]
        return any(g.broken is not None for g in groups)

    def group_for(self, assignment: Assignment) -> SyncGroup | None:
        """The sync group of the assignment's generation, rebuilt when the generation changed or it broke;
        None when the version has no collective receivers (all colocated). A receiver of a version several
        trainer ranks own joins one group per owner (see ``groups``)."""
        settings = self.settings
        if settings is None:
            raise CkptEngineError("agent is not registered")
        with self._group_lock:  # the poll thread may be building it ahead of the step that needs it
            return self._group_for(assignment, settings)

    def _group_for(self, assignment: Assignment, settings: RegisterReply) -> SyncGroup | None:
        current = self.group
        owner_rank = self._owner_rank(assignment)
        with_owners = owner_rank is not None and assignment.owners > 1
        # No collective receivers (all colocated or pulling): no sync group, but owners still vote on their own.
        wanted = self._group_count(assignment) if assignment.world_size >= 2 else 0
        if not wanted and not with_owners:
            self._close_groups()
            return None
        anchor = current if current is not None else self.owners_group
        usable = (anchor is not None and self.groups_built_as == settings.agent_id
                  and anchor.generation == assignment.generation and not self.group_broken
                  and len(self.groups) == wanted and (self.owners_group is not None) == with_owners
                  and (current is None or current.part.startswith(assignment.part)))
        if usable:
            return current
        failed = self._failed_rendezvous
        if failed is not None and failed[:3] == (settings.agent_id, assignment.generation, assignment.part):
            raise failed[3]
        self._refuse_older_generation(assignment, settings)
        self._close_groups()
        try:
            store = open_store(settings.store_host, settings.store_port, timeout_s=settings.connect_timeout_s)
            owners = ([owner_rank] if owner_rank is not None else range(wanted)) if wanted else []
            parts = [assignment.part + owner_part(o) for o in owners]  # (a class's groups: under the class's part)
            for part in parts:
                self.groups.append(self._sync_group(store, settings, assignment, part, assignment.rank,
                                                    assignment.world_size))
            if with_owners and owner_rank is not None:
                self.owners_group = self._sync_group(store, settings, assignment, "owners/", owner_rank,
                                                     assignment.owners)
        except Exception as exc:
            self._close_groups()
            self._failed_rendezvous = (settings.agent_id, assignment.generation, assignment.part, exc)
            raise
        self.groups_built_as = settings.agent_id
        return self.group

    def _refuse_older_generation(self, assignment: Assignment, settings: RegisterReply) -> None:
        current = self.group
        if (current is not None and current.name == settings.group_name and self.groups_built_as == settings.agent_id
                and assignment.generation < current.generation):
            # a version the daemon has already ended: rebuilding its old group would tear down the current one
            raise CkptEngineError(f"version {assignment.version} belongs to sync group generation "
                                  f"{assignment.generation}, superseded by {current.generation}")

    def _group_count(self, assignment: Assignment) -> int:
        return 1 if self._owner_rank(assignment) is not None else max(assignment.owners, 1)

    def _owner_rank(self, assignment: Assignment) -> int | None:
        """This process's rank among the owners of the version, when it sends (a trainer rank); else None."""
        return None

    def _sync_group(self, store, settings: RegisterReply, assignment: Assignment, part: str, rank: int,
                    world_size: int) -> SyncGroup:
        return SyncGroup(store, name=settings.group_name, generation=assignment.generation, rank=rank,
                         world_size=world_size, device=self.device, timeout_s=settings.collective_timeout_s,
                         connect_timeout_s=settings.connect_timeout_s, part=part,
                         label=f"{self.role} agent {settings.agent_id}")

    def _close_groups(self) -> None:
        for group in [*self.groups, *([self.owners_group] if self.owners_group is not None else [])]:
            group.close()
        self.groups, self.owners_group = [], None

    def _resolve_token(self) -> str | None:
        return client_token(TOKEN_OF_AGENT[self.role], self._explicit_token)

    def _register_when_free(self) -> None:
        """Register; while the daemon says the place this agent claims (its trainer rank, its engine's worker
        slot or driver) is held by an agent that has not fallen silent yet (a previous run of this process,
        restarted at once), try again until it has, for up to ``register_wait_s``. A place a live agent keeps
        holding (a second job, an engine started twice) is refused with the daemon's reason, naming it."""
        started = time.monotonic()
        deadline: float | None = None
        backoff = Backoff(initial_s=0.25, max_s=2.0)
        while True:
            try:
                self._register()
                return
            except ControlReplyError as exc:
                silent_in = (exc.record or {}).get("retry_after_s") if exc.error == "conflict" else None
                if not isinstance(silent_in, (int, float)) or isinstance(silent_in, bool) or silent_in < 0:
                    raise
                if deadline is None:
                    deadline = started + registration_wait(self.register_wait_s, float(silent_in))
                delay = max(float(silent_in), backoff.next_delay())
                if time.monotonic() + delay > deadline:
                    raise
                log.info("registration refused for now (%s); trying again in %.1fs", exc.detail, delay)
                time.sleep(delay)

    def _register(self, client: ControlClient | None = None) -> None:
        held = self.versions_held()
        body = {"role": self.role, "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "device": str(self.device.torch_device), "versions": held,
                "history_id": self.history_id if held else None, "token": self.token,
                "host_id": self.host_id, "sync_every": self.sync_every, **self.register_extra()}
        reply = (client or self._client).request("register", body, timeout_s=self.request_timeout_s)
        settings = RegisterReply.model_validate(reply)
        if held and settings.history_id != self.history_id:
            log.warning("the daemon numbers versions by another history than the one versions %s came from; "
                        "dropping them", held)
            self.forget_versions()
        self.history_id = settings.history_id
        longest = longest_poll_wait(settings.heartbeat_s)
        if self.poll_wait_s > longest:
            log.warning("poll_wait_s %.1fs is longer than the daemon's heartbeat allows (heartbeat_s %.1fs): polls "
                        "wait %.1fs at most", self.poll_wait_s, settings.heartbeat_s, longest)
            self.poll_wait_s = longest
        self._received = None  # acknowledgements name assignments of one registration: a new daemon may reuse keys
        self.settings = settings
        log.info("registered with %s as %s %s", self.endpoint, self.role, settings.agent_id)

    def _poll_loop(self) -> None:
        # A lost poll is noticed only at its timeout. Polls are the heartbeat: half a heartbeat past the parked
        # wait lets the next one reach the daemon before it gives up on this agent.
        heartbeat_s = self.settings.heartbeat_s if self.settings is not None else self.request_timeout_s
        poller = ControlClient(self.endpoint, timeout_s=self.poll_wait_s + min(heartbeat_s / 2, self.request_timeout_s),
                               token=self.token)
        backoff = Backoff(initial_s=0.25, max_s=10.0)
        try:
            while not self._stop.is_set():
                if self._poll_once(poller):
                    backoff.reset()
                    self._poll_failures.succeeded()
                elif backoff.wait(self._stop):
                    return
        finally:
            poller.close()

    def _poll_once(self, poller: ControlClient) -> bool:
        """One poll (and what its reply asks for); False when it failed and the loop should back off."""
        polled_as, asked_at = self.agent_id, time.monotonic()
        try:
            unable = self.unable_now()
            body = {**self._identity(), "versions": self.versions_held(), "wait_s": self.poll_wait_s,
                    "received": self._received, **({"unable": unable} if unable else {})}
            reply = poller.request("poll", clip_reasons(body))
        except ControlReplyError as exc:
            self._poll_failures.failed(exc)
            if registration_lost(exc):
                # A restarted daemon, or a new token in the credentials file. Registered again: poll at once,
                # not after the backoff the failures grew (longer than a heartbeat, it would expire again).
                return self._try_register(poller, failed_as=polled_as)
            return False
        except CkptEngineError as exc:
            self._poll_failures.failed(exc)
            return False
        self.in_flight_now(reply.get("in_flight"), asked_at)
        if reply.get("assignment"):
            assignment = Assignment.model_validate(reply["assignment"]).receipt(polled_as)
            self._received = assignment.key()
            # per registration: a restarted daemon may reuse version ids (e.g. an in-memory history)
            if (polled_as, assignment.key()) not in self._handled:
                self._handled.append((polled_as, assignment.key()))
                self._dispatch(assignment)
        return True

    def in_flight_now(self, version: int | None, asked_at: float) -> None:
        """The daemon's version in flight (None: none) as it answered a poll sent at ``asked_at``
        (time.monotonic())."""

    def _try_register(self, client: ControlClient, *, failed_as: str) -> bool:
        """Register again after a request as ``failed_as`` was refused as unregistered (or unauthorized), on
        ``client``: the shared one may be held by a report still waiting for the dead daemon's reply (up to the
        request timeout), and until registered the agent is invisible. Registered once, whichever thread
        noticed first (two registrations would be two agents). True once registered."""
        with self._register_lock:
            if self.settings is not None and self.settings.agent_id != failed_as:
                return True  # another thread registered again meanwhile
            token = self._resolve_token()
            if token != self.token:
                log.warning("using the %s token found now (the credentials changed)", TOKEN_OF_AGENT[self.role])
                self.token = client.token = self._client.token = token
            try:
                self._register(client)
                log.warning("registered again as %s", self.agent_id)
                return True
            except CkptEngineError as exc:
                self._poll_failures.failed(f"registering again: {exc}")
                return False

    def unable_now(self) -> str | None:
        """Why this agent cannot take versions now, said with every poll (None: it can)."""
        return None

    def _poll_loop_died(self, exc: BaseException) -> None:
        # Without polls the daemon drops this agent after its heartbeat timeout; say so where it is seen.
        self._poll_failures.failed(f"the poll thread died: {type(exc).__name__}: {exc}")

    def _dispatch(self, assignment: Assignment) -> None:
        try:
            self.handle(assignment)
        except Exception:  # an assignment that cannot even be queued must not stop the heartbeat
            log.exception("handling assignment %s failed", assignment)
