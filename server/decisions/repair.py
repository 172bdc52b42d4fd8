"""Catch-up and repair: which receivers are brought a version of their own from the trainer's cache, which
version, and what the cache must keep for it. Pure: the agents, the history lookups and the time are
arguments.

A receiver that holds no whole version (new, torn, or of unknown state) is brought one as a re-push of its
own, without the training loop. A torn one gets the version it served last, known to work on it; the others
get the newest committed one. The workers of a driven engine are one model: they are due together and take
the same version. Versions receivers may need again stay in the cache (``kept_for_repairs``), so a run of
failed versions cannot push them out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckpt_engine.control.messages import MAX_KEPT
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.quorum import needs_catch_up

# version id -> the cached version holding its bytes (itself, or a re-push's source), or None when not cached
CachedSource = Callable[[int], "int | None"]
# version id -> the version holding its bytes (itself, or a re-push's source), cached or not; None: unknown
SourceOf = Callable[[int], "int | None"]


@dataclass(frozen=True)
class CatchUp:
    source: int  # the cached version to re-push
    receivers: tuple[AgentRecord, ...]
    purpose: str  # "repair" when one of them is torn, else "catch_up"


def repair_source(receiver: AgentRecord, latest_committed: int | None, cached_source: CachedSource) -> int | None:
    """The cached version that would bring ``receiver`` a whole model: a torn one the version it served last,
    when still cached; otherwise (and for the others) the newest committed one."""
    model = receiver.model
    if model.torn is not None and model.last_served is not None:
        own = cached_source(model.last_served)
        if own is not None:
            return own
    return cached_source(latest_committed) if latest_committed is not None else None


def plan_catch_up(pool: Sequence[AgentRecord], now: float, latest_committed: int | None,
                  cached_source: CachedSource) -> CatchUp | None:
    """Receivers of ``pool`` (those that can take a version now) that need one and are due, grouped by the
    version they need; the largest group is brought its version now, the others later."""
    def due(receiver: AgentRecord) -> bool:  # an engine's workers are due together
        peers = [m for m in pool if receiver.driven and m.driven and m.engine == receiver.engine] or [receiver]
        return all(m.model.catch_up_due <= now for m in peers)

    by_source: dict[int, list[AgentRecord]] = {}
    engine_source: dict[str, int | None] = {}
    for receiver in (r for r in pool if needs_catch_up(r, pool) and due(r)):
        if receiver.driven:  # one model: every worker takes the version its torn workers served last
            key = receiver.engine or ""
            if key not in engine_source:  # (its workers served the same versions: the driver's)
                engine_source[key] = repair_source(receiver, latest_committed, cached_source)
            source = engine_source[key]
        else:
            source = repair_source(receiver, latest_committed, cached_source)
        if source is not None:
            by_source.setdefault(source, []).append(receiver)
    if not by_source:
        return None
    source, receivers = max(by_source.items(), key=lambda item: len(item[1]))
    purpose = "repair" if any(r.model.torn is not None for r in receivers) else "catch_up"
    return CatchUp(source, tuple(receivers), purpose)


def kept_for_repairs(receivers: Sequence[AgentRecord], latest_committed: int | None, source_of: SourceOf, *,
                     limit: int = MAX_KEPT) -> list[int]:
    """Cached versions receivers may need again, at most ``limit`` (and MAX_KEPT): the newest committed one
    first (a catch-up sends it), then, newest first, the one each proven receiver serves or served last (a
    repair re-applies it). The trainer's cache never evicts them to make room. What a receiver only claims to
    hold (a newcomer's word) pins nothing, else any rollout-token holder could make the trainer keep old copies."""
    wanted = {v for r in receivers if r.model.proven for v in (r.model.serving, r.model.last_served)}
    sources = {source_of(v) for v in wanted | {latest_committed} if v is not None}
    newest = sorted((s for s in sources if s is not None), reverse=True)
    latest = source_of(latest_committed) if latest_committed is not None else None
    kept = ([latest] if latest is not None else []) + [s for s in newest if s != latest]  # the newest committed first
    return kept[: max(1, min(limit, MAX_KEPT))]
