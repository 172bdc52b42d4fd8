"""``ckpt-engine serve``: history, rendezvous store, controller, ZMQ and HTTP control planes in one process.

SIGTERM/SIGINT: uvicorn stops accepting requests, the in-flight version gets a grace period to end and is
otherwise recorded as interrupted, sockets close, and the process exits 0 (1 when the history could not be
written: the log names every outcome that was lost).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import uvicorn

from ckpt_engine.config import EngineConfig, is_loopback, parse_zmq_endpoint
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.retry import FailureLog
from ckpt_engine.server.authority import Authority
from ckpt_engine.server.connections import (
    ClosedConnections,
    connection_budget,
    guarded_protocol,
    http_limits,
    raise_open_files,
    widen_listen_queue,
)
from ckpt_engine.server.controller import Controller
from ckpt_engine.server.history import HistoryStore
from ckpt_engine.server.http_app import create_app
from ckpt_engine.server.metrics import Metrics
from ckpt_engine.server.zmq_server import ZmqServer
from ckpt_engine.transport.group import serve_store

log = logging.getLogger("ckpt_engine.daemon")
_TICK_S = 0.5


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its own shutdown, which would kill the process before the
    in-flight version is recorded; here the signal only asks the server to stop and ``run`` returns."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets is None:
            widen_listen_queue([sock for server in getattr(self, "servers", []) for sock in server.sockets])

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Daemon:
    def __init__(self, config: EngineConfig, open_files_before: int | None = None) -> None:
        self.config = config
        self.budget = connection_budget(config)  # within the open-file limit now (serve() raised it)
        self._open_files_before = open_files_before
        self.authority = Authority(config)
        self.history = HistoryStore(config.store.history_path, lock_wait_s=config.store.lock_wait_s)
        stopped = self.history.interrupt_unfinished("the daemon stopped before this version's outcome was recorded; "
                                                    "receivers may hold it (they are sent a whole version again)")
        if stopped:
            log.warning("marked versions %s interrupted: they were in flight when the daemon stopped", stopped)
        try:
            self.store = serve_store(config.store.rendezvous_host, config.store.rendezvous_port,
                                     timeout_s=config.timeouts.connect_s)
        except BaseException:
            self.history.close()
            raise
        # A fresh group name per daemon run: store prefixes of an earlier run can never be read by mistake.
        self.controller = Controller(config, self.history, Metrics(), store_host=config.store.rendezvous_host,
                                     store_port=self.store.port, group_name=f"ckpt-{uuid.uuid4().hex[:8]}",
                                     engine_secret=self.authority.engine_secret())
        self.zmq = ZmqServer(self.controller, config.zmq.endpoint, max_frame_bytes=config.zmq.max_frame_bytes,
                             authority=self.authority, max_peers=self.budget.zmq_peers,
                             handshake_timeout_s=config.zmq.handshake_timeout_s)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="ckpt-ticker", daemon=True)

    def run(self) -> int:
        self._warn_if_exposed()
        self.zmq.start()
        self._ticker.start()
        # (h11 always, with deadlines for slow clients and a bound on connections: server/connections.py)
        protocol = guarded_protocol(http_limits(self.config, self.budget),
                                    ClosedConnections("HTTP", self.controller.metrics.connections_closed))
        server = _Server(uvicorn.Config(create_app(self.controller, self.config, self.authority),
                                        host=self.config.http.host,
                                        port=self.config.http.port, log_level="warning", access_log=False,
                                        http=protocol, backlog=self.budget.http_backlog))
        self._log_budget()
        log.warning("ckpt-engine serving: http://%s:%d  zmq %s  rendezvous %s:%d  history %s  credentials %s",
                    self.config.http.host, self.config.http.port, self.zmq.bound_endpoint,
                    self.config.store.rendezvous_host, self.store.port, self.config.store.history_path,
                    "none (auth.open)" if self.authority.open else self.authority.credentials_file)
        try:
            server.run()  # returns after SIGTERM/SIGINT
        finally:
            lost = self.shutdown()
        return 1 if lost else 0

    def _log_budget(self) -> None:
        budget, before = self.budget, self._open_files_before
        raised = f" (raised from {before})" if before is not None and before != budget.open_files else ""
        log.warning("open-file limit %s%s: at most %d HTTP connections, %d ZMQ connections", budget.open_files,
                    raised, budget.http_connections, budget.zmq_peers)
        if budget.zmq_peers < 2 * self.config.max_agents:  # an agent holds two (its polls, its reports)
            log.warning("the open-file limit leaves room for %d ZMQ connections, about %d agents (max_agents is "
                        "%d): raise the hard limit (systemd: LimitNOFILE=, docker: --ulimit nofile=)",
                        budget.zmq_peers, budget.zmq_peers // 2, self.config.max_agents)

    def shutdown(self) -> int:
        """Stop; returns how many history records could not be written (their latest state is lost)."""
        self.controller.shutdown(grace_s=min(self.config.timeouts.ack_s, 30.0))  # (it logs what it waits for)
        self._stop.set()
        self.zmq.stop()
        grace = time.monotonic() + min(self.config.timeouts.ack_s, 10.0)
        while not self.history.flush(force=True) and time.monotonic() < grace:  # e.g. a disk that frees up
            time.sleep(0.5)
        lost = self.history.close()
        for record in lost:
            log.error("history could not be written: version %d %s (%s) is lost from the file; it will read as "
                      "interrupted after a restart", record.id, record.status, record.reason or "no reason")
        log.warning("stopped%s", f" with {len(lost)} unwritten history record(s)" if lost else "")
        return len(lost)

    def _tick(self) -> None:
        failures = FailureLog(log, "controller tick")
        while not self._stop.wait(_TICK_S):
            try:
                self.controller.tick()
                failures.succeeded()
                self.controller.tick_health.succeeded(self.controller.clock())
            except Exception as exc:  # noqa: BLE001 - logged once, then periodically, /health says so: the ticker lives
                failures.failed(f"{type(exc).__name__}: {exc}")
                self.controller.tick_health.failed(f"{type(exc).__name__}: {exc}", self.controller.clock())

    def _warn_if_exposed(self) -> None:
        exposed = self.exposed_binds(self.config)
        if exposed and self.authority.open:
            log.warning("WARNING: listening beyond loopback with auth.open (%s): anyone who can reach these "
                        "ports can trigger syncs, register agents and read history. Unset auth.open, or bind to "
                        "127.0.0.1.", ", ".join(exposed))

    @staticmethod
    def exposed_binds(config: EngineConfig) -> list[str]:
        """The listening sockets that are reachable from other hosts, as 'key=host'."""
        transport, zmq_host, _ = parse_zmq_endpoint(config.zmq.endpoint)
        binds = [("http.host", config.http.host), ("store.rendezvous_host", config.store.rendezvous_host)]
        if transport == "tcp":
            binds.append(("zmq.endpoint", zmq_host))
        return [f"{key}={host}" for key, host in binds if not is_loopback(host)]


class OneLineFormatter(logging.Formatter):
    """Log records one line each: control characters of a message (peers choose the strings some messages
    carry: reasons, host names) are escaped, so no peer can forge a log line. Tracebacks stay as they are."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))


def escape_controls(text: str) -> str:
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode() for ch in text)


def serve(config: EngineConfig) -> int:
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a daemon that seems stuck shows where it waits
    # A file-size limit must surface as a storage fault the daemon reports (EFBIG), not kill it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Every connection costs a descriptor: the hard limit, not the soft one (often 1024), bounds them.
    before, _ = raise_open_files()
    try:
        daemon = Daemon(config, open_files_before=before)
    except CkptEngineError as exc:  # a history or store that cannot be used: say which, without a traceback
        log.error("cannot start: %s", exc)
        return 2
    return daemon.run()
