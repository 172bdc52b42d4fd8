"""This rank's digests of the pieces it holds of each version it sends, met with where its pullers read them.

A send digests every bucket this rank owns as it goes (send/sender.py). A version its pullers read is offered
as soon as it is cached, usually before that: the offer then asks for the digests (``wanted``) and they are
posted the moment the send has them (``computed``): as computed once this rank's buckets are digested and
kept, as final once the owners voted that every one sent its share (transport/digest_board.py); a version
offered after its send finds them here. The lead owner holds its own back until the
daemon has its report of the version (``release``): pullers need every owner's post, the lead's included, so
whatever they load is a version the daemon judges. Either
way they are taken once, by the send: a pull costs no digest pass of its own.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from typing import Protocol

_VERSIONS_KEPT = 4  # pulled versions whose digests wait here for an offer (one comes right after the send)


class DigestSink(Protocol):
    def post(self, digests: Sequence[int], layout_digest: str, final: bool = True) -> None: ...


class OwnDigests:
    """By (version, key): key "" for a plain version's send, else the class key of a sharded version's class.
    Only versions said to be pulled (``expect``) are kept: a sharded version's classes hold a digest per piece
    each, too many to keep for versions nobody pulls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (posts are made under it: forget() returns once none can come)
        self._expected: list[int] = []  # the latest versions with pullers, oldest first
        self._held: set[int] = set()  # of those, the ones posted only once released (see expect)
        self._computed: dict[tuple[int, str], tuple[str, array, bool]] = {}  # (layout digest, digests, final)
        self._wanted: dict[tuple[int, str], DigestSink] = {}

    def expect(self, version: int, *, hold: bool = False) -> None:
        """``version`` has pullers: keep what its sends digest until it is offered. ``hold``: post nothing of
        it until :meth:`release` (the lead owner's, once the daemon has its report of the version: pullers
        then never load a version whose outcome the daemon cannot know)."""
        with self._lock:
            if version not in self._expected:
                self._expected = [*self._expected, version][-_VERSIONS_KEPT:]
            if hold:
                self._held.add(version)
            kept = set(self._expected)
            self._held &= kept
            self._computed = {k: v for k, v in self._computed.items() if k[0] in kept}

    def computed(self, version: int, key: str, layout_digest: str, digests: Sequence[int], final: bool = True) -> None:
        """A send of ``version`` digested this rank's pieces of its wire layout (``layout_digest``), in order:
        ``final`` once the owners voted, else as soon as this rank's are digested and kept."""
        with self._lock:
            if version in self._expected and (final or (version, key) not in self._computed):
                self._computed[(version, key)] = (layout_digest, array("q", digests), final)
            if final and version not in self._held:
                sink = self._wanted.pop((version, key), None)
            else:
                sink = self._wanted.get((version, key))
            if sink is not None:
                sink.post(digests, layout_digest, final and version not in self._held)

    def wanted(self, version: int, key: str, sink: DigestSink) -> None:
        """Post this rank's digests of ``version`` (``key``) to ``sink``: now if its send computed them (and
        the version is not held), else when it does (or is released)."""
        with self._lock:
            computed = self._computed.get((version, key))
            final = computed is not None and computed[2] and version not in self._held
            if computed is not None:  # (held: as computed, until released)
                sink.post(computed[1].tolist(), computed[0], final)
            if not final:
                self._wanted[(version, key)] = sink

    def known(self, version: int, key: str) -> bool:
        """Whether a send of ``version`` digested this rank's pieces of ``key`` and the owners voted (posted or
        held)."""
        with self._lock:
            computed = self._computed.get((version, key))
            return computed is not None and computed[2]

    def release(self, version: int) -> None:
        """Post what is held of ``version`` to where it is wanted; later digests of it are posted at once."""
        with self._lock:
            self._held.discard(version)
            for key in [k for k in self._wanted if k[0] == version and k in self._computed and self._computed[k][2]]:
                layout_digest, digests, _ = self._computed[key]
                self._wanted.pop(key).post(digests.tolist(), layout_digest)

    def clear(self) -> None:
        """Forget every version (their ids belong to another history: the same id may come again)."""
        with self._lock:
            self._expected, self._held, self._computed, self._wanted = [], set(), {}, {}

    def forget(self, version: int) -> None:
        """No more posts for ``version`` (its offer's memory is about to be reused)."""
        with self._lock:
            self._wanted = {k: v for k, v in self._wanted.items() if k[0] != version}
            self._held.discard(version)
