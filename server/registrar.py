"""Registration: who may join (decisions/claims.py), what it may say it holds, and the settings it is told.
Not thread-safe by itself: the controller calls it under its lock."""

from __future__ import annotations

import hashlib
import hmac
import logging

from ckpt_engine.config import EngineConfig
from ckpt_engine.control.messages import Register, RegisterReply
from ckpt_engine.server.agents import AgentRegistry
from ckpt_engine.server.cache_book import CacheBook
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.claims import judge_registration
from ckpt_engine.server.errors import BadRequest, Conflict, Forbidden, Unavailable
from ckpt_engine.server.history import HistoryStore

log = logging.getLogger(__name__)
_NEWCOMER_SETTLE_S = 1.0  # a newcomer's catch-up waits this long: one that vanishes at once costs nothing
_MAX_INHERITED_ID = 1 << 32  # highest lost-history id a new history numbers after: far below id exhaustion


class Registrar:
    def __init__(self, config: EngineConfig, history: HistoryStore, agents: AgentRegistry, book: CacheBook, *,
                 group_name: str, store_host: str, store_port: int, engine_secret: bytes) -> None:
        self.config, self.history, self.agents, self.book = config, history, agents, book
        self.group_name, self.store_host, self.store_port = group_name, store_host, store_port
        self._engine_secret = engine_secret

    def engine_key(self, engine: str) -> str:
        """The key the workers of ``engine`` register with, issued to its driver. It is the same for every run of
        the daemon with the same credentials, so workers registering again after a restart still hold it."""
        return hmac.new(self._engine_secret, f"engine:{engine}".encode(), hashlib.sha256).hexdigest()[:32]

    def admit(self, message: Register, now: float) -> tuple[AgentRecord, list[AgentRecord]]:
        """Register ``message``: returns the new agent and the silent agents whose places it takes, for the
        caller to let go (a restarted process). Raises Conflict naming a live agent whose place it claims
        (decisions/claims.py)."""
        if message.role == "driver" and message.engine is None:
            raise BadRequest("a driver names its engine")
        if message.driven and (message.engine is None or message.members is None):
            raise BadRequest("a driven receiver names its engine and how many workers the engine has (members)")
        if message.role == "receiver" and message.driven and not hmac.compare_digest(
                (message.engine_key or "").encode(), self.engine_key(message.engine or "").encode()):
            raise Forbidden(f"a worker of engine {message.engine!r} registers with the key its engine's driver was "
                            "issued (engine_key in the driver's registration reply); start the driver first")
        if message.shard_spec is not None and message.role != "receiver":  # the spec was parsed with the message
            raise BadRequest("a shard spec is a receiver's")  # framework workers too: their syncs send classes
        if message.transport == "nixl" and (message.role != "receiver" or not self.config.nixl_trust_receivers):
            raise BadRequest("only a receiver pulls over nixl, and only where the deployment trusts its receivers "
                             "with the trainer's memory (nixl_trust_receivers: true; docs/security.md)")
        if len(self.agents.all()) >= self.config.max_agents:
            raise Unavailable(f"{self.config.max_agents} agents are registered (max_agents); unregister some or "
                              "raise the limit")
        verdict = judge_registration(message, self.agents.all(), now, self.config.timeouts.heartbeat_s)
        if verdict.conflict is not None:
            raise Conflict(verdict.conflict, verdict.record())
        replaced = [a for a in map(self.agents.get, verdict.replaces) if a is not None]
        for old in replaced:
            log.warning("%s %s (rank %d, silent for %.1fs) replaced by a new registration from pid %d on %s (a "
                        "restart)", old.role, old.agent_id, old.rank, now - old.last_seen, message.pid, message.host)
        # Versions are numbered by one history: those of another mean nothing here (the file was lost or
        # replaced), and ids this history never issued are a peer's invention. Neither touches our numbering.
        held = self.book.known(message.versions) if message.history_id == self.history.history_id else []
        if message.role == "trainer" and message.versions and message.history_id != self.history.history_id:
            self._number_after_lost_history(message)
        agent = self.agents.add(message, held)
        if agent.role == "receiver":
            agent.model.registered(held[-1] if held else None, now, _NEWCOMER_SETTLE_S)
        if agent.role == "trainer":
            agent.ipc_name = agent.ipc_name or f"ckpt-engine/{self.group_name}/{agent.agent_id}"
        log.info("agent %s registered: %s rank %d on %s (%s)%s", agent.agent_id, agent.role, agent.rank,
                 agent.host, agent.device, f" engine {agent.engine}" if agent.engine else "")
        return agent, replaced

    def reply(self, agent: AgentRecord) -> RegisterReply:
        timeouts = self.config.timeouts
        return RegisterReply(
            agent_id=agent.agent_id, session=agent.session, history_id=self.history.history_id,
            ipc_name=agent.ipc_name, heartbeat_s=timeouts.heartbeat_s, group_name=self.group_name,
            store_host=self.store_host, store_port=self.store_port, bucket_size=self.config.bucket_size,
            alignment=self.config.alignment, keep_versions=self.config.keep_versions, verify=self.config.verify,
            connect_timeout_s=timeouts.connect_s, collective_timeout_s=timeouts.collective_s,
            ack_timeout_s=timeouts.ack_s, version_timeout_s=timeouts.version_s,
            engine_key=self.engine_key(agent.engine or "") if agent.role == "driver" else None,
            staging=agent.staging or self.config.staging, staging_share=self.config.staging_share,
            staging_budget=(int(self.config.staging_budget_mb * (1 << 20)) if self.config.staging_budget_mb else None),
            transport=self.config.transport,
        )

    def _number_after_lost_history(self, message: Register) -> None:
        """A trainer holds versions of another history (this one was lost or replaced). While this one has
        issued nothing yet, its ids start after the trainer's, so logs and dashboards never show one id for two
        versions. The agent drops those versions either way: their ids mean nothing here. Only a trainer's word
        counts, and only for an empty history, so nothing a peer says moves the numbering of a live one."""
        if self.book.max_issued > 0 or self.history.latest() is not None or message.history_id is None:
            return
        highest = max(message.versions)
        if 0 < highest <= _MAX_INHERITED_ID and self.history.number_after(highest):
            log.warning("the trainer holds versions up to %d of history %s, not this one (%s: lost or replaced); "
                        "new versions are numbered from %d", highest, message.history_id, self.history.history_id,
                        highest + 1)

