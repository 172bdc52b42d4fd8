"""How a version leaves the trainer: one type from the request to the history."""

from __future__ import annotations

from typing import Literal

from ckpt_engine.errors import ConfigError

# cached: the trainer is held for a device -> host snapshot into the versioned cache, the send runs from the
# cache in the background. bypass_cpu: sent straight from the live tensors (no host copy, not cached).
Mode = Literal["cached", "bypass_cpu"]
MODES: tuple[Mode, ...] = ("cached", "bypass_cpu")
SPARSE_NEEDS_THE_CACHE = "sparse works from the host cache, so it cannot be combined with bypass_cpu"


def mode_of(bypass_cpu: bool) -> Mode:
    return "bypass_cpu" if bypass_cpu else "cached"


def check_sparse(mode: Mode, sparse: bool) -> None:
    if sparse and mode == "bypass_cpu":
        raise ConfigError(SPARSE_NEEDS_THE_CACHE)


def check_mode(mode: object) -> Mode:
    """``mode`` if it is one of MODES; a ConfigError naming them otherwise (a typo must not quietly become a
    cached version)."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]
