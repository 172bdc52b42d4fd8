"""Newcomers' admission. Pure: the time is an argument.

A registration that never proved itself joins a regular version directly where the cache cannot first bring it
one of its own (bypass_cpu deployments, or no cached version yet). If it then never joins the rendezvous,
everyone loses that version. Benching it is not enough: the bench is per registration, and registering again
starts afresh. So after a newcomer misses a version, newcomers wait out a gate, longer each time until one
proves itself. Receivers that proved themselves are never held back."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ckpt_engine.retry import Backoff

_GATE_BACKOFF = dict(initial_s=5.0, max_s=300.0)


@dataclass
class NewcomerGate:
    closed_until: float = 0.0
    reason: str | None = None
    backoff: Backoff = field(default_factory=lambda: Backoff(**_GATE_BACKOFF), repr=False)

    def admits(self, now: float) -> bool:
        """Whether receivers that never proved themselves may join regular versions now."""
        return now >= self.closed_until

    def missed(self, now: float, why: str) -> float:
        """A newcomer never joined a version it was in: newcomers wait, longer each time; returns how long."""
        delay = self.backoff.next_delay()
        self.closed_until, self.reason = now + delay, why
        return delay

    def proved(self) -> None:
        """A newcomer took a whole version: the gate opens at the next miss's shortest wait again."""
        self.backoff.reset()

    def public(self, now: float) -> dict:
        return {"newcomers_held_for_s": round(max(0.0, self.closed_until - now), 3) if not self.admits(now) else 0.0,
                "newcomers_held_because": self.reason if not self.admits(now) else None}


def blamed_for_rendezvous(named: Sequence[str], members: Sequence[str], proven: Collection[str]) -> list[str]:
    """Who is benched for a sync group that did not form. ``named``: whom the trainer saw absent; ``members``: the
    receivers of the groups that did not form; ``proven``: those that took a whole version under their
    registration. The store a group forms in takes any member's word: a member can publish a false address and
    so make a proven peer look absent. The unproven are therefore suspected first: the named ones, else every
    unproven member. Proven receivers are blamed only when no unproven one was there."""
    named_new = [a for a in named if a not in proven]
    if named_new:
        return named_new
    members_new = [a for a in members if a not in proven]
    return members_new or list(named)
