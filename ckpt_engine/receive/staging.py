"""Where a receiver holds a version before or while it is applied: a pure choice, made per version.

- ``device``: the whole version is staged on the receiver's device. The engine pauses only to apply it.
- ``host``: the whole version is staged in pinned host memory and copied in under the pause. The device holds
  only two buckets to receive into.
- ``stream``: two buckets on the device, plus room to put together the pieces of a tensor larger than a bucket.
  Each bucket is verified and applied while the next is on the wire, so the engine is paused for the whole
  transfer.
- ``auto``: the first of device, host, stream whose memory fits ``share`` of what is free now.

A receiver whose load takes whole versions only (it cannot iterate a stream) never streams: ``auto`` then picks
between device and host, and an explicit ``stream`` falls back to host, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.modes import STAGINGS, Staging, StagingMode

__all__ = ["STAGINGS", "Held", "Staging", "StagingChoice", "StagingMode", "StagingNeeds", "choose_staging"]


@dataclass(frozen=True)
class StagingNeeds:
    """Bytes each mode allocates for one version. Buffers this receiver holds already are not counted again."""

    version: int  # the whole version in wire layout
    buckets: int  # two buckets to receive into while one is checked
    assembly: int  # the largest tensor sent in pieces; a streamed one is put together before it is applied

    @classmethod
    def of(cls, layout: Layout) -> StagingNeeds:
        return cls(max(layout.total_bytes, 1), 2 * max(layout.max_bucket_bytes, 1), layout.largest_chunked_bytes)


@dataclass(frozen=True)
class Held:
    """Bytes of staging buffers this receiver holds already, which the mode that owns them reuses."""

    device: int = 0
    host: int = 0
    buckets: int = 0


@dataclass(frozen=True)
class StagingChoice:
    mode: StagingMode
    why: str


def choose_staging(policy: Staging, needs: StagingNeeds, *, free_device: int, free_host: int, share: float,
                   held: Held = Held(), streams: bool = True) -> StagingChoice:
    """The staging of one version. ``free_*``: bytes free now. Buffers held here count as free, because a mode
    that does not use them releases them. ``share``: the part of it staging may take. ``streams``: whether the
    receiver's load can take a stream."""
    if policy == "stream" and not streams:
        return StagingChoice("host", "staging is stream, but this receiver's load takes whole versions only")
    if policy != "auto":
        return StagingChoice(policy, f"staging is {policy}")
    budget_device = int((free_device + held.device + held.buckets) * share)
    budget_host = int((free_host + held.host) * share)
    if needs.version <= budget_device:
        return StagingChoice("device", f"the version ({_mb(needs.version)}) fits {share:.0%} of the device's free "
                                       f"{_mb(free_device + held.device + held.buckets)}")
    host_fits = needs.version <= budget_host and needs.buckets <= budget_device
    if host_fits or not streams:
        what = "fits" if host_fits else "is the last resort (this receiver's load takes whole versions only)"
        return StagingChoice("host", f"the version ({_mb(needs.version)}) exceeds {share:.0%} of the device's free "
                                     f"{_mb(free_device + held.device + held.buckets)}; host staging {what} "
                                     f"({_mb(free_host + held.host)} free)")
    return StagingChoice("stream", f"the version ({_mb(needs.version)}) fits {share:.0%} of neither the device's "
                                   f"free {_mb(free_device + held.device + held.buckets)} nor the host's "
                                   f"{_mb(free_host + held.host)}: streamed through two buckets "
                                   f"({_mb(needs.buckets + needs.assembly)})")


def _mb(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
