"""Bad frames against the real daemon's ZMQ control socket: random bytes, invalid and truncated msgpack,
non-map values, JSON garbage, oversized frames, odd envelopes, messages out of order, wrong field types,
unregistered agents and wrong tokens. Each gets an error reply (ok: false with an error) or is dropped (a log
line says so, or libzmq closes the connection of a frame over its hard cap); afterwards the daemon still
answers, its history is unchanged and a fresh agent registers and polls. Seeded: the same frames every run."""

from __future__ import annotations

import json
import random
import string
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from ckpt_engine.control.messages import MAX_ID
from ckpt_engine.server.zmq_server import hard_frame_cap
from tests.daemon_harness import DaemonProcess, free_port, start_daemon, write_config

pytestmark = pytest.mark.multiproc

TOKEN = "zmq-fuzz-token-0123456789"
MAX_FRAME = 64 << 10  # the daemon's zmq.max_frame_bytes here (small, so oversized frames are cheap)
SEED = 20240611


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> DaemonProcess:
    directory = tmp_path_factory.mktemp("fuzz-zmq")
    daemon = start_daemon(write_config(directory, auth_token=TOKEN,
                                       zmq={"endpoint": f"tcp://127.0.0.1:{free_port()}",
                                            "max_frame_bytes": MAX_FRAME}))
    with daemon.client() as client:  # one refused version, so "history unchanged" has something to compare
        assert client.post("/sync", json={"step": 1}).status_code == 503
    yield daemon
    assert daemon.stop() == 0


class Peer:
    """A DEALER socket: sends frames, returns the reply's frames (or None when none came)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes, timeout_ms: int = 5000) -> list[bytes] | None:
        self.sock.send_multipart(list(frames))
        if not self.sock.poll(timeout_ms):
            return None
        return self.sock.recv_multipart()

    def request(self, message: Any, encoding: str = "msgpack") -> dict:
        raw = json.dumps(message).encode() if encoding == "json" else msgpack.packb(message, use_bin_type=True)
        reply = self.ask(raw)
        assert reply is not None, f"no reply to {message!r}"
        return decode(reply[-1])

    def close(self) -> None:
        self.sock.close()


def decode(raw: bytes) -> dict:
    reply = json.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw, raw=False)
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
    if not reply["ok"]:
        assert isinstance(reply.get("error"), str) and reply["error"], reply
    return reply


def error_of(reply: list[bytes] | None) -> str:
    assert reply is not None, "no reply"
    answer = decode(reply[-1])
    assert answer["ok"] is False, answer
    return answer["error"]


@pytest.fixture()
def peer(daemon: DaemonProcess) -> Iterator[Peer]:
    peer = Peer(daemon.zmq)
    yield peer
    peer.close()


def _history(daemon: DaemonProcess) -> list[dict]:
    with daemon.client() as client:
        return client.get("/versions", params={"limit": 1000}).json()["versions"]


# ---- generators (all driven by one seeded Random) -------------------------------------------------------

def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds: list[Callable[[], Any]] = [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-5, 5),
        lambda: rng.choice([MAX_ID + 1, -(1 << 63), (1 << 64) - 1, 1 << 40]),
        lambda: rng.choice([0.0, -1.5, 1e308, float("inf"), float("-inf"), float("nan")]),
        lambda: "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 20))),
        lambda: rng.randbytes(rng.randint(0, 20)),
    ]
    if depth < 3:
        kinds += [lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))],
                  lambda: {rng.choice(["a", "type", "body", "id", "agent_id", "version"]): random_value(rng, depth + 1)
                           for _ in range(rng.randint(0, 4))}]
    return rng.choice(kinds)()


TEMPLATES: dict[str, dict] = {  # valid bodies of every message type but "sync" (which records a version)
    "register": {"role": "receiver", "rank": 0, "host": "h", "pid": 1, "device": "cpu", "versions": [],
                 "token": TOKEN, "sync_every": 1},
    "poll": {"agent_id": "0123456789ab", "session": "s" * 48, "versions": [1], "wait_s": 0},
    "report": {"agent_id": "0123456789ab", "session": "s" * 48, "version": 1, "event": "received", "ok": True,
               "receivers": []},
    "unregister": {"agent_id": "0123456789ab", "session": "s" * 48},
    "versions": {"limit": 5}, "version": {"version": 1}, "push": {"version": 1}, "status": {},
}


def mutated_message(rng: random.Random, index: int) -> dict:
    """A valid-looking message with one to three fields broken. Agent ids are never registered ones, and
    "register" always loses its token, so no frame here changes state: every one must be refused."""
    kind = rng.choice(sorted(TEMPLATES))
    body = dict(TEMPLATES[kind])
    for _ in range(rng.randint(1, 3)):
        action = rng.choice(["retype", "drop", "extra", "retype"])
        key = rng.choice(sorted(body) or ["x"])
        if action == "retype":
            body[key] = random_value(rng)
        elif action == "drop":
            body.pop(key, None)
        else:
            body[rng.choice(["colour", "agent", "Version", ""])] = random_value(rng)
    message: dict[str, Any] = {"id": index, "type": kind, "body": body}
    if kind in ("register", "versions", "version", "push", "status"):  # could succeed with the token
        body.pop("token", None)
        message["token"] = rng.choice([None, "", "wrong-token-wrong-token", TOKEN[:-1], 12345, [TOKEN]])
    else:  # the token, but an agent id nobody registered
        message["token"] = TOKEN
    if rng.random() < 0.2:
        message[rng.choice(["type", "body"])] = random_value(rng)
    return message


def encoded(rng: random.Random, message: dict) -> bytes:
    if rng.random() < 0.3:
        try:
            return json.dumps(message).encode()
        except (TypeError, ValueError):  # bytes are not JSON
            pass
    return msgpack.packb(message, use_bin_type=True)


# ---- tests --------------------------------------------------------------------------------------------------

def test_random_bytes_and_undecodable_frames_get_bad_frame_replies(peer: Peer) -> None:
    rng = random.Random(SEED)
    frames = [rng.randbytes(rng.randint(0, 512)) for _ in range(150)]
    frames += [b"", b"\xc1", b"\xc1\x00garbage", b"\x85", b"\xdd\xff\xff\xff\xff", b"\x91" * 100_000,
               b"\xc7\x03\xff\x00\x00\x00", b"{", b'{"id": 1,', b"{\xff}", b'{"a": NaN, "type": "status"',
               b"{" + b'"a":' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # deeper than Python's recursion limit
               b"{}" * 3, json.dumps({"id": 1}).encode()[:-1]]
    for raw in frames:
        reply = peer.ask(raw)
        assert reply is not None, f"no reply to {raw[:40]!r}"
        answer = decode(reply[-1])
        assert answer["ok"] is False, (raw[:40], answer)  # random bytes may decode as a map: then another error


@pytest.mark.parametrize("value", [0, -1, 1.5, None, True, "status", b"bytes", [1, 2, 3], [{"type": "status"}],
                                   [[[[]]]], "{}"])
def test_frames_that_are_not_maps_get_bad_frame(peer: Peer, value: Any) -> None:
    assert error_of(peer.ask(msgpack.packb(value, use_bin_type=True))) == "bad frame"
    assert error_of(peer.ask(json.dumps(value if not isinstance(value, bytes) else "b").encode())) == "bad frame"


def test_truncated_frames_get_bad_frame(peer: Peer) -> None:
    rng = random.Random(SEED + 1)
    for kind, body in TEMPLATES.items():
        raw = msgpack.packb({"id": 1, "type": kind, "body": body, "token": TOKEN}, use_bin_type=True)
        for cut in sorted({0, 1, len(raw) - 1, *(rng.randrange(1, len(raw)) for _ in range(6))}):
            assert error_of(peer.ask(raw[:cut])) == "bad frame", (kind, cut)
        text = json.dumps({"id": 1, "type": kind, "body": body, "token": TOKEN}).encode()
        assert error_of(peer.ask(text[:rng.randrange(1, len(text))])) == "bad frame"


def test_oversized_frames_are_refused_or_cost_the_connection(daemon: DaemonProcess, peer: Peer) -> None:
    status = msgpack.packb({"id": 1, "type": "status", "token": TOKEN, "pad": "x" * MAX_FRAME})
    assert len(status) > MAX_FRAME
    reply = peer.ask(status)
    assert error_of(reply) == "bad frame" and "exceeds the limit" in decode(reply[-1])["detail"]
    assert error_of(peer.ask(b"\x00" * (hard_frame_cap(MAX_FRAME) - 10))) == "bad frame"
    # Over libzmq's hard cap the frame is never buffered whole: the connection is dropped, nothing answers.
    lost = Peer(daemon.zmq)
    try:
        assert lost.ask(b"\x00" * (hard_frame_cap(MAX_FRAME) + 1), timeout_ms=1500) is None
    finally:
        lost.close()
    assert peer.request({"id": 2, "type": "status", "token": TOKEN})["ok"] is True


def test_envelopes_with_extra_frames(daemon: DaemonProcess, peer: Peer) -> None:
    status = msgpack.packb({"id": 7, "type": "status", "token": TOKEN})
    # Extra frames before the payload are routing envelope (a REQ delimiter, proxy hops): echoed back.
    reply = peer.ask(b"", status)
    assert reply is not None and reply[0] == b"" and decode(reply[1])["ok"] is True
    reply = peer.ask(b"hop-1", b"hop-2", status)
    assert reply is not None and reply[:2] == [b"hop-1", b"hop-2"] and decode(reply[2])["id"] == 7
    # The payload is the last frame: an envelope-looking last frame is a bad frame.
    assert error_of(peer.ask(status, b"")) == "bad frame"
    assert error_of(peer.ask(status, b"trailing")) == "bad frame"
    # More frames than any envelope needs: refused at once, with a log line.
    assert error_of(peer.ask(*[b"x"] * 20, status)) == "bad frame"
    assert "ZMQ message of 21 frames refused" in _wait_for_log(daemon, "frames refused")


def _wait_for_log(daemon: DaemonProcess, needle: str, timeout_s: float = 5) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in daemon.log():
            return daemon.log()
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in the daemon log:\n{daemon.log()}")


def test_wrong_or_missing_token_is_unauthorized_for_every_type(peer: Peer) -> None:
    for kind, body in TEMPLATES.items():
        body = {k: v for k, v in body.items() if k != "token"}
        for token in (None, "", "wrong-token-wrong-token", TOKEN + "x", TOKEN[:-1], 12345, [TOKEN]):
            message = {"id": 1, "type": kind, "body": body, **({} if token is None else {"token": token})}
            for encoding in ("msgpack", "json"):
                reply = peer.request(message, encoding)
                assert reply["ok"] is False and reply["error"] == "unauthorized", (kind, token, reply)
    wrong_in_body = {**TEMPLATES["register"], "token": "wrong-token-wrong-token"}
    assert peer.request({"id": 2, "type": "register", "body": wrong_in_body, "token": TOKEN})["error"] == "unauthorized"
    assert peer.request({"id": 3, "type": "sync", "body": {}})["error"] == "unauthorized"


def test_out_of_order_and_unregistered_agents(daemon: DaemonProcess, peer: Peer) -> None:
    before = _history(daemon)
    stranger = {"agent_id": "feedfacecafe", "session": "s" * 48}
    for kind, body in [("poll", {**stranger, "wait_s": 0}), ("report", {**stranger, "version": 1, "event": "done"}),
                       ("report", {**stranger, "version": 1, "event": "evicted", "cache_versions": [1]}),
                       ("unregister", stranger)]:
        reply = peer.request({"id": 1, "type": kind, "body": body, "token": TOKEN})
        assert reply["error"] == "bad request" and "unregistered agent" in reply["detail"], reply
    agent = peer.request({"id": 2, "type": "register", "body": TEMPLATES["register"], "token": TOKEN})["body"]
    mine = {"agent_id": agent["agent_id"], "session": agent["session"]}
    unknown = peer.request({"id": 3, "type": "report", "token": TOKEN,
                            "body": {**mine, "version": 987654, "event": "received", "ok": True}})
    assert unknown["error"] == "not found" and "987654" in unknown["detail"]
    # A receiver cannot report what only a trainer does, such as its cache bookkeeping.
    evicted = peer.request({"id": 4, "type": "report", "token": TOKEN,
                            "body": {**mine, "version": 1, "event": "evicted", "cache_versions": [1]}})
    assert evicted["error"] == "bad request" and "cannot report 'evicted'" in evicted["detail"], evicted
    for body in [{**mine, "wait_s": "soon"}, {**mine, "wait_s": -1}, {**mine, "wait_s": 1e9},
                 {**mine, "wait_s": float("nan")}, {**mine, "versions": "1"}, {**mine, "versions": [MAX_ID + 1]},
                 {"agent_id": 7}, {}]:
        assert peer.request({"id": 5, "type": "poll", "body": body, "token": TOKEN})["error"] == "bad request", body
    for body in [{**mine, "version": "one", "event": "done"}, {**mine, "version": 1, "event": "exploded"},
                 {**mine, "version": (1 << 64) - 1, "event": "done"},
                 {**mine, "version": 1, "event": "done", "step": 1 << 63},
                 {**mine, "version": 1, "event": "done", "receivers": [{"rank": "first", "ok": True}]},
                 {**mine, "version": 1, "event": "done", "receivers": "all"},
                 {**mine, "version": 1, "event": "done", "cache_versions": list(range(2000))}]:
        assert peer.request({"id": 6, "type": "report", "body": body, "token": TOKEN})["error"] == "bad request", body
    for kind, body in [("versions", {"limit": "ten"}), ("versions", {"limit": True}), ("versions", {"limit": 0}),
                       ("version", {"version": (1 << 64) - 1}), ("version", {"version": "1"}),
                       ("push", {"version": None}), ("push", {"version": -(1 << 63)}),
                       ("unregister", {"agent_id": ["x"]}), ("sync", {"step": (1 << 64) - 1}),
                       ("sync", {"timeout_s": -1}), ("sync", {"timeout_s": float("inf")}), ("sync", {"wait": [1]}),
                       ("register", {**TEMPLATES["register"], "role": "pirate"}),
                       ("register", {**TEMPLATES["register"], "pid": "one"}),
                       ("register", {**TEMPLATES["register"], "sync_every": 0}),
                       ("launch", {})]:
        assert peer.request({"id": 7, "type": kind, "body": body, "token": TOKEN})["error"] in (
            "bad request", "not found"), (kind, body)
    for message in [{"id": 8, "type": 7, "token": TOKEN}, {"id": 9, "type": "status", "body": [], "token": TOKEN},
                    {"id": 10, "type": None, "token": TOKEN}, {"type": "status", "body": "x", "token": TOKEN}]:
        assert peer.request(message)["error"] == "bad request", message
    peer.request({"id": 11, "type": "unregister", "body": mine, "token": TOKEN})
    assert _history(daemon) == before


def test_seeded_mutations_of_valid_messages_are_all_refused(daemon: DaemonProcess, peer: Peer) -> None:
    rng = random.Random(SEED + 2)
    before = _history(daemon)
    errors: dict[str, int] = {}
    for index in range(300):
        raw = encoded(rng, mutated_message(rng, index))
        if rng.random() < 0.1:
            raw = raw[:rng.randrange(len(raw))]
        reply = peer.ask(raw)
        assert reply is not None, f"no reply to {raw[:80]!r}"
        answer = decode(reply[-1])
        assert answer["ok"] is False, (raw[:200], answer)
        errors[answer["error"]] = errors.get(answer["error"], 0) + 1
    assert set(errors) <= {"bad frame", "bad request", "unauthorized", "not found"}, errors
    assert _history(daemon) == before


WRONG_TYPED: dict[str, dict[str, list[Any]]] = {  # fields of the reads and writes by id, with values of a wrong type
    "versions": {"limit": [[5], {"n": 5}, True, 2.5, "many", None], "status": [["failed"], 3, {"s": 1}, "bogus", b"x"],
                 "before": ["soon", [1], True, 0.5, {}]},
    "latest": {"status": [["failed"], 3, {"s": 1}, "bogus", b"x", True]},
    "version": {"version": ["one", [1], True, 1.5, None, {}]},
    "push": {"version": ["one", [1], True, 1.5, None, {}]},
    "evict": {"version": ["one", [1], True, 1.5, None, {}]},
}


def test_well_formed_frames_with_wrong_typed_fields_get_bad_request(daemon: DaemonProcess, peer: Peer) -> None:
    """With a valid token (trust round 3 found ZMQ `latest` answering an internal error for a list-valued
    status): every such frame is parsed by the same model as its HTTP twin and refused as a bad request."""
    rng = random.Random(SEED + 3)
    before = _history(daemon)
    for index in range(120):
        kind = rng.choice(sorted(WRONG_TYPED))
        field = rng.choice(sorted(WRONG_TYPED[kind]))
        body = {field: rng.choice(WRONG_TYPED[kind][field])}
        answer = decode(peer.ask(encoded(rng, {"id": index, "type": kind, "body": body, "token": TOKEN}))[-1])
        assert answer["ok"] is False and answer["error"] == "bad request", (kind, body, answer)
        assert field in str(answer["detail"]), (kind, body, answer)
    assert _history(daemon) == before
    assert "Traceback" not in daemon.log()


def test_the_daemon_is_whole_afterwards(daemon: DaemonProcess) -> None:
    before = _history(daemon)
    assert daemon.proc.poll() is None and "Traceback" not in daemon.log()
    with daemon.client() as client:
        assert client.get("/health").json() == {"ok": True, "degraded": False, "problem": None}
        assert client.get("/status").json()["in_flight"] is None
    fresh = Peer(daemon.zmq)
    try:
        agent = fresh.request({"id": 1, "type": "register", "body": TEMPLATES["register"], "token": TOKEN})
        assert agent["ok"] is True and agent["id"] == 1
        identity = {"agent_id": agent["body"]["agent_id"], "session": agent["body"]["session"]}
        polled = fresh.request({"id": 2, "type": "poll", "token": TOKEN, "body": {**identity, "wait_s": 0}})
        assert polled == {"id": 2, "ok": True, "body": {"assignment": None, "in_flight": None}}
        fresh.request({"id": 3, "type": "unregister", "token": TOKEN, "body": identity})
    finally:
        fresh.close()
    assert _history(daemon) == before and len(before) == 1 and before[0]["status"] == "failed"


# ---- a hostile peer with valid credentials ------------------------------------------------------------------

def test_a_hostile_peer_with_a_rollout_token_changes_nothing_but_its_own_standing(tmp_path) -> None:
    import threading

    import torch

    from ckpt_engine.trials.hostile import hostile_messages
    from ckpt_engine.workers.adapters.torch_module import ModuleAdapter
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from ckpt_engine.workers.trainer_agent import TrainerAgent
    from tests.raw_agent import RawAgent

    daemon = start_daemon(write_config(tmp_path, transport="collective"))
    trainer_model, rollout_model = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    trainer = TrainerAgent(trainer_model, daemon.zmq, poll_wait_s=0.2).start()
    receiver = RolloutAgent(ModuleAdapter(rollout_model).load, daemon.zmq, poll_wait_s=0.2).start()
    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            trainer.step(step)
            time.sleep(0.01)

    def request_sync(http) -> int:
        """The hostile receiver's catch-ups (which fail, alone) may be in flight: retry those 409s."""
        deadline = time.monotonic() + 60
        while True:
            reply = http.post("/sync", json={})
            if reply.status_code == 202 or time.monotonic() > deadline:
                return reply.json()["version"]
            time.sleep(0.2)

    loop = threading.Thread(target=train, daemon=True)
    loop.start()
    rng = random.Random(SEED + 3)
    answers: dict[str, int] = {}
    hostile = None
    try:
        with daemon.client() as http:
            assert http.post("/sync", json={"wait": True, "timeout_s": 60}).json()["status"] == "committed"
            hostile = RawAgent(daemon, "receiver")  # joins once the cluster holds a version
            hostile_ids = {hostile.agent_id}
            for _ in range(4):
                with torch.no_grad():
                    trainer_model.weight.add_(1.0)
                version = request_sync(http)
                victims = [trainer.agent_id, receiver.agent_id]
                messages = hostile_messages(rng, victims, hostile.identity, version)
                for index in range(60):
                    message = next(messages)
                    try:
                        hostile.request(message["type"], message["body"])
                        answers["ok"] = answers.get("ok", 0) + 1
                    except Exception as exc:  # noqa: BLE001 - refusals are the expected answers
                        key = getattr(exc, "error", type(exc).__name__)
                        answers[key] = answers.get(key, 0) + 1
                    if message["type"] == "register" and index % 7 == 0:
                        hostile.close()
                        hostile = RawAgent(daemon, "receiver")  # a fresh identity now and then
                        hostile_ids.add(hostile.agent_id)
                record = http.get(f"/versions/{version}").json()
                deadline = time.monotonic() + 30
                while record["status"] not in ("committed", "failed", "cancelled") and time.monotonic() < deadline:
                    time.sleep(0.1)
                    record = http.get(f"/versions/{version}").json()
                mine = [r for r in receiver.results if r.version == version]
                assert record["status"] == "committed", record
                assert mine and record["version_digest"] == mine[-1].version_digest  # the receiver's own digest
                status = http.get("/status").json()
                assert status["trainer"] == trainer.agent_id
            versions = http.get("/versions", params={"limit": 100}).json()["versions"]
            ids = [v["id"] for v in versions]
            assert sorted(ids) == list(range(1, len(ids) + 1))  # numbered by the daemon alone: 1, 2, ...
            # besides the operator's versions, only catch-ups the hostile receiver failed, alone
            others = [v for v in versions if v["purpose"] != "sync"]
            assert all({r["agent_id"] for r in v["receivers"]} <= hostile_ids for v in others), others
            assert torch.equal(rollout_model.weight, trainer_model.weight)
    finally:
        stop.set()
        loop.join(10)
        if hostile is not None:
            hostile.close()
        receiver.close()
        trainer.close()
        daemon.stop()
    # conflict: a second driver
    assert set(answers) <= {"ok", "forbidden", "bad request", "not found", "conflict"}, answers
