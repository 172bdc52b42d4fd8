"""Retrying without spinning, and saying so without flooding the log.

Every loop that retries after a failure waits a :class:`Backoff` delay (exponential, with jitter, capped)
and reports through a :class:`FailureLog`: the first failure at once, then a reminder at most every
``every_s`` with how often it failed meanwhile, and one line when it works again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.25  # +- this fraction, so many agents that failed together do not retry together
    _next: float = field(default=0.0, repr=False)

    def next_delay(self) -> float:
        base = self.initial_s if self._next <= 0 else min(self._next * self.factor, self.max_s)
        self._next = base
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))

    def reset(self) -> None:
        self._next = 0.0

    def wait(self, stop: threading.Event | None = None) -> bool:
        """Sleep the next delay; True when ``stop`` was set meanwhile."""
        delay = self.next_delay()
        if stop is None:
            time.sleep(delay)
            return False
        return stop.wait(delay)


@dataclass
class FailureLog:
    """One failing activity (e.g. "poll"): logs its first failure, then periodically, then its recovery."""

    log: logging.Logger
    what: str
    every_s: float = 60.0
    failures: int = 0
    first_at: float | None = None
    last_error: str | None = None
    _last_logged: float = field(default=0.0, repr=False)
    _on_change: Callable[[str | None], None] | None = field(default=None, repr=False)

    def failed(self, error: object) -> None:
        now = time.monotonic()
        self.failures += 1
        changed = self.last_error is not None and _kind(str(error)) != _kind(self.last_error)
        self.last_error = str(error)
        if changed:  # e.g. a timeout became "unauthorized": a new cause is said at once, not a minute later
            self._last_logged = now
            self.log.warning("%s now fails differently after %d attempts: %s", self.what, self.failures, error)
            if self._on_change is not None:
                self._on_change(self.last_error)
        elif self.first_at is None:
            self.first_at, self._last_logged = now, now
            self.log.warning("%s failed: %s (retrying with backoff)", self.what, error)
            if self._on_change is not None:
                self._on_change(self.last_error)
        elif now - self._last_logged >= self.every_s:
            self._last_logged = now
            self.log.warning("%s still failing after %d attempts over %.0fs: %s", self.what, self.failures,
                             now - self.first_at, error)

    def succeeded(self) -> None:
        if self.first_at is not None:
            self.log.warning("%s works again after %d failed attempts over %.1fs", self.what, self.failures,
                             time.monotonic() - self.first_at)
            if self._on_change is not None:
                self._on_change(None)
        self.failures, self.first_at, self.last_error = 0, None, None

    @property
    def failing_for_s(self) -> float:
        return 0.0 if self.first_at is None else time.monotonic() - self.first_at


def _kind(error: str) -> str:
    """The cause of an error message, without its details (``"unauthorized: ..."`` -> ``"unauthorized"``)."""
    return error.split(":", 1)[0].strip()
