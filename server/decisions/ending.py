"""When a version in flight is judged, how its trainer's stages move its status, and whom its end benches.
Pure: the flight's facts in, decisions out; ``server/flights.py`` carries them out and writes the history."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

# A version's status as its trainer reports stages; it never moves back.
STAGE_ORDER = {"requested": 0, "snapshotting": 1, "transferring": 2, "verifying": 3}


def advances(current: str | None, event: str) -> bool:
    """Whether the trainer's ``event`` (a stage) moves a version whose status is ``current`` forward."""
    return event in STAGE_ORDER and STAGE_ORDER[event] > STAGE_ORDER.get(current or "", 99)


def waiting_for(quorum: Mapping[str, int], reported: Collection[str], absent_ranks: Collection[int],
                registered: Collection[str], apply_sent: Iterable[str], applied: Collection[str],
                engines_with_driver: Collection[str]) -> list[str]:
    """Who the version still waits on once its trainer is done: every receiver of its quorum that is still
    registered, joined its rendezvous and has not reported its own outcome; every engine told to apply whose
    driver is still there and has not said how the apply went."""
    receivers = [a for a, rank in quorum.items() if a not in reported and rank not in absent_ranks and a in registered]
    return receivers + [e for e in apply_sent if e not in applied and e in engines_with_driver]


def unoffered_pullers(pullers: Collection[str], offered: bool, failed: bool) -> set[str]:
    """The pullers that will never be handed the version: the trainer's lead, or another owner rank, failed
    (``failed``) before every owner offered it. Nobody waits for them, and they still hold what they held."""
    return set() if offered or not failed else set(pullers)


def ready_to_judge(sent_digest: bool, waiting: list[str], since_done_s: float, ack_s: float,
                   pulling: Collection[str] = (), pull_s: float = 0.0) -> bool:
    """Once its trainer is done, a version is judged when nobody is waited on, or the acknowledgement time has
    passed since. Without a digest from the trainer nothing can commit: no need to hear the receivers. A puller
    may still be reading when the trainer is done (its offer came as soon as the version was cached, its
    digests once the trainer took them): while one is waited on, the wait is ``pull_s`` (what is left of the
    version's time, less an acknowledgement's) if that is longer."""
    if not sent_digest or not waiting:
        return True
    pulls = any(agent in pulling for agent in waiting)
    return since_done_s >= (max(ack_s, pull_s) if pulls else ack_s)


@dataclass(frozen=True)
class Benching:
    """Receivers out of the quorums for a while (longer each time), back only through a version of their own;
    ``unproven``: they also lose what proved them."""

    agents: tuple[str, ...]
    why: str
    unproven: bool = False


def benchings(version: int, *, heard_everyone: bool, silent: Iterable[str],
              unfit_classes: Iterable[tuple[Iterable[str], str]], absent: Iterable[str]) -> list[Benching]:
    """Whom a version's end benches:
    - the receivers silent about their outcome, where the daemon waited for every one (``heard_everyone``: the
      trainer sent a digest);
    - every member of a class whose shard spec does not fit the version (it would fail every version);
    - the receivers the failed rendezvous is laid at (decisions/newcomers.py ``blamed_for_rendezvous``)."""
    out = []
    if heard_everyone:
        out.append(Benching(tuple(silent), f"did not report its outcome of version {version}"))
    for members, reason in unfit_classes:
        out.append(Benching(tuple(members), f"its shard spec does not fit version {version}: {reason[:500]}"))
    out.append(Benching(tuple(absent), f"did not join the sync group of version {version}", unproven=True))
    return [b for b in out if b.agents]


def engine_to_apply(engine: str | None, engines: Mapping[str, Iterable[str]], settled: Collection[str],
                    staged: Mapping[str, int | None], version: int) -> bool:
    """Whether ``engine``'s driver is told to apply ``version`` now. The engine must be of the version's quorum,
    not yet told nor failed (``settled``), and every one of its workers must have staged this version.
    ``staged`` holds each still-registered worker's staged version: a gone worker is missing from it."""
    if engine is None or engine not in engines or engine in settled:
        return False
    members = list(engines[engine])
    return all(staged.get(m) == version for m in members)


def to_discard(engine: str | None, engines: Mapping[str, Iterable[str]], settled: Collection[str],
               failed_worker: str, reported: Collection[str]) -> list[str] | None:
    """The workers to tell to drop their staging after a driven worker failed the version. Its whole engine
    fails it, so the other workers that have not reported drop what they staged now, not at their take timeout.
    None where the engine does not fail anew: not of the quorum, already told to apply, or already failed
    (``settled``)."""
    if engine is None or engine not in engines or engine in settled:
        return None
    return [m for m in engines[engine] if m != failed_worker and m not in reported]
