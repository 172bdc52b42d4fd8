"""What each receiver of a version the daemon drives is assigned. Pure: the shell queues them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

from ckpt_engine.control.messages import Assignment, PullOffer
from ckpt_engine.server.decisions.agent_record import AgentRecord
from ckpt_engine.server.decisions.receiver_classes import ClassPlan


def receive_assignments(remote: Sequence[AgentRecord], colocated: Sequence[AgentRecord], quorum: Mapping[str, int],
                        classes: ClassPlan, ipc_name: str | None, common: Mapping[str, Any]
                        ) -> list[tuple[AgentRecord, Assignment]]:
    """Pushed receivers: each on the version's sync group, or its class's (the trainer and the receivers that keep
    the same slices); colocated ones through the trainer's hub. ``common``: what every assignment of the version
    says (version, mode, step, generation, world size, owners)."""
    out = []
    for receiver in remote:
        seat = classes.seats.get(receiver.agent_id)
        if seat is not None:
            out.append((receiver, Assignment(kind="receive", part=seat.part, rank=seat.rank,
                                             **{**common, "world_size": seat.world_size})))
        else:
            out.append((receiver, Assignment(kind="receive", rank=quorum[receiver.agent_id], **common)))
    out += [(receiver, Assignment(kind="receive", rank=quorum[receiver.agent_id], transport="ipc", ipc_name=ipc_name,
                                  **common)) for receiver in colocated]
    return out


def offer_problem(version: int, owners: int, rank: int, offer: PullOffer | None, offered: Set[int]) -> str | None:
    """Why trainer rank ``rank``'s offer cannot be one of the owners' offers of ``version`` (None: it can).
    Each owner rank offers its own share once; the lead's (rank 0's) also names the descriptor."""
    if offer is None:
        return "the report carries no offer"
    if offer.version != version:
        return f"it offers version {offer.version}"
    if not 0 <= rank < owners:
        return f"the version is owned by {owners} rank(s)"
    if rank in offered:
        return "this rank offered it already"
    if len(offer.sources) != 1:
        return f"an owner rank offers its own share (one source), not {len(offer.sources)}"
    if (offer.descriptor is not None or bool(offer.classes)) != (rank == 0):
        return "only the lead owner (rank 0) names the descriptor"
    if offer.descriptor is not None and offer.classes:
        return "a version is offered whole or by class, not both"
    return None


def joined_offer(version: int, owners: int, offers: Mapping[int, PullOffer]) -> PullOffer | None:
    """The owner ranks' offers (checked by ``offer_problem``) as the one offer the pullers get, once every owner
    has offered (None until then)."""
    if len(offers) < owners:
        return None
    return PullOffer(version=version, sources=[offers[rank].sources[0] for rank in range(owners)],
                     descriptor=offers[0].descriptor, classes=offers[0].classes)


def pull_assignments(version: int, mode: str, step: int | None, pullers: Mapping[str, int], offer: PullOffer,
                     classes: Mapping[str, str] | None = None) -> list[tuple[str, Assignment]]:
    """Pullers (agent id -> quorum rank): each gets the owners' joined offer, to read the version from it; in a
    sharded version (``classes``: each receiver's class key), with its class's descriptor alone. A puller whose
    class the trainer did not offer gets an offer without a descriptor: its pull fails saying so."""
    out = []
    for agent_id, rank in pullers.items():
        mine = offer
        if classes:
            mine = offer.model_copy(update={"classes": {}, "descriptor": offer.classes.get(classes.get(agent_id, ""))})
        out.append((agent_id, Assignment(kind="receive", version=version, mode=mode, step=step, rank=rank,
                                         transport="nixl", offer=mine)))
    return out
