"""Turn verl's weight generator into one of our versions on one actor rank.

verl yields full tensors one at a time, and the generator is collective (FSDP gathers inside it): every actor
rank walks all of it. Our protocol needs the whole layout (names, dtypes, shapes) before the first bucket, so
the version can only start once the generator is done. What it costs: each rank keeps a copy of the tensors of
the buckets it owns (with ``ranks`` actor ranks, about 1/ranks of the model's full tensors, where verl made
them: usually the training device) until they are snapshotted (cached) or sent (bypass_cpu); the other tensors
are dropped as they come. A copy, not the tensor: verl promises a yielded tensor only until the generator
moves on. The bucket and owner of each tensor are known as it comes (layout.Packer,
owners.OwnerPicker: the same rules as plan_layout / plan_owners, checked against them at the end).

No verl import here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ckpt_engine.errors import ConfigError, LayoutError
from ckpt_engine.plan.layout import DEFAULT_ALIGNMENT, Packer, plan_layout
from ckpt_engine.plan.owners import OwnerPicker, plan_owners
from ckpt_engine.plan.tensors import NamedTensors, spec_of


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """Same dtype and shape, one element of host memory (a zero-stride view): stands for a tensor of a bucket
    another rank owns. It is never read: a rank reads only the buckets it owns (checked in collect_owned)."""
    return torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)  # zeros: the same digest every version


def collect_owned(weights: Iterable[tuple[str, torch.Tensor]], *, rank: int, ranks: int, bucket_size: int,
                  alignment: int = DEFAULT_ALIGNMENT) -> tuple[NamedTensors, int]:
    """Walk all of ``weights``; returns (every tensor, this rank's owned ones real and the others placeholders;
    bytes kept). ``rank`` among ``ranks`` owners."""
    if not 0 <= rank < ranks:
        raise ConfigError(f"actor rank {rank} is outside {ranks} actor ranks")
    packer = Packer(bucket_size, alignment)
    picker = OwnerPicker(ranks)
    owner_of: list[int] = []  # per bucket, as the stream opened it
    tensors: dict[str, torch.Tensor] = {}
    kept = 0
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ConfigError(f"verl's weight generator must yield (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if name in tensors:
            raise LayoutError(f"verl's weight generator yielded tensor {name!r} twice")
        buckets = packer.add(spec_of(name, tensor))
        while len(owner_of) <= buckets[-1]:  # a bucket opened: the ones before it are closed and charged
            if owner_of:
                picker.charge(owner_of[-1], packer.bucket_nbytes(len(owner_of) - 1))
            owner_of.append(owner_of[-1] if packer.continues(len(owner_of)) else picker.pick())
        if owner_of[buckets[0]] == rank:  # (a chunked tensor's pieces have one owner)
            # A copy: a yielded tensor is valid only until the generator moves on (verl's merged-LoRA export
            # restores the base weights in place when it ends; an exporter may reuse its buffers).
            tensors[name] = tensor.detach().clone()
            kept += tensor.numel() * tensor.element_size()
        else:
            tensors[name] = _placeholder(tensor)
    if not tensors:
        raise ConfigError("verl's weight generator yielded no tensors")
    named = NamedTensors(tensors)
    # The streamed plan must be the one the publisher will make, or a rank would read a placeholder.
    layout = plan_layout([spec_of(n, t) for n, t in tensors.items()], bucket_size, alignment)
    planned = plan_owners(layout, ranks).of
    if tuple(owner_of) != planned:
        raise LayoutError(f"streamed bucket owners {owner_of} differ from the planned {list(planned)}")
    return named, kept


def drain(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Walk all of ``weights`` keeping nothing: a rank that sends none of them still takes part in the
    generator's collective gathers (a rollback sends a cached version instead)."""
    for _ in weights:
        pass
