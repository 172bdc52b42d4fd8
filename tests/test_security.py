"""Security properties of the daemon (docs/security.md): loopback binds by default (the rendezvous store
included), a loud warning when a port leaves loopback without a token, tokens compared in constant time,
and no deserializer of untrusted bytes that can run code anywhere in the shipped code."""

from __future__ import annotations

import copy
import hmac
import ipaddress
import os
import re
from pathlib import Path

import httpx
import pytest
import yaml

from ckpt_engine.config import EngineConfig
from tests.daemon_harness import ROOT, free_port, start_daemon

pytestmark = pytest.mark.multiproc

DEPLOY = ROOT / "deploy" / "engine.yaml"


def _config(directory: Path, **changes: object) -> Path:
    """deploy/engine.yaml as shipped (hosts included), with free ports and a history file of the test."""
    data = copy.deepcopy(yaml.safe_load(DEPLOY.read_text()))
    data["http"]["port"] = free_port()
    data["zmq"]["endpoint"] = data["zmq"]["endpoint"].rsplit(":", 1)[0] + f":{free_port()}"
    data["store"].update(history_path=str(directory / "history.sqlite3"), rendezvous_port=free_port())
    data["auth"] = {"credentials_file": str(directory / "credentials.json")}
    for key, value in changes.items():
        section, _, leaf = key.rpartition(".")
        (data[section] if section else data)[leaf] = value
    path = directory / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def listening(pid: int) -> set[str]:
    """'address:port' of the TCP sockets process ``pid`` listens on (from /proc, no tools needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                found.add(f"{ipaddress.ip_address(raw)}:{int(port, 16)}")
    return found


def test_defaults_are_loopback() -> None:
    config = EngineConfig()
    assert config.http.host == "127.0.0.1" and config.store.rendezvous_host == "127.0.0.1"
    assert config.zmq.endpoint.startswith("tcp://127.0.0.1:") and config.auth_token is None


def test_the_shipped_config_listens_on_loopback_only_and_does_not_warn(tmp_path: Path) -> None:
    daemon = start_daemon(_config(tmp_path))
    try:
        addresses = listening(daemon.proc.pid)
        # HTTP, ZMQ and the rendezvous store; the store used to listen on every interface (torch's TCPStore
        # ignores the host it is given), now it gets a socket bound to store.rendezvous_host.
        assert len(addresses) == 3 and all(a.startswith("127.0.0.1:") for a in addresses), addresses
        assert "beyond loopback" not in daemon.log()
    finally:
        assert daemon.stop() == 0


def test_a_wildcard_bind_is_guarded_by_the_role_tokens_and_warns_loudly_when_open(tmp_path: Path) -> None:
    daemon = start_daemon(_config(tmp_path, **{"http.host": "0.0.0.0"}))
    try:
        assert "beyond loopback" not in daemon.log()  # the generated role tokens guard it
        assert any(a.startswith("0.0.0.0:") for a in listening(daemon.proc.pid))
        assert httpx.get(f"{daemon.url}/status").status_code == 401
    finally:
        assert daemon.stop() == 0
    (tmp_path / "open").mkdir()
    daemon = start_daemon(_config(tmp_path / "open", **{"http.host": "0.0.0.0", "auth.open": True}))
    try:
        log = daemon.log()
        assert "WARNING: listening beyond loopback with auth.open (http.host=0.0.0.0)" in log, log
        assert httpx.get(f"{daemon.url}/status").status_code == 200
    finally:
        assert daemon.stop() == 0


def test_tokens_and_sessions_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ckpt_engine.config import parse_config
    from ckpt_engine.control.messages import Register
    from ckpt_engine.server.agents import AgentRegistry
    from ckpt_engine.server.authority import Authority

    calls: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    authority = Authority(parse_config({"auth": {"credentials_file": str(tmp_path / "c.json")}}))
    operator = authority.credentials.operator  # type: ignore[union-attr]
    assert authority.roles_of(operator) == {"operator"} and authority.roles_of("wrong") == set()
    assert len(calls) == 6  # every role's token compared, for the right token as for a wrong one
    registry = AgentRegistry(10)
    agent = registry.add(Register(role="receiver", host="h", pid=1, device="cpu"), [])
    assert registry.get(agent.agent_id, agent.session) is agent and registry.get(agent.agent_id, "x" * 48) is None
    assert len(calls) == 8 and all(isinstance(a, bytes) for pair in calls for a in pair)


def test_a_made_token_never_reads_as_an_option_on_the_command_line() -> None:
    from ckpt_engine.cli.main import _parser
    from ckpt_engine.control.auth import new_token

    tokens = [new_token() for _ in range(2000)]  # a urlsafe token started with "-" 1 time in 64: a CI run hit it
    assert not [t for t in tokens if t.startswith("-")] and len(set(tokens)) == len(tokens)
    assert all(_parser().parse_args(["--token", t, "status"]).token == t for t in tokens[:200])


UNSAFE = re.compile(r"\bimport pickle\b|\bpickle\.|\bcPickle\b|\bdill\b|\bshelve\b|\bmarshal\.loads|torch\.load\b|"
                    r"(?<![.\w])eval\(|(?<![.\w])exec\(|yaml\.load\(|yaml\.unsafe_load|yaml\.Loader\b|"
                    r"_object_list\(|all_gather_object|gather_object|scatter_object|recv_object|np\.load\(")


@pytest.mark.parametrize("package", ["ckpt_engine", "server", "workers", "cli", "trials", "demos"])
def test_no_code_runs_from_untrusted_bytes(package: str) -> None:
    """Every network or IPC decoder is msgpack/JSON into typed models: no pickle (torch.load, object
    collectives), no eval/exec, no unsafe YAML."""
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in sorted((ROOT / package).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if UNSAFE.search(line)]
    assert hits == []
