"""What the operator reads: ``check-config`` never prints a token (from the file or the environment), and the
daemon's shutdown log says what it waits for (nothing, or the version in flight for at most min(ack_s, 30) s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ckpt_engine.cli.main import REDACTED, redacted
from tests.daemon_harness import ROOT, start_daemon, write_config

SECRETS = {"CKPT_ENGINE_AUTH__OPERATOR_TOKEN": "opop-secret-from-the-env-0123",
           "CKPT_ENGINE_AUTH__ROLLOUT_TOKEN": "roro-secret-from-the-env-4567"}
IN_FILE = {"trainer_token": "trtr-secret-in-the-file-89ab"}
LEGACY = "lega-secret-in-the-file-cdef"


@pytest.mark.parametrize("settings, shown", [
    ({"auth": {"operator_token": "x" * 20, "trainer_token": None}}, {"auth": {"operator_token": REDACTED,
                                                                               "trainer_token": None}}),
    ({"auth_token": "y" * 20, "http": {"port": 1}}, {"auth_token": REDACTED, "http": {"port": 1}}),
    ({"token": "z" * 20, "tokens": 3, "token_count": 4}, {"token": REDACTED, "tokens": 3, "token_count": 4}),
    ({"list": [{"rollout_token": "w" * 20}]}, {"list": [{"rollout_token": REDACTED}]}),
])
def test_redacted_replaces_every_given_token_only(settings: dict, shown: dict) -> None:
    assert redacted(settings) == shown


@pytest.mark.multiproc
def test_check_config_prints_no_token_from_the_file_or_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"auth": {**IN_FILE, "credentials_file": str(tmp_path / "creds.json")},
                                      "auth_token": LEGACY, "store": {"history_path": str(tmp_path / "h.sqlite3")}}))
    env = {key: value for key, value in os.environ.items() if not key.startswith("CKPT_ENGINE_")} | SECRETS
    result = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "check-config", str(config)], env=env,
                            check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    for secret in [*SECRETS.values(), *IN_FILE.values(), LEGACY]:
        assert secret not in result.stdout + result.stderr
    shown = json.loads(result.stdout)
    assert shown["auth_token"] == REDACTED
    assert {role: shown["auth"][f"{role}_token"] for role in ("operator", "trainer", "rollout")} == \
        dict.fromkeys(("operator", "trainer", "rollout"), REDACTED)
    assert shown["auth"]["credentials_file"] == str(tmp_path / "creds.json")  # everything else as before


@pytest.mark.multiproc
def test_shutdown_with_nothing_in_flight_says_so(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path))
    assert daemon.stop() == 0
    log = daemon.log()
    assert "shutting down: no version in flight" in log, log
    assert "giving" not in log and "120s" not in log


@pytest.mark.multiproc
def test_shutdown_with_a_version_in_flight_names_it_and_the_real_wait(tmp_path: Path) -> None:
    from ckpt_engine.device import detect_device
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from ckpt_engine.workers.trainer_agent import TrainerAgent
    from tests.models import AwkwardModel

    config = write_config(tmp_path, timeouts={"connect_s": 3, "collective_s": 3, "ack_s": 2, "heartbeat_s": 5,
                                              "version_s": 8})
    daemon = start_daemon(config)
    device = detect_device("cpu")
    # real agents, but the trainer never reaches a step boundary: the version stays in flight
    trainer = TrainerAgent(AwkwardModel(1), daemon.zmq, device=device, poll_wait_s=0.3).start()
    receiver = RolloutAgent(lambda payload: None, daemon.zmq, device=device, poll_wait_s=0.3).start()
    try:
        with daemon.client() as client:
            deadline = time.monotonic() + 60
            while len(client.get("/receivers").json()["agents"]) < 2:
                assert time.monotonic() < deadline, "agents did not register"
                time.sleep(0.1)
            version = client.post("/sync", json={"step": 1}).json()["version"]
        started = time.monotonic()
        assert daemon.stop() == 0
        assert time.monotonic() - started < 20
    finally:
        trainer.close()
        receiver.close()
    log = daemon.log()
    assert f"shutting down: giving version {version}, in flight, up to 2s to end" in log, log
    assert f"version {version} did not end within 2s: recorded interrupted" in log, log
