"""The quick start's main job runs for real: trainer + 2 receivers, both modes, identical final weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc


def test_demo_syncs_every_version_and_receivers_match_the_trainer() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "demo", "--steps", "8", "--sync-every", "2"],
        capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[1],
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    rows = [line for line in lines if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 4
    assert {row.split()[2] for row in rows} == {"cached", "bypass_cpu"}
    assert all(" 2/2 " in row for row in rows)
    assert "RESULT: OK" in out.stdout
