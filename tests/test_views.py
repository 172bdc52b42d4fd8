"""The rules of what an operator is shown of each receiver (server/decisions/views.py)."""

from __future__ import annotations

import pytest

from ckpt_engine.server.decisions.views import ReceiverRow, lag, last_errors, receiver_rows

V = [  # newest first, as GET /versions lists them
    {"id": 5, "status": "committed", "receivers": [{"agent_id": "a", "ok": True}, {"agent_id": "b", "ok": True}]},
    {"id": 4, "status": "failed", "receivers": [{"agent_id": "b", "ok": False, "reason": "load failed"}]},
    {"id": 3, "status": "committed", "receivers": [{"agent_id": "a", "ok": False, "reason": None}]},
    {"id": 2, "status": "cancelled", "receivers": []},
    {"id": 1, "status": "committed", "receivers": [{"agent_id": "a", "ok": True}]},
]


@pytest.mark.parametrize("serving, expected", [(5, 0), (3, 1), (1, 2), (0, 3), (None, None)])
def test_lag_counts_committed_versions_newer_than_the_one_served(serving: int | None, expected: int | None) -> None:
    assert lag(serving, [5, 3, 1]) == expected


def test_the_last_error_is_each_receivers_newest_failure_also_after_it_recovered() -> None:
    assert last_errors(V) == {"b": "v4: load failed", "a": "v3: failed"}


@pytest.mark.parametrize("agent, row", [
    ({"agent_id": "a", "role": "receiver", "state": "serving", "serving": 3},
     ReceiverRow("a", None, "serving", 3, 1, "v3: failed")),
    ({"agent_id": "b", "role": "receiver", "state": "torn", "serving": None, "torn": "apply failed", "engine": "e"},
     ReceiverRow("b", "e", "torn", None, None, "apply failed")),  # the current trouble before a past one
    ({"agent_id": "c", "role": "receiver", "state": "unable", "serving": 5, "unable": "never joined"},
     ReceiverRow("c", None, "unable", 5, 0, "never joined")),
])
def test_receiver_rows(agent: dict, row: ReceiverRow) -> None:
    assert receiver_rows([agent], V) == [row]


def test_trainers_and_drivers_are_not_receiver_rows() -> None:
    assert receiver_rows([{"agent_id": "t", "role": "trainer"}, {"agent_id": "d", "role": "driver"}], V) == []
