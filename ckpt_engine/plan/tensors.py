"""Named tensors of a model, and typed views of tensor slots inside flat uint8 buffers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Union

import torch

from ckpt_engine.errors import LayoutMismatchError
from ckpt_engine.plan.dtypes import dtype_from_name, dtype_name
from ckpt_engine.plan.layout import Bucket, Layout, TensorSlot, TensorSpec

NameMap = Callable[[str], str]


BucketTensors = Callable[[Bucket], Mapping[str, torch.Tensor]]
TensorsOrProvider = Union[Mapping[str, torch.Tensor], BucketTensors]


@dataclass
class NamedTensors:
    """Tensors to sync, in registration order, plus names that share storage with one of them (tied weights).

    An alias is sent once under its canonical name and handed to the receiver under both names. Subclasses
    whose tensors are sharded (FSDP2 DTensors) override :meth:`bucket_tensors` to assemble full tensors one
    bucket at a time; shapes and dtypes here are always those of the full tensors.
    """

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)

    def layout_key(self) -> list[tuple[str, torch.dtype, torch.Size]]:
        """Cheap identity of what the layout depends on (names, dtypes, full shapes, order)."""
        return [(name, t.dtype, t.shape) for name, t in self.tensors.items()]

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """The full tensors of ``bucket`` (every rank of a sharded model must call this for the same buckets)."""
        return self.tensors


def provider_of(tensors: TensorsOrProvider) -> BucketTensors:
    if callable(tensors):
        return tensors
    return lambda bucket: tensors


# Name components that training wrappers insert and the inference side does not know: torch.compile,
# FSDP1 and activation checkpointing. (FSDP2's fully_shard keeps names as they are.)
WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def strip_wrapper_prefixes(name: str) -> str:
    """``_orig_mod.layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def named_tensors_of(
    module: torch.nn.Module, *, include_buffers: bool = True, name_map: NameMap | None = None
) -> NamedTensors:
    """Parameters, then persistent buffers, of ``module`` in registration order; tied tensors become aliases.

    Names go through ``name_map`` (default: wrapper prefixes stripped). Non-persistent buffers (e.g. rotary
    tables) are left out: the receiver's model computes its own.
    """
    rename = name_map or strip_wrapper_prefixes
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    items = list(module.named_parameters(remove_duplicate=False))
    if include_buffers:
        items += persistent_buffers(module)
    for raw_name, tensor in items:
        name = rename(raw_name)
        canonical = first_name.get(id(tensor))
        if canonical is not None:
            aliases[name] = canonical
            continue
        first_name[id(tensor)] = name
        tensors[name] = tensor.detach()
    return NamedTensors(tensors, aliases)


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong to the state dict, with their full names, in registration order."""
    out = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        skip = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


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
