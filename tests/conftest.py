"""Test-wide safety nets: no daemon outlives the test that started it, even when the test failed early."""

from __future__ import annotations

import pytest

from tests.daemon_harness import RUNNING


@pytest.fixture(autouse=True)
def _stop_leftover_daemons():
    before = len(RUNNING)  # daemons of wider-scoped fixtures were started already and stay
    yield
    while len(RUNNING) > before:
        daemon = RUNNING.pop()
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(10)
