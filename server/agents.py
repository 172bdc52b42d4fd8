"""Registry of agents (trainer ranks and receivers) known to the daemon, with heartbeat expiry."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from ckpt_engine.control import Assignment, Register


@dataclass
class Agent:
    agent_id: str
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
    catch_up_tried: bool = False
    pending: deque[Assignment] = field(default_factory=deque)
    ipc_name: str | None = None  # trainers: the same-host hub they serve colocated receivers from
    poll_wait_s: float = 0.0  # the wait of its latest poll: a healthy agent polls again within about that

    def heartbeating(self, now: float, heartbeat_s: float) -> bool:
        """Seen as recently as a healthy agent is. One silent for longer (stalled, cut off) is still registered
        until ``heartbeat_s`` passes, but must not be put into a version's quorum: it would fail the version."""
        return now - self.last_seen <= self.poll_wait_s + heartbeat_s / 2

    def public(self) -> dict:
        return {"agent_id": self.agent_id, "role": self.role, "rank": self.rank, "host": self.host, "pid": self.pid,
                "device": self.device, "host_id": self.host_id, "versions": self.versions, "sync_every": self.sync_every,
                "registered_at": self.registered_at,
                "seconds_since_seen": round(time.monotonic() - self.last_seen, 3)}


class AgentRegistry:
    """Not thread-safe by itself: the controller calls it under its lock."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self._agents: dict[str, Agent] = {}
        self._seq = itertools.count()

    def add(self, message: Register) -> Agent:
        now = time.monotonic()
        agent = Agent(uuid.uuid4().hex[:12], next(self._seq), message.role, message.rank, message.host,
                      message.pid, message.device, message.host_id, time.time(), now, list(message.versions),
                      message.sync_every)
        if message.role == "trainer":
            agent.ipc_name = message.ipc_name
        self._agents[agent.agent_id] = agent
        return agent

    def get(self, agent_id: str) -> Agent | None:
        return self._agents.get(agent_id)

    def seen(self, agent: Agent) -> None:
        agent.last_seen = time.monotonic()

    def refresh(self) -> None:
        """Start every agent's heartbeat window again (the daemon itself was stalled, not the agents)."""
        now = time.monotonic()
        for agent in self._agents.values():
            agent.last_seen = now

    def expire(self) -> list[Agent]:
        """Drop agents silent for longer than the heartbeat timeout; returns them."""
        limit = time.monotonic() - self.heartbeat_s
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

    def receivers(self) -> list[Agent]:
        return sorted((a for a in self._agents.values() if a.role == "receiver"), key=lambda a: a.seq)

    def all(self) -> list[Agent]:
        return sorted(self._agents.values(), key=lambda a: a.seq)
