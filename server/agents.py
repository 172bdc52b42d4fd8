"""Registry of agents (trainer ranks, receivers, engine drivers) known to the daemon, with heartbeat expiry.

Each registration gets an agent id and a session secret. Later messages must name both, so one agent cannot
speak for another. What the daemon knows of a receiver's model is its ``model``, one state machine
(decisions/receivers.py). A driver remembers the apply it was asked for.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
from collections.abc import Callable

from ckpt_engine.control.messages import Register
from ckpt_engine.plan.shards import spec_key
from ckpt_engine.server.decisions.agent_record import AgentRecord


class AgentRegistry:
    """Not thread-safe by itself: the controller calls it under its lock."""

    def __init__(self, heartbeat_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self._agents: dict[str, AgentRecord] = {}
        self._seq = itertools.count()

    def add(self, message: Register, versions: list[int]) -> AgentRecord:
        now = self.clock()
        agent = AgentRecord(secrets.token_hex(8), secrets.token_hex(24), next(self._seq), message.role, message.rank,
                      message.host, message.pid, message.device, message.host_id, time.time(), now, versions,
                      message.sync_every, engine=message.engine, driven=message.driven, members=message.members,
                      whole_versions=message.whole_versions, trainer_ranks=message.trainer_ranks or 1,
                      framework=message.framework, staging=message.staging, pulls=message.transport == "nixl")
        if message.role == "trainer":
            agent.ipc_name = message.ipc_name
        if message.role == "receiver" and message.shard_spec:
            agent.shard_spec, agent.shard_key = message.shard_spec, spec_key(message.shard_spec)
        self._agents[agent.agent_id] = agent
        return agent

    def get(self, agent_id: str, session: str | None = None) -> AgentRecord | None:
        """The agent, or None when ``session`` is given and is not the one its registration was issued."""
        agent = self._agents.get(agent_id)
        if agent is None or session is None:
            return agent
        # compare_digest, so the time taken does not tell how much of a guessed secret was right
        return agent if hmac.compare_digest(session.encode(), agent.session.encode()) else None

    def seen(self, agent: AgentRecord) -> None:
        agent.last_seen = self.clock()

    def refresh(self) -> None:
        """Start every agent's heartbeat window again, for when the daemon itself was stalled, not the agents."""
        now = self.clock()
        for agent in self._agents.values():
            agent.last_seen = now

    def expire(self) -> list[AgentRecord]:
        """Drop agents silent for longer than the heartbeat timeout, and return them."""
        limit = self.clock() - self.heartbeat_s
        gone = [a for a in self._agents.values() if a.last_seen < limit]
        for agent in gone:
            del self._agents[agent.agent_id]
        return gone

    def remove(self, agent_id: str) -> None:
        self._agents.pop(agent_id, None)

    def trainer(self) -> AgentRecord | None:
        """The sending trainer rank: rank 0, the earliest registered if several claim it."""
        candidates = [a for a in self._agents.values() if a.role == "trainer" and a.rank == 0]
        return min(candidates, key=lambda a: a.seq) if candidates else None

    def trainers(self) -> dict[int, AgentRecord]:
        """Every trainer rank's agent; the earliest registered for a rank claimed twice."""
        out: dict[int, AgentRecord] = {}
        for agent in sorted((a for a in self._agents.values() if a.role == "trainer"), key=lambda a: a.seq):
            out.setdefault(agent.rank, agent)
        return out

    def receivers(self) -> list[AgentRecord]:
        return sorted((a for a in self._agents.values() if a.role == "receiver"), key=lambda a: a.seq)

    def driver(self, engine: str) -> AgentRecord | None:
        return self.drivers().get(engine)

    def drivers(self) -> dict[str, AgentRecord]:
        """Each engine's driver; the earliest registered, should two claim it."""
        out: dict[str, AgentRecord] = {}
        for agent in sorted((a for a in self._agents.values() if a.role == "driver"), key=lambda a: a.seq):
            out.setdefault(agent.engine or "", agent)
        return out

    def engine_members(self, engine: str) -> list[AgentRecord]:
        return [a for a in self.receivers() if a.engine == engine]

    def all(self) -> list[AgentRecord]:
        return sorted(self._agents.values(), key=lambda a: a.seq)
