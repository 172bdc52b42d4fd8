"""Background threads of the worker-side agents."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def supervised(target: Callable[[], None], name: str, on_death: Callable[[BaseException], None] | None = None
               ) -> threading.Thread:
    """A daemon thread whose unexpected death is logged with its traceback and handed to ``on_death``."""

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            log.exception("thread %s died", name)
            if on_death is not None:
                try:
                    on_death(exc)
                except Exception:
                    log.exception("handling the death of thread %s failed", name)

    return threading.Thread(target=run, name=name, daemon=True)
