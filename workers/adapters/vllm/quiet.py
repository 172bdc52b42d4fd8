"""vLLM's log lines that every ckpt-engine sync causes and that say nothing wrong, kept out of the log; nothing else.

- ``RotaryEmbedding: Failed to load weights`` (a warning of vLLM's layerwise reload, at every apply): the
  reload counts a layer's buffers as weights to load, and a rotary embedding has only buffers, its cos/sin
  tables, which vLLM computes and no checkpoint carries. vLLM puts the old tables back, which is right.
  Dropped for rotary embeddings only: the same warning for any other layer is a weight the version did not
  carry, and stays (ckpt-engine also refuses such a version itself: worker.check_every_layer_loaded).
- The same warning for every layer a failed apply had not reached yet, while ckpt-engine closes that reload
  (worker.reset_reload, inside :func:`resetting`): the engine is torn and reported already; those layers are
  put back as they were, which is what the warning says.
- A failed apply in a worker (a streamed version torn part way, a layer not filled): ckpt-engine has reported
  it to the daemon, which repairs the engine, and the driver logs it in one line. The worker raises
  :class:`VersionNotApplied` to vLLM, and vLLM logs it with its whole stack, in the worker (``WorkerProc hit an
  exception.``) and again in the engine core (``Invocation of collective_rpc method failed``, the worker's error
  in its text). Those records keep their line, with ckpt-engine's reason, but not the stack
  (``CKPT_ENGINE_VLLM_TRACEBACKS=1`` keeps it).
- Then the driver closes that update (``finish_weight_update``), as it must after any failure, and vLLM, which
  closed an update whose ``update_weights`` failed by itself, answers "finish_weight_update called without a
  matching start_weight_update", logged with its stack in the worker and the engine core: those keep their line
  too, without the stack.

Any other exception vLLM logs keeps its stack.

:func:`install` attaches the filter in each vLLM process (plugin.py calls it; the worker paths call it too).
Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator

from ckpt_engine.errors import CkptEngineError

# where vLLM logs them (vllm.logger.init_logger(__name__)); the "vllm" logger's handlers see every vllm.* record
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
WORKER_LOGGER = "vllm.v1.executor.multiproc_executor"
CORE_LOGGER = "vllm.v1.engine.core"
VLLM_LOGGER = "vllm"
KEEP_TRACEBACKS_ENV = "CKPT_ENGINE_VLLM_TRACEBACKS"

_ROTARY_NOT_LOADED = re.compile(r"^\w*RotaryEmbedding: Failed to load weights$")
_NOT_LOADED = re.compile(r"^\w+: Failed to load weights$")
# VersionNotApplied's text, also inside another exception's (vLLM passes a worker's error on as text)
_NOT_APPLIED = re.compile(r"ckpt-engine: version (\d+) was not applied in this worker")
# vLLM's answer to the driver closing an update it closed itself (after update_weights failed)
_CLOSED_ALREADY = re.compile(r"finish_weight_update called without a matching start_weight_update")
_local = threading.local()


class VersionNotApplied(CkptEngineError):
    """What a vLLM worker raises when applying a version failed: ckpt-engine reported it to the daemon already
    (which repairs the engine). Raised from the failure itself."""

    def __init__(self, message: str) -> None:  # (one argument: vLLM may pickle it)
        super().__init__(message)
        match = _NOT_APPLIED.search(message)
        self.version = int(match.group(1)) if match else None


def not_applied(exc: BaseException, version: int) -> VersionNotApplied:
    return VersionNotApplied(f"ckpt-engine: version {version} was not applied in this worker "
                             f"({type(exc).__name__}: {exc}); the daemon was told and repairs the engine")


def reported_version(exc: BaseException | None) -> int | None:
    """The version whose reported apply failure ``exc`` is, wraps (its cause or context), or names in its text."""
    for link in _chain(exc):
        if isinstance(link, VersionNotApplied) and link.version is not None:
            return link.version
        match = _NOT_APPLIED.search(_text(link))
        if match:
            return int(match.group(1))
    return None


def expected(exc: BaseException | None) -> str | None:
    """Why a stack vLLM logs for ``exc`` says nothing new (None: it may, keep it)."""
    version = reported_version(exc)
    if version is not None:
        return f"version {version}'s failed apply, reported to the daemon"
    if any(_CLOSED_ALREADY.search(_text(link)) for link in _chain(exc)):
        return "the driver closing an update vLLM had closed itself after a failed update_weights: expected"
    return None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception whose str() fails is not ours
        return ""


@contextlib.contextmanager
def resetting() -> Iterator[None]:
    """Around closing the reload of a failed apply, on its thread: vLLM's "Failed to load weights" for the
    layers the failed version had not reached are expected there."""
    _local.resetting = True
    try:
        yield
    finally:
        _local.resetting = False


class ExpectedVLLMLogs(logging.Filter):
    """Drops the rotary embeddings' reload warning (and every layer's while a failed reload is closed); cuts the
    stack from vLLM's records of an apply failure ckpt-engine reported and of closing its update (each record
    stays, one line, with the error). Everything else passes unchanged."""

    def __init__(self, keep_tracebacks: bool | None = None) -> None:
        super().__init__()
        self.keep_tracebacks = (os.environ.get(KEEP_TRACEBACKS_ENV, "") not in ("", "0")
                                if keep_tracebacks is None else keep_tracebacks)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == RELOAD_LOGGER and record.levelno == logging.WARNING:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
                return True
            if getattr(_local, "resetting", False):
                return not _NOT_LOADED.match(message)
            return not _ROTARY_NOT_LOADED.match(message)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or self.keep_tracebacks or expected(exc) is None:
            return True
        try:
            record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is left as it is
            return True
        record.msg = (f"{record.getMessage()} {type(exc).__name__}: {exc} (stack left out: {KEEP_TRACEBACKS_ENV}=1 "
                      "keeps it)")
        record.args = None
        record.exc_info = None
        record.exc_text = None
        return True


_FILTER = ExpectedVLLMLogs()


def install() -> None:
    """Attach the filter where vLLM's records pass (idempotent): the loggers that make these records (a logger's
    filter sees what is logged on it) and the handlers of vLLM's root logger (what vLLM configured)."""
    targets: list[logging.Filterer] = [logging.getLogger(name) for name in (RELOAD_LOGGER, WORKER_LOGGER, CORE_LOGGER)]
    targets += logging.getLogger(VLLM_LOGGER).handlers
    for target in targets:
        if _FILTER not in target.filters:
            target.addFilter(_FILTER)
