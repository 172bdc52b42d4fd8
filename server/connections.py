"""What the daemon's connections may cost it: the open-file budget, and the HTTP plane's guard against slow and
idle clients (the ZMQ plane's is server/zmq_peers.py).

uvicorn waits for ever for a request's head (a client sending half a request line holds its connection, and
so a file descriptor, as long as it likes) and accepts connections until ``accept()`` fails with EMFILE, when
``/health`` and every other request fail too. Here:

- the soft ``RLIMIT_NOFILE`` is raised to the hard limit at start (``raise_open_files``);
- the descriptors are shared out (``connection_budget``): a quarter for HTTP connections, a quarter for ZMQ
  peers, the rest for the rendezvous store, the history, libzmq, bursts of connections not yet closed;
- HTTP connections (``guarded_protocol``, a uvicorn ``H11Protocol``) must bring a request's head within
  ``http.header_timeout_s`` (from the connection, or from the previous response on it) and its body within
  ``http.body_timeout_s`` of the head; past ``max_connections`` open ones, the oldest that waits for a request
  (idle or incomplete), or whose client does not read its response, is closed to make room for the new one.
  A request being answered is never cut short (``POST /sync`` with ``wait`` may wait minutes).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ckpt_engine.config import EngineConfig

log = logging.getLogger("ckpt_engine.daemon")

# Descriptors the daemon needs besides its connections: the history and its lock, the log, the listening
# sockets, libzmq's and the event loop's own (eventfds, epoll), worker threads, torch's store.
RESERVED_FDS = 96
_UNLIMITED = 1 << 20  # RLIM_INFINITY: budget as if this many (the kernel's nr_open is rarely more)
LISTEN_QUEUE = 1024  # connections the kernel holds for the HTTP listener until they are accepted


def raise_open_files() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns (soft before, soft now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft, soft
    targets = [hard]
    if hard == resource.RLIM_INFINITY:  # the kernel refuses more than fs.nr_open descriptors
        try:
            targets = [int(Path("/proc/sys/fs/nr_open").read_text()), _UNLIMITED]
        except (OSError, ValueError):
            targets = [_UNLIMITED]
    for target in targets:
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (ValueError, OSError):
            continue
    return soft, soft


@dataclass(frozen=True)
class Budget:
    open_files: int  # the soft limit the budget was made for
    http_connections: int
    # how many connections the event loop accepts in one go (asyncio's accept loop takes uvicorn's backlog for
    # it); the kernel's queue of connections not yet accepted is LISTEN_QUEUE long (it costs no descriptors)
    http_backlog: int
    zmq_peers: int


def connection_budget(config: EngineConfig, open_files: int | None = None) -> Budget:
    """How many HTTP connections and ZMQ peers the daemon keeps open at most, within ``open_files`` (the soft
    RLIMIT_NOFILE now when None), so that no ``accept()`` in the process fails for want of a descriptor."""
    if open_files is None:
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if open_files == resource.RLIM_INFINITY:
        open_files = _UNLIMITED
    quarter = max(open_files - RESERVED_FDS, 64) // 4
    # asyncio accepts up to ``backlog`` connections per loop iteration before any of them is seen (their
    # protocols start, and ones past the limit are closed, two or three iterations later): that many
    # iterations' worth must fit beside the connections kept
    backlog = max(4, min(128, quarter // 8))
    http = max(4, min(config.http.max_connections, quarter - 4 * backlog))
    zmq = max(4, min(config.zmq.max_peers, quarter))
    return Budget(open_files, http, backlog, zmq)


class ClosedConnections:
    """Counts the connections a plane closes to protect the daemon (``ckpt_engine_connections_closed_total``)
    and logs them: the first at once, then a summary at most every ``every_s``, so a flood of them does not
    flood the log. Thread-safe."""

    def __init__(self, plane: str, counter: Any = None, every_s: float = 60.0) -> None:
        self.plane, self.counter, self.every_s = plane, counter, every_s
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._next_log = 0.0

    def closed(self, reason: str, peer: str = "") -> None:
        if self.counter is not None:
            self.counter.labels(plane=self.plane.lower(), reason=reason).inc()
        with self._lock:
            self._pending[reason] += 1
            now = time.monotonic()
            if now < self._next_log:
                return
            counts, self._pending = self._pending, Counter()
            self._next_log = now + self.every_s
        log.warning("%s: closed %s (latest: %s%s); more are summed up at most every %.0fs", self.plane,
                    ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in sorted(counts.items())),
                    reason.replace("_", " "), f" from {peer}" if peer else "", self.every_s)


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


_HEAD, _BODY, _BUSY = "head", "body", "busy"  # waiting for a request's head / its body / answering it
_TIMEOUT_REPLY = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines for a request's head and body and a bound on open connections
    (see the module's docstring). Subclassed per daemon by ``guarded_protocol`` with its limits."""

    limits: ClassVar[HttpLimits]
    closing: ClassVar[ClosedConnections]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase: str | None = None
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._phase = None
        super().connection_lost(exc)

    # ---- deadlines -------------------------------------------------------------------------------------
    def _current(self) -> str | None:
        if self.transport.is_closing():
            return None
        theirs = self.conn.their_state
        if theirs is h11.IDLE:
            return _HEAD
        if theirs is h11.SEND_BODY:
            return _BODY
        if theirs in (h11.DONE, h11.MUST_CLOSE) and self.conn.our_state not in (h11.DONE, h11.MUST_CLOSE,
                                                                                h11.CLOSED):
            return _BUSY
        return None  # (the connection is about to close)

    def _watch(self) -> None:
        """Re-arm the deadline when the connection moved on to another phase."""
        phase = self._current()
        if phase == self._phase:
            return
        self._cancel()
        self._phase, self._since = phase, self.loop.time()
        if phase in (_HEAD, _BODY):
            limit = self.limits.header_timeout_s if phase == _HEAD else self.limits.body_timeout_s
            self._timer = self.loop.call_later(limit, self._expired, phase)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str) -> None:
        self._timer = None
        if self._phase == phase and not self.transport.is_closing():
            self._close(f"{phase}_timeout", reply=phase == _HEAD and bool(self.conn.trailing_data[0]))

    def _close(self, reason: str, reply: bool = False) -> None:
        """Close now, whatever the client left unread (a client that does not read would keep it open)."""
        self._cancel()
        self._phase = None
        if reply:  # a partial request: say why (h11 cannot, without a request line)
            self.transport.write(_TIMEOUT_REPLY)
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else ""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()
        self.closing.closed(reason, peer)

    # ---- the bound on open connections ------------------------------------------------------------------
    def _evictable(self) -> bool:
        if self._phase == _HEAD:
            return True
        if self._phase == _BODY and self.cycle is not None and self.cycle.response_complete:
            return True  # answered already (a 401 or 413 before its body came)
        return self.flow is not None and self.flow.write_paused  # its client does not read what it asked for

    def _make_room(self) -> None:
        limit = self.limits.max_connections
        if len(self.connections) <= limit:
            return
        live = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c._phase is not None]
        if len(live) <= limit:
            return
        # oldest first; this connection, the newest, last (when nothing else can go, it is refused). A few more
        # than needed, so that a flood of connections is not one scan of them all per connection.
        victims = sorted((c for c in live if c._evictable()), key=lambda c: (c is self, c._since))
        for victim in victims[:len(live) - limit + _spare(limit)]:
            if victim is not self or len(live) > limit:
                victim._close("over_limit")
                live.remove(victim)


def widen_listen_queue(sockets: list[Any], queue: int = LISTEN_QUEUE) -> None:
    """listen() again with a longer queue: asyncio takes the backlog it was given (kept small, see
    ``connection_budget``) both for listen() and for how many connections it accepts at once. A longer kernel
    queue costs no descriptors, and spares clients dropped SYNs (a second's wait each) when many connect."""
    for listener in sockets:
        with socket.fromfd(listener.fileno(), listener.family, listener.type) as dup:
            dup.listen(queue)


def _spare(limit: int) -> int:
    """Connections closed beyond what is needed, once over a limit, so a flood is dealt with in batches."""
    return limit // 16


def guarded_protocol(limits: HttpLimits, closing: ClosedConnections) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "closing": closing})


def http_limits(config: EngineConfig, budget: Budget) -> HttpLimits:
    return HttpLimits(config.http.header_timeout_s, config.http.body_timeout_s, budget.http_connections)

