"""Full tensors from an FSDP2 (``fully_shard``) model, assembled one bucket at a time.

Every trainer rank calls :meth:`ShardedTensors.bucket_tensors` for the same buckets in the same order. For
the common case (DTensor parameters sharded on dim 0 over a 1-D mesh) a bucket costs one
``all_gather_into_tensor`` of the ranks' packed local shards, not one collective per tensor; other
placements fall back to ``full_tensor()``. Memory stays at about one bucket of gathered bytes, also for a
tensor larger than a bucket: each piece gathers only the rows it spans.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ckpt_engine.errors import LayoutMismatchError, TrainerGroupError
from ckpt_engine.plan.layout import Bucket, TensorSlot
from ckpt_engine.plan.tensors import NamedTensors, NameMap, byte_view, named_tensors_of

# torch >= 2.13 names it all_gather_single; older releases only have all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rows_per_rank(dim0: int, world: int) -> list[int]:
    """Rows of dim 0 each rank holds under FSDP2's chunking (``torch.chunk``: ceil-sized, trailing may be 0)."""
    chunk = math.ceil(dim0 / world) if dim0 else 0
    return [max(0, min((r + 1) * chunk, dim0) - min(r * chunk, dim0)) for r in range(world)]


def _dim0_sharded(tensor: torch.Tensor) -> bool:
    return (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1
            and tuple(tensor.placements) == (Shard(0),))


@dataclass
class ShardedTensors(NamedTensors):
    """NamedTensors whose DTensors are gathered per bucket (shapes and dtypes are the full tensors')."""

    def bucket_tensors(self, bucket: Bucket, to: int | None = None) -> Mapping[str, torch.Tensor]:
        """The bucket's tensors, gathered: a whole tensor, or for a piece of a tensor larger than a bucket only
        that piece's elements (a dim-0-sharded one gathers just the rows the piece spans)."""
        out: dict[str, torch.Tensor] = {}
        sharded: list[tuple[TensorSlot, DTensor]] = []
        for slot in bucket.slots:
            tensor = self.tensors[slot.name]
            if _dim0_sharded(tensor):
                sharded.append((slot, tensor))  # type: ignore[arg-type]
            elif isinstance(tensor, DTensor):  # (other placements: the whole tensor, once per piece)
                with job_collective(f"gathering {slot.name} (bucket {bucket.index})"):
                    out[slot.name] = tensor.full_tensor()
            else:
                out[slot.name] = tensor
        by_group: dict[int, list[tuple[TensorSlot, DTensor]]] = {}
        for slot, tensor in sharded:
            by_group.setdefault(id(tensor.device_mesh.get_group()), []).append((slot, tensor))
        for items in by_group.values():
            with job_collective(f"gathering bucket {bucket.index}"):  # this rank's part in it, and what precedes it
                plans, stride, received = _exchange(items, to)
            out.update(_unpack(plans, stride, received))  # local work after it: a failure here leaves ranks in step
        return out


@contextlib.contextmanager
def job_collective(what: str) -> Iterator[None]:
    """A collective of the trainer job's own process group, and this rank's way into it: a failure there leaves
    the ranks out of step in their collectives, so it is the job's (TrainerGroupError), not only a sync's."""
    try:
        yield
    except Exception as exc:
        raise TrainerGroupError(f"{what} on the trainer's process group failed: {type(exc).__name__}: {exc}") \
            from exc


@dataclass(frozen=True)
class _Plan:
    """One tensor's part in a bucket's gather: rows ``first`` to ``first + sum(rows)`` of the full tensor (all of
    it, or those a piece spans), ``rows[r]`` of them from rank r, at ``offsets[r]`` in each rank's part."""

    slot: TensorSlot
    tensor: DTensor
    local: torch.Tensor  # this rank's rows of them
    rows: list[int]
    row_bytes: int
    offsets: list[int]
    first: int


def _plan(slot: TensorSlot, tensor: DTensor, world: int, me: int, offsets: list[int]) -> _Plan:
    dim0 = tensor.shape[0]
    held = rows_per_rank(dim0, world)
    row_bytes = (tensor.numel() // dim0 if dim0 else 0) * tensor.element_size()
    local = tensor.to_local()
    if local.shape[0] != held[me]:
        raise LayoutMismatchError(f"{slot.name}: local shard has {local.shape[0]} rows, chunking says {held[me]}")
    first, end = 0, dim0
    if slot.is_piece:  # the rows the piece's bytes lie in
        first, end = slot.start // row_bytes, -(-(slot.start + slot.nbytes) // row_bytes)
    starts = [sum(held[:r]) for r in range(world)]
    rows = [max(0, min(starts[r] + held[r], end) - max(starts[r], first)) for r in range(world)]
    mine = max(starts[me], first) - starts[me]
    return _Plan(slot, tensor, local[mine : mine + rows[me]], rows, row_bytes, list(offsets), first)


def _exchange(items: list[tuple[TensorSlot, DTensor]], to: int | None = None
              ) -> tuple[list[_Plan], int, list[torch.Tensor] | torch.Tensor | None]:
    """One collective for every dim-0-sharded tensor of a bucket that shares a process group: a gather to
    the process of global rank ``to`` (the bucket's owner; 1/world of an all-gather's traffic), or an
    all-gather when ``to`` is None or not in that group (e.g. hybrid sharding's replica groups). Returns the
    plan, the stride and what arrived (per-rank chunks, one all-gathered tensor, or None off the owner)."""
    group = items[0][1].device_mesh.get_group()
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if to is not None:
        try:
            to = dist.get_group_rank(group, to)
        except (ValueError, RuntimeError):
            to = None
    plans: list[_Plan] = []
    sizes = [0] * world
    for slot, tensor in items:
        plan = _plan(slot, tensor, world, me, sizes)
        for r in range(world):
            sizes[r] += plan.rows[r] * plan.row_bytes
        plans.append(plan)
    stride = max(sizes)
    device = items[0][1].to_local().device
    send = torch.empty(stride, dtype=torch.uint8, device=device)
    for plan in plans:
        if plan.rows[me]:
            send[plan.offsets[me] : plan.offsets[me] + plan.rows[me] * plan.row_bytes] = byte_view(plan.local)
    if to is not None:
        chunks = [torch.empty(stride, dtype=torch.uint8, device=device) for _ in range(world)] if me == to else None
        dist.gather(send, chunks, dst=dist.get_global_rank(group, to), group=group)
        return plans, stride, chunks
    gathered = torch.empty(world * stride, dtype=torch.uint8, device=device)
    _all_gather_single(gathered, send, group=group)
    return plans, stride, gathered


def _unpack(plans: list[_Plan], stride: int, received: list[torch.Tensor] | torch.Tensor | None
            ) -> dict[str, torch.Tensor]:
    """The full tensors, or the pieces' elements, out of what a gather brought (nothing on a rank it was not
    gathered to)."""
    if received is None:
        return {}
    gathered = torch.cat(received) if isinstance(received, list) else received
    out = {}
    for plan in plans:
        parts = [gathered[r * stride + plan.offsets[r] : r * stride + plan.offsets[r] + plan.rows[r] * plan.row_bytes]
                 for r in range(len(plan.rows))]
        raw, slot, dtype = torch.cat(parts), plan.slot, plan.tensor.dtype
        if slot.is_piece:
            skip = slot.start - plan.first * plan.row_bytes
            out[slot.name] = raw[skip : skip + slot.nbytes].view(dtype)  # (piece_of takes it as the piece)
        else:
            out[slot.name] = raw.view(dtype).view(plan.tensor.shape)
    return out


def sharded_tensors_of(module: nn.Module, *, include_buffers: bool = True,
                       name_map: NameMap | None = None) -> NamedTensors:
    """The model's tensors for syncing: ShardedTensors when any is a DTensor, plain NamedTensors otherwise."""
    named = named_tensors_of(module, include_buffers=include_buffers, name_map=name_map)
    if any(isinstance(t, DTensor) for t in named.tensors.values()):
        return ShardedTensors(named.tensors, named.aliases)
    return named
