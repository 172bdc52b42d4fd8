"""The ZMQ plane's bound on connections. libzmq accepts every connection a peer opens and keeps it as long as
the peer likes: one that completes its handshake and then sends half a frame, or nothing, holds a descriptor
for ever. Unbounded, that ends with ``accept()`` failing with EMFILE for the whole process.

``PeerGuard`` watches the ROUTER socket's connections through a libzmq socket monitor (each accepted
connection's descriptor, and its end). It runs on a thread of its own, so it acts within milliseconds even
while the server's loop is busy. Past ``limit`` open connections it closes, to make room:

1. connections that never sent an authenticated message (a token the daemon accepts), oldest first, once they
   had ``NEW_CONNECTION_GRACE_S`` to speak. An attacker without a token can hold only these, and a legitimate
   client's new connection speaks at once.
2. then those whose last authenticated message is oldest, except ones with a request parked at the daemon
   (a poll or a ``sync`` with ``wait``, whose reply would be lost).

An agent whose idle connection was closed loses nothing: libzmq reconnects at once and sends what it queued.
Closing is ``shutdown()`` of libzmq's own descriptor, once its socket inode shows it is still the connection
seen accepted. libzmq then sees the peer gone and closes it the usual way. libzmq itself closes connections
whose ZMTP handshake does not end within ``zmq.handshake_timeout_s`` (ZMQ_HANDSHAKE_IVL).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from ckpt_engine.server.connections import ClosedConnections

log = logging.getLogger(__name__)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
NEW_CONNECTION_GRACE_S = 2.0  # a client's first message comes within this of its connection, on a loaded host too
_names = itertools.count()


@dataclass(eq=False)
class Peer:
    """One accepted connection. ``last`` and ``parked`` are written by the server's loop thread only."""

    fd: int
    inode: int
    accepted: float
    last: float | None = None  # when it last sent an authenticated message
    parked: int = 0  # its requests parked at the daemon
    address: str = field(default="")


class PeerGuard:
    def __init__(self, ctx: zmq.Context, limit: int, closing: ClosedConnections) -> None:
        self.ctx, self.limit, self.closing = ctx, limit, closing
        self._address = f"inproc://ckpt-engine-zmq-peers-{os.getpid()}-{next(_names)}"
        self._peers: dict[int, Peer] = {}  # changed by the guard's thread only
        self._families: tuple[int, ...] = ()
        self._port: int | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-zmq-peers", daemon=True)

    # ---- the server's loop thread ---------------------------------------------------------------------
    def attach(self, sock: zmq.Socket) -> None:
        """Watch ``sock``'s connections; before it binds, so no connection goes unseen."""
        sock.monitor(self._address, _EVENTS)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the ZMQ connection monitor did not start")

    def bound(self, endpoint: str) -> None:
        """The endpoint the socket listens on: accepted descriptors are checked to be its connections."""
        if endpoint.startswith("ipc://"):
            self._families = (socket.AF_UNIX,)
        else:
            self._families = (socket.AF_INET, socket.AF_INET6)
            self._port = int(endpoint.rsplit(":", 1)[1])

    def peer(self, fd: int | None) -> Peer | None:
        return self._peers.get(fd) if fd is not None else None

    @staticmethod
    def spoke(peer: Peer | None) -> None:
        if peer is not None:
            peer.last = time.monotonic()

    def detach(self, sock: zmq.Socket) -> None:
        self._stop.set()
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._thread.join(5)

    # ---- the guard's thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        monitor = self.ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(self._address)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not monitor.poll(200):
                    continue
                while True:
                    try:
                        event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    try:
                        self._on_event(event["event"], int(event["value"]))
                    except Exception:  # the guard must outlive anything one connection does
                        log.exception("ZMQ connection monitor: handling %s failed", event.get("event"))
        except zmq.ZMQError as exc:  # the context ends: the server stops
            if not self._stop.is_set():
                log.warning("ZMQ connection monitor stopped: %s", exc)
        finally:
            monitor.close(linger=0)

    def _on_event(self, kind: int, fd: int) -> None:
        if kind == zmq.EVENT_DISCONNECTED:
            self._peers.pop(fd, None)
            return
        if kind != zmq.EVENT_ACCEPTED:
            return
        identity = self._identify(fd)
        if identity is None:  # closed (and perhaps reused) before this event came: its end event follows
            return
        inode, address = identity
        self._peers[fd] = Peer(fd, inode, time.monotonic(), address=address)
        if len(self._peers) > self.limit:
            self._make_room()

    def _identify(self, fd: int) -> tuple[int, str] | None:
        """(socket inode, peer address) of ``fd`` if it is a connection to our endpoint."""
        try:
            inode = os.fstat(fd).st_ino
            sock = socket.socket(fileno=fd)  # wraps libzmq's descriptor: detached below, never closed
        except OSError:
            return None
        try:
            if sock.family not in self._families:
                return None
            if self._port is not None and sock.getsockname()[1] != self._port:
                return None
            peer = sock.getpeername()
            address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        except OSError:
            return None
        finally:
            sock.detach()
        return inode, address

    def _make_room(self) -> None:
        excess = len(self._peers) - self.limit
        # First the never authenticated, oldest first: as many as needed and a few more, so a flood costs one sort
        # per batch, not per connection. Then, if still over, only as many as needed of those silent longest
        # that wait for no reply. A connection within its grace has had no time to speak: it is no stranger yet,
        # else idle authenticated ones would lock every newcomer out.
        settled = time.monotonic() - NEW_CONNECTION_GRACE_S
        strangers = sorted((p for p in self._peers.values()
                            if p.last is None and p.parked <= 0 and p.accepted <= settled),
                           key=lambda p: p.accepted)[:excess + self.limit // 16]
        for peer in strangers:
            self._close(peer, "over_limit_unauthenticated")
        excess -= len(strangers)
        if excess > 0:
            known = sorted((p for p in self._peers.values() if p.last is not None and p.parked <= 0),
                           key=lambda p: p.last or 0.0)
            for peer in known[:excess]:
                self._close(peer, "over_limit")
            excess -= len(known[:excess])
        if excess > self.limit // 8:  # a flood faster than the grace: the hard bound holds whatever the rate
            young = sorted((p for p in self._peers.values() if p.last is None and p.parked <= 0),
                           key=lambda p: p.accepted)
            for peer in young[: excess - self.limit // 8]:
                self._close(peer, "over_limit_unauthenticated")

    def _close(self, peer: Peer, reason: str) -> None:
        self._peers.pop(peer.fd, None)
        try:
            if os.fstat(peer.fd).st_ino != peer.inode:  # libzmq closed it and the number went to another file
                return
            sock = socket.socket(fileno=peer.fd)
        except OSError:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)  # libzmq sees the peer gone and closes its descriptor
        except OSError:
            return
        finally:
            sock.detach()
        self.closing.closed(reason, peer.address)
