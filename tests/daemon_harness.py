"""The tests' view of the shared daemon launcher (ckpt_engine/server/launch.py): every daemon a test starts
is remembered, so the autouse fixture in conftest.py stops it whatever the test did."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ckpt_engine.server import launch
from ckpt_engine.server.launch import REPO as ROOT  # noqa: F401 - tests start processes there
from ckpt_engine.server.launch import DaemonProcess, free_port, write_config  # noqa: F401

RUNNING: list[DaemonProcess] = []  # stopped by the autouse fixture in conftest.py, whatever a test did


def start_daemon(config_path: Path, env: dict[str, str] | None = None, timeout_s: float = 30) -> DaemonProcess:
    try:
        daemon = launch.start_daemon(config_path, env=env, timeout_s=timeout_s)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from exc
    RUNNING.append(daemon)
    return daemon


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
