"""The owners' votes of a version several trainer ranks own (plan/owners.py), on their own group.

    ready  before the first bucket: every owner prepared its share (and shares what every owner's plan needs:
           a sparse version's digests and base, so all plan the same changes); the plans must be equal
    sent   after the last: every owner sent its buckets (and every bucket's digests, for the trailer)

A vote carries a flag and int64 values; an owner that votes no first leaves its reason in the group's store,
so the lead's abort names it. When an owner fails, or the vote itself does (an owner died, stalled or left),
the lead aborts the version for the receivers (they never load it) and every owner raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import xxhash

from ckpt_engine.errors import CkptEngineError, ConfigError, ProtocolError
from ckpt_engine.plan.modes import MODES
from ckpt_engine.transport.group import SyncGroup, absent_of

if TYPE_CHECKING:
    from ckpt_engine.send.sources import Source

log = logging.getLogger(__name__)
AbortReceivers = Callable[["Source", str], None]


class Aborted(CkptEngineError):
    """The version was abandoned part way (the lead told the receivers why)."""


class NotReady(CkptEngineError):
    """An owner could not prepare the version: nothing of it went out (the lead told the receivers)."""


class OwnersVote:
    def __init__(self, group: SyncGroup | None, abort_receivers: AbortReceivers) -> None:
        """``group``: the owner ranks' group (None: this rank is the version's only owner)."""
        self.group = group
        self.rank = group.rank if group is not None else 0
        self._abort_receivers = abort_receivers

    def ready(self, source: Source, algo: str, device: torch.device) -> list[list[int]] | None:
        """Prepare, and with several owners vote that every one is ready; what every owner told (for
        ``source.plan``), or None for a version of one owner."""
        if self.group is None:
            if source.owners.ranks != 1:  # before anything goes out: receivers would wait for other owners
                reason = (f"version {source.version} is planned for {source.owners.ranks} owner ranks, but this "
                          "sender has no owners' group (attach one, or publish without ownership)")
                self._abort_receivers(source, reason)
                raise ConfigError(reason)
            try:
                source.prepare(algo, device, self.rank)  # type: ignore[arg-type]
            except Exception as exc:  # nothing went out: tell the receivers now, not at their timeout
                self._abort_receivers(source, f"version {source.version} could not be prepared: "
                                              f"{type(exc).__name__}: {exc}")
                raise
            return None
        try:
            if source.owners.ranks != self.group.world_size:
                raise ConfigError(f"it is planned for {source.owners.ranks} owner ranks, the owners' group has "
                                  f"{self.group.world_size}")
            told = source.prepare(algo, device, self.rank)  # type: ignore[arg-type]
        except Exception as exc:
            self.group.say(f"why/{source.version}", f"{type(exc).__name__}: {exc}")
            self._vote_or_abort(source, False, [], "ready")
            raise NotReady(f"owner rank {self.rank} could not prepare version {source.version}: "
                           f"{type(exc).__name__}: {exc}") from exc
        plan = _plan_words(source)
        votes = self._vote_or_abort(source, True, [*plan, *told], "ready")
        self._end_if_failed(source, votes, "could not prepare", NotReady)
        differ = [rank for rank, (_, values) in enumerate(votes) if values[: len(plan)] != plan]
        if differ:  # each owner would send its buckets of another plan: refused before any bucket goes out
            reason = (f"owner rank(s) {differ} planned version {source.version} differently from owner rank "
                      f"{self.rank} (tensor names, order, dtypes or shapes, the owner count, or the mode differ)")
            self._abort_receivers(source, reason)
            raise NotReady(reason)
        return [values[len(plan):] for _, values in votes]

    def sent(self, source: Source, mine: list[int]) -> list[int]:
        """Every bucket's digests in the version's order: this rank's own, or with several owners everyone's
        (after they all sent their buckets). When an owner failed, the lead aborts the version."""
        if self.group is None:
            return mine
        votes = self._vote_or_abort(source, True, mine, "sent")
        self._end_if_failed(source, votes, "could not send their buckets of", Aborted)
        layout, owners = source.layout, source.owners
        cursors = [0] * owners.ranks
        digests: list[int] = []
        for bucket in layout.buckets:
            owner = owners.of[bucket.index]
            values = votes[owner][1]
            digests.extend(values[cursors[owner] : cursors[owner] + len(bucket.slots)])
            cursors[owner] += len(bucket.slots)
        return digests

    def stand_down(self, version: int, reason: str) -> None:
        """This rank will not send ``version`` at all: it says so, with its reason, in both votes the other
        owners wait in (before the first bucket and after the last)."""
        if self.group is None:
            return
        self.group.say(f"why/{version}", reason)
        try:
            self.vote(version, False, [], "ready")
        except CkptEngineError as exc:
            log.warning("version %d: the owners' ready vote failed: %s", version, exc)
            return
        self.failed(version, reason)

    def failed(self, version: int, reason: str, what: str = "sent") -> None:
        """This rank failed (between the votes, or before the first): say so in the vote the others wait in,
        with its reason (best effort)."""
        if self.group is not None:
            self.group.say(f"why/{version}", reason)
        try:
            self.vote(version, False, [], what)
        except CkptEngineError as exc:
            log.warning("version %d: could not tell the other owners that this one failed (%s): %s", version,
                        reason, exc)

    def vote(self, version: int, ok: bool, values: list[int], what: str) -> list[tuple[bool, list[int]]]:
        """One exchange among the owners: each says whether it is fine, with its values."""
        if self.group is None:
            return [(ok, values)]
        told = self.group.exchange_ints([version, int(ok), *values], f"version {version}: owners {what}",
                                        round_id=(what, version))
        out = []
        for rank, entry in enumerate(told):
            if len(entry) < 2 or entry[0] != version:
                raise ProtocolError(f"owner rank {rank} voted on version {entry[0] if entry else '?'}, not {version}")
            out.append((bool(entry[1]), entry[2:]))
        return out

    def _end_if_failed(self, source: Source, votes: list[tuple[bool, list[int]]], what: str,
                       error: type[CkptEngineError]) -> None:
        """When an owner voted no, the lead aborts the version for the receivers; every owner raises."""
        failed = [rank for rank, (ok, _) in enumerate(votes) if not ok]
        if not failed:
            return
        why = self.group.heard(f"why/{source.version}", failed) if self.group is not None else {}
        said = "".join(f"; owner rank {rank}: {text}" for rank, text in sorted(why.items()))
        reason = f"owner rank(s) {failed} {what} version {source.version}{said}"
        self._abort_receivers(source, reason)
        raise error(reason)

    def _vote_or_abort(self, source: Source, ok: bool, values: list[int], what: str) -> list[tuple[bool, list[int]]]:
        """A vote; when the vote itself fails (an owner died, stalled or left), the lead tells the receivers
        why instead of leaving them to their timeout."""
        try:
            return self.vote(source.version, ok, values, what)
        except CkptEngineError as exc:
            absent = list(absent_of(exc))
            who = f"owner rank(s) {absent} did not come" if absent else "an owner rank died, stalled or left"
            reason = f"the owners' {what} vote of version {source.version} failed ({who}): {exc}"
            self._abort_receivers(source, reason)
            raise Aborted(reason) from exc


def _plan_words(source: Source) -> list[int]:
    """What every owner of a version must have planned alike, as int64 words for the owners' vote."""
    def word(text: str) -> int:
        return xxhash.xxh3_64_intdigest(text.encode()) >> 2  # fits int64
    return [word(source.layout.digest), source.owners.ranks, word(source.owners.digest), MODES.index(source.mode)]
