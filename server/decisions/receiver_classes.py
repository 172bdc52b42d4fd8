"""Receiver classes of a sharded version (pure). Receivers that keep the same slices (the same shard spec key)
share one stream of exactly their bytes, on a sync group of their own. The trainer is rank 0 of every class's
group; a class's receivers are ranks 1.., in their order in the version's quorum. Receivers on the trainer's
host take the same-host path instead, each class through shared slots of its own."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ckpt_engine.control.messages import ClassDone, ClassLane
from ckpt_engine.server.decisions.agent_record import AgentRecord


class Seat(NamedTuple):
    """A receiver's place in a sharded version: its class, its class group's part, its rank there and the
    group's size."""

    key: str
    part: str
    rank: int
    world_size: int


@dataclass(frozen=True)
class ClassPlan:
    lanes: list[ClassLane]  # what the trainer sends, class by class
    seats: dict[str, Seat]  # by receiver agent id: the receivers on their class's group
    keys: dict[str, str]  # by receiver agent id: its class's key (also the colocated receivers')

    def key_of(self, agent_id: str) -> str | None:
        return self.keys.get(agent_id)


NO_CLASSES = ClassPlan([], {}, {})


def plan_lanes(receivers: Sequence[AgentRecord], quorum: Mapping[str, int],
               colocated: Collection[str] = (), pulling: Collection[str] = ()) -> ClassPlan:
    """The classes of a version sent to ``receivers`` (ranks in ``quorum``). None when no receiver declared a
    shard spec (a plain version); else one per distinct spec, and receivers without one form the class of whole
    tensors. Classes are ordered by their first receiver's rank, so the parts stay stable while the quorum
    does. The ``colocated`` receivers (agent ids) take the same-host path and the ``pulling`` ones read their
    pieces over nixl: no seat in their class's group."""
    if not any(r.shard_spec for r in receivers):
        return NO_CLASSES
    grouped: dict[str, list[AgentRecord]] = {}
    for receiver in sorted(receivers, key=lambda r: quorum[r.agent_id]):
        grouped.setdefault(receiver.shard_key, []).append(receiver)  # ("whole" without a spec)
    lanes, seats, keys = [], {}, {}
    for index, (key, members) in enumerate(grouped.items()):
        part = f"class-{index}/"
        remote = [m for m in members if m.agent_id not in colocated and m.agent_id not in pulling]
        lanes.append(ClassLane(key=key, part=part, spec=members[0].shard_spec or {},
                               ranks=[quorum[m.agent_id] for m in remote],
                               ipc_peers={m.agent_id: quorum[m.agent_id] for m in members if m.agent_id in colocated},
                               pullers=[quorum[m.agent_id] for m in members if m.agent_id in pulling]))
        for seat, member in enumerate(remote, start=1):
            seats[member.agent_id] = Seat(key, part, seat, 1 + len(remote))
        keys.update({m.agent_id: key for m in members})
    return ClassPlan(lanes, seats, keys)


def expected_by_receiver(plan: ClassPlan, classes: Sequence[ClassDone]) -> dict[str, str | None]:
    """Each receiver's expected digest: its class's, as the trainer sent it. A class the trainer sent whole has
    its digest also when the class's send failed for some of its receivers (one dropped, one that did not
    acknowledge): the others verified those very bytes. None where it never got that far."""
    digests = {c.key: c.version_digest for c in classes}
    return {agent_id: digests.get(key) for agent_id, key in plan.keys.items()}
