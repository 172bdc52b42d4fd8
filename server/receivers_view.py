"""What GET /receivers and the per-receiver metrics show: the controller's agents (read under its lock), each
receiver with its lag against the newest committed versions (read from the history outside that lock), the
rules being server/decisions/views.py's."""

from __future__ import annotations

from typing import Protocol

from ckpt_engine.server.decisions.views import LAG_WINDOW, ReceiverRow, receiver_rows, with_lag
from ckpt_engine.server.history import HistoryStore


class Controller(Protocol):
    """What this view reads of the controller (server/controller.py)."""

    history: HistoryStore

    def agents_public(self) -> list[dict]: ...


def receivers_public(controller: Controller) -> list[dict]:
    """GET /receivers: every agent, a receiver with its lag (the one number the metrics, CLI and page show)."""
    return _public(controller, _committed(controller))


def receiver_rows_of(controller: Controller) -> list[ReceiverRow]:
    """The per-receiver metrics' rows, read at each scrape (one history read for the lag and the errors)."""
    committed = _committed(controller)
    return receiver_rows(_public(controller, committed), [r.to_dict() for r in committed])


def _public(controller: Controller, committed: list) -> list[dict]:
    return with_lag(controller.agents_public(), [r.id for r in committed])


def _committed(controller: Controller) -> list:
    return controller.history.list(limit=LAG_WINDOW, status="committed")
