"""What the daemon knows of one receiver's model, as one state machine (pure: the time is an argument).

States (the names ``/receivers``, the history and the docs use):

    new      it holds no whole version the daemon knows of: just registered (what it says it holds is a claim
             until a version of its own proves it), or its outcome of a version was never heard. It is brought
             a version from the cache alone (catch-up) before it joins anyone else's.
    serving  it holds version ``serving`` whole, taken under this registration (proven).
    staged   a driven worker (an engine of several) verified a version and waits for its engine's driver;
             its model still holds what it served.
    torn     an apply failed part way: it holds no whole version and serves nothing until a repair (the
             version it served last, from the trainer's cache) is applied whole.
    unable   it is out of the quorums until ``unable_until`` (it said it cannot receive, it never joined a
             version's rendezvous, or it was silent about its outcome); back through a version of its own.

Every move is one method below; ``MOVES`` lists them (docs/architecture.md shows the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt_engine.retry import Backoff

NEW, SERVING, STAGED, TORN, UNABLE = "new", "serving", "staged", "torn", "unable"
STATES = (NEW, SERVING, STAGED, TORN, UNABLE)
_UNABLE_BACKOFF = dict(initial_s=5.0, max_s=300.0)
_REPAIR_BACKOFF = dict(initial_s=1.0, max_s=120.0)

# event -> what it does (the one list of moves; the methods of ReceiverModel carry them out)
MOVES: dict[str, str] = {
    "registered": "-> new (a version it says it holds is kept as a claim, not proof)",
    "took": "its own report says a version verified and applied -> serving (a driven worker: stays, see applied)",
    "staged": "a driven worker of the version's quorum verified it -> staged",
    "unstaged": "the version it staged ended without its driver's apply -> back to what it holds",
    "applied": "its engine's driver applied the staged version -> serving",
    "refused": "it refused or could not verify a version, nothing changed -> it holds what it says it holds",
    "tore": "an apply failed part way -> torn (its last served version is what a repair brings)",
    "lost_track": "a version ended without its outcome -> new (what it holds is unknown until a whole one)",
    "proved": "a version committed with it in it -> serving counts as proven",
    "benched": "it cannot receive, missed a rendezvous, or was silent -> unable until a time (longer each time)",
    "catch_up_failed": "a catch-up or repair ended without it whole -> tried again after a backoff",
}


@dataclass
class ReceiverModel:
    serving: int | None = None  # the version it holds whole, as far as the daemon knows
    last_served: int | None = None  # the last version it held whole (a repair re-applies it)
    staged: int | None = None  # driven: verified, waiting for the driver
    torn: str | None = None  # why it holds no whole version
    proven: bool = False  # it took a whole version under this registration
    unable: str | None = None  # why it cannot receive now
    unable_until: float = 0.0
    catch_up_due: float = 0.0  # when to (re)try bringing it a version of its own
    catch_up_attempts: int = 0
    unable_backoff: Backoff = field(default_factory=lambda: Backoff(**_UNABLE_BACKOFF), repr=False)
    catch_up_backoff: Backoff = field(default_factory=lambda: Backoff(**_REPAIR_BACKOFF), repr=False)

    # ---- what it is now ---------------------------------------------------------------------------
    def state(self, now: float) -> str:
        if self.torn is not None:
            return TORN
        if self.unable is not None and now < self.unable_until:
            return UNABLE
        if self.staged is not None:
            return STAGED
        return SERVING if self.serving is not None and self.proven else NEW

    def able(self, now: float) -> bool:
        return self.unable is None or now >= self.unable_until

    def whole(self) -> bool:
        """It holds a whole version it proved under this registration (it may join regular versions)."""
        return self.serving is not None and self.proven

    # ---- moves ---------------------------------------------------------------------------------------
    def registered(self, claimed: int | None, now: float, settle_s: float) -> None:
        self.serving = self.last_served = claimed
        self.catch_up_due = now + settle_s  # one that vanishes at once costs nothing

    def took(self, version: int, *, driven: bool) -> None:
        self.staged, self.torn, self.unable = None, None, None
        self.unable_backoff.reset()
        if not driven:  # a driven worker's model is its engine's: only the driver's outcome says it serves
            self.serving = self.last_served = version
            self.catch_up_attempts = 0

    def staged_version(self, version: int) -> None:
        self.staged = version

    def unstaged(self) -> None:
        self.staged = None

    def applied(self, version: int) -> None:
        self.serving = self.last_served = version
        self.torn, self.staged = None, None

    def refused(self, holds: int | None, *, driven: bool) -> None:
        self.staged = None
        if not driven:
            self.serving = holds

    def tore(self, reason: str) -> None:
        if self.torn is None:  # a fresh tear: repaired at once, then with backoff
            self.catch_up_attempts, self.catch_up_due = 0, 0.0
            self.catch_up_backoff.reset()
        self.torn, self.serving, self.staged = reason, None, None

    def lost_track(self) -> None:
        self.serving = None

    def proved(self) -> None:
        self.proven = True

    def benched(self, reason: str, now: float, *, unproven: bool = False) -> float:
        """Out of the quorums for a while, longer each time; returns for how long."""
        delay = self.unable_backoff.next_delay()
        self.unable, self.unable_until = reason, now + delay
        if unproven:
            self.proven = False
        return delay

    def catch_up_failed(self, now: float) -> None:
        self.catch_up_attempts += 1
        self.catch_up_due = now + self.catch_up_backoff.next_delay()

    def public(self, now: float) -> dict:
        return {"state": self.state(now), "serving": self.serving, "staged": self.staged, "torn": self.torn,
                "proven": self.proven, "unable": self.unable,
                "unable_for_s": round(max(0.0, self.unable_until - now), 3) if self.unable else None}
