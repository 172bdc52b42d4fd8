"""Named tensors of a model, and typed views of tensor slots inside flat uint8 buffers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ckpt_engine.dtypes import dtype_from_name, dtype_name
from ckpt_engine.errors import LayoutMismatchError
from ckpt_engine.layout import Layout, TensorSlot, TensorSpec

NameMap = Callable[[str], str]


@dataclass
class NamedTensors:
    """Tensors to sync, in registration order, plus names that share storage with one of them (tied weights).

    An alias is sent once under its canonical name and handed to the receiver under both names.
    """

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)


def named_tensors_of(
    module: torch.nn.Module, *, include_buffers: bool = True, name_map: NameMap | None = None
) -> NamedTensors:
    """Parameters (then buffers) of ``module`` in registration order; tied tensors become aliases."""
    rename = name_map or (lambda name: name)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    items = list(module.named_parameters(remove_duplicate=False))
    if include_buffers:
        items += list(module.named_buffers(remove_duplicate=False))
    for raw_name, tensor in items:
        name = rename(raw_name)
        canonical = first_name.get(id(tensor))
        if canonical is not None:
            aliases[name] = canonical
            continue
        first_name[id(tensor)] = name
        tensors[name] = tensor.detach()
    return NamedTensors(tensors, aliases)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [spec_of(name, tensor) for name, tensor in tensors.items()]


def slot_view(buf: torch.Tensor, slot: TensorSlot, base: int = 0) -> torch.Tensor:
    """The tensor of ``slot`` as a typed, shaped, zero-copy view into the uint8 buffer ``buf``."""
    start = base + slot.offset
    raw = buf[start : start + slot.nbytes]
    return raw.view(dtype_from_name(slot.dtype)).view(slot.shape)


def check_matches_layout(layout: Layout, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise LayoutMismatchError naming the first tensor that differs from the layout."""
    if len(tensors) != layout.num_tensors:
        raise LayoutMismatchError(f"layout has {layout.num_tensors} tensors, got {len(tensors)}")
    for slot in layout.slots:
        tensor = tensors.get(slot.name)
        if tensor is None:
            raise LayoutMismatchError(f"tensor {slot.name!r} of the layout is missing")
        if spec_of(slot.name, tensor) != slot.spec:
            raise LayoutMismatchError(
                f"tensor {slot.name!r} is {dtype_name(tensor.dtype)}{tuple(tensor.shape)}, "
                f"layout says {slot.dtype}{slot.shape}"
            )


def fill_bucket(buf: torch.Tensor, slots: tuple[TensorSlot, ...], tensors: Mapping[str, torch.Tensor],
                bucket_nbytes: int, base: int = 0) -> None:
    """Copy each slot's tensor into ``buf[base : base + bucket_nbytes]`` with zeroed padding, so every fill puts
    identical bytes on the wire. Same-device sources go in one ``torch.cat`` (one kernel instead of one copy
    per tensor); sources on another device (device -> host snapshot) are copied one by one, asynchronously."""
    if bucket_nbytes == 0:
        return
    out = buf[base : base + bucket_nbytes]
    sources = [tensors[slot.name] for slot in slots]
    if all(t.device == out.device for t in sources):
        torch.cat(_pieces(slots, sources, bucket_nbytes, out.device), out=out)
        return
    cursor = 0
    for slot, source in zip(slots, sources):
        if slot.offset > cursor:
            out[cursor : slot.offset].zero_()
        slot_view(out, slot).copy_(source, non_blocking=True)
        cursor = slot.offset + slot.nbytes
    if bucket_nbytes > cursor:
        out[cursor:].zero_()


_zeros: dict[tuple[int, str], torch.Tensor] = {}


def _zero_bytes(n: int, device: torch.device) -> torch.Tensor:
    key = (n, str(device))
    zeros = _zeros.get(key)
    if zeros is None:
        zeros = _zeros[key] = torch.zeros(n, dtype=torch.uint8, device=device)
    return zeros


def _pieces(slots: tuple[TensorSlot, ...], sources: list[torch.Tensor], nbytes: int,
            device: torch.device) -> list[torch.Tensor]:
    """The bucket as a list of byte views: each tensor's bytes and the zero padding between them."""
    pieces: list[torch.Tensor] = []
    cursor = 0
    for slot, source in zip(slots, sources):
        if slot.offset > cursor:
            pieces.append(_zero_bytes(slot.offset - cursor, device))
        pieces.append(source.reshape(-1).view(torch.uint8))
        cursor = slot.offset + slot.nbytes
    if nbytes > cursor:
        pieces.append(_zero_bytes(nbytes - cursor, device))
    return pieces
