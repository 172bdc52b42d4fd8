"""Whether the daemon's periodic work (expiry, time limits, repairs) is healthy, for ``/health``. Unhealthy when
no tick has succeeded for a while (failing every time, stuck in one, or its thread gone), or when most ticks of
the last half minute failed. Pure: the caller passes the clock's reading."""

from __future__ import annotations

import collections

FAILING_S = 5.0  # no successful tick for this long: not ok
WINDOW_S = 30.0  # ticks looked back on for intermittent failures
MIN_TICKS = 10  # ... once there are at least this many in the window


class TickHealth:
    def __init__(self, now: float) -> None:
        self._last_ok = now  # a daemon that just started has not failed yet
        self._error: str | None = None
        self._ticks: collections.deque[tuple[float, bool]] = collections.deque()

    def failed(self, error: str, now: float) -> None:
        self._error = error
        self._note(now, False)

    def succeeded(self, now: float) -> None:
        self._last_ok = now
        self._note(now, True)

    def problem(self, now: float) -> str | None:
        """Why the periodic work is not healthy, or None."""
        quiet = now - self._last_ok
        if quiet >= FAILING_S:
            why = f"failed: {self._error}" if self._error else "not completed (stuck, or its thread is gone)"
            return f"the controller's periodic work has not succeeded for {quiet:.0f}s: last {why}"
        recent = [ok for at, ok in self._ticks if now - at <= WINDOW_S]
        failed = recent.count(False)
        if len(recent) >= MIN_TICKS and failed * 2 > len(recent):
            return (f"the controller's periodic work failed {failed} of its last {len(recent)} runs: "
                    f"{self._error}")
        return None

    def _note(self, now: float, ok: bool) -> None:
        self._ticks.append((now, ok))
        while self._ticks and now - self._ticks[0][0] > WINDOW_S:
            self._ticks.popleft()
