"""The commit rule (pure): whether a version committed, judged from the receivers' own reports.

A version commits when all of these hold:
- The trainer sent it with the version's digest. For a new version that is what the trainer sent. For a
  re-push (rollback, catch-up, repair) it is what the history recorded for the source when it committed,
  never a digest recomputed from the cache now. A re-push the trainer did not send (it refused a changed
  copy, or failed first) commits nothing, whatever receivers say: the source's digest is public, so a
  receiver reporting it proves nothing.
- Enough receivers of its quorum reported, themselves, a digest equal to the version's: ``min_receivers``
  (at most the quorum), or every one under a policy that needs every receiver (a framework's sync). A
  receiver the trainer saw absent from the rendezvous received nothing, whatever it reports.
- No engine's driver failed to apply it: the workers of an engine succeed or fail together.
The trainer's relayed acknowledgements are evidence in the record, never a vote.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_engine.control.messages import ReceiverAck, Report
from ckpt_engine.server.decisions.views import receiver_name


@dataclass(frozen=True)
class Outcome:
    status: str  # committed | failed
    reason: str | None
    entries: list[dict]  # per quorum member, for the history
    stages: dict[str, float]
    committed: list[str]  # agent ids that committed it (they proved they hold a whole version)
    silent: list[str]  # quorum members that never reported their own outcome, absent ones excluded


def expected_digest(done: Report, source_digest: str | None, source: int | None) -> tuple[str | None, str | None]:
    """The digest receivers must have computed, and why the trainer's bytes are not the version's (None: they
    are). ``source``/``source_digest``: a re-push's source version and the digest recorded for it."""
    if source is None:
        return done.version_digest, None
    if done.version_digest is None:  # the trainer sent nothing (it refused its copy, or failed first)
        return None, None
    if done.version_digest != source_digest:
        return source_digest, (f"the trainer re-sent version {source} with digest {done.version_digest}, but it "
                               f"committed as {source_digest}: the cached copy changed since")
    return source_digest, None


def staging_entry(own: Report) -> dict | None:
    """Where a receiver held the version, why, and how long its engine was paused for it (as it said)."""
    if own.staging is None:
        return None
    return {"mode": own.staging, "why": own.staging_why, "pause_s": own.stages.get("pause")}


def receiver_verdict(own: Report | None, expected: str | None, wire_ack: ReceiverAck | None) -> tuple[bool, str | None]:
    """A receiver's verdict: its own report, with the digest it computed equal to the version's."""
    if own is None:
        seen = f" (the trainer saw: {wire_ack.reason or ('ok' if wire_ack.ok else 'failed')})" if wire_ack else ""
        return False, f"did not report its own outcome{seen}"
    if not own.ok:
        return False, own.reason or "failed"
    if expected is None:
        return False, "the trainer has no digest for this version"
    if own.version_digest != expected:
        return False, f"its digest {own.version_digest} differs from the version's {expected}"
    return True, None


def judge(quorum: Mapping[str, int], reports: Mapping[str, Report], done: Report, *,
          engines: Mapping[str, Sequence[str]], applied: Mapping[str, Report], owner_failures: Mapping[int, str],
          transports: Mapping[str, str | None], expected: str | None, stale: str | None, need: int,
          expected_for: Mapping[str, str | None] | None = None, unoffered: Collection[str] = ()) -> Outcome:
    """The version's outcome: ``need`` receivers must have committed it (see the module's rule).
    ``expected_for``: a sharded version's digest per receiver (its class's pieces); ``expected`` is then the
    version's identity (its full tensors), which must exist for anything to commit. ``unoffered``: pullers
    that were never handed the version (the trainer failed first): no report was due from them."""
    wire = {ack.rank: ack for ack in done.receivers}
    absent = set(done.absent_ranks)
    stages = dict(done.stages)
    entries: list[dict[str, Any]] = []
    for agent_id, rank in quorum.items():
        own = reports.get(agent_id)
        mine = expected_for.get(agent_id) if expected_for is not None else expected
        ok, reason = receiver_verdict(own, mine, wire.get(rank))
        if rank in absent:
            ok, reason = False, "it never joined the version's sync group (the trainer saw it absent)"
        if agent_id in unoffered and own is None:
            ok, reason = False, "never offered: the trainer failed before every owner offered the version"
        entries.append({"rank": rank, "agent_id": agent_id, "transport": transports.get(agent_id), "ok": ok,
                        "reason": reason, "version_digest": own.version_digest if own else None,
                        "seconds": own.stages if own else {},
                        "missing_report": own is None and agent_id not in unoffered,
                        "staging": staging_entry(own) if own else None})
        for stage in ("load", "verify"):
            seconds = own.stages.get(stage) if own else None
            if seconds is not None:
                stages[stage] = max(stages.get(stage, 0.0), seconds)
    _engines_together(engines, applied, entries)
    committed = [e["agent_id"] for e in entries if e["ok"]]
    ok = expected is not None and stale is None and len(committed) >= need
    failures = [e for e in entries if not e["ok"]]
    if ok:  # (an owner rank's own failure after every receiver verified its bytes: said, not decisive)
        notes = [f"{receiver_name(e['rank'])}: {e['reason']}" for e in failures] + [
            f"owner rank {rank} failed afterwards: {why}" for rank, why in sorted(owner_failures.items())]
        reason = f"committed by {len(committed)} of {len(quorum)} receivers; " + "; ".join(notes) if notes else None
    else:
        reason = _failure_reason(done, failures, owner_failures, stale) or \
            f"{len(committed)}/{len(quorum)} receivers committed, {need} needed"
    return Outcome("committed" if ok else "failed", reason, entries, stages, committed if ok else [],
                   [a for a, rank in quorum.items() if a not in reports and rank not in absent and a not in unoffered])


def _engines_together(engines: Mapping[str, Sequence[str]], applied: Mapping[str, Report], entries: list[dict]) -> None:
    for engine, members in engines.items():
        mine = [e for e in entries if e["agent_id"] in members]
        failed = [e for e in mine if not e["ok"]]
        done = applied.get(engine)
        paused = done.stages.get("pause") if done is not None else None
        for entry in mine:  # an engine is paused by its driver: its pause is the driver's
            if paused is not None and entry["staging"] is not None:
                entry["staging"] = {**entry["staging"], "pause_s": paused}
        if done is not None and not done.ok:
            why = f"engine {engine} driver: {done.reason}"
        elif failed:
            why = f"engine {engine}: {receiver_name(failed[0]['rank'])} failed"
        else:
            continue
        for entry in mine:
            if entry["ok"]:
                entry.update(ok=False, reason=why)


def _failure_reason(done: Report, failures: list[dict], owner_failures: Mapping[int, str], stale: str | None) -> str:
    """Each cause once: the trainer's, other owner ranks', then each receiver's. The receiver failures the
    trainer relays are left out: the receivers' own reports say them better. A receiver told of the sender's
    abort would repeat the sender's reason, so it is said once, by the sender."""
    # The library names a receiver by its sync-group rank: a trainer's "rank N: ..." is receiver N's failure.
    judged = {prefix for e in failures for prefix in (f"rank {e['rank']}:", f"{receiver_name(e['rank'])}:")}
    trainer = [part for part in (done.reason or "").split("; ") if not done.ok and part
               and not any(part.startswith(prefix) for prefix in judged)]
    owners = [f"owner rank {rank}: {why}" for rank, why in sorted(owner_failures.items())]
    receivers = [f"{receiver_name(e['rank'])}: " + ("aborted by the sender" if done.reason and e["reason"]
                                          and done.reason in e["reason"] else e["reason"]) for e in failures]
    return "; ".join(dict.fromkeys(filter(None, [stale, *trainer, *owners, *receivers])))
