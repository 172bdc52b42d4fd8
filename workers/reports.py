"""An agent's reports to the daemon: queued by the training loop or the receive path, delivered in order by a
thread of their own, so that neither ever waits on the daemon. An outcome is retried with backoff for as long
as its version may last; a report a restarted daemon cannot know is dropped rather than holding back the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ckpt_engine.control.client import ControlClient, ControlReplyError, RequestAbandoned
from ckpt_engine.control.messages import RegisterReply
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.retry import Backoff, FailureLog
from ckpt_engine.workers.threads import supervised

log = logging.getLogger(__name__)
# replies after which retrying the same request cannot help
FINAL_ERRORS = {"bad request", "not found", "conflict", "forbidden", "unauthorized"}
_OUTCOMES = ("done", "received", "applied")  # a version hangs until its time limit without these
Answered = Callable[[dict[str, Any] | None], None]


class Reply:
    """The daemon's reply to one report (an ``Answered``), once it is delivered; None: given up on."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.body: dict[str, Any] | None = None

    def __call__(self, body: dict[str, Any] | None) -> None:
        self.body = body
        self._event.set()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        return self.body if self._event.wait(timeout_s) else None


class ReportOutbox:
    """``settings()``: the agent's current registration (None before the first); ``stop``: set when the agent
    closes (a retried progress report gives up then; an outcome is still delivered within its bound)."""

    def __init__(self, client: ControlClient, settings: Callable[[], RegisterReply | None], stop: threading.Event,
                 *, role: str, endpoint: str) -> None:
        self._client = client
        self._settings = settings
        self._stop = stop
        self._queue: queue.Queue[tuple[dict[str, Any], Answered | None] | None] = queue.Queue()
        self._thread = supervised(self._loop, f"ckpt-{role}-report")
        self.failures = FailureLog(log, f"{role} agent: reporting to the daemon at {endpoint}")

    def start(self) -> None:
        self._thread.start()

    def put(self, body: dict[str, Any], answered: Answered | None = None) -> None:
        """Queue ``body``; ``answered`` is called with the daemon's reply once it is delivered, or with None
        once it is given up on (refused, dropped, or out of time)."""
        self._queue.put((body, answered))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued report has been delivered (or given up on); False on timeout."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Deliver what is queued (each delivery is bounded), then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            body, answered = item
            reply = None
            try:
                reply = self._deliver(body)
            except Exception:  # one undeliverable report must not end the delivery of the others
                log.exception("report %s of version %s could not be delivered", body.get("event"), body.get("version"))
            finally:
                if answered is not None:
                    answered(reply)
                self._queue.task_done()
        self._queue.task_done()

    def _deliver(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The daemon's reply; None if the report was given up on."""
        # An outcome lost on the way (connection cut, reply lost, daemon busy) would leave the version hanging
        # until its time limit: retry those, with backoff, for as long as the version may last.
        outcome = body["event"] in _OUTCOMES
        settings = self._settings()
        deadline = time.monotonic() + (settings.version_timeout_s if outcome and settings else 0.0)
        backoff = Backoff(initial_s=0.2, max_s=5.0)

        def stale() -> bool:
            # Registered again since (the daemon restarted): the new daemon knows neither this id nor its version.
            current = self._settings()
            return current is not None and current.agent_id != body["agent_id"]

        while True:
            if stale():
                log.info("report %s of version %d dropped: registered again since", body["event"], body["version"])
                return None
            try:
                reply = self._client.request("report", body, abandon=stale)
                self.failures.succeeded()
                return reply if isinstance(reply, dict) else {}
            except RequestAbandoned:
                continue
            except ControlReplyError as exc:
                if exc.error in FINAL_ERRORS:  # the daemon answered: retrying the same report cannot help
                    log.warning("report %s of version %d refused: %s", body["event"], body["version"], exc)
                    return None
                failure: CkptEngineError = exc
            except CkptEngineError as exc:
                failure = exc
            if time.monotonic() >= deadline or self._client.closed:
                log.warning("could not report %s of version %d: %s", body["event"], body["version"], failure)
                return None
            self.failures.failed(failure)
            if backoff.wait(self._stop if not outcome else None):
                return None
