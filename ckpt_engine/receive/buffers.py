"""A receiver's staging buffers, kept across versions. They are released when a version's staging does not use
them, so a receiver that had to stream gives its memory back to the engine.

A streamed version lands each bucket in a buffer of a small pool. A buffer is reused once nothing else refers
to its memory, i.e. the load let go of every view into it. Another is allocated while the load still holds
views: vLLM's layerwise reload keeps a layer's weights until the layer is complete, which may be a bucket
later. Another is also allocated while the transport has not yet let go of a bucket it finished receiving,
since gloo's and NCCL's work objects release their tensors from their own threads. So two are in use, now and
then three. Buffers are reused rather than allocated per bucket: a host allocator keeps freed buffers (glibc
raises its mmap threshold after the first free), and fresh pages would fault in on every bucket."""

from __future__ import annotations

import torch

from ckpt_engine.device import DeviceInfo, comm_empty, free_memory, host_empty
from ckpt_engine.errors import StagingUnavailable
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.receive.staging import Held, StagingMode


class StagingBuffers:
    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self.whole: torch.Tensor | None = None  # device staging: a whole version on the device
        self.host: torch.Tensor | None = None  # host staging: a whole version in pinned host memory
        self.pair: list[torch.Tensor] = []  # host: two buckets to receive into, on the device
        self.pool: list[tuple[torch.Tensor, int]] = []  # stream: (buffer, its use count when nothing refers to it)
        self._bucket_bytes = 1  # stream: the size a bucket's buffer is made, the layout's largest bucket

    def held(self) -> Held:
        return Held(device=_size(self.whole), host=_size(self.host),
                    buckets=sum(b.numel() for b in self.pair) + sum(b.numel() for b, _ in self.pool))

    def free(self) -> tuple[int, int]:
        """(device, host) bytes free now."""
        return free_memory(self.device)

    def prepare(self, mode: StagingMode, layout: Layout) -> None:
        """Allocate what ``mode`` needs for ``layout`` and release what it does not use. Raises
        StagingUnavailable when the memory is not there."""
        whole = mode == "device"
        self.whole = self._sized(self.whole if whole else None, layout.total_bytes if whole else 0, comm_empty)
        self.host = self._sized(self.host if mode == "host" else None,
                                layout.total_bytes if mode == "host" else 0, host_empty)
        # stream: the pool keeps at most a few buffers that serve this layout; a load that held views grew it
        self._bucket_bytes = max(layout.max_bucket_bytes, 1)
        self.pool = _kept(self.pool, self._bucket_bytes) if mode == "stream" else []
        bucket = max(layout.max_bucket_bytes, 1) if mode == "host" else 0
        if not bucket:
            self.pair = []
        elif len(self.pair) != 2 or self.pair[0].numel() < bucket:
            self.pair = []
            self.pair = [self._sized(None, bucket, comm_empty), self._sized(None, bucket, comm_empty)]  # type: ignore[list-item]

    def landing(self, nbytes: int) -> torch.Tensor:
        """A buffer that nothing else refers to, for one streamed bucket or one chunked tensor put together."""
        free = [entry for entry in self.pool if _serves(entry[0].numel(), nbytes, self._bucket_bytes)
                and _uses(entry[0]) == entry[1]]
        if free:
            return min(free, key=lambda entry: entry[0].numel())[0][:nbytes]
        # For a larger chunked tensor, the smaller free assembly buffers go: the pool's bound is then the largest
        # such tensor, not their sum.
        if nbytes > self._bucket_bytes:
            self.pool = [entry for entry in self.pool
                         if entry[0].numel() <= self._bucket_bytes or _uses(entry[0]) != entry[1]]
        buffer: torch.Tensor = self._sized(None, max(nbytes, self._bucket_bytes), comm_empty)  # type: ignore[assignment]
        if _COUNTS_USES:  # without the count a buffer cannot be known free, so each is used once
            self.pool.append((buffer, _uses(buffer)))
        return buffer[:nbytes]

    def bucket(self, layout: Layout, bucket: Bucket, shared: torch.Tensor | None) -> torch.Tensor:
        """Where bucket ``bucket``'s bytes land when staged: its place in a whole buffer, or under host staging
        one of the pair, taking turns. ``shared``: the sender's whole buffer, on the same host."""
        whole = shared if shared is not None else self.whole
        if whole is not None:
            return whole[bucket.flat_offset : bucket.flat_offset + bucket.nbytes]
        return self.pair[bucket.index % 2][: bucket.nbytes]

    def _sized(self, buffer: torch.Tensor | None, nbytes: int, make) -> torch.Tensor | None:
        if nbytes == 0:
            return None
        if buffer is not None and buffer.numel() >= nbytes:
            return buffer
        try:
            return make(max(nbytes, 1), self.device)
        except (RuntimeError, MemoryError) as exc:  # torch's allocators raise RuntimeError or its OOM subclasses
            raise StagingUnavailable(f"cannot allocate {nbytes} bytes of staging: {exc}") from exc


_BUCKETS_KEPT = 3  # stream bucket buffers kept from one version to the next: two in use, a third now and then


def _kept(pool: list[tuple[torch.Tensor, int]], bucket_bytes: int) -> list[tuple[torch.Tensor, int]]:
    """What the pool keeps for the next version: a few bucket-sized buffers, and its largest assembly buffer,
    where the next version's chunked tensors are put together. Buffers of another layout go."""
    buckets = [entry for entry in pool if entry[0].numel() == bucket_bytes][:_BUCKETS_KEPT]
    larger = [entry for entry in pool if entry[0].numel() > bucket_bytes]
    return buckets + ([max(larger, key=lambda entry: entry[0].numel())] if larger else [])


_COUNTS_USES = hasattr(torch._C, "_storage_Use_Count")  # torch.multiprocessing relies on it too


def _serves(size: int, nbytes: int, bucket_bytes: int) -> bool:
    """Whether a pool buffer of ``size`` bytes takes ``nbytes``. A bucket lands only in a bucket-sized buffer,
    so the buffer a chunked tensor is put together in stays free for the next such tensor."""
    return size == bucket_bytes if nbytes <= bucket_bytes else size >= nbytes


def _uses(buffer: torch.Tensor) -> int:
    """How many tensors, views included, refer to ``buffer``'s memory now."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


def _size(buffer: torch.Tensor | None) -> int:
    return 0 if buffer is None else buffer.numel()
