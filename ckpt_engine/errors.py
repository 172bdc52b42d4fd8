"""Exception types raised by ckpt-engine. Every failure the library can name has its own type."""

from __future__ import annotations

from collections.abc import Iterable

from ckpt_engine.ranks import QuorumRank


class CkptEngineError(Exception):
    """Base class of every error raised on purpose by ckpt-engine."""


class ConfigError(CkptEngineError, ValueError):
    """A setting or argument has a bad value."""


class DeviceError(CkptEngineError):
    """The requested device or backend is not available in this process."""


class LayoutError(CkptEngineError, ValueError):
    """A bucket layout cannot be planned from the given tensors."""


class LayoutMismatchError(CkptEngineError):
    """Two ranks hold different layouts for the same version."""


class ProtocolError(CkptEngineError):
    """A message on the wire is malformed, truncated or out of order."""


class SyncTimeoutError(CkptEngineError, TimeoutError):
    """A wait on a peer (rendezvous, collective, acknowledgement) ran past its timeout."""


class ReceiversAbsent(SyncTimeoutError):
    """Receivers of a version never joined its rendezvous: ``ranks`` are their ranks in the version's quorum
    (converted from the failed group's own ranks where the group is known)."""

    def __init__(self, message: str, ranks: Iterable[QuorumRank] = ()) -> None:
        super().__init__(message)
        self.ranks: tuple[QuorumRank, ...] = tuple(ranks)


def absent_receivers(exc: BaseException) -> list[QuorumRank]:
    """The quorum ranks a failure names as never having joined (none for any other failure)."""
    return list(exc.ranks) if isinstance(exc, ReceiversAbsent) else []


class TrainerGroupError(CkptEngineError):
    """A collective of the trainer job's own process group failed during a sync (a rank died, or stalled past
    the group's timeout): the job's ranks are out of step in their collectives. Raised to the training loop,
    which must end (as after any failed collective) so the job is restarted as a whole."""


class GroupBrokenError(CkptEngineError):
    """The sync group failed mid-operation and must be rebuilt before it can be used again."""


class ApplyRefused(CkptEngineError):
    """An engine refused a verified version before changing anything: the model still holds what it held."""


class TornModelError(CkptEngineError):
    """The model holds no whole version: an apply failed part way. It must not serve until repaired."""


class StagingUnavailable(CkptEngineError):
    """This receiver cannot allocate the memory a version needs (it says how much)."""


class CacheError(CkptEngineError):
    """A version cache operation cannot be carried out (unknown or evicted version)."""
