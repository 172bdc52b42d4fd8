"""The versions a trainer rank offers its pullers before their send (``pull_server.offers_before_send``).

The publisher calls the offer once the version is cached and waits for it a bounded time before the send starts
(``publish(before_send=...)``); the version's report waits for it as long again. An offer still not made by then
is given up on: the version fails for its pullers, and an offer made later is failed at once, never reported (so
the daemon never hears "offered" after "done", and nothing is offered twice).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ckpt_engine.errors import CkptEngineError
from ckpt_engine.transport.messages import PullOffer

log = logging.getLogger(__name__)


class EarlyOffers:
    """Thread-safe: offers run on the publisher's threads, the reports on the sends'."""

    def __init__(self) -> None:
        self.offered: set[int] = set()  # offered before their send, until the send's report
        self._done: dict[int, threading.Event] = {}  # versions being offered: set once offered (or not)
        self._late: set[int] = set()  # given up on while their offer still ran
        self._lock = threading.Lock()

    def offering(self, version: int, offer: Callable[[], PullOffer], report: Callable[[PullOffer], None],
                 fail: Callable[[str], None]) -> Callable[[], None]:
        """What offers ``version`` (``offer``), then ``report``s it; or, given up on meanwhile, ``fail``s it."""
        done = self._done[version] = threading.Event()

        def run() -> None:
            offered: PullOffer | None = None
            try:
                offered = offer()
            except CkptEngineError as exc:
                log.info("version %d is not offered before its send (%s): it is once its send ended, if that "
                         "succeeds", version, exc)
            finally:
                with self._lock:
                    late = version in self._late
                    self._late.discard(version)
                    if offered is not None and not late:
                        self.offered.add(version)
                        report(offered)  # (before the send's report can see it done)
                    done.set()
            if offered is not None and late:  # (its version already failed for its pullers)
                fail("its offer came after its send had ended")

        return run

    def settled(self, version: int, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for ``version``'s early offer, if any. False where it is still not made: it
        is given up on from now (see above)."""
        done = self._done.pop(version, None)
        if done is None or done.wait(wait_s):
            return True
        with self._lock:
            if done.is_set():
                return True
            self._late.add(version)
            return False

    def forget(self, version: int) -> None:
        """``version`` is not offered early after all (its publish failed before its send started)."""
        self._done.pop(version, None)
        self.offered.discard(version)
