"""How a version's lifecycle differs by who drives the trainer: one lifecycle, two policies (pure data).

- ``PLAIN``: the daemon drives it and assigns every send and receive. A version needs ``min_receivers`` of its
  quorum. A request while one is in flight is refused (409). A rollback is a re-push, assigned at once.
  Receivers that hold no whole version are brought one (catch-up, repair).
- ``FRAMEWORK`` (verl): the framework moves the bytes on its own groups and schedule. The daemon numbers its
  syncs and judges the workers' own reports, but assigns nothing. A sync needs every worker it named. The
  framework runs one sync at a time, so opening the next supersedes one still open (its outcome unknown:
  interrupted). A rollback waits for the framework's next sync and is sent in its place. No catch-ups.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncPolicy:
    name: str
    assigns: bool  # the daemon assigns the sends and receives (else the framework's groups carry it)
    needs_every_receiver: bool  # commit only when every quorum member committed
    supersedes_open: bool  # opening the next version interrupts one still in flight (else 409)
    queues_rollbacks: bool  # a push waits for the next sync instead of starting a re-push now
    catches_up: bool  # receivers that hold no whole version are brought one from the cache

    def need(self, quorum: int, min_receivers: int) -> int:
        """Receivers that must commit a version of ``quorum`` members."""
        return quorum if self.needs_every_receiver else min(max(min_receivers, 1), quorum)


PLAIN = SyncPolicy("plain", assigns=True, needs_every_receiver=False, supersedes_open=False,
                   queues_rollbacks=False, catches_up=True)
FRAMEWORK = SyncPolicy("framework", assigns=False, needs_every_receiver=True, supersedes_open=True,
                       queues_rollbacks=True, catches_up=False)


def policy_of(framework: str | None) -> SyncPolicy:
    """The policy of a trainer registered with ``framework`` (None: the daemon drives it)."""
    return FRAMEWORK if framework is not None else PLAIN
