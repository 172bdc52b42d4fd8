"""Registry of agents (trainer ranks, receivers, engine drivers) known to the daemon, with heartbeat expiry.

Each registration gets an agent id and a session secret; later messages must name both, so one agent cannot
speak for another. What the daemon knows of a receiver's model is its ``model`` (decisions/receivers.py: one
state machine); a driver remembers the apply it was asked for.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt_engine.server.decisions.receivers import ReceiverModel

from ckpt_engine.control.messages import Assignment, Register
from ckpt_engine.plan.shards import spec_from_wire, spec_key, spec_to_wire


@dataclass
class Agent:
    agent_id: str
    session: str
    seq: int
    role: str
    rank: int
    host: str
    pid: int
    device: str
    host_id: str | None
    registered_at: float
    last_seen: float
    versions: list[int] = field(default_factory=list)
    sync_every: int = 1
    offered: int = 0  # regular versions requested since this agent registered (for sync_every)
    pending: deque[Assignment] = field(default_factory=deque)
    ipc_name: str | None = None  # trainers: the same-host hub they serve colocated receivers from
    poll_wait_s: float = 0.0  # the wait of its latest poll: a healthy agent polls again within about that
    # engines of several workers
    engine: str | None = None
    driven: bool = False
    members: int | None = None  # drivers: receivers of their engine
    whole_versions: bool = False  # receivers whose engine takes no sparse version (vLLM)
    trainer_ranks: int = 1  # trainer rank 0: ranks of its job
    keep_versions: int | None = None  # trainer rank 0 of a framework: what its caches keep (None: the deployment's)
    framework: str | None = None  # verl: the framework moves this agent's versions (messages.Register)
    staging: str | None = None  # receivers: the staging policy they asked for (None: the deployment's)
    staged_last: dict | None = None  # receivers: where their last version was held, why, and the pause
    model: ReceiverModel = field(default_factory=ReceiverModel)  # receivers: what their model holds
    applying: int | None = None  # drivers: the version they were told to apply (its outcome is theirs to say)
    # receivers: the slices they keep (wire form, normalised) and its class key (plan/shards.py spec_key);
    # None: every tensor whole
    shard_spec: dict | None = None
    shard_key: str = "whole"

    def silence_window(self, heartbeat_s: float) -> float:
        """How long a healthy agent may go unseen: its poll's wait and half a heartbeat."""
        return self.poll_wait_s + heartbeat_s / 2

    def heartbeating(self, now: float, heartbeat_s: float) -> bool:
        """Seen as recently as a healthy agent is. One silent for longer (stalled, cut off) is still registered
        until ``heartbeat_s`` passes, but must not be put into a version's quorum: it would fail the version."""
        return now - self.last_seen <= self.silence_window(heartbeat_s)

    def state(self, now: float) -> str:
        return self.model.state(now) if self.role == "receiver" else "registered"

    def public(self, now: float) -> dict:
        model = self.model.public(now) if self.role == "receiver" else {
            "state": "registered", "serving": None, "staged": None, "torn": None, "proven": False, "unable": None,
            "unable_for_s": None}
        return {"agent_id": self.agent_id, "role": self.role, "rank": self.rank, "host": self.host, "pid": self.pid,
                "device": self.device, "host_id": self.host_id, "versions": self.versions, "sync_every": self.sync_every,
                "registered_at": self.registered_at, "seconds_since_seen": round(now - self.last_seen, 3),
                "engine": self.engine, "driven": self.driven, "members": self.members,
                "whole_versions": self.whole_versions, "framework": self.framework, "staging": self.staging,
                "last_staging": self.staged_last, "shard_class": self.shard_key if self.shard_spec else None,
                "sharded_tensors": len(self.shard_spec or {}), **model}


class AgentRegistry:
    """Not thread-safe by itself: the controller calls it under its lock."""

    def __init__(self, heartbeat_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self._agents: dict[str, Agent] = {}
        self._seq = itertools.count()

    def add(self, message: Register, versions: list[int]) -> Agent:
        now = self.clock()
        agent = Agent(secrets.token_hex(8), secrets.token_hex(24), next(self._seq), message.role, message.rank,
                      message.host, message.pid, message.device, message.host_id, time.time(), now, versions,
                      message.sync_every, engine=message.engine, driven=message.driven, members=message.members,
                      whole_versions=message.whole_versions, trainer_ranks=message.trainer_ranks or 1,
                      framework=message.framework, staging=message.staging)
        if message.role == "trainer":
            agent.ipc_name = message.ipc_name
        if message.role == "receiver" and message.shard_spec:
            spec = spec_from_wire(message.shard_spec)  # (the registrar checked it)
            agent.shard_spec, agent.shard_key = spec_to_wire(spec), spec_key(spec)
        self._agents[agent.agent_id] = agent
        return agent

    def get(self, agent_id: str, session: str | None = None) -> Agent | None:
        """The agent, if ``session`` (when given) is the one its registration was issued."""
        agent = self._agents.get(agent_id)
        if agent is None or session is None:
            return agent
        # compare_digest: the time taken does not tell how much of a guessed secret was right
        return agent if hmac.compare_digest(session.encode(), agent.session.encode()) else None

    def seen(self, agent: Agent) -> None:
        agent.last_seen = self.clock()

    def refresh(self) -> None:
        """Start every agent's heartbeat window again (the daemon itself was stalled, not the agents)."""
        now = self.clock()
        for agent in self._agents.values():
            agent.last_seen = now

    def expire(self) -> list[Agent]:
        """Drop agents silent for longer than the heartbeat timeout; returns them."""
        limit = self.clock() - self.heartbeat_s
        gone = [a for a in self._agents.values() if a.last_seen < limit]
        for agent in gone:
            del self._agents[agent.agent_id]
        return gone

    def remove(self, agent_id: str) -> None:
        self._agents.pop(agent_id, None)

    def trainer(self) -> Agent | None:
        """The sending trainer rank (rank 0, the earliest registered if several claim it)."""
        candidates = [a for a in self._agents.values() if a.role == "trainer" and a.rank == 0]
        return min(candidates, key=lambda a: a.seq) if candidates else None

    def trainers(self) -> dict[int, Agent]:
        """Every trainer rank's agent (the earliest registered for a rank claimed twice)."""
        out: dict[int, Agent] = {}
        for agent in sorted((a for a in self._agents.values() if a.role == "trainer"), key=lambda a: a.seq):
            out.setdefault(agent.rank, agent)
        return out

    def receivers(self) -> list[Agent]:
        return sorted((a for a in self._agents.values() if a.role == "receiver"), key=lambda a: a.seq)

    def driver(self, engine: str) -> Agent | None:
        return self.drivers().get(engine)

    def drivers(self) -> dict[str, Agent]:
        """Each engine's driver (the earliest registered, should two claim it)."""
        out: dict[str, Agent] = {}
        for agent in sorted((a for a in self._agents.values() if a.role == "driver"), key=lambda a: a.seq):
            out.setdefault(agent.engine or "", agent)
        return out

    def engine_members(self, engine: str) -> list[Agent]:
        return [a for a in self.receivers() if a.engine == engine]

    def all(self) -> list[Agent]:
        return sorted(self._agents.values(), key=lambda a: a.seq)
