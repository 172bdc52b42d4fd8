"""workers/adapters/vllm/quiet.py: which of vLLM's log records a sync causes are dropped, cut or kept (a table;
no vLLM needed: the records are what vLLM's loggers make)."""

from __future__ import annotations

import logging
import sys

import pytest

from ckpt_engine.workers.adapters.vllm.quiet import (
    CORE_LOGGER,
    RELOAD_LOGGER,
    WORKER_LOGGER,
    ExpectedVLLMLogs,
    VersionNotApplied,
    install,
    not_applied,
    reported_version,
    resetting,
)


def record(name: str, level: int, msg: str, *args, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord(name, level, "layerwise.py", 1, msg, args or None, exc_info)


def failure(reported: bool, wrapped: bool = False) -> BaseException:
    """What a worker raises (reported: as the backend does, VersionNotApplied from the failure), and what vLLM's
    engine core makes of it (wrapped: its own RuntimeError naming the worker's error in its text, no cause)."""
    try:
        try:
            raise RuntimeError("the version did not carry every weight of 1 layer(s)")
        except RuntimeError as exc:
            if reported:
                raise not_applied(exc, 7) from exc
            raise
    except (RuntimeError, VersionNotApplied) as exc:
        caught = exc
    if wrapped:
        try:
            raise RuntimeError(f"Worker failed with error '{caught}', please check the stack trace above")
        except RuntimeError as exc:
            exc.__context__ = None
            return exc
    return caught


NOT_APPLIED = ("ckpt-engine: version 7 was not applied in this worker (RuntimeError: the version did not carry "
               "every weight of 1 layer(s)); the daemon was told and repairs the engine")


# (record, passes, what the message becomes: None = unchanged, and whether the stack stays)
CASES = [
    ("rotary embedding: vLLM computes its tables", record(RELOAD_LOGGER, logging.WARNING, "%s: Failed to load weights",
                                                          "RotaryEmbedding"), False, None, None),
    ("a rotary subclass", record(RELOAD_LOGGER, logging.WARNING, "%s: Failed to load weights",
                                 "Llama3RotaryEmbedding"), False, None, None),
    ("a layer with weights: a real gap, kept", record(RELOAD_LOGGER, logging.WARNING, "%s: Failed to load weights",
                                                      "QKVParallelLinear"), True, None, None),
    ("another reload warning, kept", record(RELOAD_LOGGER, logging.WARNING, "Allocating %.1f MB of device memory",
                                            12.0), True, None, None),
    ("the same text from another logger, kept", record("vllm.other", logging.WARNING, "%s: Failed to load weights",
                                                       "RotaryEmbedding"), True, None, None),
    ("a reported apply failure in the worker: one line, no stack",
     record(WORKER_LOGGER, logging.ERROR, "WorkerProc hit an exception.", exc=failure(True)), True,
     f"WorkerProc hit an exception. VersionNotApplied: {NOT_APPLIED}", False),
    ("the same in the engine core, as text in vLLM's own error",
     record(CORE_LOGGER, logging.ERROR, "Invocation of %s method failed", "collective_rpc",
            exc=failure(True, wrapped=True)), True,
     f"Invocation of collective_rpc method failed RuntimeError: Worker failed with error '{NOT_APPLIED}'", False),
    ("any other exception keeps its stack", record(WORKER_LOGGER, logging.ERROR, "WorkerProc hit an exception.",
                                                   exc=failure(False)), True, None, True),
    ("another exception in the engine core keeps its stack", record(CORE_LOGGER, logging.ERROR,
     "Invocation of %s method failed", "collective_rpc", exc=failure(False, wrapped=True)), True, None, True),
    ("the driver closing an update vLLM closed itself: one line",
     record(WORKER_LOGGER, logging.ERROR, "WorkerProc hit an exception.", exc=RuntimeError(
         "finish_weight_update called without a matching start_weight_update.")), True,
     "WorkerProc hit an exception. RuntimeError: finish_weight_update called without a matching", False),
    ("the same, as the engine core passes it on", record(CORE_LOGGER, logging.ERROR, "Invocation of %s method failed",
     "collective_rpc", exc=RuntimeError("Worker failed with error 'finish_weight_update called without a matching "
                                        "start_weight_update.', please check the stack trace above")), True,
     "Invocation of collective_rpc method failed RuntimeError: Worker failed with error 'finish_weight_update", False),
    ("an unrelated record", record("vllm.engine", logging.INFO, "Avg prompt throughput: %d", 3), True, None, None),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_what_passes_and_what_it_says(case) -> None:
    _, rec, passes, message, stack = case
    before = rec.getMessage()
    assert ExpectedVLLMLogs(keep_tracebacks=False).filter(rec) is passes
    if message is None:
        assert rec.getMessage() == before
    else:
        assert rec.getMessage().startswith(message), rec.getMessage()
        assert "CKPT_ENGINE_VLLM_TRACEBACKS=1" in rec.getMessage()
    if stack is not None:
        assert (rec.exc_info is not None) is stack


def test_keep_tracebacks_leaves_reported_failures_whole() -> None:
    rec = record(WORKER_LOGGER, logging.ERROR, "WorkerProc hit an exception.", exc=failure(True))
    assert ExpectedVLLMLogs(keep_tracebacks=True).filter(rec) and rec.exc_info is not None
    assert rec.getMessage() == "WorkerProc hit an exception."


def test_reported_version_follows_causes_and_text_and_stops_on_cycles() -> None:
    assert reported_version(None) is None and reported_version(failure(False)) is None
    assert reported_version(failure(True)) == 7 and reported_version(failure(True, wrapped=True)) == 7
    assert isinstance(failure(True), VersionNotApplied) and isinstance(failure(True).__cause__, RuntimeError)
    import pickle

    assert pickle.loads(pickle.dumps(failure(True))).version == 7  # (vLLM may pickle it across processes)
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert reported_version(a) is None


def test_closing_a_failed_reload_drops_every_layers_warning_on_that_thread_only() -> None:
    quiet = ExpectedVLLMLogs(keep_tracebacks=False)

    def linear() -> logging.LogRecord:
        return record(RELOAD_LOGGER, logging.WARNING, "%s: Failed to load weights", "RowParallelLinear")

    with resetting():
        assert not quiet.filter(linear())
        seen = []
        import threading

        other = threading.Thread(target=lambda: seen.append(quiet.filter(linear())))
        other.start()
        other.join()
        assert seen == [True]  # another thread's reload is not being closed
        assert quiet.filter(record(RELOAD_LOGGER, logging.WARNING, "Allocating %.1f MB of device memory", 1.0))
    assert quiet.filter(linear())


def test_installed_where_vllm_logs_them(capsys) -> None:
    vllm_root = logging.getLogger("vllm")
    handler = logging.StreamHandler(sys.stderr)
    vllm_root.addHandler(handler)
    try:
        install()
        install()  # idempotent
        reload_log, worker_log = logging.getLogger(RELOAD_LOGGER), logging.getLogger(WORKER_LOGGER)
        assert len(reload_log.filters) == 1 and len(worker_log.filters) == 1 and len(handler.filters) == 1
        assert len(logging.getLogger(CORE_LOGGER).filters) == 1
        reload_log.warning("%s: Failed to load weights", "RotaryEmbedding")
        reload_log.warning("%s: Failed to load weights", "RowParallelLinear")
        try:
            raise failure(True)
        except VersionNotApplied:
            worker_log.exception("WorkerProc hit an exception.")
        err = capsys.readouterr().err
        assert "RotaryEmbedding" not in err and "RowParallelLinear: Failed to load weights" in err
        assert "version 7 was not applied in this worker" in err and "Traceback" not in err
    finally:
        vllm_root.removeHandler(handler)
