"""The quick start's main job runs for real, end to end (a smaller model than the default)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).parents[1]
SMALL = ["--steps", "8", "--sync-every", "4", "--hidden", "64", "--layers", "2", "--vocab", "256"]


# (cached, as the quick start runs it: bypass_cpu versions of an FSDP2 job reaching transformers rollouts
# byte-exact are tests/test_fsdp_sync.py's, and the library demo sends both modes)
@pytest.mark.parametrize("mode", [[]], ids=["cached"])
def test_fully_async_demo_commits_every_version_and_rollouts_match(mode: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "ckpt_engine.server", "demo", *SMALL, *mode],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    text = out.stdout
    assert text.count("committed:") == 2
    assert ("bypass_cpu" if mode else "cached") in text.split("version history")[1]
    assert text.count("final weights digest") == 2 and "RESULT: OK" in text
    assert "[rollout 1] generating with version 2" in text or "[rollout 2] generating with version 2" in text
    assert "daemon stopped (exit 0)" in text


def test_library_demo_syncs_every_version_and_receivers_match_the_trainer() -> None:
    out = subprocess.run([sys.executable, "-m", "ckpt_engine.server", "demo-library", "--steps", "8", "--sync-every",
                          "2"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 4
    assert {row.split()[2] for row in rows} == {"cached", "bypass_cpu"}
    assert all(" 2/2 " in row for row in rows)
    assert "RESULT: OK" in out.stdout
