"""Which tensors changed since the previous cached version, found from per-tensor digests of what this
process holds (its FSDP2 shards, or whole tensors), without gathering anything.

Sharded trainers all-reduce the vectors of every rank (see sparse.agreement_vector); a single process uses
its own vector as is. The result is the layout of the changed tensors and the cached parent to share the
rest with (VersionCache.snapshot_delta).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from ckpt_engine.device import DigestAlgo
from ckpt_engine.plan.dtypes import dtype_name
from ckpt_engine.plan.hashing import layout_digests, xxh3_digest
from ckpt_engine.plan.layout import Bucket, Layout, plan_layout
from ckpt_engine.plan.owners import Owners
from ckpt_engine.plan.sparse import agreed_changes, agreement_vector, changed_layout
from ckpt_engine.plan.tensors import NamedTensors, byte_view, fill_bucket, specs_of


class ShardDigester:
    """Per-tensor digests of the tensors this process holds. One host sync per call, not per tensor; memory
    is one bucket of scratch on the tensors' device."""

    def __init__(self, algo: DigestAlgo, bucket_size: int, alignment: int) -> None:
        self.algo, self.bucket_size, self.alignment = algo, bucket_size, alignment
        self._key: list | None = None
        self._layout: Layout | None = None
        self._scratch: torch.Tensor | None = None

    def digests(self, named: NamedTensors, layout: Layout) -> list[int]:
        """Digests in ``layout``'s tensor order (the full model's layout, identical on every rank)."""
        local = {s.name: _local(named.tensors[s.name]) for s in layout.slots}
        # One value broadcast to a shape (a stand-in for a tensor another rank holds, see the verl adapter):
        # digested from that value, not from a copy of its full size.
        broadcast = {name: _broadcast_digest(t) for name, t in local.items() if _is_broadcast(t)}
        if broadcast:
            rest = iter(self._digest_list({n: t for n, t in local.items() if n not in broadcast}))
            return [broadcast[n] if n in broadcast else next(rest) for n in local]
        return self._digest_list(local)

    def _digest_list(self, local: dict[str, torch.Tensor]) -> list[int]:
        if not local:
            return []
        if self.algo == "xxh3-64" and all(t.device.type == "cpu" and t.is_contiguous() for t in local.values()):
            # host tensors are hashed where they are: no copy into a bucket first
            return [xxh3_digest(dtype_name(t.dtype), tuple(t.shape), byte_view(t))
                    for t in local.values()]
        key = [(name, t.dtype, t.shape, t.device) for name, t in local.items()]
        if key != self._key or self._layout is None:
            self._layout = plan_layout(specs_of(local), self.bucket_size, self.alignment)
            self._key, self._scratch = key, None
        own = self._layout
        if self._scratch is None:
            device = next(iter(local.values())).device
            self._scratch = torch.empty(max(own.max_bucket_bytes, 8), dtype=torch.uint8, device=device)
        scratch = self._scratch

        def read(bucket: Bucket) -> torch.Tensor:  # stream order keeps the scratch reuse safe on devices
            fill_bucket(scratch, bucket.slots, local, bucket.nbytes)
            return scratch

        return layout_digests(own, read, self.algo)


class ChangeTracker:
    """Remembers this process's digests of the last version it was asked about, and turns the (reduced)
    agreement vector into what to snapshot."""

    def __init__(self, algo: DigestAlgo, bucket_size: int, alignment: int) -> None:
        self.digester = ShardDigester(algo, bucket_size, alignment)
        self.bucket_size, self.alignment = bucket_size, alignment
        self._last: tuple[int, str, list[int]] | None = None  # (version, layout digest, digests)

    def vector(self, version: int, named: NamedTensors, layout: Layout,
               can_share: Callable[[int], bool]) -> list[int]:
        """This process's agreement vector for ``version``; ``can_share(parent)`` says whether the cache
        still holds the parent (only the rank that caches needs to say no)."""
        digests = self.digester.digests(named, layout)
        previous = self._last if self._last is not None and self._last[1] == layout.digest else None
        self._last = (version, layout.digest, digests)
        parent = previous[0] if previous is not None and can_share(previous[0]) else None
        return agreement_vector(parent, previous[2] if previous is not None else None, digests)

    def delta(self, reduced: list[int], layout: Layout, owners: Owners | None = None) -> tuple[int, Layout] | None:
        """(parent version, layout of the changed tensors), or None for a full snapshot; with several
        ``owners`` of ``layout``, a bucket of the changes holds tensors of one owner only."""
        agreed = agreed_changes(reduced)
        if agreed is None:
            return None
        return agreed[0], changed_layout(layout, agreed[1], bucket_size=self.bucket_size, alignment=self.alignment,
                                         owners=owners)


def _is_broadcast(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 1 and all(stride == 0 for stride in tensor.stride())


def _broadcast_digest(tensor: torch.Tensor) -> int:
    value = torch.empty(1, dtype=tensor.dtype).copy_(tensor.reshape(-1)[:1])  # (a fresh one: stride 1)
    return xxh3_digest(f"broadcast:{dtype_name(tensor.dtype)}", tuple(tensor.shape), byte_view(value))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
