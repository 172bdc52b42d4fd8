"""The tests' view of the shared daemon launcher (ckpt_engine/server/launch.py): every daemon a test starts
is remembered, so the autouse fixture in conftest.py stops it whatever the test did."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ckpt_engine.server import launch
from ckpt_engine.server.launch import REPO as ROOT
from ckpt_engine.server.launch import TEST_TIMEOUTS, DaemonProcess, free_port, write_config  # noqa: F401

RUNNING: list[DaemonProcess] = []  # stopped by the autouse fixture in conftest.py, whatever a test did


def timeouts(**changed: float) -> dict[str, float]:
    """The daemon's timeouts for a test: launch.TEST_TIMEOUTS (what write_config sets without ``timeouts=``:
    bounds far above the work, met on a loaded machine), but for the ones the test is about (``changed``):
    mostly one it waits out on purpose, short so that the test stays quick. Only those: every other wait keeps
    its generous bound, so that nothing a starved process does meanwhile races against the one waited out."""
    unknown = set(changed) - set(launch.TEST_TIMEOUTS)
    if unknown:
        raise ValueError(f"unknown timeouts {sorted(unknown)}")
    chosen = {**launch.TEST_TIMEOUTS, **changed}
    if "version_s" not in changed:  # (a part of a version may not take longer than the version)
        chosen["version_s"] = max(chosen["version_s"], chosen["connect_s"], chosen["collective_s"], chosen["ack_s"])
    return chosen


def silent_after(heartbeat_s: float, poll_wait_s: float) -> float:
    """How long after its last poll the daemon leaves an agent out of new versions' quorums (server/agents.py
    silence_window: its poll's wait and half a heartbeat); it is dropped after ``heartbeat_s``."""
    return poll_wait_s + heartbeat_s / 2


_PORT_TRIES = 3  # free_port() only finds a port free: another process may take it before the daemon binds it


def start_daemon(config_path: Path, env: dict[str, str] | None = None, timeout_s: float = 30,
                 spawner: launch.Spawner | None = None) -> DaemonProcess:
    """``spawner``: how the daemon's process is started (default: forked from the tests' fork server)."""
    for attempt in range(_PORT_TRIES):
        try:
            daemon = launch.start_daemon(config_path, env=env, timeout_s=timeout_s, spawner=spawner or forked_daemon)
            break
        except RuntimeError as exc:
            if "address already in use" not in str(exc).lower() or attempt == _PORT_TRIES - 1:
                raise AssertionError(str(exc)) from exc
            _new_ports(config_path)
    RUNNING.append(daemon)
    return daemon


def _new_ports(config_path: Path) -> None:
    """Other free loopback ports for the daemon's HTTP and ZMQ endpoints (what write_config picked was taken)."""
    import yaml

    data = yaml.safe_load(config_path.read_text())
    data["http"]["port"] = free_port()
    data["zmq"]["endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    config_path.write_text(yaml.safe_dump(data))


def forked_daemon(config_path: Path, env: dict[str, str], log_path: Path) -> ForkedProcess:
    """``ckpt-engine serve`` as a real process of its own, forked from the tests' fork server (tests/procs.py),
    which imported the daemon's modules (torch among them) once: not seconds of imports per daemon."""
    from tests.procs import context

    proc = context().Process(target=_serve, args=(str(config_path), env, str(log_path)), daemon=False)
    proc.start()
    return ForkedProcess(proc)


def _serve(config_path: str, env: dict[str, str], log_path: str) -> None:
    import sys

    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(ROOT))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    from ckpt_engine.cli.main import main

    code = main(["serve", "--config", config_path])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # (as the command would: no multiprocessing clean-up of a process that served)


class ForkedProcess:
    """What the tests use of subprocess.Popen, for a multiprocessing.Process."""

    def __init__(self, proc) -> None:
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"daemon {self.pid}", timeout or 0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)


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


class TrainerLoop:
    """A TrainerAgent stepping in a thread of the test process; ``tensors()`` says what it serves now."""

    def __init__(self, endpoint: str, tensors, poll_wait_s: float = 0.2, wire_hook=None) -> None:
        import threading

        from ckpt_engine.workers.trainer_agent import TrainerAgent

        self.agent = TrainerAgent(tensors, endpoint, poll_wait_s=poll_wait_s, wire_hook=wire_hook).start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = 0
        while not self._stop.is_set():
            step += 1
            self.agent.step(step)
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.agent.wait_idle(30)
        self.agent.close()


def sync_when_idle(http, body: dict | None = None, timeout_s: float = 60) -> dict:
    """POST /sync and wait for its end, waiting out a version already in flight (a catch-up or repair the
    daemon started by itself answers 409 meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = http.post("/sync", json={"wait": True, "timeout_s": timeout_s, **(body or {})})
        if reply.status_code != 409 or time.monotonic() > deadline:
            return reply.json()
        time.sleep(0.2)
