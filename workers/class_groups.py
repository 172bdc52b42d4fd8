"""A trainer rank's sync groups of a sharded version (one generation): per class of receivers, its group with
them (this rank is the sender, rank 0; none for a class of colocated receivers only) and, with several owners,
the class's owners' group.

Every group of a generation is built once, all at once (each on its own thread and store connection): a class
whose receivers never come costs the connect timeout once, and only that class. A group that failed is not
built again in the same generation (its store keys would let a second try pass the members' rendezvous and
wait in the backend's own connect instead); the daemon starts a new generation after a failed version.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckpt_engine.control.messages import ClassLane
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.send.class_senders import Lane
from ckpt_engine.transport.group import SyncGroup

# (part of the generation's store, this rank's rank in it, the group's size) -> the group, built
BuildGroup = Callable[[str, int, int], SyncGroup]


@dataclass(frozen=True)
class ClassGroupsKey:
    """What a generation's class groups were built for: rebuilt only when it changes."""

    generation: int
    parts: tuple[str | None, ...]  # per class, its group's part (None: colocated receivers only)
    owner_rank: int | None  # this rank's rank among several owners (None: one owner)
    owners: int
    registration: str | None = None  # the agent id they were built under (a restarted daemon: a new store)


class ClassGroups:
    def __init__(self, key: ClassGroupsKey, lanes: Sequence[ClassLane], build: BuildGroup) -> None:
        """Build every group of ``lanes`` now, concurrently; a group that does not form is remembered as why."""
        self.key = key
        count = len(lanes)
        self.groups: list[SyncGroup | None] = [None] * count
        self.owner_groups: list[SyncGroup | None] = [None] * count
        self.failures: list[Exception | None] = [None] * count
        jobs: list[tuple[int, bool, str, int, int]] = []  # (class, owners' group?, part, rank, size)
        for index, (lane, part) in enumerate(zip(lanes, key.parts)):
            if part is not None:
                jobs.append((index, False, part, 0, 1 + len(lane.ranks)))
            if key.owner_rank is not None:
                jobs.append((index, True, lane.part + "owners/", key.owner_rank, key.owners))
        lock = threading.Lock()

        def run(job: tuple[int, bool, str, int, int]) -> None:
            index, owners, part, rank, size = job
            try:
                group = build(part, rank, size)
            except Exception as exc:  # noqa: BLE001 - kept as the class's failure, raised nowhere
                with lock:
                    self._failed(index, lanes[index], owners, exc)
                return
            with lock:
                (self.owner_groups if owners else self.groups)[index] = group

        threads = [threading.Thread(target=run, args=(job,), name=f"ckpt-class-rendezvous-{job[0]}", daemon=True)
                   for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()  # (each build is bounded by its connect timeout)

    def _failed(self, index: int, lane: ClassLane, owners: bool, exc: Exception) -> None:
        # (an owners' group's absent ranks are owner ranks, no receiver's: only its text is kept)
        failure = CkptEngineError(f"the owners' group did not form: {exc}") if owners else exc
        if self.failures[index] is None:
            self.failures[index] = failure

    @property
    def broken(self) -> bool:
        return any(g is not None and g.broken is not None for g in [*self.groups, *self.owner_groups])

    def lanes(self, lanes: Sequence[ClassLane]) -> tuple[Lane, ...]:
        """The route's classes: each with its groups, or with why they did not form."""
        return tuple(Lane(lane.key, lane.spec, group, tuple(lane.ranks), owners, lane.ipc_peers,
                          unreachable=failure, pulls=bool(lane.pullers))
                     for lane, group, owners, failure in zip(lanes, self.groups, self.owner_groups, self.failures))

    def close(self) -> None:
        for group in [*self.groups, *self.owner_groups]:
            if group is not None:
                group.close()
