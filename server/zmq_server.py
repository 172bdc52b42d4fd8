"""ZMQ control plane: one ROUTER socket for agents and in-process callers (request/reply, never PUB/SUB).

A poll from an agent is parked until the controller has an assignment for it or its wait runs out, so work
reaches agents at once without busy polling. Every frame gets a reply; a malformed one gets an error reply
and never disturbs the loop. With an auth token configured, every message must carry it (agents send it
on every frame); later messages of an agent name the agent id its registration returned.

Size limits: a frame over ``max_frame_bytes`` gets an error reply; libzmq itself drops the connection of a
peer that sends a frame over twice that (MAXMSGSIZE), so a huge frame is never buffered whole.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from ckpt_engine.control.auth import Role
from ckpt_engine.control.messages import (MAX_ID, Poll, PollReply, Register, Report, SyncRequest, Unregister, decode_frame,
                                  encode_frame, parse_body)
from ckpt_engine.errors import ProtocolError
from ckpt_engine.server.authority import ANY, Authority
from ckpt_engine.server.controller import Controller
from ckpt_engine.server.errors import BadRequest, ControlError, NotFound
from ckpt_engine.server.history import TERMINAL

log = logging.getLogger(__name__)
_LOOP_POLL_MS = 20
_MAX_FRAMES = 8  # routing id + a REQ delimiter or a few proxy hops + the payload
_MAX_PARKED = 4096  # waiting polls and syncs; beyond this they are answered at once instead of parked
_ID_RANGE = (-MAX_ID, MAX_ID)


def hard_frame_cap(max_frame_bytes: int) -> int:
    """libzmq's MAXMSGSIZE: frames up to this get an error reply, larger ones cost the peer its connection."""
    return max(2 * max_frame_bytes, max_frame_bytes + (64 << 10))


@dataclass
class _Parked:
    envelope: list[bytes]
    request_id: Any
    encoding: str
    deadline: float
    ready: Callable[[], bool]
    answer: Callable[[], dict]


class ZmqServer:
    def __init__(self, controller: Controller, endpoint: str, *, max_frame_bytes: int, authority: Authority) -> None:
        self.controller = controller
        self.endpoint = endpoint
        self.max_frame_bytes = max_frame_bytes
        self.authority = authority
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._parked: list[_Parked] = []  # touched only by the loop thread
        self._thread = threading.Thread(target=self._run, name="ckpt-zmq", daemon=True)
        self.bound_endpoint: str | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"ZMQ server could not bind {self.endpoint}: {self._error}")

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, hard_frame_cap(self.max_frame_bytes))
        if self.endpoint.startswith("tcp://["):  # libzmq binds IPv6 addresses only when asked to
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(self.endpoint)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            sock.close()
            ctx.term()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(_LOOP_POLL_MS):
                    self._drain(sock)
                self._serve_parked(sock)
        finally:
            sock.close()
            ctx.term()

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(sock, frames)
            except Exception:  # never let one request kill the loop
                log.exception("ZMQ request handling failed")

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) < 2:
            log.warning("dropping a ZMQ message without an envelope (%d frame(s))", len(frames))
            return
        if len(frames) > _MAX_FRAMES:
            log.warning("ZMQ message of %d frames refused (at most %d)", len(frames) - 1, _MAX_FRAMES - 1)
            self._reply(sock, frames[:1], "msgpack", {"id": None, "ok": False, "error": "bad frame",
                                                       "detail": f"{len(frames) - 1} frames; at most "
                                                                 f"{_MAX_FRAMES - 1} are accepted"})
            return
        envelope, payload = frames[:-1], frames[-1]
        try:
            message, encoding = decode_frame(payload, self.max_frame_bytes)
        except ProtocolError as exc:
            self._reply(sock, envelope, "msgpack", {"id": None, "ok": False, "error": "bad frame", "detail": str(exc)})
            return
        request_id = message.get("id")
        try:
            result = self._dispatch(message, envelope, encoding)
            if isinstance(result, _Parked):
                self._parked.append(result)
                return
            reply = {"id": request_id, "ok": True, "body": result}
        except ControlError as exc:
            self.controller.metrics.refused.labels(reason=exc.error).inc()
            reply = {"id": request_id, "ok": False, "error": exc.error, "detail": exc.detail, "record": exc.record}
        except ProtocolError as exc:
            self.controller.metrics.refused.labels(reason="bad request").inc()
            reply = {"id": request_id, "ok": False, "error": "bad request", "detail": str(exc)}
        except Exception as exc:  # a bug, but the caller still gets an answer instead of its timeout
            log.exception("ZMQ %r request failed", message.get("type"))
            reply = {"id": request_id, "ok": False, "error": "internal error", "detail": f"{type(exc).__name__}: {exc}"}
        self._reply(sock, envelope, encoding, reply)

    def _dispatch(self, message: dict, envelope: list[bytes], encoding: str) -> dict | _Parked:
        kind, body = message.get("type"), message.get("body", {})
        if not isinstance(kind, str):
            raise ProtocolError("frame has no 'type'")
        if not isinstance(body, dict):
            raise ProtocolError("'body' must be a map")
        operation = _OPERATIONS.get(kind)
        # Before anything else is parsed: without a valid token a peer learns nothing but "unauthorized".
        # Agents send the token on every frame; a Register may carry it in its body instead.
        in_body = body.get("token") if kind == "register" else None
        token = in_body if in_body is not None else message.get("token")
        if operation is None:
            self.authority.require(token, ANY, "any request")
            raise BadRequest(f"unknown message type {kind!r}")
        roles = self.authority.require(token, operation.roles(body), f"{kind!r}")
        return operation.run(self, _Request(message, envelope, encoding, body, roles))

    # ---- operations ----------------------------------------------------------------------------------
    def _register(self, request: "_Request") -> dict:
        return self.controller.register(parse_body(Register, request.body)).model_dump()

    def _poll(self, request: "_Request") -> dict | _Parked:
        poll = parse_body(Poll, request.body)
        self.controller.acknowledge(poll, request.roles)  # first: an acknowledged assignment must not be sent again
        assignment = self.controller.poll(poll, request.roles)
        if assignment is None and poll.wait_s > 0 and len(self._parked) < _MAX_PARKED:
            return self._park_poll(request.message, request.envelope, request.encoding, poll, request.roles)
        return PollReply(assignment=assignment).model_dump()

    def _report(self, request: "_Request") -> dict:
        self.controller.report(parse_body(Report, request.body), request.roles)
        return {}

    def _unregister(self, request: "_Request") -> dict:
        leaving = parse_body(Unregister, request.body)
        self.controller.unregister(leaving.agent_id, leaving.session, request.roles)
        return {}

    def _sync(self, request: "_Request") -> dict | _Parked:
        sync = parse_body(SyncRequest, request.body)
        record = self.controller.request_sync(step=sync.step, bypass_cpu=sync.bypass_cpu, sparse=sync.sparse)
        if sync.wait and len(self._parked) < _MAX_PARKED:
            return self._park_until_terminal(request.message, request.envelope, request.encoding, record.id,
                                             sync.timeout_s)
        return record.to_dict()

    def _versions(self, request: "_Request") -> dict:
        limit = _int_arg(request.body, "limit", 50, (1, 1000))
        return {"versions": [r.to_dict() for r in self.controller.history.list(limit=limit)]}

    def _version(self, request: "_Request") -> dict:
        version = _int_arg(request.body, "version", None, _ID_RANGE)
        record = self.controller.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        return record.to_dict()

    def _push(self, request: "_Request") -> dict:
        return self.controller.push(_int_arg(request.body, "version", None, _ID_RANGE)).to_dict()

    def _status(self, request: "_Request") -> dict:
        return self.controller.status()

    def _park_until_terminal(self, message: dict, envelope: list[bytes], encoding: str, version: int,
                             timeout_s: float | None) -> _Parked:
        history = self.controller.history
        limit = timeout_s or self.controller.config.timeouts.version_s
        return _Parked(envelope, message.get("id"), encoding, time.monotonic() + limit,
                       lambda: history.get(version).status in TERMINAL,  # type: ignore[union-attr]
                       lambda: history.get(version).to_dict())  # type: ignore[union-attr]

    def _park_poll(self, message: dict, envelope: list[bytes], encoding: str, request: Poll,
                   roles: set[str]) -> _Parked:
        agent_id = request.agent_id

        def answer() -> dict:
            try:
                return PollReply(assignment=self.controller.poll(request, roles)).model_dump()
            except ControlError:
                return PollReply().model_dump()

        return _Parked(envelope, message.get("id"), encoding, time.monotonic() + request.wait_s,
                       lambda: self.controller.has_pending(agent_id), answer)

    def _serve_parked(self, sock: zmq.Socket) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        keep = []
        for parked in self._parked:
            if parked.ready() or now >= parked.deadline:
                self._reply(sock, parked.envelope, parked.encoding,
                            {"id": parked.request_id, "ok": True, "body": parked.answer()})
            else:
                keep.append(parked)
        self._parked = keep

    def _reply(self, sock: zmq.Socket, envelope: list[bytes], encoding: str, reply: dict) -> None:
        try:
            frame = encode_frame(reply, encoding)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. an id echoed back that JSON cannot hold
            log.warning("could not encode a ZMQ reply (%s); sending an error instead", exc)
            frame = encode_frame({"id": None, "ok": False, "error": "internal error",
                                  "detail": f"reply not encodable: {exc}"}, "msgpack")
        try:
            sock.send_multipart([*envelope, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not reply to a ZMQ peer: %s", exc)


@dataclass(frozen=True)
class _Request:
    message: dict
    envelope: list[bytes]
    encoding: str
    body: dict
    roles: set[Role]


@dataclass(frozen=True)
class _Operation:
    roles: Callable[[dict], frozenset[Role]]
    run: Callable[[ZmqServer, _Request], dict | _Parked]


def _fixed(*roles: Role) -> Callable[[dict], frozenset[Role]]:
    return lambda body: frozenset(roles)


def _registering(body: dict) -> frozenset[Role]:
    return frozenset({"trainer"} if body.get("role") == "trainer" else {"rollout"})


# One entry per message type: the roles a token must grant, and the handler.
_OPERATIONS: dict[str, _Operation] = {
    "register": _Operation(_registering, ZmqServer._register),
    "poll": _Operation(_fixed("trainer", "rollout"), ZmqServer._poll),
    "report": _Operation(_fixed("trainer", "rollout"), ZmqServer._report),
    "unregister": _Operation(_fixed("trainer", "rollout"), ZmqServer._unregister),
    "sync": _Operation(_fixed("operator", "trainer"), ZmqServer._sync),
    "push": _Operation(_fixed("operator"), ZmqServer._push),
    "versions": _Operation(lambda body: ANY, ZmqServer._versions),
    "version": _Operation(lambda body: ANY, ZmqServer._version),
    "status": _Operation(lambda body: ANY, ZmqServer._status),
}


def _int_arg(body: dict, key: str, default: int | None, bounds: tuple[int, int]) -> int:
    """An integer field of a body within ``bounds`` (bools are not integers here)."""
    value = body.get(key, default)
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{key}' must be an integer from {low} to {high}")
    return value
