"""A hostile peer with valid credentials: what a holder of the rollout token could send, well-formed.

Used by the fault trials (``hostile_peer``) and by tests/test_fuzz_zmq.py. Every message passes the
schemas; the point is what it claims: versions the daemon never issued, events of another role, other
agents' ids with guessed sessions, requests its role may not make.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from ckpt_engine.control.messages import MAX_ID


def hostile_messages(rng: random.Random, victims: list[str], mine: dict, in_flight: int | None) -> Iterator[dict]:
    """Well-formed messages a rollout token holder could send: claims of huge or foreign versions, reports of
    every event (also the trainer's) about the version in flight, and other agents' ids with guessed sessions."""
    versions = [1, 2, MAX_ID, MAX_ID - 1, 1 << 40, *( [in_flight] if in_flight else [])]

    def digest() -> str:
        return "".join(rng.choice("0123456789abcdef") for _ in range(16))

    def someone() -> dict:
        return {"agent_id": rng.choice(victims), "session": rng.randbytes(24).hex()}

    choices: list[Callable[[], dict]] = [
        lambda: {"type": "register", "body": {"role": rng.choice(["receiver", "driver"]), "rank": rng.randint(0, 3),
                                              "host": "evil", "pid": 1, "device": "cpu",
                                              "versions": rng.sample(versions, 2), "history_id": digest(),
                                              "engine": "e", "members": 1, "driven": rng.random() < 0.5}},
        lambda: {"type": "poll", "body": {**mine, "versions": rng.sample(versions, 3), "wait_s": 0,
                                          "received": rng.choice([None, f"send:{in_flight}", "apply:1"])}},
        lambda: {"type": "report", "body": {**mine, "version": rng.choice(versions), "ok": rng.random() < 0.7,
                                            "event": rng.choice(["received", "staged", "applied", "done",
                                                                 "snapshotting", "evicted"]),
                                            "version_digest": digest(), "torn": rng.random() < 0.3,
                                            "serving": rng.choice(versions), "unable": rng.choice([None, "x"]),
                                            "cache_versions": rng.sample(versions, 2)}},
        lambda: {"type": rng.choice(["poll", "unregister"]), "body": {**someone(), "wait_s": 0}},
        lambda: {"type": "report", "body": {**someone(), "version": in_flight or 1, "event": "done", "ok": True,
                                            "version_digest": digest(), "cache_versions": []}},
        lambda: {"type": rng.choice(["sync", "push"]), "body": {"version": 1}},
        lambda: {"type": rng.choice(["status", "versions"]), "body": {}},
    ]
    while True:
        yield rng.choice(choices)()


