"""What a receiver hands its ``load`` (a verified version, whole or streamed) and what it reports back."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ckpt_engine.errors import CkptEngineError
from ckpt_engine.plan.layout import TensorSpec
from ckpt_engine.plan.modes import Mode
from ckpt_engine.transport.messages import Ack


@dataclass
class VersionPayload:
    """A version for ``load``. Whole (device or host staging): every tensor verified before the call, as named
    views in ``tensors``, valid during the call. Streamed: ``stream`` yields each tensor once the bucket holding
    it verified, valid until the next is asked for; it ends only after the whole version and its trailer
    verified, and raises instead where anything failed (the load then stops: what it applied so far is not a
    version). ``items()`` serves both; ``specs`` names every tensor either carries before anything is read."""

    version: int
    step: int | None
    mode: Mode
    version_digest: str | None  # None for a streamed version until it ended (see ReceiveResult)
    tensors: Mapping[str, torch.Tensor]
    sparse: bool = False  # only the tensors that changed since the version the receiver holds
    specs: Mapping[str, TensorSpec] = field(default_factory=dict)  # aliases included; read-only (shared)
    stream: Iterator[tuple[str, torch.Tensor]] | None = None
    paused_s: float | None = None  # set by a load that measured how long its engine was paused for it
    aliases: Mapping[str, str] = field(default_factory=dict)  # tied names -> the names whose bytes they carry

    @property
    def streamed(self) -> bool:
        return self.stream is not None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the version with its name (aliases too)."""
        return self.stream if self.stream is not None else iter(self.tensors.items())

    def names(self) -> frozenset[str]:
        return frozenset(self.specs) if self.specs else frozenset(self.tensors)


LoadFn = Callable[[VersionPayload], None]


@dataclass
class ReceiveResult:
    version: int | None
    ok: bool
    reason: str | None = None
    version_digest: str | None = None
    bad_tensors: list[str] = field(default_factory=list)
    loaded: bool = False
    bytes_received: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    torn: bool = False  # load failed part way: the model holds no whole version
    unable: str | None = None  # this receiver cannot take versions like this one now (e.g. memory)
    staging: str | None = None  # device | host | stream | shared: where the version was held
    staging_why: str | None = None

    def ack(self, rank: int) -> Ack:
        return Ack(version=self.version or 0, rank=rank, ok=self.ok, version_digest=self.version_digest,
                   reason=self.reason, bad_tensors=self.bad_tensors, seconds=self.seconds)


class StreamFailed(CkptEngineError):
    """A streamed version failed part way (a bucket did not verify or never came, or the trailer disagreed)."""


class SenderAborted(CkptEngineError):
    """The sender abandoned the version; nothing of it was loaded."""
