"""What an operator is shown of each receiver, from the records the HTTP API returns (pure): how far behind it
is, and the last thing that went wrong for it. The metrics (server/metrics.py), ``ckpt-engine status`` and the
operator page (server/page/page.js, which applies the same rules to the same JSON) show these.

Lag counts committed versions newer than the one a receiver serves, not ids: a failed or cancelled version
takes an id but brings nothing a receiver missed. The daemon computes it once, over its newest LAG_WINDOW
committed versions, and GET /receivers carries it (``lag``): every view shows that number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LAG_WINDOW = 100  # committed versions looked at: a receiver further behind shows this lag (it is far behind)


def receiver_name(rank: int) -> str:
    """How every view names a receiver of a version: ``receiver N``, N its rank in the version's quorum
    (ckpt_engine/ranks.py QuorumRank: 1.., the history entries' ``rank``). Reasons, the log, ``ckpt-engine
    version`` and the page use this name. Where a receiver is listed as an agent (GET /receivers,
    ``ckpt-engine status``, the page's receivers), it is named by its agent id, with the N of the newest version
    it was in."""
    return f"receiver {rank}"


def quorum_ranks(versions: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    """Each receiver's rank in the newest of ``versions`` (newest first) that had it in its quorum, with that
    version's id: ``{agent_id: (rank, version)}``. The N of ``receiver N`` can change as receivers come and go."""
    found: dict[str, tuple[int, int]] = {}
    for record in versions:
        for entry in record.get("receivers") or ():
            agent, rank = entry.get("agent_id"), entry.get("rank")
            if agent and isinstance(rank, int) and agent not in found:
                found[agent] = (rank, record["id"])
    return found


@dataclass(frozen=True)
class ReceiverRow:
    agent_id: str
    engine: str | None
    state: str
    serving: int | None
    lag: int | None  # None: it serves nothing, so no lag is meaningful (its state says why)
    last_error: str | None


def lag(serving: int | None, committed_ids: Iterable[int]) -> int | None:
    """Committed versions newer than ``serving``."""
    if serving is None:
        return None
    return sum(1 for version in committed_ids if version > serving)


def with_lag(agents: list[dict], committed_ids: Sequence[int]) -> list[dict]:
    """``agents`` (GET /receivers rows), each receiver with its ``lag`` against ``committed_ids``."""
    for row in agents:
        if row["role"] == "receiver":
            row["lag"] = lag(row.get("serving"), committed_ids)
    return agents


def last_errors(versions: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each receiver's newest failure in ``versions`` (newest first, as GET /versions lists them), as
    ``v<id>: <reason>``. Kept even when a later version succeeded: the receiver's state says whether it
    recovered, this says why it had to."""
    errors: dict[str, str] = {}
    for record in versions:
        for entry in record.get("receivers") or ():
            agent = entry.get("agent_id")
            if agent and not entry.get("ok") and agent not in errors:
                errors[agent] = f"v{record['id']}: {entry.get('reason') or 'failed'}"
    return errors


def receiver_rows(agents: Sequence[Mapping[str, Any]], versions: Sequence[Mapping[str, Any]]) -> list[ReceiverRow]:
    """One row per receiver of ``agents`` (GET /receivers), judged against ``versions`` (GET /versions)."""
    committed = [v["id"] for v in versions if v.get("status") == "committed"]
    errors = last_errors(versions)
    return [ReceiverRow(a["agent_id"], a.get("engine"), a.get("state", "new"), a.get("serving"),
                        a["lag"] if "lag" in a else lag(a.get("serving"), committed),  # (the daemon's, when given)
                        a.get("torn") or a.get("unable") or errors.get(a["agent_id"]))
            for a in agents if a.get("role") == "receiver"]


__all__ = ["LAG_WINDOW", "ReceiverRow", "lag", "last_errors", "quorum_ranks", "receiver_name", "receiver_rows",
           "with_lag"]
