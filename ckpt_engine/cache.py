"""Versioned host cache: the last ``keep_versions`` parameter versions, laid out as on the wire.

Each version is one flat host buffer (pinned where the device runtime allows) holding every bucket at
``bucket.flat_offset``, so sending from the cache needs no repacking. Buffers of evicted versions go to a
pool and are reused by later versions, so a steady stream of versions allocates nothing new.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch

from ckpt_engine.device import DeviceInfo, host_empty, synchronize
from ckpt_engine.errors import CacheError, ConfigError
from ckpt_engine.ipc import SharedSlot, create_slot
from ckpt_engine.layout import Layout
from ckpt_engine.tensors import TensorsOrProvider, check_matches_layout, fill_bucket, provider_of, slot_view

log = logging.getLogger(__name__)
_segment_ids = itertools.count(1000)  # ids of shareable cache buffers (slots use 0 and 1)


@dataclass
class CachedVersion:
    version: int
    layout: Layout
    step: int | None
    aliases: dict[str, str]
    created_at: float
    snapshot_seconds: float
    _buffer: torch.Tensor = field(repr=False)
    _leases: int = field(default=0, repr=False)
    _evicted: bool = field(default=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    @property
    def buffer(self) -> torch.Tensor:
        """The flat buffer holding every bucket at its ``flat_offset``."""
        return self._buffer

    def bucket(self, index: int) -> torch.Tensor:
        """uint8 view of bucket ``index`` inside the version's buffer."""
        bucket = self.layout.buckets[index]
        return self._buffer[bucket.flat_offset : bucket.flat_offset + bucket.nbytes]

    def tensor(self, name: str) -> torch.Tensor:
        for slot in self.layout.slots:
            if slot.name == name:
                return slot_view(self._buffer, slot, self.layout.buckets[slot.bucket].flat_offset)
        raise KeyError(name)


class VersionCache:
    """Keeps the newest ``keep_versions`` versions; thread-safe."""

    def __init__(self, device: DeviceInfo, keep_versions: int = 2, *, shareable: bool = False) -> None:
        """``shareable``: host buffers are memfd segments that colocated receivers can map (CPU only), so a
        cached version reaches them without any copy."""
        if keep_versions < 1:
            raise ConfigError(f"keep_versions must be >= 1, got {keep_versions}")
        self.device = device
        self.shareable = shareable and device.comm_device.type == "cpu"
        self._shared: dict[int, SharedSlot] = {}  # buffer data_ptr -> its segment
        self.keep_versions = keep_versions
        self._versions: dict[int, CachedVersion] = {}
        self._pool: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocations = 0
        self.bytes_allocated = 0

    def snapshot(
        self,
        version: int,
        layout: Layout,
        tensors: TensorsOrProvider,
        *,
        aliases: Mapping[str, str] | None = None,
        step: int | None = None,
        check: bool = True,
    ) -> CachedVersion:
        """Copy ``tensors`` (device or host) into the cache as ``version``; returns once the copy is done.
        ``tensors`` may be a per-bucket provider (sharded models assemble full tensors bucket by bucket).
        ``check=False`` skips re-checking tensors against the layout (for callers that planned it from them)."""
        if check and not callable(tensors):
            check_matches_layout(layout, tensors)
        provide = provider_of(tensors)
        started = time.perf_counter()
        with self._lock:
            if version in self._versions:
                raise CacheError(f"version {version} is already cached")
            self._make_room(self.keep_versions - 1)
            buffer = self._take_buffer(layout)
        for bucket in layout.buckets:
            fill_bucket(buffer, bucket.slots, provide(bucket), bucket.nbytes, bucket.flat_offset)
        synchronize(self.device)
        cached = CachedVersion(
            version, layout, step, dict(aliases or {}), time.time(), time.perf_counter() - started, buffer
        )
        with self._lock:
            self._versions[version] = cached
            self._make_room(self.keep_versions)
        return cached

    def get(self, version: int) -> CachedVersion:
        with self._lock:
            cached = self._versions.get(version)
        if cached is None:
            raise CacheError(f"version {version} is not in the cache (held: {self.versions()})")
        return cached

    def __contains__(self, version: int) -> bool:
        with self._lock:
            return version in self._versions

    def latest(self) -> CachedVersion | None:
        with self._lock:
            return self._versions[max(self._versions)] if self._versions else None

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def bytes_by_version(self) -> dict[int, int]:
        with self._lock:
            return {v: c.nbytes for v, c in sorted(self._versions.items())}

    @property
    def bytes_held(self) -> int:
        """Bytes of the versions currently cached (what eviction would free)."""
        return sum(self.bytes_by_version().values())

    def evict(self, version: int) -> int:
        """Drop ``version``; returns the bytes it held. A leased version's buffer is reused after release."""
        with self._lock:
            cached = self._versions.pop(version, None)
            if cached is None:
                raise CacheError(f"version {version} is not in the cache")
            self._retire(cached)
            return cached.nbytes

    @contextlib.contextmanager
    def lease(self, version: int) -> Iterator[CachedVersion]:
        """Hold ``version``'s buffer while reading it (e.g. a background send), even if it is evicted meanwhile."""
        with self._lock:
            cached = self._versions.get(version)
            if cached is None:
                raise CacheError(f"version {version} is not in the cache")
            cached._leases += 1
        try:
            yield cached
        finally:
            with self._lock:
                cached._leases -= 1
                if cached._evicted and cached._leases == 0:
                    self._pool.append(cached._buffer)

    def shared_segment(self, cached: CachedVersion) -> SharedSlot | None:
        """The memfd segment behind a cached version, when the cache is shareable."""
        return self._shared.get(cached.buffer.data_ptr())

    def _make_room(self, keep: int) -> None:
        while len(self._versions) > keep:
            oldest = min(self._versions)
            log.debug("evicting version %d (%d bytes)", oldest, self._versions[oldest].nbytes)
            self._retire(self._versions.pop(oldest))

    def _retire(self, cached: CachedVersion) -> None:
        cached._evicted = True
        if cached._leases == 0:
            self._pool.append(cached._buffer)

    def _take_buffer(self, layout: Layout) -> torch.Tensor:
        need = max(layout.total_bytes, 1)
        fitting = [b for b in self._pool if b.numel() >= need]
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self._pool.remove(buffer)
            return buffer
        # The model grew: buffers too small for it will never fit again, so free them.
        for small in self._pool:
            self.bytes_allocated -= small.numel()
            segment = self._shared.pop(small.data_ptr(), None)
            if segment is not None:
                segment.close()
        self._pool.clear()
        if self.shareable:
            segment = create_slot(next(_segment_ids), need, self.device)
            self._shared[segment.tensor.data_ptr()] = segment
            buffer = segment.tensor
        else:
            buffer = host_empty(need, self.device)
        self.allocations += 1
        self.bytes_allocated += buffer.numel()
        return buffer
