"""Start the real daemon (``ckpt-engine serve``) as a subprocess on free 127.0.0.1 ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class DaemonProcess:
    proc: subprocess.Popen
    config_path: Path
    url: str
    zmq: str
    credentials_path: Path | None
    log_path: Path

    def tokens(self) -> dict[str, str | None]:
        """The role tokens the daemon accepts (read from its credentials file; all None with auth.open)."""
        if self.credentials_path is None:
            return {"operator": None, "trainer": None, "rollout": None}
        from ckpt_engine.auth import read_credentials

        found = read_credentials(self.credentials_path)
        return found.model_dump() if found is not None else {"operator": None, "trainer": None, "rollout": None}

    @property
    def token(self) -> str | None:
        """The operator's token."""
        return self.tokens()["operator"]

    def client(self, token: str | None = "default") -> httpx.Client:
        token = self.token if token == "default" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def write_config(directory: Path, base: Path | None = None, **overrides: object) -> Path:
    """A config for tests: loopback ports picked free, history in ``directory``, short timeouts."""
    data = yaml.safe_load(base.read_text()) if base else {}
    data.update({
        "bucket_size_mb": 0.0625,
        "http": {"host": "127.0.0.1", "port": free_port()},
        "zmq": {"endpoint": f"tcp://127.0.0.1:{free_port()}"},
        "store": {"history_path": str(directory / "history.sqlite3"), "rendezvous_host": "127.0.0.1",
                  "rendezvous_port": 0},
        "timeouts": {"connect_s": 15, "collective_s": 15, "ack_s": 30, "heartbeat_s": 5, "version_s": 60},
        "auth": {"credentials_file": str(directory / "credentials.json")},
    })
    data.update(overrides)
    path = directory / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


RUNNING: list[DaemonProcess] = []  # stopped by the autouse fixture in conftest.py, whatever a test did


def start_daemon(config_path: Path, env: dict[str, str] | None = None, timeout_s: float = 30) -> DaemonProcess:
    config = yaml.safe_load(config_path.read_text())
    http = config["http"]
    if env:
        http = {**http, "port": int(env.get("CKPT_ENGINE_HTTP__PORT", http["port"]))}
    log_path = config_path.with_suffix(f".{time.monotonic_ns()}.log")
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_engine.cli", "serve", "--config", str(config_path)],
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    auth = config.get("auth") or {}
    credentials = None if auth.get("open") else Path(os.path.expanduser(
        auth.get("credentials_file", "~/.ckpt-engine/credentials.json")))
    daemon = DaemonProcess(proc, config_path, f"http://127.0.0.1:{http['port']}", config["zmq"]["endpoint"],
                           credentials, log_path)
    RUNNING.append(daemon)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}:\n{daemon.log()}")
        try:
            if httpx.get(f"{daemon.url}/health", timeout=1).status_code == 200:
                if credentials is not None:  # agents of this test (and the processes it starts) find the tokens
                    os.environ["CKPT_ENGINE_CREDENTIALS"] = str(credentials)
                return daemon
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"daemon did not answer /health within {timeout_s}s:\n{daemon.log()}")


def train_until_stopped(agent, stop_file: str, on_version=None) -> None:
    """A training loop stand-in: step the trainer agent until ``stop_file`` exists, calling
    ``on_version(step)`` after each step that served a version; then finish and leave cleanly."""
    step = 0
    while not os.path.exists(stop_file):
        step += 1
        if agent.step(step) is not None and on_version is not None:
            on_version(step)
        time.sleep(0.01)
    agent.wait_idle(30)
    agent.close()
