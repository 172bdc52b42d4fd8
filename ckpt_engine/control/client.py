"""ZMQ client for the daemon's control socket: request/reply with request ids and a timeout on every wait.

Not thread-safe by itself; methods take a lock, so one client can be shared, but an agent gives its
long-polling thread a client of its own so reports never queue behind a parked poll.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ckpt_engine.control.messages import decode_frame, encode_frame
from ckpt_engine.errors import CkptEngineError, SyncTimeoutError

_MAX_REPLY_BYTES = 64 << 20


class ControlReplyError(CkptEngineError):
    """The daemon answered with an error."""

    def __init__(self, error: str, detail: Any, record: dict | None = None) -> None:
        super().__init__(f"{error}: {detail}")
        self.error, self.detail, self.record = error, detail, record


class RequestAbandoned(CkptEngineError):
    """The caller stopped waiting for the reply (it would no longer mean anything)."""


class ControlClient:
    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, token: str | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.token = token
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.closed = False

    def request(self, kind: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                abandon: Callable[[], bool] | None = None) -> dict:
        """Send one request and wait for its reply; raises SyncTimeoutError or ControlReplyError, or
        RequestAbandoned once ``abandon()`` turns true while waiting (checked every 0.1 s)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            reply = self._exchange(kind, body, limit, abandon)
        except zmq.ZMQError as exc:  # e.g. the client was closed while another thread still reported
            raise CkptEngineError(f"control socket to {self.endpoint} failed: {exc}") from exc
        if not reply.get("ok"):
            raise ControlReplyError(str(reply.get("error")), reply.get("detail"), reply.get("record"))
        return reply.get("body") or {}

    def _exchange(self, kind: str, body: dict[str, Any] | None, limit: float,
                  abandon: Callable[[], bool] | None) -> dict:
        with self._lock:
            request_id = next(self._ids)
            frame: dict[str, Any] = {"id": request_id, "type": kind, "body": body or {}}
            if self.token is not None:
                frame["token"] = self.token
            self._sock.send(encode_frame(frame))
            deadline = time.monotonic() + limit
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    raise SyncTimeoutError(f"no reply to {kind!r} from {self.endpoint} within {limit:.1f}s")
                if abandon is not None and abandon():
                    raise RequestAbandoned(f"stopped waiting for the reply to {kind!r}")
                if not self._sock.poll(min(remaining_ms, 100) if abandon else remaining_ms, zmq.POLLIN):
                    continue
                reply, _ = decode_frame(self._sock.recv(), _MAX_REPLY_BYTES)
                if reply.get("id") == request_id:
                    return reply  # replies to earlier, timed-out requests are dropped

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._sock.close(linger=0)
