"""Config fuzz: seeded mutations of deploy/engine.yaml (wrong types, out-of-range numbers, unknown and
misplaced keys, bad enums, endpoints, ports and hosts, nulls, duplicate keys, tokens, inconsistent timeouts).

Every rejected mutation must be a ConfigError naming the mutated key; every accepted one must really work,
which is checked here with the real pieces the daemon uses later (socket and ZMQ binds, the RegisterReply
every agent gets, JSON for /status, the bucket planner, header round trip of the token, ...). A few
accepted ones start the real daemon; a few rejected ones must stop `check-config` and `serve` at once."""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from ckpt_engine.config import EngineConfig, load_config
from ckpt_engine.control.messages import ReceiverAck, RegisterReply, Report, encode_frame
from ckpt_engine.errors import ConfigError
from tests.daemon_harness import ROOT, free_port, start_daemon

DEPLOY = ROOT / "deploy" / "engine.yaml"
BASE: dict = yaml.safe_load(DEPLOY.read_text())
SEED = 1337
MUTATIONS = 400
SECTIONS = ("timeouts", "http", "zmq", "store")


@dataclass
class Mutation:
    kind: str
    path: str  # the key the error must name
    data: dict
    text: str | None = None  # raw YAML instead of data (duplicate keys)
    env: dict[str, str] = field(default_factory=dict)

    def write(self, directory: Path) -> Path:
        path = directory / f"mutation-{uuid.uuid4().hex[:8]}.yaml"
        path.write_text(self.text if self.text is not None else yaml.safe_dump(self.data, sort_keys=False))
        return path


def leaves(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        out += leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]
    return out


def set_path(data: dict, path: str, value: Any) -> dict:
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[leaf] = value
    return data


def get_path(data: dict, path: str) -> Any:
    for key in path.split("."):
        data = data[key]
    return data


LEAVES = leaves(BASE)
NUMERIC = [p for p in LEAVES if type(get_path(BASE, p)) in (int, float)]
TEXT = ["http.host", "zmq.endpoint", "store.history_path", "store.rendezvous_host", "device", "backend",
        "transport", "auth_token"]
ODD_VALUES = ["text", True, False, [1], {"a": 1}, 3.5, -7, None, "", 0, "1", 1e400]
NUMBERS = [0, -1, -0.5, 1e-9, 0.001, 0.5, 1, 7, 8, 1023, 1024, 4096, 65535, 65536, 86400, 86401, 1e12, 2 ** 21,
           2 ** 64, 10 ** 30, float("inf"), float("-inf"), float("nan"), "12", "0x10", "1e3", 2.5]
ENUM_VALUES = ["", "CUDA", "gpu", "tpu", " cpu", "cpu ", "auto\n", "Auto", "none", "nccl,gloo"]
ENDPOINTS = ["tcp://", "foo", "tcp://127.0.0.1", "tcp://127.0.0.1:", "tcp://127.0.0.1:99999", "tcp://:8766",
             "tcp://127.0.0.1:8766:1", "udp://127.0.0.1:1", "inproc://x", "ipc://", "tcp://::1:8766",
             "tcp://127.0.0.1:-1", "tcp://127.0.0.1:８７６６", "tcp://256.1.1.1:1", "tcp://exa mple:1",
             "ipc:///no-such-dir-for-ckpt/x.sock", "ipc://" + "a" * 200, " tcp://127.0.0.1:1", "TCP://127.0.0.1:1",
             "tcp://[::1]:0", "tcp://*:0", "tcp://localhost:0", "tcp://127.0.0.1:*", "ipc://@ckpt-fuzz",
             "tcp://0.0.0.0:0"]
HOSTS = ["", " ", "foo bar", "256.0.0.1", "1.2.3", "::::", "-bad", "bad-", "a" * 300, "http://x", "127.0.0.1:80",
         "[::1]", "host_name", "ünïcode", "127.0.0.1 ", "*", "..", "a..b", "10.0.0.1/8",
         "127.0.0.1", "localhost", "0.0.0.0", "::1", "::"]
PORTS = [-1, 65536, 70000, 10 ** 6, "http", 1.5, 0, 65535, "8765"]
TOKENS = ["short", " " * 20, "x" * 15, "tok en with a space", "é" * 16, "a" * 5000, "\t" + "a" * 16, "a" * 16 + "\n",
          "a" * 16, "S3cret!token#with$symbols", 1234567890123456789, True, ["a" * 16]]
KEYS = ["bypass-cpu", "BYPASS_CPU", "bypassCpu", "bucket_size", "timeout", "tokens", "port", "host", "extra",
        "http.port", "ack", "keep_version", "verify ", "Device", "auth-token", "endpoint"]


def m_wrong_type(rng: random.Random) -> Mutation:
    path = rng.choice(LEAVES + ["auth_token"])
    return Mutation("wrong_type", path, set_path(copy.deepcopy(BASE), path, rng.choice(ODD_VALUES)))


def m_number(rng: random.Random) -> Mutation:
    path = rng.choice(NUMERIC)
    return Mutation("number", path, set_path(copy.deepcopy(BASE), path, rng.choice(NUMBERS)))


def m_unknown_key(rng: random.Random) -> Mutation:
    section, key = rng.choice([None, *SECTIONS]), rng.choice(KEYS)
    data = copy.deepcopy(BASE)
    (data if section is None else data[section])[key] = rng.choice([1, "x", True, None])
    return Mutation("unknown_key", key if section is None else f"{section}.{key}", data)


def m_enum(rng: random.Random) -> Mutation:
    path = rng.choice(["device", "backend", "transport"])
    return Mutation("enum", path, set_path(copy.deepcopy(BASE), path, rng.choice(ENUM_VALUES)))


def m_nesting(rng: random.Random) -> Mutation:
    data, section = copy.deepcopy(BASE), rng.choice(SECTIONS)
    choice = rng.randrange(4)
    if choice == 0:  # a section that is not a mapping
        data[section] = rng.choice([5, "yes", [1, 2], [{"port": 1}], None, ""])
        return Mutation("nesting", section, data)
    if choice == 1:  # a nested key at the top level
        key = rng.choice(sorted(data[section]))
        data[key] = data[section].pop(key)
        return Mutation("nesting", key, data)
    if choice == 2:  # a top-level key inside a section
        key = rng.choice(["bypass_cpu", "keep_versions", "auth_token", "device"])
        data[section][key] = data.get(key)
        return Mutation("nesting", f"{section}.{key}", data)
    other = rng.choice([s for s in SECTIONS if s != section])  # a section inside another
    data[section][other] = copy.deepcopy(BASE[other])
    return Mutation("nesting", f"{section}.{other}", data)


def m_empty(rng: random.Random) -> Mutation:
    path = rng.choice(TEXT)
    return Mutation("empty", path, set_path(copy.deepcopy(BASE), path, ""))


def m_endpoint(rng: random.Random) -> Mutation:
    return Mutation("endpoint", "zmq.endpoint", set_path(copy.deepcopy(BASE), "zmq.endpoint", rng.choice(ENDPOINTS)))


def m_port(rng: random.Random) -> Mutation:
    path, port = rng.choice(["http.port", "store.rendezvous_port"]), rng.choice(PORTS)
    return Mutation("port", path, set_path(copy.deepcopy(BASE), path, port))


def m_host(rng: random.Random) -> Mutation:
    path = rng.choice(["http.host", "store.rendezvous_host"])
    return Mutation("host", path, set_path(copy.deepcopy(BASE), path, rng.choice(HOSTS)))


def m_null(rng: random.Random) -> Mutation:
    path = rng.choice(LEAVES + list(SECTIONS))
    return Mutation("null", path, set_path(copy.deepcopy(BASE), path, None))


def m_duplicate(rng: random.Random) -> Mutation:
    text = yaml.safe_dump(BASE, sort_keys=False)
    path = rng.choice(LEAVES)
    *parents, leaf = path.split(".")
    line = f"{leaf}: {yaml.safe_dump(rng.choice([1, True, 'x']), default_flow_style=True).split(chr(10))[0]}"
    if not parents:
        text += line + "\n"
    else:
        text = text.replace(f"{parents[0]}:\n", f"{parents[0]}:\n  {line}\n", 1)
    return Mutation("duplicate", path, copy.deepcopy(BASE), text=text)


def m_token(rng: random.Random) -> Mutation:
    return Mutation("token", "auth_token", set_path(copy.deepcopy(BASE), "auth_token", rng.choice(TOKENS)))


def m_timeouts(rng: random.Random) -> Mutation:
    key = rng.choice(["connect_s", "collective_s", "ack_s", "heartbeat_s"])
    data = copy.deepcopy(BASE)
    if key == "heartbeat_s":
        data["timeouts"]["heartbeat_s"] = rng.choice([0.5, 0.999, 1, 1e-3])
        return Mutation("timeouts", "timeouts.heartbeat_s", data)
    data["timeouts"][key] = data["timeouts"]["version_s"] * rng.choice([0.5, 1, 1.5, 10])
    return Mutation("timeouts", f"timeouts.{key}", data)


def m_combo(rng: random.Random) -> Mutation:
    data, choice = copy.deepcopy(BASE), rng.randrange(5)
    if choice == 0:
        data.update(sparse=True, bypass_cpu=rng.choice([True, False]))
        return Mutation("combo", "bypass_cpu", data)
    if choice == 1:
        data.update(device=rng.choice(["cpu", "cuda", "npu", "auto"]), backend=rng.choice(["nccl", "hccl", "gloo"]))
        return Mutation("combo", "backend", data)
    if choice == 2:
        data.update(alignment=rng.choice([256, 4096, 1 << 20, 3, 384]), bucket_size_mb=rng.choice([0.0001, 0.001, 1]))
        return Mutation("combo", "bucket_size_mb" if data["alignment"] & (data["alignment"] - 1) == 0 else
                        "alignment", data)
    if choice == 3:
        data["store"]["rendezvous_port"] = rng.choice([data["http"]["port"], 8766, 9999])
        return Mutation("combo", "store.rendezvous_port", data)
    data["zmq"]["endpoint"] = f"tcp://{rng.choice(['127.0.0.1', '*', '10.1.2.3'])}:{rng.choice([8765, 8767, 9998])}"
    return Mutation("combo", "zmq.endpoint", data)


def m_env(rng: random.Random) -> Mutation:
    name, value, path = rng.choice([
        ("CKPT_ENGINE_HTTP__PORT", "70000", "http.port"), ("CKPT_ENGINE_HTTP__PORT", "8766", "http.port"),
        ("CKPT_ENGINE_TIMEOUTS__ACK_S", "-1", "timeouts.ack_s"),
        ("CKPT_ENGINE_ZMQ__ENDPOINT", "tcp://", "zmq.endpoint"),
        ("CKPT_ENGINE_AUTH_TOKEN", "1234567890123456789", "auth_token"),  # digits: still a text token
        ("CKPT_ENGINE_AUTH_TOKEN", "*starts-with-a-star", "auth_token"), ("CKPT_ENGINE_SPARSE", "maybe", "sparse"),
        ("CKPT_ENGINE_KEEP_VERSIONS", "[1", "CKPT_ENGINE_KEEP_VERSIONS")])
    return Mutation("env", path, copy.deepcopy(BASE), env={name: value})


MUTATORS: list[Callable[[random.Random], Mutation]] = [
    m_wrong_type, m_number, m_unknown_key, m_enum, m_nesting, m_empty, m_endpoint, m_port, m_host, m_null,
    m_duplicate, m_token, m_timeouts, m_combo, m_env]


def mutations() -> list[Mutation]:
    rng = random.Random(SEED)
    return [MUTATORS[i % len(MUTATORS)](rng) for i in range(MUTATIONS)]


# ---- what "really usable" means, checked with the pieces the daemon and the agents use --------------------

def problems_running(config: EngineConfig) -> list[str]:
    checks = [_agents_settings, _status_json, _binds, _timeouts, _buckets, _token, _modes, _ports, _sizes, _history]
    return [problem for check in checks for problem in check(config)]


def _agents_settings(config: EngineConfig) -> list[str]:
    t = config.timeouts
    reply = RegisterReply(agent_id="a" * 12, session="s" * 48, history_id="h" * 32, heartbeat_s=t.heartbeat_s,
                          group_name="g", store_host=config.store.rendezvous_host,
                          store_port=config.store.rendezvous_port, bucket_size=config.bucket_size,
                          alignment=config.alignment, keep_versions=config.keep_versions, verify=config.verify,
                          connect_timeout_s=t.connect_s, collective_timeout_s=t.collective_s, ack_timeout_s=t.ack_s,
                          version_timeout_s=t.version_s)
    try:
        encode_frame({"id": 1, "ok": True, "body": reply.model_dump()})
        datetime.timedelta(seconds=t.connect_s)  # what the store and the sync group get
    except (OverflowError, ValueError, TypeError) as exc:
        return [f"register reply or timedelta: {exc}"]
    return []


def _status_json(config: EngineConfig) -> list[str]:
    try:  # GET /status serializes these with allow_nan=False
        json.dumps(config.model_dump(), allow_nan=False)
    except ValueError as exc:
        return [f"/status: {exc}"]
    return []


def _bind_tcp(host: str) -> str | None:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.bind(address)
    except OSError as exc:
        return f"cannot bind {host!r}: {exc}"
    return None


def _binds(config: EngineConfig) -> list[str]:
    problems = [p for p in (_bind_tcp(config.http.host), _bind_tcp(config.store.rendezvous_host)) if p]
    endpoint = config.zmq.endpoint
    if endpoint.startswith("tcp://"):
        endpoint = endpoint[:endpoint.rindex(":")] + ":*"  # any port: the configured one may be taken here
    elif not endpoint.startswith("ipc://@"):
        endpoint = f"ipc://{Path(endpoint[6:]).parent}/ckpt-fuzz-{uuid.uuid4().hex[:6]}.sock"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(endpoint)
        if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
            os.unlink(endpoint[6:])
    except zmq.ZMQError as exc:
        problems.append(f"cannot bind ZMQ {endpoint}: {exc}")
    finally:
        sock.close(0)
    return problems


def _timeouts(config: EngineConfig) -> list[str]:
    t = config.timeouts
    values = [t.connect_s, t.collective_s, t.ack_s, t.version_s, t.heartbeat_s]
    problems = [f"timeout {v}" for v in values if not (math.isfinite(v) and 0 < v <= 86400)]
    if max(t.connect_s, t.collective_s, t.ack_s) > t.version_s:
        problems.append("a part of a version may take longer than the version")
    if t.heartbeat_s < 1.0:
        problems.append("heartbeat shorter than the agents' poll interval")
    return problems


def _buckets(config: EngineConfig) -> list[str]:
    from ckpt_engine.plan.layout import TensorSpec, plan_layout

    try:
        plan_layout([TensorSpec("w", "float32", (3,)), TensorSpec("b", "float32", (5,))], config.bucket_size,
                    config.alignment)
    except Exception as exc:  # noqa: BLE001 - any error here is what an agent would meet on its first version
        return [f"bucket plan: {exc}"]
    return []


def _token(config: EngineConfig) -> list[str]:
    token = config.auth_token
    if token is None:
        return []
    header = f"Bearer {token}"
    try:
        header.encode("ascii")
    except UnicodeEncodeError:
        return ["token cannot travel in an HTTP header"]
    _scheme, _, value = header.partition(" ")
    return [] if value.strip() == token and token.isprintable() else ["token changes on its way through HTTP"]


def _modes(config: EngineConfig) -> list[str]:
    from ckpt_engine.device import DeviceError, _pick_backend

    problems = ["every default sync would be refused"] if config.sparse and config.bypass_cpu else []
    if config.device != "auto":
        try:
            _pick_backend(config.device, config.backend)  # type: ignore[arg-type]
        except DeviceError as exc:
            problems.append(str(exc))
    return problems


def _ports(config: EngineConfig) -> list[str]:
    ports = [config.http.port, config.store.rendezvous_port]
    if config.zmq.endpoint.startswith("tcp://") and not config.zmq.endpoint.endswith(":*"):
        ports.append(int(config.zmq.endpoint.rsplit(":", 1)[1]))
    fixed = [p for p in ports if p]
    if config.zmq.endpoint.startswith("tcp://10.1.2.3:"):  # a distinct address: may share a port number
        fixed = fixed[:2]
    return ["two listeners on one port"] if len(set(fixed)) < len(fixed) else []


def _sizes(config: EngineConfig) -> list[str]:
    report = Report(agent_id="a" * 12, session="s" * 48, version=1, event="done", ok=True, version_digest="d" * 32,
                    stages={"snapshot": 1.0},
                    receivers=[ReceiverAck(rank=r, ok=True, version_digest="d" * 32, seconds={"load": 1.0})
                               for r in range(64)], cache_versions=[1, 2, 3])
    problems = []
    if len(encode_frame({"id": 1, "type": "report", "body": report.model_dump()})) > config.zmq.max_frame_bytes:
        problems.append("a trainer's report for 64 receivers does not fit in a ZMQ frame")
    if config.http.max_body_bytes < 256:
        problems.append("POST /sync bodies do not fit")
    return problems


def _history(config: EngineConfig) -> list[str]:
    path = config.store.history_path
    return [] if path and not os.path.isdir(path) else [f"history path {path!r}"]


# ---- the tests ----------------------------------------------------------------------------------------------

def load(mutation: Mutation, directory: Path) -> EngineConfig:
    return load_config(mutation.write(directory), environ=mutation.env)


def names(message: str, path: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(path)}(?!\w)", message) is not None


def test_every_mutation_is_refused_by_name_or_really_works(tmp_path: Path) -> None:
    outcomes: dict[str, list[int]] = {}
    for index, mutation in enumerate(mutations()):
        try:
            config = load(mutation, tmp_path)
        except ConfigError as exc:
            assert names(str(exc), mutation.path), f"#{index} {mutation.kind}: {exc} does not name {mutation.path}"
            outcomes.setdefault(mutation.kind, [0, 0])[0] += 1
            continue
        problems = problems_running(config)
        assert not problems, f"#{index} {mutation.kind} {mutation.path} was accepted but: {problems}"
        outcomes.setdefault(mutation.kind, [0, 0])[1] += 1
    refused = sum(r for r, _ in outcomes.values())
    accepted = sum(a for _, a in outcomes.values())
    assert refused + accepted == MUTATIONS and refused > MUTATIONS / 2 and accepted > 20, outcomes
    assert set(outcomes) == {m.__name__[2:] for m in MUTATORS}, outcomes  # every kind ran


@pytest.mark.parametrize("text, key", [
    ("bypass_cpu: false\nbypass_cpu: true\n", "bypass_cpu"),
    ("http:\n  port: 1\n  host: 127.0.0.1\n  port: 2\n", "http.port"),
    ("timeouts: {ack_s: 1, ack_s: 2}\n", "timeouts.ack_s"),
])
def test_duplicate_keys_are_errors(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: given more than once"):
        load_config(path, environ={})


def test_env_text_values_are_taken_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("keep_versions: 2\n")
    for token in ("1234567890123456789", "*starts-with-a-star", "!tagged-token-value", "true-token-not-a-bool"):
        assert load_config(path, environ={"CKPT_ENGINE_AUTH_TOKEN": token}).auth_token == token


def _daemon_base(directory: Path) -> dict:
    data = copy.deepcopy(BASE)
    data.update(http={**BASE["http"], "port": free_port()},
                zmq={**BASE["zmq"], "endpoint": f"tcp://127.0.0.1:{free_port()}"},
                store={**BASE["store"], "history_path": str(directory / "history.sqlite3"), "rendezvous_port": 0})
    return data


FIXED = ("http.", "zmq.", "store.")  # the daemon runs below need their own free ports and files


def _picked(accepted: bool, count: int, directory: Path) -> list[Mutation]:
    """The first ``count`` mutations of distinct kinds with that outcome, redone on a base with free ports."""
    picked: dict[str, Mutation] = {}
    for mutation in mutations():
        if mutation.kind in picked or mutation.kind in ("duplicate", "env") or mutation.path.startswith(FIXED):
            continue
        data = _daemon_base(directory)
        data.update({k: v for k, v in mutation.data.items() if k not in ("http", "zmq", "store")})
        candidate = Mutation(mutation.kind, mutation.path, data)
        try:
            load(candidate, directory)
            ok = True
        except ConfigError:
            ok = False
        if ok == accepted:
            picked[mutation.kind] = candidate
        if len(picked) == count:
            break
    return list(picked.values())


def test_accepted_mutations_start_the_daemon(tmp_path: Path) -> None:
    started = _picked(accepted=True, count=3, directory=tmp_path)
    assert len(started) == 3
    for mutation in started:
        daemon = start_daemon(mutation.write(tmp_path))
        try:
            with daemon.client() as client:
                assert client.get("/health").status_code == 200, mutation
        finally:
            assert daemon.stop() == 0, daemon.log()


def test_refused_mutations_stop_check_config_and_serve_at_once(tmp_path: Path) -> None:
    refused = _picked(accepted=False, count=3, directory=tmp_path)
    assert len(refused) == 3
    for mutation in refused:
        path = mutation.write(tmp_path)
        for command in (["check-config", str(path)], ["serve", "--config", str(path)]):
            run = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", *command], capture_output=True, text=True,
                                 timeout=60, cwd=ROOT)
            assert run.returncode == 2, (command, mutation, run.stdout, run.stderr)
            assert names(run.stderr, mutation.path) and run.stderr.startswith("error:"), (mutation.path, run.stderr)
