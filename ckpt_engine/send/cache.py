"""Versioned host cache: the last ``keep_versions`` parameter versions, laid out as on the wire.

A whole version is one flat host buffer (pinned where the device runtime allows) holding every bucket at
``bucket.flat_offset``, so sending it needs no repacking. A delta version (sparse mode) stores only the
tensors that changed since its parent version in a buffer of their own and shares the parent's bytes for
the rest, so an unchanged tensor is held once however many cached versions contain it.

Buffers are reference-counted by the versions (and leases) that use them. A buffer nobody uses any more goes
to a pool for later versions, so a steady stream of versions allocates nothing new.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ckpt_engine.device import DeviceInfo, host_empty, mark, stream_synchronize, wait_for
from ckpt_engine.errors import CacheError, ConfigError, LayoutMismatchError
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.owners import Owners, Share, single_owner
from ckpt_engine.plan.sparse import Manifest
from ckpt_engine.plan.tensors import (
    TensorsOrProvider,
    check_matches_layout,
    fill_bucket,
    forget_fill_views,
    provider_of,
    slot_view,
    staging_bytes,
)
from ckpt_engine.send.filling import FillProgress, LiveReads
from ckpt_engine.transport.same_host import SharedSlot, create_slot

log = logging.getLogger(__name__)
_segment_ids = itertools.count(1000)  # ids of shareable cache buffers (slots use 0 and 1)


@dataclass
class CachedVersion:
    version: int
    layout: Layout  # what this cache holds of the version: the whole model's, or this trainer rank's share
    step: int | None
    aliases: dict[str, str]
    created_at: float
    snapshot_seconds: float
    _buffer: torch.Tensor = field(repr=False)  # this version's own bytes, laid out as ``own_layout``
    own_layout: Layout | None = field(default=None, repr=False)  # None: the whole layout (not a delta)
    parent: int | None = None  # delta: the version the unchanged tensors are shared with
    _shared: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # delta: unchanged tensors
    _buffers: tuple[torch.Tensor, ...] = field(default=(), repr=False)  # every buffer this version reads
    _views: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _local: dict[int, int] | None = field(default=None, repr=False)
    _leases: int = field(default=0, repr=False)
    _evicted: bool = field(default=False, repr=False)
    # Of a version several trainer ranks own: the version's layout, its owners, and the index in it of each
    # bucket of ``layout`` (this rank's share). None: ``layout`` is the version's, all of it held here.
    version_layout: Layout | None = None
    owners: Owners | None = None
    wire: tuple[int, ...] | None = None
    # The version as first sent: every tensor's digest, as the receivers verified it and the daemon recorded it.
    # A re-send checks this rank's bytes against it before anything goes out.
    identity: Manifest | None = None
    # How far its snapshot got, while it runs: a send may read the filled buckets meanwhile. The version is listed
    # in the cache (for re-sends, sparse bases, repairs) only once whole.
    filling: FillProgress | None = field(default=None, repr=False)
    # While its snapshot holds the training loop: the live tensors, which its send may read instead (filling.py).
    live: LiveReads | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.own_layout is None:
            self.own_layout = self.layout
        if not self._buffers:
            self._buffers = (self._buffer,)
        if self.version_layout is None:
            self.version_layout = self.layout
        if self.owners is None:
            self.owners = single_owner(self.layout)
        if self.wire is None:
            self.wire = tuple(range(len(self.layout.buckets)))

    def local_index(self, wire_index: int) -> int:
        """The index in ``layout`` of the version's bucket ``wire_index`` (which this rank owns)."""
        if self._local is None:
            self._local = {wire: local for local, wire in enumerate(self.wire)}  # type: ignore[arg-type]
        local = self._local.get(wire_index)
        if local is None:
            raise CacheError(f"version {self.version}: bucket {wire_index} is not this rank's to send")
        return local

    @property
    def _own(self) -> Layout:
        """``own_layout``, which ``__post_init__`` always sets (the whole layout unless a delta)."""
        if self.own_layout is None:
            raise CacheError(f"version {self.version} has no own layout")
        return self.own_layout

    @property
    def is_whole(self) -> bool:
        """All bytes in one buffer in wire layout (buckets can be read in place)."""
        return self.parent is None

    @property
    def changed(self) -> tuple[str, ...]:
        """Tensors stored by this version itself (all of them unless it is a delta)."""
        return tuple(slot.name for slot in self._own.slots)

    @property
    def nbytes(self) -> int:
        """Bytes this version stores itself."""
        return self._own.total_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of tensors a delta shares with earlier versions instead of storing them again."""
        return self.layout.total_bytes - sum(slot.nbytes for slot in self._own.slots)

    @property
    def buffer(self) -> torch.Tensor:
        """The version's own flat buffer (every bucket at its ``flat_offset`` for a whole version)."""
        return self._buffer

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every buffer its tensors lie in: its own first, then (a delta) those of the versions it shares with."""
        return self._buffers

    def bucket(self, index: int) -> torch.Tensor:
        """uint8 view of bucket ``index`` inside the version's buffer (whole versions only)."""
        if not self.is_whole:
            raise CacheError(f"version {self.version} is a delta of {self.parent}: fill its buckets with fill()")
        bucket = self.layout.buckets[index]
        return self._buffer[bucket.flat_offset : bucket.flat_offset + bucket.nbytes]

    def fill(self, index: int, out: torch.Tensor) -> torch.Tensor:
        """Bucket ``index`` of the whole layout assembled into ``out``; returns the filled view."""
        bucket = self.layout.buckets[index]
        fill_bucket(out, bucket.slots, self.views(), bucket.nbytes)
        return out[: bucket.nbytes]

    def views(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version as a zero-copy view, whichever buffer holds it."""
        if self._views is None:
            own = self._own
            views = {s.name: slot_view(self._buffer, s, own.buckets[s.bucket].flat_offset) for s in own.slots}
            self._views = views | self._shared
        return self._views

    def tensor(self, name: str) -> torch.Tensor:
        view = self.views().get(name)
        if view is None:
            raise KeyError(name)
        return view


class VersionCache:
    """Keeps the newest ``keep_versions`` versions; thread-safe."""

    def __init__(self, device: DeviceInfo, keep_versions: int = 2, *, shareable: bool = False,
                 staged: bool | None = None, external_trim: bool = False) -> None:
        """``shareable``: host buffers are memfd segments that colocated receivers can map (CPU only), so a
        cached version reaches them without any copy.

        ``staged``: a snapshot packs a bucket's small tensors into a staging buffer on the device (at most
        ``STAGING_BYTES``, kept) and copies each packed span to the host at once, instead of one device→host
        copy per tensor (plan/tensors.py ``fill_bucket``). None: staged where the device is an accelerator.
        True on CPU runs the same path with a host staging buffer, for tests.

        ``external_trim``: whoever learns how each version ended (the daemon) evicts versions: a failed one at
        once, the oldest committed one once a newer one committed. A new version is then held beside the
        ``keep_versions`` others until that word comes, so a version in flight or one that failed never takes a
        committed one's place. Meanwhile the cache makes room by itself only past ``2 × keep_versions + 1``
        versions."""
        if keep_versions < 1:
            raise ConfigError(f"keep_versions must be >= 1, got {keep_versions}")
        self.external_trim = external_trim
        self.device = device
        self.staged = device.kind != "cpu" if staged is None else staged
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()  # one snapshot at a time packs through the staging buffer
        self.shareable = shareable and device.comm_device.type == "cpu"
        self._shared: dict[int, SharedSlot] = {}  # buffer data_ptr -> its segment
        self.keep_versions = keep_versions
        self._versions: dict[int, CachedVersion] = {}
        self._filling: set[int] = set()  # versions begun and not yet filled (not listed)
        self._pool: list[torch.Tensor] = []
        self._refs: dict[int, int] = {}  # buffer data_ptr -> versions (cached or leased) reading it
        self._used: dict[int, int] = {}  # buffer data_ptr -> bytes its owner version stores in it
        self._lock = threading.Lock()
        self._pinned: frozenset[int] = frozenset()
        self.allocations = 0
        self.bytes_allocated = 0
        # Called with each buffer the cache lets go of (a pull server deregisters what it registered of it)
        self.on_drop: list[Callable[[torch.Tensor], None]] = []

    def snapshot(
        self,
        version: int,
        layout: Layout,
        tensors: TensorsOrProvider,
        *,
        aliases: Mapping[str, str] | None = None,
        step: int | None = None,
        check: bool = True,
        share: Share | None = None,
        owners: Owners | None = None,
        version_layout: Layout | None = None,
    ) -> CachedVersion:
        """Copy ``tensors`` (device or host) into the cache as ``version``; returns once the copy is done.
        ``tensors`` may be a per-bucket provider (sharded models assemble full tensors bucket by bucket).
        ``check=False`` skips re-checking tensors against the layout (for callers that planned it from them).
        ``share`` (with ``owners`` and ``version_layout``): ``layout`` is this rank's share of that version."""
        if check and not callable(tensors):
            check_matches_layout(layout, tensors)
        cached = self.begin(version, layout, aliases=aliases, step=step, share=share, owners=owners,
                            version_layout=version_layout)
        try:
            self.fill(cached, tensors)
        finally:
            self.unlease(cached)
        return cached

    def begin(self, version: int, layout: Layout, *, aliases: Mapping[str, str] | None = None,
              step: int | None = None, share: Share | None = None, owners: Owners | None = None,
              version_layout: Layout | None = None) -> CachedVersion:
        """A buffer for ``version``, to be filled by :meth:`fill`. It is leased once for the caller, who ends the
        lease with :meth:`unlease`. A send may read its buckets as :attr:`CachedVersion.filling` says they are
        filled. The cache lists it only once it is whole."""
        with self._lock:
            self._check_new(version)
            self._make_room(self._room - 1)
            buffer = self._take_buffer(layout)
            cached = CachedVersion(version, layout, step, dict(aliases or {}), time.time(), 0.0, buffer,
                                   version_layout=version_layout, owners=owners,
                                   wire=share.wire if share is not None else None,
                                   filling=FillProgress(version, len(layout.buckets)))
            cached._leases = 1
            self._hold(cached)
            self._filling.add(version)
        return cached

    def fill(self, cached: CachedVersion, tensors: TensorsOrProvider,
             live: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy ``tensors`` into a version from :meth:`begin`, bucket by bucket, marking each one filled, then
        list it. Returns once every copy is done, so the caller may change its tensors again. On failure the
        version is dropped (its buffer is reused once nothing leases it) and the error raised. ``live``: the
        version's tensors by name (those ``tensors`` provides, not gathered), lent to its send meanwhile as
        ``cached.live``. The send may fill its device slots from them instead of from the cache. Before this
        returns, it takes them back and waits for the reads the send had queued."""
        progress = cached.filling
        with self._lock:
            waiting = progress is not None and cached.version in self._filling
        if progress is None or not waiting:
            raise CacheError(f"version {cached.version} is not waiting to be filled")
        provide = provider_of(tensors)
        started = time.perf_counter()
        if live is not None:
            cached.live = LiveReads(live, mark(self.device))  # the send's reads come after the loop's work so far
        try:
            with self._staging_for(cached.layout) as staging:
                for position, bucket in enumerate(cached.layout.buckets):
                    fill_bucket(cached.buffer, bucket.slots, provide(bucket), bucket.nbytes, bucket.flat_offset,
                                staging=staging)
                    progress.filled(position, mark(self.device))
                # This thread's copies only: the whole device would include a send's transfers running meanwhile.
                stream_synchronize(self.device)
        except BaseException as exc:
            self._end_live(cached)
            progress.failed(f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._filling.discard(cached.version)
                self._retire(cached)
            raise
        self._end_live(cached)
        cached.snapshot_seconds = time.perf_counter() - started
        cached.filling = None  # every copy landed: readers from now on have nothing to wait for
        with self._lock:
            self._filling.discard(cached.version)
            self._list(cached)

    def snapshot_delta(self, version: int, parent: int, changed: Layout, tensors: TensorsOrProvider, *,
                       aliases: Mapping[str, str] | None = None, step: int | None = None) -> CachedVersion:
        """Cache ``version`` as the cached ``parent`` with the tensors of ``changed`` (a layout of some of its
        tensors) replaced by ``tensors``; the others are shared with the parent, not copied."""
        started = time.perf_counter()
        with self.lease(parent) as base:
            unknown = [s.name for s in changed.slots if s.name not in base.views()]
            if unknown:
                raise LayoutMismatchError(f"tensors not in version {parent}: {unknown[:3]}")
            with self._lock:
                self._check_new(version)
                self._make_room(self._room - 1)  # the lease keeps the parent's bytes meanwhile
                buffer = self._take_buffer(changed)
                self._filling.add(version)  # (a snapshot of the same id meanwhile is refused)
            try:
                self._fill_delta(buffer, changed, tensors)
            except BaseException:
                with self._lock:
                    self._filling.discard(version)
                    self._pool.append(buffer)  # (nothing else reads it yet)
                raise
            names = {s.name for s in changed.slots}
            shared = {name: view for name, view in base.views().items() if name not in names}
            buffers = (buffer, *_buffers_holding(base._buffers, shared.values()))
            cached = CachedVersion(version, base.layout, step, dict(aliases or {}), time.time(),
                                   time.perf_counter() - started, buffer, own_layout=changed, parent=parent,
                                   _shared=shared, _buffers=buffers, version_layout=base.version_layout,
                                   owners=base.owners, wire=base.wire)
            with self._lock:
                self._filling.discard(version)
                self._hold(cached)
                self._list(cached)
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
        """Bytes each cached version stores itself (a delta's shared tensors count at their owner)."""
        with self._lock:
            return {v: c.nbytes for v, c in sorted(self._versions.items())}

    @property
    def bytes_held(self) -> int:
        """Bytes of every buffer some version still reads: what evicting everything would free."""
        with self._lock:
            return sum(self._used[ptr] for ptr, refs in self._refs.items() if refs > 0)

    def evict(self, version: int) -> int:
        """Drop ``version``; returns the bytes it stored itself. Its buffer is reused once no cached version
        shares its tensors and no lease reads it."""
        with self._lock:
            cached = self._versions.pop(version, None)
            if cached is None:
                raise CacheError(f"version {version} is not in the cache")
            self._retire(cached)
            return cached.nbytes

    @contextlib.contextmanager
    def lease(self, version: int) -> Iterator[CachedVersion]:
        """Hold ``version``'s buffers while reading them (e.g. a background send), even if it is evicted meanwhile."""
        with self._lock:
            cached = self._versions.get(version)
            if cached is None:
                raise CacheError(f"version {version} is not in the cache")
            cached._leases += 1
        try:
            yield cached
        finally:
            self.unlease(cached)

    def unlease(self, cached: CachedVersion) -> None:
        """End one lease of ``cached`` (from :meth:`lease` or :meth:`begin`)."""
        with self._lock:
            cached._leases -= 1
            if cached._evicted and cached._leases == 0:
                self._release(cached)

    def shared_segment(self, cached: CachedVersion) -> SharedSlot | None:
        """The memfd segment behind a whole cached version, when the cache is shareable."""
        return self._shared.get(cached.buffer.data_ptr()) if cached.is_whole else None

    def _check_new(self, version: int) -> None:
        if version in self._versions or version in self._filling:
            raise CacheError(f"version {version} is already cached")

    def _fill_delta(self, buffer: torch.Tensor, layout: Layout, tensors: TensorsOrProvider) -> None:
        provide = provider_of(tensors)
        try:
            with self._staging_for(layout) as staging:
                for bucket in layout.buckets:
                    fill_bucket(buffer, bucket.slots, provide(bucket), bucket.nbytes, bucket.flat_offset,
                                staging=staging)
                stream_synchronize(self.device)
        except BaseException:
            with self._lock:
                self._pool.append(buffer)  # nothing refers to it yet: straight back to the pool
            raise

    def _end_live(self, cached: CachedVersion) -> None:
        """Take the live tensors back from the send and wait for its reads of them (device to device, queued on
        its stream: short) before the training loop may change them."""
        if cached.live is not None:
            wait_for(self.device, cached.live.end(), host=True)

    @contextlib.contextmanager
    def _staging_for(self, layout: Layout) -> Iterator[torch.Tensor | None]:
        """The staging buffer a snapshot of ``layout`` packs through (None: not staged). One snapshot at a time
        holds it until its copies are done: the caller synchronises its stream before it lets go."""
        if not self.staged or not layout.buckets:
            yield None
            return
        need = staging_bytes(layout.max_bucket_bytes)
        with self._staging_lock:
            if self._staging is None or self._staging.numel() < need:
                if self._staging is not None:
                    forget_fill_views(self._staging)
                self._staging = None
                self._staging = torch.empty(need, dtype=torch.uint8, device=self.device.torch_device)
            yield self._staging

    def _hold(self, cached: CachedVersion) -> None:
        """Count ``cached`` among the readers of its buffers (under the lock)."""
        self._used[cached.buffer.data_ptr()] = cached.nbytes
        for buffer in cached._buffers:
            self._refs[buffer.data_ptr()] = self._refs.get(buffer.data_ptr(), 0) + 1

    def _list(self, cached: CachedVersion) -> None:
        """Make ``cached`` (held) one of the cached versions (under the lock)."""
        self._versions[cached.version] = cached
        self._make_room(self._room, new=cached.version)

    @property
    def _room(self) -> int:
        """Versions the cache holds before it evicts one by itself (see ``external_trim``)."""
        return 2 * self.keep_versions + 1 if self.external_trim else self.keep_versions

    def pin(self, versions: Iterable[int]) -> None:
        """Set the versions that must not be evicted to make room for new ones: the daemon's word on what
        receivers serve, which a repair or catch-up re-sends. Making room evicts the oldest unpinned version
        first, so a failed version goes before them. With only pinned versions left to evict, the cache holds
        more than its room and warns."""
        with self._lock:
            self._pinned = frozenset(versions)

    @property
    def pinned(self) -> frozenset[int]:
        return self._pinned

    def _make_room(self, keep: int, new: int | None = None) -> None:
        while len(self._versions) > keep:
            evictable = [v for v in self._versions if v not in self._pinned and v != new]
            if not evictable:
                log.warning("the cache holds %d version(s) that receivers may need for a repair (%s) besides "
                            "keep_versions=%d", len(self._versions), sorted(self._versions), self.keep_versions)
                return
            oldest = min(evictable)
            log.debug("evicting version %d (%d bytes)", oldest, self._versions[oldest].nbytes)
            self._retire(self._versions.pop(oldest))

    def _retire(self, cached: CachedVersion) -> None:
        cached._evicted = True
        if cached._leases == 0:
            self._release(cached)

    def _release(self, cached: CachedVersion) -> None:
        for buffer in cached._buffers:
            ptr = buffer.data_ptr()
            self._refs[ptr] -= 1
            if self._refs[ptr] == 0:
                del self._refs[ptr]
                self._used.pop(ptr, None)
                self._pool.append(buffer)

    def _take_buffer(self, layout: Layout) -> torch.Tensor:
        need = max(layout.total_bytes, 1)
        fitting = [b for b in self._pool if b.numel() >= need]
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self._unpool(buffer)
            return buffer
        if self.shareable:
            segment = create_slot(next(_segment_ids), need, self.device)
            self._shared[segment.tensor.data_ptr()] = segment
            buffer = segment.tensor
        else:
            buffer = host_empty(need, self.device)
        self.allocations += 1
        self.bytes_allocated += buffer.numel()
        # Whole versions and deltas of all sizes come and go: keep the pool about as large as the cache.
        while len(self._pool) > self.keep_versions:
            self._drop(min(self._pool, key=torch.Tensor.numel))
        return buffer

    def _unpool(self, buffer: torch.Tensor) -> None:
        self._pool = [b for b in self._pool if b is not buffer]  # list.remove would compare tensors by value

    def _drop(self, buffer: torch.Tensor) -> None:
        self._unpool(buffer)
        forget_fill_views(buffer)
        self.bytes_allocated -= buffer.numel()
        segment = self._shared.pop(buffer.data_ptr(), None)
        if segment is not None:
            segment.close()
        for dropped in self.on_drop:
            dropped(buffer)


def _buffers_holding(buffers: tuple[torch.Tensor, ...], views) -> list[torch.Tensor]:
    """The buffers among ``buffers`` that some of ``views`` point into."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel(), b) for b in buffers]
    used: dict[int, torch.Tensor] = {}
    for view in views:
        ptr = view.data_ptr()
        for start, end, buffer in spans:
            if start <= ptr < end or (view.numel() == 0 and ptr == start):
                used[start] = buffer
                break
    return list(used.values())
