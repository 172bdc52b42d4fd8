"""Rank numbers, one type per space they count in. A number of one space read in another once benched a healthy
receiver (a class group's rank 1 taken for the quorum's rank 1): convert only through the functions here or
the class lane's own map (send/class_senders.py ``Lane.quorum_rank``)."""

from __future__ import annotations

from typing import NewType

# A member's rank in one sync group: 0 is the sender, receivers 1..
GroupRank = NewType("GroupRank", int)
# A receiver's rank in a version's quorum (1..): what the daemon judges and benches by
QuorumRank = NewType("QuorumRank", int)


def plain_seat(rank: GroupRank) -> QuorumRank:
    """A plain version's groups (one per owner) seat every collective receiver at its quorum rank."""
    return QuorumRank(int(rank))
