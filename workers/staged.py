"""A verified version waiting for its engine's own thread: the bridge between a receiver (which verifies
versions on its own thread) and an engine that applies weights only on its thread, when its driver says so
(vLLM's start / update / finish under its own pause).

The receiver's ``load`` stages the version and waits: the staging buffer holds the bytes until the engine has
applied them, so nothing is copied. The engine's thread takes the version, applies it, and reports the
outcome back, which ``load`` returns (or raises) as usual. A version the engine never takes is refused
(nothing changed); one it took and failed to apply leaves the model torn, and ``load`` raises so.

A streamed version (staging ``stream``) is staged as soon as its header is known: the engine's thread then
reads it off the wire bucket by bucket while it applies it, under the pause its driver took (the sender waits
meanwhile, within the transport's timeouts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckpt_engine.errors import ApplyRefused, CkptEngineError, SyncTimeoutError
from ckpt_engine.receive.collective import VersionPayload

log = logging.getLogger(__name__)


class StagedVersion:
    """One version in hand between two threads. ``on_staged(version)`` is called (on the receive thread) when
    a version is ready to be applied, e.g. to tell the daemon, which then tells the engine's driver."""

    def __init__(self, *, on_staged: Callable[[int], None], take_timeout_s: float, apply_timeout_s: float,
                 check: Callable[[VersionPayload], None] | None = None,
                 on_applied: Callable[[frozenset[str]], None] | None = None) -> None:
        """``take_timeout_s``: how long a staged version waits for the engine to take it (then it is refused,
        nothing changed); ``apply_timeout_s``: how long an apply in progress may take (then the model is
        declared torn). ``check(payload)`` may refuse a version before it is staged (ApplyRefused);
        ``on_applied(names)`` hears the names of each version applied whole."""
        self.on_staged, self.check, self.on_applied = on_staged, check, on_applied
        self.take_timeout_s, self.apply_timeout_s = take_timeout_s, apply_timeout_s
        self._cond = threading.Condition()
        self._payload: VersionPayload | None = None
        self._taken = False
        self._outcome: BaseException | None = None
        self._done = False
        self._taken_at = 0.0
        # the newest version the engine will not take, told before this worker staged it (its engine failed it),
        # and when: it holds for that version's lifetime only (a restarted daemon numbers versions afresh)
        self._discarded: tuple[int, str, float] | None = None

    @property
    def staged(self) -> int | None:
        with self._cond:
            return self._payload.version if self._payload is not None and not self._taken else None

    # ---- the receive thread ---------------------------------------------------------------------------
    def load(self, payload: VersionPayload) -> None:
        """LoadFn: stage ``payload`` and wait until the engine has applied it (or refused, or failed)."""
        if self.check is not None:
            self.check(payload)
        with self._cond:
            told = self._discarded
            if told is not None and told[0] == payload.version and time.monotonic() - told[2] < self.take_timeout_s:
                raise ApplyRefused(f"version {payload.version} was not applied: {told[1]}")
            self._payload, self._taken, self._outcome, self._done = payload, False, None, False
        try:
            self.on_staged(payload.version)
        except Exception:  # telling the daemon is best effort: the engine may still take it
            log.exception("reporting version %d as staged failed", payload.version)
        with self._cond:
            try:
                if not self._cond.wait_for(lambda: self._taken or self._done, self.take_timeout_s):
                    raise ApplyRefused(f"version {payload.version} was verified but not applied within "
                                       f"{self.take_timeout_s:.0f}s (is the engine's driver running?)")
                if not self._cond.wait_for(lambda: self._done, self.apply_timeout_s):
                    raise SyncTimeoutError(f"applying version {payload.version} did not finish within "
                                           f"{self.apply_timeout_s:.0f}s")
                if self._outcome is not None:
                    raise self._outcome
            finally:
                self._payload, self._taken = None, False  # the staging views are not to be read after this

    # ---- the engine's thread ----------------------------------------------------------------------------
    def take(self, version: int, timeout_s: float) -> VersionPayload:
        """The staged ``version``, waiting up to ``timeout_s`` for it; from now on the receive thread waits for
        :meth:`finish`. ApplyRefused when it does not come (nothing was taken)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                payload = self._payload
                if payload is not None and payload.version == version and not self._taken:
                    self._taken = True
                    self._taken_at = time.perf_counter()
                    self._cond.notify_all()
                    return payload
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    held = "nothing" if payload is None else f"version {payload.version}"
                    raise ApplyRefused(f"version {version} is not staged in this worker (it holds {held}): "
                                       "it was not verified here")
                self._cond.wait(remaining)

    def finish(self, version: int, error: BaseException | None = None) -> None:
        """The outcome of applying ``version``: None when it applied whole, else the error (the model is torn
        unless the error is an ApplyRefused)."""
        with self._cond:
            if self._payload is None or self._payload.version != version:
                return  # the receive thread gave up on it already
            if error is not None and not isinstance(error, (ApplyRefused, CkptEngineError)):
                error = _Failed(f"{type(error).__name__}: {error}")
            self._payload.paused_s = time.perf_counter() - self._taken_at  # (its driver paused the engine for it)
            if error is None and self.on_applied is not None:
                self.on_applied(self._payload.names())
            self._outcome, self._done = error, True
            self._cond.notify_all()

    def discard(self, version: int, reason: str) -> None:
        """The engine will not take ``version`` (its driver failed, or another worker failed the version):
        refuse it now instead of after ``take_timeout_s``, so this worker can receive the next version (e.g. a
        repair); told before it is staged, it is refused when it is. A version the engine has taken already
        is left to its apply."""
        with self._cond:
            if self._payload is None or self._payload.version != version:
                if self._discarded is None or version >= self._discarded[0]:
                    self._discarded = (version, reason, time.monotonic())
                return
            if self._taken:
                return
            self._outcome, self._done = ApplyRefused(f"version {version} was not applied: {reason}"), True
            self._cond.notify_all()


class _Failed(CkptEngineError):
    """The engine failed while applying (its own exception, by name and message)."""
