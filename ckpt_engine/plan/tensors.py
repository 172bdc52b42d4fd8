"""Named tensors of a model, and typed views of tensor slots inside flat uint8 buffers."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Union

import torch

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.dtypes import NAME_BY_DTYPE, dtype_from_name, dtype_name
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

    @property
    def gathers(self) -> bool:
        """Whether :meth:`bucket_tensors` may run collectives (every rank of the trainer's group taking part in
        each bucket's): assumed of any subclass that overrides it, unless the subclass says otherwise."""
        return type(self).bucket_tensors is not NamedTensors.bucket_tensors

    def check_sendable(self) -> None:
        """Every tensor can go on the wire byte-exact, checked on every version (a tensor may turn sparse or meta
        under the same name, dtype and shape): one cheap pass, the full check only for the ones it flags."""
        strided = torch.strided
        for name, t in self.tensors.items():
            if t.layout is not strided or t.is_meta or t.is_nested or t.dtype not in NAME_BY_DTYPE:
                check_sendable(name, t)

    def layout_key(self) -> list[tuple]:
        """Cheap identity of what the layout depends on (names, dtypes, full shapes, order). Flat tuples of
        plain values: a torch.Size per tensor kept alive costs the garbage collector ~1 µs a tensor."""
        return [(name, t.dtype, *t.shape) for name, t in self.tensors.items()]

    def bucket_tensors(self, bucket: Bucket, to: int | None = None) -> Mapping[str, torch.Tensor]:
        """The full tensors of ``bucket`` (every rank of a sharded model must call this for the same buckets).
        ``to``: only the process of that global rank needs them (the bucket's owner); a sharded model then
        gathers to it alone and other ranks get nothing. Tensors held whole are there on every rank anyway."""
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
    """What ``tensor`` is on the wire; a LayoutError naming it when it cannot go there byte-exact."""
    check_sendable(name, tensor)
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def check_sendable(name: str, tensor: torch.Tensor) -> None:
    """Any dense tensor goes on the wire byte-exact, whatever its strides, storage offset, or conjugate and
    negative views (its values are what is sent, in row-major order). Sparse, quantized, nested and meta
    tensors have no such bytes: refused up front, by name."""
    if tensor.layout != torch.strided:
        raise LayoutError(f"tensor {name!r} has layout {tensor.layout}: only dense tensors can be sent "
                          "(convert it, e.g. .to_dense())")
    if tensor.is_quantized:
        raise LayoutError(f"tensor {name!r} is quantized ({tensor.dtype}): send its int representation and scales "
                          "as tensors of their own")
    if getattr(tensor, "is_nested", False):
        raise LayoutError(f"tensor {name!r} is a nested tensor: only dense tensors can be sent")
    if tensor.device.type == "meta":
        raise LayoutError(f"tensor {name!r} is on the meta device: it holds no data")
    if tensor.dtype not in NAME_BY_DTYPE:
        raise LayoutError(f"tensor {name!r} has dtype {tensor.dtype}, which cannot go on the wire (supported: "
                          f"{', '.join(sorted(NAME_BY_DTYPE.values()))})")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as flat uint8 in row-major order: the tensor itself when it is laid out so, else a
    contiguous copy (strided and offset views, expanded dimensions, conjugate or negative views)."""
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [spec_of(name, tensor) for name, tensor in tensors.items()]


def slot_view(buf: torch.Tensor, slot: TensorSlot, base: int = 0) -> torch.Tensor:
    """The tensor of ``slot`` as a typed, shaped, zero-copy view into the uint8 buffer ``buf``; a piece of a
    chunked tensor as a flat typed view of its elements."""
    start = base + slot.offset
    raw = buf[start : start + slot.nbytes].view(dtype_from_name(slot.dtype))
    return raw if slot.is_piece else raw.view(slot.shape)


def piece_of(tensor: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """What ``slot`` carries of ``tensor``: the tensor itself, or, for a piece of a chunked tensor, its elements
    in row-major order from the piece's start (a zero-copy view of a contiguous tensor; a strided one is made
    contiguous first). A source that is already the piece (as many elements) is taken as it is."""
    if not slot.is_piece:
        return tensor
    size = tensor.element_size()
    count = slot.nbytes // size
    if tensor.numel() == count:
        return tensor.reshape(-1)
    first = slot.start // size
    return tensor.reshape(-1)[first : first + count]


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
    identical bytes on the wire. The typed views of the slots and of the padding are made once per (buffer,
    bucket) and reused, and the copies go in one call for the whole bucket (``torch._foreach_copy_``): what
    costs per tensor is only torch's own copy. Sources of any strides, offsets or device are copied as they
    are (a device -> host snapshot is asynchronous)."""
    if bucket_nbytes == 0:
        return
    targets, gaps, names = _fill_views(buf, slots, bucket_nbytes, base)
    sources = list(map(tensors.__getitem__, names))
    if slots and (slots[0].parts > 1 or slots[-1].parts > 1):  # (a chunked tensor's piece opens or ends a bucket)
        sources = [piece_of(source, slot) for source, slot in zip(sources, slots)]
    torch._foreach_copy_(targets, _plain(sources), non_blocking=True)
    if gaps:
        torch._foreach_zero_(gaps)


def _plain(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Conjugate or negative views' values as plain values (copies into the bucket take them as stored);
    checked with C-level calls only: this runs for every tensor of every version."""
    if any(map(torch.Tensor.is_conj, sources)) or any(map(torch.Tensor.is_neg, sources)):
        return [t.resolve_conj().resolve_neg() for t in sources]
    return sources


# (id of the slots tuple, buffer address, size, base) -> (slots, slot views, padding views); the slots tuple is
# held so its id is not reused while the entry lives. The views keep their buffer alive: a few entries only.
_FILL_VIEWS: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
_FILL_VIEWS_KEPT = 64
_FILL_VIEWS_LOCK = threading.Lock()  # the training thread snapshots while send threads fill


def forget_fill_views(buffer: torch.Tensor) -> None:
    """Drop the views kept into ``buffer``, which its owner is freeing: they would keep its memory alive."""
    ptr = buffer.data_ptr()
    with _FILL_VIEWS_LOCK:
        for key in [k for k in _FILL_VIEWS if k[1] == ptr]:
            del _FILL_VIEWS[key]


def _fill_views(buf: torch.Tensor, slots: tuple[TensorSlot, ...], nbytes: int,
                base: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    key = (id(slots), buf.data_ptr(), buf.numel(), str(buf.device), base)
    with _FILL_VIEWS_LOCK:
        found = _FILL_VIEWS.get(key)
        if found is not None and found[0] is slots:
            _FILL_VIEWS.move_to_end(key)
            return found[1], found[2], found[3]
    out = buf[base : base + nbytes]
    targets = [slot_view(out, slot) for slot in slots]
    gaps, cursor = [], 0
    for slot in slots:
        if slot.offset > cursor:
            gaps.append(out[cursor : slot.offset])
        cursor = slot.offset + slot.nbytes
    if nbytes > cursor:
        gaps.append(out[cursor:nbytes])
    names = [slot.name for slot in slots]
    with _FILL_VIEWS_LOCK:
        _FILL_VIEWS[key] = (slots, targets, gaps, names)
        while len(_FILL_VIEWS) > _FILL_VIEWS_KEPT:
            _FILL_VIEWS.popitem(last=False)
    return targets, gaps, names
