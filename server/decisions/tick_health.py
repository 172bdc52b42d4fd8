"""Whether the daemon's periodic work (expiry, time limits, repairs) is healthy: one failure is logged and
retried; failing for a while makes ``/health`` say not ok. Pure: the caller passes the clock's reading."""

from __future__ import annotations

FAILING_S = 5.0  # ticks failing this long make /health say not ok


class TickHealth:
    def __init__(self) -> None:
        self._failing_since: float | None = None
        self._error: str | None = None

    def failed(self, error: str, now: float) -> None:
        if self._failing_since is None:
            self._failing_since = now
        self._error = error

    def succeeded(self) -> None:
        self._failing_since, self._error = None, None

    def problem(self, now: float) -> str | None:
        """Why the periodic work has kept failing for a while, if it has."""
        since = self._failing_since
        if since is None or now - since < FAILING_S:
            return None
        return f"the controller's periodic work has failed for {now - since:.0f}s: {self._error}"
