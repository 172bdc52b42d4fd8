"""When regular versions go to whom: each receiver's own cadence (``sync_every``), and the pause that keeps
catch-ups from starving the training loop's versions. Pure: the caller passes the clock's reading."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_engine.server.decisions.agent_record import AgentRecord


def offer(receivers: list[AgentRecord]) -> list[AgentRecord]:
    """A regular version is offered to every candidate; those whose ``sync_every``-th offer this is take it."""
    due = [r for r in receivers if r.offered % r.sync_every == 0]
    for receiver in receivers:
        receiver.offered += 1
    return due


@dataclass
class CatchUpPause:
    """Holds new catch-ups back after a regular version was refused for a catch-up or repair in flight. The
    caller's retry gets two rendezvous bounds and a margin to go first, so newcomers that keep failing their
    catch-ups cannot starve the trainer's versions."""

    until: float = 0.0

    def sync_refused(self, now: float, connect_s: float) -> None:
        self.until = now + 2 * connect_s + 5

    def holds(self, now: float) -> bool:
        return now < self.until
