"""Engine driver: applies verified versions to an inference engine of several workers at once, under the
engine's own pause, and keeps a torn engine from serving.

The engine's workers run receivers that verify each version and stage it (workers/staged.py). When every
worker of the engine has staged a version, the daemon assigns ``apply`` to the engine's driver, which

    pauses generation -> starts the engine's weight update -> has every worker apply the staged version ->
    finishes the update (the engine labels it with the version id) -> resumes generation.

If applying fails part way (the engine raised, a worker ran out of memory, a name it does not know), the
engine holds no whole version: the driver closes the update, stays paused, reports the engine torn, and the
daemon re-sends the version the engine served last from the trainer's cache; the driver applies that and only
then resumes. The engine never generates with a mix of versions.

``EngineControl`` is what a driver needs from an engine; workers/adapters/vllm/control.py has vLLM's (a
server over HTTP, an in-process ``LLM``, and the older worker extension).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Protocol

from ckpt_engine.control.messages import Assignment
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.workers.agent import Agent
from ckpt_engine.workers.threads import supervised

log = logging.getLogger(__name__)


class EngineControl(Protocol):
    """An engine's weight-update controls, as its driver calls them (in this order, per version)."""

    def pause(self) -> None: ...

    def apply(self, version: int) -> None:
        """Every worker applies the staged ``version``; raises if any failed (the engine may then be torn)."""

    def abandon(self) -> None:
        """Close an update that failed part way (best effort; errors are the caller's to ignore)."""

    def resume(self) -> None: ...


class EngineDriver(Agent):
    role = "driver"

    def __init__(self, control: EngineControl, endpoint: str, *, engine: str, token: str | None = None,
                 poll_wait_s: float = 1.0, **agent_options: Any) -> None:
        from ckpt_engine.device import detect_device

        super().__init__(endpoint, token=token, device=agent_options.pop("device", None) or detect_device("cpu"),
                         poll_wait_s=poll_wait_s, **agent_options)
        self.control = control
        self.engine = engine
        self.version: int | None = None  # the version the engine serves whole
        self.torn: str | None = None  # why the engine holds no whole version (it stays paused meanwhile)
        self.applied = threading.Condition()
        self._work: queue.Queue[Assignment | None] = queue.Queue()
        self._worker = supervised(self._work_loop, "ckpt-driver", self._work_loop_died)

    def register_extra(self) -> dict[str, Any]:
        return {"engine": self.engine}

    @property
    def engine_key(self) -> str | None:
        """What this engine's workers register with (the daemon issued it to this driver)."""
        return self.settings.engine_key if self.settings is not None else None

    def on_registered(self) -> None:
        if not self._worker.is_alive():
            self._worker.start()

    def handle(self, assignment: Assignment) -> None:
        if assignment.kind == "apply":
            self._work.put(assignment)

    def close(self) -> None:
        self._work.put(None)
        if self._worker.is_alive():
            self._worker.join(self.request_timeout_s * 3)
        super().close()

    def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Block until the engine serves ``version`` or a newer one; for scripts and tests."""
        with self.applied:
            return self.applied.wait_for(lambda: self.version is not None and self.version >= version, timeout_s)

    def _work_loop(self) -> None:
        while (assignment := self._work.get()) is not None:
            if self.from_earlier_registration(assignment):
                log.warning("apply of version %d skipped: assigned before the daemon restarted", assignment.version)
                continue
            self._apply(assignment.version)

    def _work_loop_died(self, exc: BaseException) -> None:
        if not self._stop.is_set():
            self._worker = supervised(self._work_loop, "ckpt-driver", self._work_loop_died)
            self._worker.start()

    def _apply(self, version: int) -> None:
        control = self.control
        paused = time.perf_counter()
        if self.torn is None:  # a torn engine is paused already
            try:
                control.pause()
            except Exception as exc:  # noqa: BLE001 - nothing changed: the staged version times out in the workers
                log.warning("version %d not applied: pausing the engine failed: %s", version, exc)
                self.report(version, "applied", ok=False, reason=f"pause failed: {_name(exc)}", serving=self.version)
                return
        try:
            control.apply(version)
        except Exception as exc:  # noqa: BLE001 - whatever the engine raised, it may hold a mix now
            self._torn(version, exc)
            return
        with self.applied:
            self.version, self.torn = version, None
            self.applied.notify_all()
        try:
            control.resume()
        except Exception as exc:  # noqa: BLE001 - the version is applied either way: a failed resume is logged
            log.warning("resuming the engine after version %d failed: %s", version, exc)
        self.report(version, "applied", ok=True, serving=version, stages={"pause": time.perf_counter() - paused})
        log.info("engine %s serves version %d", self.engine, version)

    def _torn(self, version: int, exc: BaseException) -> None:
        reason = f"applying version {version} failed part way: {_name(exc)}"
        log.error("engine %s is torn (%s); it stays paused until a whole version is applied", self.engine, reason)
        try:
            self.control.abandon()
        except Exception as closing:  # noqa: BLE001 - the engine is torn either way: a failed abandon is logged
            log.info("closing the failed update: %s", closing)
        with self.applied:
            self.version, self.torn = None, reason
            self.applied.notify_all()
        self.report(version, "applied", ok=False, reason=reason, torn=True)


def _name(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 2000 else text[:2000] + "..."


__all__ = ["CkptEngineError", "EngineControl", "EngineDriver"]
