"""How a version leaves the trainer: one type from the request to the history."""

from __future__ import annotations

from typing import Literal

from ckpt_engine.errors import ConfigError

# cached: the trainer is held for a device -> host snapshot into the versioned cache, the send runs from the
# cache in the background. bypass_cpu: sent straight from the live tensors (no host copy, not cached).
Mode = Literal["cached", "bypass_cpu"]
MODES: tuple[Mode, ...] = ("cached", "bypass_cpu")
# How a version reaches a receiver's model: staged whole on the device or in host memory, or streamed bucket by
# bucket (receive/staging.py chooses; ``auto``: per version, by free memory). One type from the YAML to the history.
Staging = Literal["auto", "device", "host", "stream"]
StagingMode = Literal["device", "host", "stream"]
STAGINGS: tuple[Staging, ...] = ("auto", "device", "host", "stream")
DEFAULT_STAGING: Staging = "auto"  # the one default: the deployment's, the wire's and a library receiver's
SPARSE_NEEDS_THE_CACHE = "sparse works from the host cache, so it cannot be combined with bypass_cpu"


def mode_of(bypass_cpu: bool) -> Mode:
    return "bypass_cpu" if bypass_cpu else "cached"


def check_sparse(mode: Mode, sparse: bool) -> None:
    """The one sparse rule: sparse versions are cached ones."""
    if sparse and mode == "bypass_cpu":
        raise ConfigError(SPARSE_NEEDS_THE_CACHE)


def resolve(bypass_cpu: bool | None, sparse: bool | None, *, default_bypass_cpu: bool,
            default_sparse: bool) -> tuple[Mode, bool]:
    """A request's mode and sparse flag: what it says, else the deployment's (the one place a default is
    applied, for every path). A default yields to what the request asks (``bypass_cpu: true`` under a sparse
    deployment is a whole bypass version; ``sparse: true`` under a bypass deployment a cached one); asking
    for both is a ConfigError."""
    if bypass_cpu is not None and sparse is not None:
        check_sparse(mode_of(bypass_cpu), sparse)
        return mode_of(bypass_cpu), sparse
    if bypass_cpu is not None:
        return mode_of(bypass_cpu), default_sparse and not bypass_cpu
    if sparse is not None:
        return mode_of(default_bypass_cpu and not sparse), sparse
    try:
        check_sparse(mode_of(default_bypass_cpu), default_sparse)
    except ConfigError as exc:
        raise ConfigError(f"the deployment sets both bypass_cpu and sparse: {exc}") from None
    return mode_of(default_bypass_cpu), default_sparse


def overlaps_snapshot(mode: Mode, *, delta: bool, sparse_base: bool, owner_ranks: int, gathers: bool,
                      host_wire: bool, device_copy: bool, wanted: bool | None = None) -> bool:
    """Whether a cached version's send starts while its snapshot is still filling the cache (bucket k leaves once
    it is cached). Never for the versions whose send needs them whole first: a sparse send digests every tensor
    to find what changed, and a delta is assembled from its parent. Never where the send thread's collectives
    would run beside the snapshot's on device communicators: the owners' votes of a version of several owners,
    or the gathers of a sharded model onto a device wire (NCCL does not order two communicators used from two
    threads alike on every rank). Else as ``wanted`` says; by default (None) where the snapshot is a
    device→host copy (``device_copy``), done by a copy engine beside the send's work: a host snapshot is a
    memcpy on the cores the send needs too, and measured on 2 cores it held the training loop twice as long for
    a few percent off the time to verified (docs/performance-notes.md)."""
    if wanted is False or mode != "cached" or delta or sparse_base:
        return False
    if owner_ranks != 1 or (gathers and not host_wire):
        return False
    return device_copy if wanted is None else True


def check_mode(mode: object) -> Mode:
    """``mode`` if it is one of MODES; a ConfigError naming them otherwise (a typo must not quietly become a
    cached version)."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode
