"""Loosely typed values are refused on both planes (issue 35, finding 6): ``{"step": "1"}``, ``{"step": 1.0}``,
``{"bypass_cpu": "yes"}`` in ``POST /sync`` and the ZMQ ``sync``, and ``/versions/1.0`` or ``/versions/%201``
for version 1, are a 422 with a JSON reason over HTTP and a ``bad request`` over ZMQ; what agents, the CLI and
callers really send (ints from msgpack, floats that are floats or whole) still validates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from pydantic import TypeAdapter, ValidationError

from ckpt_engine.control.client import ControlClient, ControlReplyError
from ckpt_engine.control.messages import (
    FrameworkSyncRequest,
    Poll,
    Register,
    Report,
    SyncRequest,
    VersionsQuery,
    decode_frame,
    encode_frame,
    parse_body,
)
from ckpt_engine.errors import ProtocolError
from ckpt_engine.server.http_app import VersionId
from ckpt_engine.server.operations import OPERATIONS
from tests.daemon_harness import DaemonProcess, start_daemon, write_config

SESSION = "s" * 32

LOOSE_SYNC_BODIES = [
    {"step": "1"}, {"step": 1.0}, {"step": True}, {"step": "0x1"},
    {"bypass_cpu": "yes"}, {"bypass_cpu": 1}, {"bypass_cpu": "true"},
    {"sparse": "false"}, {"sparse": 0},
    {"wait": 1}, {"wait": "true"},
    {"timeout_s": "5"}, {"timeout_s": True},
]
SYNC_BODIES = [
    {}, {"step": 1}, {"step": 0}, {"step": None}, {"bypass_cpu": True}, {"bypass_cpu": None}, {"sparse": False},
    {"wait": True, "timeout_s": 5}, {"wait": True, "timeout_s": 2.5},
    {"step": 7, "bypass_cpu": None, "sparse": None},  # what ``ckpt-engine sync`` sends (cli/main.py)
]


# ---- the models (pure) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", LOOSE_SYNC_BODIES, ids=repr)
def test_loose_sync_bodies_are_refused_on_both_planes(body: dict) -> None:
    with pytest.raises(ValidationError):  # POST /sync: FastAPI validates the body with the model as it is
        SyncRequest.model_validate(body)
    with pytest.raises(ProtocolError, match=next(iter(body))):  # the ZMQ sync
        OPERATIONS["sync"].parse(body)


@pytest.mark.parametrize("body", SYNC_BODIES, ids=repr)
def test_typed_sync_bodies_are_taken_on_both_planes(body: dict) -> None:
    assert SyncRequest.model_validate(body).model_dump(exclude_unset=True) == {
        k: (float(v) if k == "timeout_s" else v) for k, v in body.items()}
    for encoding in ("msgpack", "json"):  # as the frame arrives
        frame, _ = decode_frame(encode_frame({"id": 1, "type": "sync", "body": body}, encoding), 1 << 20)
        OPERATIONS["sync"].parse(frame["body"])


def test_a_frameworks_sync_is_typed_too() -> None:
    body = {"receivers": ["agent-1", "agent-2"], "bypass_cpu": False, "limit_s": 600, "agent_id": "agent-0",
            "session": SESSION}  # what verl's actor rank 0 sends (workers/adapters/verl/daemon.py)
    for encoding in ("msgpack", "json"):
        frame, _ = decode_frame(encode_frame({"body": {**body, "limit_s": 37.5}}, encoding), 1 << 20)
        assert isinstance(OPERATIONS["sync"].parse(frame["body"]), FrameworkSyncRequest)
    assert OPERATIONS["sync"].parse(body).limit_s == 600.0
    for loose in ({"limit_s": "600"}, {"receivers": "agent-1"}, {"bypass_cpu": "no"}):
        with pytest.raises(ProtocolError):
            OPERATIONS["sync"].parse({**body, **loose})


@pytest.mark.parametrize("text, expected", [("1", 1), ("0", 0), ("-1", -1), ("007", 7),
                                            ("9007199254740991", 2**53 - 1)])
def test_a_version_in_a_path_is_digits(text: str, expected: int) -> None:
    assert TypeAdapter(VersionId).validate_python(text) == expected


@pytest.mark.parametrize("text", ["1.0", " 1", "1 ", "%201", "+1", "1_0", "\uff11", "", "-", "0x1", "1e3", "one",
                                  "9007199254740992"])
def test_anything_else_in_a_path_is_no_version(text: str) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(VersionId).validate_python(text)
    with pytest.raises(ValidationError):
        TypeAdapter(VersionId).validate_python(True)


def test_history_queries_take_digits_over_http_and_integers_over_zmq() -> None:
    assert VersionsQuery.model_validate({"limit": "5", "before": "9"}).limit == 5  # a query string's text
    for loose in ({"limit": "5.0"}, {"limit": " 5"}, {"before": "1e3"}, {"limit": True}):
        with pytest.raises(ValidationError):
            VersionsQuery.model_validate(loose)
    assert OPERATIONS["versions"].parse({"limit": 5}).limit == 5
    with pytest.raises(ProtocolError, match="limit"):
        OPERATIONS["versions"].parse({"limit": "5"})
    with pytest.raises(ProtocolError, match="version"):
        OPERATIONS["version"].parse({"version": 1.0})


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_agents_own_messages_still_validate(encoding: str) -> None:
    """What workers/agent.py sends, through the frame codec: ints stay ints, floats stay floats (and whole
    numbers are good floats)."""
    messages: list[tuple[type, dict[str, Any]]] = [
        (Register, {"role": "receiver", "rank": 0, "host": "h", "pid": 42, "device": "cpu", "versions": [1, 2],
                    "history_id": "x" * 16, "sync_every": 1, "whole_versions": False, "staging": "auto"}),
        (Poll, {"agent_id": "a-1", "session": SESSION, "versions": [3], "wait_s": 1.0, "received": "send:3"}),
        (Poll, {"agent_id": "a-1", "session": SESSION, "versions": [], "wait_s": 1, "received": None}),
        (Report, {"agent_id": "a-1", "session": SESSION, "version": 3, "event": "done", "step": 12, "ok": True,
                  "version_digest": "ab" * 8, "bytes": 1 << 40, "buckets": 2, "tensors": 10,
                  "stages": {"header": 0.001, "broadcast": 2, "ack": 0.5},
                  "receivers": [{"rank": 1, "ok": True, "seconds": {"load": 0.25, "verify": 1}}]}),
    ]
    for model, body in messages:
        raw = encode_frame({"id": 1, "type": "x", "body": body}, encoding)  # type: ignore[arg-type]
        frame, _ = decode_frame(raw, 1 << 20)
        parse_body(model, frame["body"], strict=True)


# ---- the live daemon ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    daemon = start_daemon(write_config(tmp_path_factory.mktemp("strict-types")))
    with daemon.client() as client:  # version 1: refused (no agents), recorded as failed
        assert client.post("/sync", json={"step": 1}).status_code == 503
    yield daemon
    assert daemon.stop() == 0


@pytest.mark.multiproc
def test_http_answers_loose_values_with_422_and_a_json_reason(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        for body in ({"step": "1"}, {"step": 1.0}, {"bypass_cpu": "yes"}):
            reply = client.post("/sync", json=body)
            assert reply.status_code == 422, (body, reply.text)
            answer = reply.json()
            field = next(iter(body))
            assert answer["error"] == "invalid request" and answer["detail"][0]["loc"] == ["body", field], answer
        assert client.get("/versions/1").json()["id"] == 1
        for method, path in (("GET", "/versions/1.0"), ("GET", "/versions/%201"), ("POST", "/versions/1.0/push"),
                             ("DELETE", "/versions/%201"), ("GET", "/versions?limit=1.0")):
            reply = client.request(method, path)
            assert reply.status_code == 422, (method, path, reply.text)
            assert reply.json()["error"] == "invalid request", reply.text
        history = client.get("/versions").json()["versions"]
    assert [record["id"] for record in history] == [1]  # none of them started a version


@pytest.mark.multiproc
def test_a_query_parameter_given_twice_is_refused_whichever_value_is_valid(daemon: DaemonProcess) -> None:
    # Found by the outside attack of 2026-11-28: the last value won, unchecked ones included (?limit=abc&limit=2).
    with daemon.client() as client:
        for query in ("limit=100000&limit=1", "limit=1&limit=100000", "limit=abc&limit=2", "status=failed&status="):
            reply = client.get(f"/versions?{query}")
            assert reply.status_code == 422, (query, reply.text)
            name = query.partition("=")[0]
            assert reply.json()["detail"] == [{"loc": ["query", name], "msg": "given more than once"}], reply.text
        assert client.get("/versions?limit=1&status=failed").status_code == 200


@pytest.mark.multiproc
def test_zmq_answers_loose_values_with_bad_request(daemon: DaemonProcess) -> None:
    client = ControlClient(daemon.zmq, timeout_s=60, token=daemon.token)
    try:
        for body in ({"step": "1"}, {"step": 1.0}, {"bypass_cpu": "yes"}):
            with pytest.raises(ControlReplyError) as refused:
                client.request("sync", body)
            assert refused.value.error == "bad request" and next(iter(body)) in str(refused.value.detail), body
        with pytest.raises(ControlReplyError, match="unavailable"):  # a typed body gets as far as the controller
            client.request("sync", {"step": 2})
    finally:
        client.close()
    # a JSON frame too: 1.0 stays a float there
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.zmq)
    try:
        sock.send(json.dumps({"id": 7, "type": "sync", "body": {"step": 1.0}, "token": daemon.token}).encode())
        assert sock.poll(60_000), "no reply"
        raw = sock.recv()
        answer = json.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw)
        assert answer["id"] == 7 and answer["ok"] is False and answer["error"] == "bad request", answer
    finally:
        sock.close()
