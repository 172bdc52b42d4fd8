"""Starting a real daemon as its own process on free 127.0.0.1 ports: one helper for the demo, the tests, the
benchmarks and the fault trials (``ckpt-engine serve`` is what runs)."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from ckpt_engine.control.auth import CREDENTIALS_ENV, read_credentials

HOST = "127.0.0.1"
# the repository checkout this package runs from (demos and tests start processes there)
REPO = Path(__file__).resolve().parents[1]


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=512)


def free_port() -> int:
    """A port free now that this process has not handed out lately: the kernel may give the same free port to
    two binds in a row, and a config with one port for two listeners is refused."""
    for _ in range(64):
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise RuntimeError("no free port that was not handed out lately")


# Bounds far above the work of a test's small versions, met by a machine that is shared and loaded (CI runners):
# a process there can be starved for seconds. An agent unheard for half a heartbeat is left out of a version's
# quorum, and dropped after a whole one, so the heartbeat is the production default's. A test that waits one
# of these out on purpose sets that one short (tests/daemon_harness.py timeouts()).
TEST_TIMEOUTS = {"connect_s": 30, "collective_s": 30, "ack_s": 30, "heartbeat_s": 10, "version_s": 60}


def write_config(directory: Path, base: Path | None = None, *, test_timeouts: bool = True, **overrides: Any) -> Path:
    """``directory/engine.yaml``: ``base`` (a deployment YAML; None: the built-in defaults, which
    deploy/engine.yaml lists) on free loopback ports, with the history and the credentials in ``directory``,
    short timeouts for tests (``test_timeouts``), then ``overrides`` (top-level keys)."""
    data = yaml.safe_load(base.read_text()) if base else {}
    data["http"] = {**(data.get("http") or {}), "host": HOST, "port": free_port()}
    data["zmq"] = {**(data.get("zmq") or {}), "endpoint": f"tcp://{HOST}:{free_port()}"}
    data["store"] = {**(data.get("store") or {}), "history_path": str(directory / "history.sqlite3"),
                     "rendezvous_host": HOST, "rendezvous_port": 0}
    data["auth"] = {**(data.get("auth") or {}), "credentials_file": str(directory / "credentials.json")}
    if test_timeouts:
        data.update(bucket_size_mb=0.0625, timeouts=dict(TEST_TIMEOUTS))
    data.update(overrides)
    path = directory / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class DaemonProcess:
    proc: Any  # subprocess.Popen, or what the tests give in its place (tests/daemon_harness.py)
    config_path: Path
    url: str
    zmq: str
    credentials_path: Path | None
    log_path: Path

    def tokens(self) -> dict[str, str | None]:
        """The role tokens the daemon accepts (read from its credentials file; all None with auth.open)."""
        found = read_credentials(self.credentials_path) if self.credentials_path is not None else None
        return found.model_dump() if found is not None else {"operator": None, "trainer": None, "rollout": None}

    @property
    def token(self) -> str | None:
        """The operator's token."""
        return self.tokens()["operator"]

    def client(self, token: str | None = "default", timeout_s: float = 60) -> httpx.Client:
        token = self.token if token == "default" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


# Starts ``ckpt-engine serve --config PATH`` with an environment and a log file; returns a Popen-like handle.
Spawner = Callable[[Path, dict[str, str], Path], Any]


def _popen(config_path: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckpt_engine.server", "serve", "--config", str(config_path)],
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)


def start_daemon(config_path: Path, *, env: dict[str, str] | None = None, timeout_s: float = 30,
                 log_path: Path | None = None, export_credentials: bool = True,
                 spawner: Spawner = _popen) -> DaemonProcess:
    """Start ``ckpt-engine serve --config config_path`` and wait until ``/health`` answers. With
    ``export_credentials`` this process's environment points at its credentials file, so agents started from
    here (and their child processes) find their role's token. ``spawner``: how the process is started (the
    tests fork it from a server that imported the daemon's modules once)."""
    config = yaml.safe_load(config_path.read_text())
    http = dict(config["http"])
    if env and "CKPT_ENGINE_HTTP__PORT" in env:
        http["port"] = int(env["CKPT_ENGINE_HTTP__PORT"])
    zmq = (env or {}).get("CKPT_ENGINE_ZMQ__ENDPOINT", config["zmq"]["endpoint"])
    log_path = log_path or config_path.with_suffix(f".{time.monotonic_ns()}.log")
    proc = spawner(config_path, {**os.environ, **(env or {})}, log_path)
    auth = config.get("auth") or {}
    credentials = (env or {}).get("CKPT_ENGINE_AUTH__CREDENTIALS_FILE") or auth.get("credentials_file")
    path = None if auth.get("open") else Path(os.path.expanduser(credentials or "~/.ckpt-engine/credentials.json"))
    daemon = DaemonProcess(proc, config_path, f"http://{http.get('host', HOST)}:{http['port']}", zmq, path, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}:\n{daemon.log_tail()}")
        try:
            if httpx.get(f"{daemon.url}/health", timeout=1).status_code == 200:
                if path is not None and export_credentials:
                    os.environ[CREDENTIALS_ENV] = str(path)
                return daemon
        except httpx.HTTPError:
            time.sleep(0.1)
    daemon.stop(signal.SIGKILL)
    raise RuntimeError(f"the daemon did not answer /health within {timeout_s:.0f}s:\n{daemon.log_tail()}")
