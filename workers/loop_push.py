"""Versions the training loop asks for (``TrainerAgent.push``): the request to the daemon, and when to ask again.

A version in flight (409) is the normal answer now and then: that step syncs nothing. Any other refusal (no
receivers, storage degraded, the daemon unreachable) repeats until something changes, so asking pauses with
backoff instead of adding a history row every step.
"""

from __future__ import annotations

import collections
import logging
import time

from ckpt_engine.control.client import ControlClient, ControlReplyError
from ckpt_engine.control.messages import Assignment
from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.retry import Backoff, FailureLog

log = logging.getLogger(__name__)


class LoopPushes:
    def __init__(self) -> None:
        self._backoff = Backoff(initial_s=1.0, max_s=30.0)
        self._after = 0.0
        self._failures = FailureLog(log, "trainer agent: push (a version requested from the loop)")

    def request(self, client: ControlClient, pending: collections.deque[Assignment], step: int,
                bypass_cpu: bool | None, timeout_s: float) -> int | None:
        """Ask the daemon for a version at ``step`` and wait until its assignment is in ``pending``; the
        version, or None (refused, unanswered, or asking is paused)."""
        if time.monotonic() < self._after:
            return None
        try:
            version = int(client.request("sync", {"step": step, "bypass_cpu": bypass_cpu})["id"])
            deadline = time.monotonic() + timeout_s
            while not any(a.version == version for a in pending):
                if time.monotonic() > deadline:
                    raise SyncTimeoutError(f"the daemon did not hand version {version} over within {timeout_s}s")
                time.sleep(0.005)
        except CkptEngineError as exc:  # ControlReplyError (refused) or no answer
            self._refused(step, exc)
            return None
        self._backoff.reset()
        self._failures.succeeded()
        return version

    def _refused(self, step: int, exc: CkptEngineError) -> None:
        if isinstance(exc, ControlReplyError) and exc.error == "conflict":
            log.debug("push at step %d: %s", step, exc)
            return
        delay = self._backoff.next_delay()
        self._after = time.monotonic() + delay
        self._failures.failed(f"{exc} (next push in {delay:.1f}s or later)")
