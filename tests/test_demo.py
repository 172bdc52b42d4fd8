"""The quick start's main job runs for real, end to end (a smaller model than the default)."""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).parents[1]
SMALL = ["--steps", "12", "--sync-every", "4", "--hidden", "64", "--layers", "2", "--vocab", "256"]


# (cached, as the quick start runs it: bypass_cpu versions of an FSDP2 job reaching transformers rollouts
# byte-exact are tests/test_fsdp_sync.py's, and the library demo sends both modes)
def test_fully_async_demo_commits_every_version_and_rollouts_match(tmp_path: Path) -> None:
    """The quick start's demo, as the README's "See it" runs it (issue 37): its daemon is deploy/engine.yaml's
    with the demo's bucket size; it prints the exact command that watches it, which works from anywhere; with
    --tear a rollout's apply tears its model and the daemon repairs it; while it holds, its trainer ranks and
    rollouts stay attached, so the status, the cache and the metrics show them (the cache of both ranks)."""
    err = (tmp_path / "stderr").open("w")
    demo = subprocess.Popen([sys.executable, "-m", "ckpt_engine.cli", "demo", *SMALL, "--tear", "2", "--hold",
                             "600"], stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    stdout = demo.stdout
    assert stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("[demo] holding") for line in out):
            assert demo.poll() is None and time.monotonic() < deadline, "".join(out)
            try:
                out.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        while not out[-1].startswith("[demo] in a terminal: "):  # (the hold repeats how to look)
            out.append(lines.get(timeout=30))
        text = "".join(out)
        assert "config deploy/engine.yaml with bucket_size_mb 4," in text, text
        command = shlex.split(out[-1].removeprefix("[demo] in a terminal: "))
        assert command[command.index("--url") + 1] in text.splitlines()[0] and command[-2:] == ["status", "--watch"]
        # the printed command as written (one frame), from another directory, with nothing in the environment
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_ENGINE_")}
        status = subprocess.run([*command, "--count", "1"], capture_output=True, text=True, timeout=60,
                                cwd=tmp_path, env=env, check=False)
        assert status.returncode == 0, status.stdout + status.stderr
        url, credentials = command[command.index("--url") + 1], command[command.index("--credentials") + 1]
        token = json.loads(Path(credentials).read_text())["operator"]
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
            config = http.get("/status").json()["config"]
            agents = http.get("/receivers").json()["agents"]
            history = http.get("/versions").json()["versions"]
            metrics = http.get("/metrics").text
    finally:
        demo.send_signal(signal.SIGTERM)  # ends a hold as Ctrl-C does (a test runner's children may ignore SIGINT)
        try:
            rest, _ = demo.communicate(timeout=180)
        finally:
            demo.kill()
            err.close()
    text += "".join(lines.queue) + (rest or "")
    assert demo.returncode == 0, text + (tmp_path / "stderr").read_text()[-4000:]
    # the run: every version committed, one tore rollout 2's model and a repair brought it back
    assert text.count(" committed: ") == 3 and text.count(" committed (a repair: v1 again") == 1, text
    assert "check: version 2 tore rollout 2's model (receiver " in text and "RESULT: OK" in text
    assert text.count("final weights digest") == 2 and "[rollout 2] generating with version 4" in text
    assert "daemon stopped (exit 0)" in text
    # deploy/engine.yaml's settings (keep_versions 2, min_receivers 1), the demo's bucket size
    assert (config["bucket_size_mb"], config["keep_versions"], config["min_receivers"]) == (4, 2, 1), config
    # held: the trainer ranks, the rollouts and the cache are all there (they had exited)
    trainers = {a["rank"]: a for a in agents if a["role"] == "trainer"}
    receivers = [a for a in agents if a["role"] == "receiver"]
    assert set(trainers) == {0, 1} and [a["state"] for a in receivers] == ["serving", "serving"], agents
    frame = status.stdout.splitlines()
    assert "  rank 1 " in status.stdout and "cache: v" in status.stdout and "cache: empty" not in status.stdout
    assert sum(line.split()[4:6] == ["serving", "v4"] for line in frame) == 2, status.stdout
    torn = next(r for r in history if r["id"] == 2)
    assert [e["torn"] for e in torn["receivers"]].count(True) == 1, torn
    repair = next(r for r in history if r["purpose"] == "repair")
    assert repair["status"] == "committed" and repair["source_version"] == 1, repair
    # ckpt_engine_cache_bytes: both ranks' shares of the cached versions (it was rank 0's share only)
    held = set(trainers[0]["versions"])
    assert held == set(trainers[1]["versions"]) and held, trainers
    cached = sum(r["bytes"] for r in history if r["id"] in held)
    cache_bytes = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("ckpt_engine_cache_bytes "))
    assert 0.95 * cached <= cache_bytes <= 1.1 * cached, (cache_bytes, cached)


def test_library_demo_syncs_every_version_and_receivers_match_the_trainer() -> None:
    out = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "demo-library", "--steps", "8", "--sync-every",
                          "2"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 4
    assert {row.split()[2] for row in rows} == {"cached", "bypass_cpu"}
    assert all(" 2/2 " in row for row in rows)
    assert "RESULT: OK" in out.stdout
