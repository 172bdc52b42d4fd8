"""What a registration may claim about membership, judged against the agents registered now. Pure: no I/O, no
locks, no clock; the controller passes the time.

A registrant says which trainer rank it is, which engine it is a worker or the driver of, how many workers
that engine has, and whether a framework drives it. None of it may change what a live agent receives. A claim
that conflicts with live (heartbeating) agents is refused, naming them. A claim to a place held by an agent
that fell silent takes that place: that is how a restarted process differs from an impostor. Host and pid are
the registrant's own say and decide nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_engine.control.messages import Register
from ckpt_engine.server.decisions.agent_record import AgentRecord


@dataclass(frozen=True)
class Verdict:
    """A registration's fate. Refused: ``conflict`` says why, ``live_agent`` names who holds the place, and
    ``retry_after_s`` is the earliest that one could have been silent long enough to be replaced. Accepted: it
    takes the places of the silent agents in ``replaces``."""

    conflict: str | None = None
    live_agent: str | None = None
    retry_after_s: float | None = None
    replaces: tuple[str, ...] = ()

    def record(self) -> dict:
        return {"live_agent": self.live_agent, "retry_after_s": self.retry_after_s}


def judge_registration(message: Register, agents: Sequence[AgentRecord], now: float, heartbeat_s: float) -> Verdict:
    """The verdict on ``message`` given the registered ``agents`` (registration order)."""
    if message.role == "trainer":
        return _trainer(message, agents, now, heartbeat_s)
    if message.role == "driver":
        return _driver(message, agents, now, heartbeat_s)
    if message.engine is not None:
        return _engine_member(message, agents, now, heartbeat_s)
    return Verdict()


def _live(agent: AgentRecord, now: float, heartbeat_s: float) -> bool:
    return agent.heartbeating(now, heartbeat_s)


def _refused(why: str, holder: AgentRecord, now: float, heartbeat_s: float) -> Verdict:
    window = holder.silence_window(heartbeat_s)
    silent_in = max(window - (now - holder.last_seen), 0.0)
    return Verdict(f"{why} A restarted process takes its place once it has been silent for {window:.1f}s "
                   f"(in {silent_in:.1f}s at the earliest).", holder.agent_id, round(silent_in, 3))


def _who(agent: AgentRecord) -> str:
    return f"agent {agent.agent_id}, pid {agent.pid} on {agent.host}"


def _trainer(message: Register, agents: Sequence[AgentRecord], now: float, heartbeat_s: float) -> Verdict:
    trainers = [a for a in agents if a.role == "trainer"]
    same = [a for a in trainers if a.rank == message.rank]
    for holder in same:
        if _live(holder, now, heartbeat_s):
            job = f"a {holder.framework} job's" if holder.framework else "a trainer job's (not a framework's)"
            served = holder.framework or message.framework or "trainer"
            return _refused(f"{job} trainer rank {message.rank} is registered and alive ({_who(holder)}): one "
                            f"daemon serves one {served} job, and a second job (or a token holder) cannot take a "
                            "live rank's place.", holder, now, heartbeat_s)
    lead = next((a for a in trainers if a.rank == 0 and _live(a, now, heartbeat_s)), None)
    if message.rank > 0 and lead is not None and message.rank >= lead.trainer_ranks:
        return Verdict(f"trainer rank {message.rank} is not a rank of the registered trainer job, which has "
                       f"{lead.trainer_ranks} rank(s) ({_who(lead)})", lead.agent_id, None)
    if message.rank > 0 and lead is not None and (message.framework or None) != (lead.framework or None):
        return Verdict(f"trainer rank {message.rank} says it is "
                       f"{'of ' + message.framework if message.framework else 'not of a framework'}"
                       f", but the registered job's rank 0 ({_who(lead)}) is "
                       f"{'of ' + lead.framework if lead.framework else 'not of a framework'}", lead.agent_id, None)
    return Verdict(replaces=tuple(a.agent_id for a in same))


def _driver(message: Register, agents: Sequence[AgentRecord], now: float, heartbeat_s: float) -> Verdict:
    engine = message.engine
    drivers = [a for a in agents if a.role == "driver" and a.engine == engine]
    for holder in drivers:
        if _live(holder, now, heartbeat_s):
            return _refused(f"engine {engine!r} has a driver already ({_who(holder)}); stop it first.", holder, now,
                            heartbeat_s)
    members = [a for a in agents if a.role == "receiver" and a.engine == engine]
    loose = [m for m in members if not m.driven and _live(m, now, heartbeat_s)]
    if loose:
        return Verdict(f"engine {engine!r} has receivers that are not driven ({_who(loose[0])}): a driver cannot "
                       "apply versions for them", loose[0].agent_id, None)
    differ = [m for m in members if m.driven and message.members is not None and m.members != message.members
              and _live(m, now, heartbeat_s)]
    if differ:
        return Verdict(f"engine {engine!r} has {differ[0].members} worker(s) as its registered worker "
                       f"{_who(differ[0])} says; this driver says {message.members}", differ[0].agent_id, None)
    return Verdict(replaces=tuple(a.agent_id for a in drivers))


def _engine_member(message: Register, agents: Sequence[AgentRecord], now: float, heartbeat_s: float) -> Verdict:
    engine = message.engine
    members = [a for a in agents if a.role == "receiver" and a.engine == engine]
    driver = next((a for a in agents if a.role == "driver" and a.engine == engine and _live(a, now, heartbeat_s)),
                  None)
    if not message.driven:
        driven = [m for m in members if m.driven] + ([driver] if driver is not None else [])
        holder = next((a for a in driven if _live(a, now, heartbeat_s)), None)
        if holder is not None:
            return Verdict(f"engine {engine!r} is driven ({_who(holder)}): its workers register as driven",
                           holder.agent_id, None)
        return Verdict()
    loose = [m for m in members if not m.driven and _live(m, now, heartbeat_s)]
    if loose:
        return Verdict(f"engine {engine!r} has receivers that are not driven ({_who(loose[0])})", loose[0].agent_id,
                       None)
    said: list[tuple[AgentRecord, int | None]] = []
    if driver is not None and driver.members is not None:
        said.append((driver, driver.members))
    said += [(m, m.members) for m in members if m.driven and _live(m, now, heartbeat_s)]
    for holder, count in said:
        if count != message.members:
            return Verdict(f"engine {engine!r} has {count} worker(s) as {_who(holder)} says; this registration says "
                           f"{message.members}", holder.agent_id, None)
    driven = [m for m in members if m.driven]
    live = [m for m in driven if _live(m, now, heartbeat_s)]
    if len(live) >= (message.members or 0):
        holder = min(live, key=lambda m: m.last_seen)  # the one that could fall silent first
        return _refused(f"engine {engine!r} has all its {message.members} worker(s) registered and alive "
                        f"({', '.join(_who(m) for m in live)}): another cannot join it.", holder, now, heartbeat_s)
    silent = sorted((m for m in driven if m not in live), key=lambda m: m.last_seen)
    surplus = len(driven) + 1 - (message.members or 0)
    return Verdict(replaces=tuple(m.agent_id for m in silent[:max(surplus, 0)]))
