"""One registered agent as the daemon's decisions see it (the registry that keeps them is server/agents.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ckpt_engine.control.messages import Assignment
from ckpt_engine.plan.shards import ShardSpec
from ckpt_engine.server.decisions.receivers import ReceiverModel


@dataclass
class AgentRecord:
    """What the daemon knows of one registration: a trainer rank, a receiver or an engine's driver. The
    registry (server/agents.py) keeps these records, checks their sessions and expires them."""

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
    pulls: bool = False  # receivers that asked to pull every version over NIXL
    staged_last: dict | None = None  # receivers: where their last version was held, why, and the pause
    model: ReceiverModel = field(default_factory=ReceiverModel)  # receivers: what their model holds
    applying: int | None = None  # drivers: the version they were told to apply (its outcome is theirs to say)
    # receivers: the slices they keep (None: every tensor whole) and their class key (plan/shards.py spec_key)
    shard_spec: ShardSpec | None = None
    shard_key: str = "whole"

    def silence_window(self, heartbeat_s: float) -> float:
        """How long a healthy agent may go unseen: its poll's wait and half a heartbeat."""
        return self.poll_wait_s + heartbeat_s / 2

    def heartbeating(self, now: float, heartbeat_s: float) -> bool:
        """Seen as recently as a healthy agent would be. One silent for longer (stalled, cut off) stays registered
        until ``heartbeat_s`` passes, but is kept out of quorums: it would fail the version."""
        return now - self.last_seen <= self.silence_window(heartbeat_s)

    def state(self, now: float) -> str:
        return self.model.state(now) if self.role == "receiver" else "registered"

    def public(self, now: float) -> dict:
        model = self.model.public(now) if self.role == "receiver" else {
            "state": "registered", "serving": None, "staged": None, "torn": None, "proven": False, "unable": None,
            "unable_for_s": None}
        return {"agent_id": self.agent_id, "role": self.role, "rank": self.rank, "host": self.host, "pid": self.pid,
                "device": self.device, "host_id": self.host_id, "versions": self.versions,
                "sync_every": self.sync_every,
                "registered_at": self.registered_at, "seconds_since_seen": round(now - self.last_seen, 3),
                "engine": self.engine, "driven": self.driven, "members": self.members,
                "whole_versions": self.whole_versions, "framework": self.framework, "staging": self.staging,
                "pulls": self.pulls,
                "last_staging": self.staged_last, "shard_class": self.shard_key if self.shard_spec else None,
                "sharded_tensors": len(self.shard_spec or {}), **model}
