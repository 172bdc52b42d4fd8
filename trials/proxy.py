"""A TCP forwarder between one agent and the daemon's ZMQ port, so a fault trial can cut that agent's control
connection for real (the agent's ZMQ socket sees the TCP connection drop, reconnects, and may lose messages)."""

from __future__ import annotations

import socket
import threading
import time

_CHUNK = 1 << 16


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._blocked_until = 0.0
        self._closed = False
        threading.Thread(target=self._accept_loop, name="chaos-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def drop(self, block_s: float) -> None:
        """Cut every open connection and refuse new ones for ``block_s`` seconds (a short partition)."""
        with self._lock:
            self._blocked_until = time.monotonic() + block_s
            conns, self._conns = self._conns, []
        for conn in conns:
            _close(conn)

    def close(self) -> None:
        self._closed = True
        _close(self._server)
        self.drop(0)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if time.monotonic() < self._blocked_until:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
                upstream.settimeout(None)
            except OSError:  # the daemon is down: the agent's ZMQ socket will retry
                _close(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _close(src)
        _close(dst)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
