"""Who takes a version: the quorum rule, and what follows from it (owners, transports, sparse base). Pure: the
agents and the time are arguments.

A receiver joins a regular version when it is heard from (within its poll wait and half a heartbeat), able
to receive (not benched) and not a framework's (verl's workers take only verl's own syncs). A worker of a
driven engine joins only when all its engine's workers qualify too and its driver is heard from: an engine is one
model, in or out whole. A receiver that holds no whole version (new, torn, or of unknown state) is first
brought one alone from the cache (catch-up, repair) whenever the cache can, so one that cannot receive fails
no one else's version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ckpt_engine.control.messages import MAX_CLASSES
from ckpt_engine.server.decisions.agent_record import AgentRecord

# (a receiver) -> the cached version a repair or catch-up would bring it, or None when the cache has none
RepairSource = Callable[[AgentRecord], "int | None"]


def heard(agent: AgentRecord, now: float, heartbeat_s: float) -> bool:
    return agent.heartbeating(now, heartbeat_s)


def engine_ready(receiver: AgentRecord, ready: Sequence[AgentRecord], driver: AgentRecord | None, now: float,
                 heartbeat_s: float) -> bool:
    """Every worker of the receiver's engine is ready and its driver is heard from."""
    members = [m for m in ready if m.engine == receiver.engine and m.driven]
    return driver is not None and heard(driver, now, heartbeat_s) and len(members) == receiver.members


def needs_catch_up(receiver: AgentRecord, pool: Sequence[AgentRecord]) -> bool:
    """Whether it holds no whole version proven under this registration (a driven worker: whether any worker
    of its engine holds none). What a newcomer says it holds is a claim until a version of its own proves it."""
    if not receiver.driven:
        return not receiver.model.whole()
    return any(not m.model.whole() for m in pool if m.engine == receiver.engine and m.driven)


def candidates(receivers: Sequence[AgentRecord], drivers: Mapping[str, AgentRecord], now: float, heartbeat_s: float, *,
               regular: bool, repair_source: RepairSource, admit_new: bool = True,
               min_receivers: int = 1) -> list[AgentRecord]:
    """Receivers that can be put into a quorum now. For a ``regular`` version this leaves out those a catch-up
    can bring a version first and, unless ``admit_new``, those that never proved themselves. Of the rest, only
    as many newcomers as ``few_newcomers`` lets in join (see decisions/newcomers.py)."""
    ready = [r for r in receivers if heard(r, now, heartbeat_s) and r.model.able(now) and r.framework is None]
    whole = [r for r in ready if not r.driven or engine_ready(r, ready, drivers.get(r.engine or ""), now,
                                                              heartbeat_s)]
    if not regular:
        return whole
    regular_ones = [r for r in whole if not (needs_catch_up(r, whole) and repair_source(r) is not None)
                    and (admit_new or r.model.proven)]
    return few_newcomers(regular_ones, min_receivers)


def _newcomer_unit(receiver: AgentRecord) -> str:
    """What joins as one: a driven engine's workers together, else the receiver alone."""
    return f"engine {receiver.engine}" if receiver.driven and receiver.engine else receiver.agent_id


def few_newcomers(receivers: Sequence[AgentRecord], min_receivers: int) -> list[AgentRecord]:
    """``receivers`` with only as many newcomers as a version needs, besides the proven ones, to reach
    ``min_receivers``, and at least one. A newcomer has not proved itself under its registration; an engine's
    workers count as one. Few are let in so that a newcomer that never joins costs one version, not every one.
    With no proven receiver (a fresh deployment) every newcomer joins. Fresh registrations go first, then those
    benched before, each in registration order."""
    proven = [r for r in receivers if r.model.proven]
    if not proven:
        return list(receivers)
    order: list[str] = []
    for r in sorted((r for r in receivers if not r.model.proven), key=lambda r: (r.model.unable is not None, r.seq)):
        if _newcomer_unit(r) not in order:
            order.append(_newcomer_unit(r))
    admitted = set(order[: max(1, min_receivers - len(proven))])
    return [r for r in receivers if r.model.proven or _newcomer_unit(r) in admitted]


def why_out(receiver: AgentRecord, receivers: Sequence[AgentRecord], drivers: Mapping[str, AgentRecord], now: float,
            heartbeat_s: float, repair_source: RepairSource, held_new: str | None = None) -> str:
    """Why a registered receiver is not in a quorum now (what an operator needs to act on). ``held_new``: why
    newcomers are held back now (None: they are not)."""
    model = receiver.model
    if not heard(receiver, now, heartbeat_s):
        return f"silent for {now - receiver.last_seen:.1f}s"
    if not model.able(now):
        return f"out for {model.unable_until - now:.0f}s more: {model.unable}"
    if receiver.framework is not None:
        return f"a {receiver.framework} worker (takes only {receiver.framework}'s own syncs)"
    if model.torn is not None:
        return f"torn ({model.torn}); it is repaired from the cache first"
    driver = drivers.get(receiver.engine or "")
    ready = [m for m in receivers if heard(m, now, heartbeat_s) and m.model.able(now)]
    if receiver.driven and not engine_ready(receiver, ready, driver, now, heartbeat_s):
        live = sum(1 for m in receivers if m.engine == receiver.engine and m.driven and heard(m, now, heartbeat_s))
        said = "missing" if driver is None else "silent" if not heard(driver, now, heartbeat_s) else "alive"
        return (f"engine {receiver.engine} is incomplete: {live} of {receiver.members} worker(s) heard from, "
                f"driver {said}")
    if needs_catch_up(receiver, [receiver]) and repair_source(receiver) is not None:
        return "new here: it takes a version of its own from the cache first (catch-up)"
    if held_new is not None and not model.proven:
        return f"new here, and newcomers are held back for now: {held_new}"
    if not model.proven:
        return "new here: it joins a regular version when its turn comes (one newcomer per version)"
    return f"not due (sync_every {receiver.sync_every})"


def quorum_problem(trainer: AgentRecord | None, receivers: Sequence[AgentRecord], everyone: Sequence[AgentRecord],
                   drivers: Mapping[str, AgentRecord], min_receivers: int, now: float, heartbeat_s: float,
                   repair_source: RepairSource, held_new: str | None = None) -> str | None:
    """Why a version cannot start with these receivers (None: it can)."""
    if trainer is None:
        return "no trainer agent (role trainer, rank 0) is registered"
    if not heard(trainer, now, heartbeat_s):
        return (f"trainer agent {trainer.agent_id} has not been heard from for {now - trainer.last_seen:.1f}s "
                "(stalled or cut off?)")
    need = max(min_receivers, 1)
    if len(receivers) >= need:
        return None
    out = [f"receiver {r.agent_id}: {why_out(r, everyone, drivers, now, heartbeat_s, repair_source, held_new)}"
           for r in everyone if r not in receivers]
    return (f"{len(receivers)} receiver(s) registered, heartbeating and able to receive, at least {need} needed "
            f"(min_receivers); " + ("; ".join(out) if out else "no receiver is registered"))


def sparse_base(receivers: Sequence[AgentRecord]) -> int | None:
    """The version every receiver of the quorum serves whole, if they all serve the same one, else None. A
    new, torn, lagging or unsettled receiver makes it a full version, and so does an engine that takes only
    whole versions. Each class of a sharded version then gets the pieces that changed since the base."""
    if any(r.whole_versions for r in receivers):
        return None
    held = {r.model.serving for r in receivers}
    return held.pop() if len(held) == 1 else None


def sharded(receivers: Sequence[AgentRecord]) -> bool:
    """Whether some receiver keeps only slices (a shard spec), which makes the version sharded. Each class of
    receivers then gets only its pieces, on sync groups of its own (one per owner). The pieces are cut from
    the trainer ranks' caches, or with bypass_cpu from their buckets as they are gathered. Colocated receivers
    take the same-host path, each class through shared slots of its own."""
    return any(r.shard_spec for r in receivers)


def within_class_limit(receivers: Sequence[AgentRecord]) -> list[AgentRecord]:
    """The receivers a version can carry. A sharded version carries at most MAX_CLASSES classes: those of
    receivers that proved themselves first, then in registration order. The others wait for a later version,
    so registrations that never take part (a flood of distinct specs) are benched one version each and cannot
    hold every version back."""
    if not sharded(receivers):
        return list(receivers)
    kept: set[str] = set()
    for receiver in sorted(receivers, key=lambda r: (not r.model.whole(), r.seq)):
        if len(kept) < MAX_CLASSES:
            kept.add(receiver.shard_key)
    return [r for r in receivers if r.shard_key in kept]


def owners_for(trainer: AgentRecord, trainers: Mapping[int, AgentRecord], source_owners: int | None, transport: str,
               now: float, heartbeat_s: float) -> int:
    """How many trainer ranks own shares of a version. A re-push has as many as its source had. A new one has
    every rank of the trainer job when each rank's agent is heard from and ``transport`` is not ``ipc`` (the
    same-host path only); otherwise one: rank 0 sends everything and the others only gather. (Pullers read each
    bucket from the rank that owns it.)"""
    if source_owners is not None:
        return source_owners
    ranks = trainer.trainer_ranks
    if ranks <= 1 or transport == "ipc":
        return 1
    return ranks if all(r in trainers and heard(trainers[r], now, heartbeat_s) for r in range(ranks)) else 1


def transports(trainer: AgentRecord, receivers: Sequence[AgentRecord], owners: int, transport: str
               ) -> tuple[list[AgentRecord], str | None]:
    """Which receivers take the same-host path (shared memory / CUDA IPC) under ``transport``, and why the
    version cannot go (None: it can). None do when several trainer ranks own the version: each sends on its own
    sync group. A sharded version's colocated receivers take it through shared slots of their class."""
    if owners > 1:
        if transport == "ipc":
            return [], f"transport is ipc, but this version is owned by {owners} trainer ranks"
        return [], None
    colocated = [r for r in receivers if transport in ("auto", "ipc") and colocatable(trainer, r)]
    if transport == "ipc" and len(colocated) < len(receivers):
        far = [r.agent_id for r in receivers if r not in colocated]
        return [], f"transport is ipc, but receiver(s) {far} are not on the trainer's host with its device kind"
    return colocated, None


def pullers(receivers: Sequence[AgentRecord], transport: str, mode: str) -> tuple[list[AgentRecord], str | None]:
    """Which receivers pull the version over NIXL from the trainer (``transport: nixl``: every one; else those
    that asked to), and why it cannot go that way. They read the cache, or a bypass_cpu version's send slots."""
    pulling = list(receivers) if transport == "nixl" else [r for r in receivers if r.pulls]
    if not pulling:
        return [], None
    who = "transport is nixl" if transport == "nixl" else f"receiver(s) {[r.agent_id for r in pulling]} pull"
    if mode != "cached" and sharded(receivers):
        return [], (f"{who}, which reads a sharded version's pieces out of the cache only (a sharded bypass_cpu "
                    "version: push it, collective or ipc)")
    return pulling, None


def colocatable(trainer: AgentRecord, receiver: AgentRecord) -> bool:
    """Same kernel and network namespace, and the same kind of device where IPC exists (CPU, CUDA)."""
    kind = trainer.device.split(":")[0]
    return (trainer.host_id is not None and receiver.host_id == trainer.host_id
            and receiver.device.split(":")[0] == kind and kind in ("cpu", "cuda"))
