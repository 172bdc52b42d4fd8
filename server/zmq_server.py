"""ZMQ control plane: one ROUTER socket for agents and in-process callers (request/reply, never PUB/SUB).

A poll from an agent is parked until the controller has an assignment for it or its wait runs out, so work
reaches agents at once without busy polling. Every frame gets a reply; a malformed one gets an error reply
and never disturbs the loop. With an auth token configured, every message must carry it (agents send it
on every frame); later messages of an agent name the agent id its registration returned.

Size limits: a frame over ``max_frame_bytes`` gets an error reply. libzmq itself drops the connection of a
peer that sends a frame over about twice that (MAXMSGSIZE, ``hard_frame_cap``), so a huge frame is never
buffered whole.

Connections: a handshake must end within ``handshake_timeout_s`` (ZMQ_HANDSHAKE_IVL), and at most
``max_peers`` stay open. To make room, server/zmq_peers.py closes those that never authenticated, then those
silent longest. No ZMTP heartbeats: after a daemon stall (SIGSTOP, swapping) libzmq would fire their expired
timers before reading the answers waiting for it, and drop every agent's connection.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Any

import zmq

from ckpt_engine.control.auth import ANY_ROLE, Role
from ckpt_engine.control.messages import Poll, PollReply, decode_frame, encode_frame
from ckpt_engine.errors import ProtocolError
from ckpt_engine.server.authority import Authority
from ckpt_engine.server.connections import ClosedConnections
from ckpt_engine.server.controller import Controller
from ckpt_engine.server.errors import BadRequest, ControlError
from ckpt_engine.server.history import TERMINAL
from ckpt_engine.server.operations import OPERATIONS, JsonText
from ckpt_engine.server.zmq_peers import Peer, PeerGuard

log = logging.getLogger(__name__)
_LOOP_POLL_MS = 20
_MAX_FRAMES = 8  # routing id + a REQ delimiter or a few proxy hops + the payload
_MAX_PARKED = 4096  # waiting polls and syncs; beyond this they are answered at once instead of parked


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
    peer: Peer | None = None  # the connection it came on (not closed to make room while it waits)
    agent_id: str | None = None  # a poll: its agent's (one parked poll per agent)


class ZmqServer:
    def __init__(self, controller: Controller, endpoint: str, *, max_frame_bytes: int, authority: Authority,
                 max_peers: int = 8192, handshake_timeout_s: float = 10.0) -> None:
        self.controller = controller
        self.endpoint = endpoint
        self.max_frame_bytes = max_frame_bytes
        self.authority = authority
        self.max_peers = max_peers
        self.handshake_timeout_s = handshake_timeout_s
        self.closing = ClosedConnections("ZMQ", controller.metrics.connections_closed)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._parked: list[_Parked] = []  # touched only by the loop thread
        self._guard: PeerGuard | None = None  # set by the loop thread once bound
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
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(self.handshake_timeout_s * 1000)))
        if self.endpoint.startswith("tcp://["):  # libzmq binds IPv6 addresses only when asked to
            sock.setsockopt(zmq.IPV6, 1)
        guard = PeerGuard(ctx, self.max_peers, self.closing)
        try:
            guard.attach(sock)
            sock.bind(self.endpoint)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            guard.bound(self.bound_endpoint)
        except (zmq.ZMQError, RuntimeError) as exc:
            self._error = exc
            self._ready.set()
            guard.detach(sock)
            sock.close()
            ctx.term()
            return
        self._guard = guard
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(_LOOP_POLL_MS):
                    self._drain(sock)
                self._serve_parked(sock)
        finally:
            guard.detach(sock)
            sock.close()
            ctx.term()

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [part.bytes for part in parts]
            try:
                self._handle(sock, frames, self._guard.peer(_source_fd(parts[-1])) if self._guard else None)
            except Exception:  # never let one request kill the loop
                log.exception("ZMQ request handling failed")

    def _handle(self, sock: zmq.Socket, frames: list[bytes], peer: Peer | None = None) -> None:
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
            result = self._dispatch(message, envelope, encoding, peer)
            if isinstance(result, _Parked):
                result.peer = peer
                if peer is not None:
                    peer.parked += 1
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

    def _dispatch(self, message: dict, envelope: list[bytes], encoding: str,
                  peer: Peer | None = None) -> dict | _Parked:
        kind, body = message.get("type"), message.get("body", {})
        if not isinstance(kind, str):
            raise ProtocolError("frame has no 'type'")
        if not isinstance(body, dict):
            raise ProtocolError("'body' must be a map")
        operation = OPERATIONS.get(kind)
        # Before anything else is parsed: without a valid token a peer learns nothing but "unauthorized".
        # Agents send the token on every frame; a Register may carry it in its body instead.
        in_body = body.get("token") if kind == "register" else None
        token = in_body if in_body is not None else message.get("token")
        if operation is None:
            self.authority.require(token, ANY_ROLE, "any request")
            PeerGuard.spoke(peer)
            raise BadRequest(f"unknown message type {kind!r}")
        roles = self.authority.require(token, operation.roles(body), f"{kind!r}")
        PeerGuard.spoke(peer)  # peers that never sent a valid token are closed first when connections run short
        request = operation.parse(body)
        result = operation.run(self.controller, request, roles)
        if kind == "poll":  # answered now if there is work, else parked until there is or its wait ends
            return self._poll_reply(message, envelope, encoding, result, roles)
        if kind == "sync" and request.wait and len(self._parked) < _MAX_PARKED:  # waits as over HTTP
            return self._park_until_terminal(message, envelope, encoding, result["id"], request.timeout_s)
        return json.loads(result) if isinstance(result, JsonText) else result

    def _poll_reply(self, message: dict, envelope: list[bytes], encoding: str, poll: Poll,
                    roles: set[Role]) -> dict | _Parked:
        reply = self.controller.poll(poll, roles)
        if reply.assignment is None and poll.wait_s > 0 and len(self._parked) < _MAX_PARKED:
            return self._park_poll(message, envelope, encoding, poll, roles)
        return reply.model_dump()

    def _park_until_terminal(self, message: dict, envelope: list[bytes], encoding: str, version: int,
                             timeout_s: float | None) -> _Parked:
        history = self.controller.history
        limit = timeout_s or self.controller.config.timeouts.version_s
        return _Parked(envelope, message.get("id"), encoding, time.monotonic() + limit,
                       lambda: history.get(version).status in TERMINAL,  # type: ignore[union-attr]
                       lambda: history.get(version).to_dict())  # type: ignore[union-attr]

    def _park_poll(self, message: dict, envelope: list[bytes], encoding: str, request: Poll,
                   roles: Set[str]) -> _Parked:
        agent_id = request.agent_id

        def answer() -> dict:
            try:
                return self.controller.poll(request, roles).model_dump()
            except (ControlError, ProtocolError):  # the agent left or was replaced while its poll waited
                return PollReply().model_dump()

        now = time.monotonic()
        # One parked poll per agent: older ones are answered now (empty), so polls parked on many connections
        # cannot pin them all.
        for earlier in self._parked:
            if earlier.agent_id == agent_id:
                earlier.deadline = now
        return _Parked(envelope, message.get("id"), encoding, now + request.wait_s,
                       lambda: self.controller.has_pending(agent_id), answer, agent_id=agent_id)

    def _serve_parked(self, sock: zmq.Socket) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        keep = []
        for parked in self._parked:
            try:
                if parked.ready() or now >= parked.deadline:
                    self._reply(sock, parked.envelope, parked.encoding,
                                {"id": parked.request_id, "ok": True, "body": parked.answer()})
                else:
                    keep.append(parked)
                    continue
            except Exception as exc:  # one parked request must never end the loop that serves every other
                log.exception("answering a parked request failed")
                self._reply(sock, parked.envelope, parked.encoding, {"id": parked.request_id, "ok": False,
                            "error": "internal error", "detail": f"{type(exc).__name__}: {exc}"})
            if parked.peer is not None:
                parked.peer.parked -= 1
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


def _source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection a message came on (libzmq's ZMQ_SRCFD)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
