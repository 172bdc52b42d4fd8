"""Named tensors of a model, and typed views of tensor slots inside flat uint8 buffers."""

from __future__ import annotations

import collections
import operator
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.dtypes import NAME_BY_DTYPE, dtype_from_name, dtype_name
from ckpt_engine.plan.layout import Bucket, Layout, TensorSlot, TensorSpec

NameMap = Callable[[str], str]


BucketTensors = Callable[[Bucket], Mapping[str, torch.Tensor]]
TensorsOrProvider = Mapping[str, torch.Tensor] | BucketTensors


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

    def layout_key(self) -> list[tuple]:
        """Cheap identity of what the layout depends on (names, dtypes, full shapes, order), after checking that
        every tensor can go on the wire byte-exact (LayoutError naming the first that cannot). Both run on every
        version (a tensor may turn sparse or meta under the same name, dtype and shape), in one pass: the full
        check only for the tensors the cheap test flags. Flat tuples of plain values: a torch.Size per tensor
        kept alive costs the garbage collector ~1 µs a tensor."""
        strided, key = torch.strided, list[tuple]()
        append = key.append
        for name, t in self.tensors.items():
            dtype = t.dtype
            if t.layout is not strided or t.is_meta or t.is_nested or dtype not in NAME_BY_DTYPE:
                check_sendable(name, t)  # (before the shape: a nested tensor has none)
            append((name, dtype, *t.shape))
        return key

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
    items: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
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
        skip: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
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


# A slot of at least this many bytes is copied on its own: one copy of it runs at the full rate, where the
# batched kernel would cost more than the launch it saves.
DIRECT_BYTES = 4 << 20
# A device→host fill (the cached snapshot of device tensors) packs the tensors below STAGED_DIRECT_BYTES into a
# device staging buffer of at most STAGING_BYTES (``staging_bytes``), then moves each packed span over PCIe in one
# copy. A larger tensor crosses on its own: its copy outlasts the host's work to queue the next one, so copies run
# back to back at the PCIe rate, where packing it would add a device pass.
STAGED_DIRECT_BYTES = 1 << 20
STAGING_BYTES = 16 << 20
# dtypes torch's batched copy kernel (``_foreach_copy_``'s fast path on CUDA) is built for; a tensor of another
# dtype (uint16/32/64, float8_e8m0fnu) is copied on its own, on every device (the same path everywhere).
_BATCHED_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "complex64", "complex128", "int64", "int32", "int16", "int8", "uint8", "bool"})


def staging_bytes(max_bucket_bytes: int) -> int:
    """The size of the device staging buffer a device→host fill of buckets up to ``max_bucket_bytes`` uses."""
    return max(1, min(max_bucket_bytes, STAGING_BYTES))


def fill_bucket(buf: torch.Tensor, slots: tuple[TensorSlot, ...], tensors: Mapping[str, torch.Tensor],
                bucket_nbytes: int, base: int = 0, *, staging: torch.Tensor | None = None) -> None:
    """Copy each slot's tensor into ``buf[base : base + bucket_nbytes]`` with zeroed padding, so every fill puts
    identical bytes on the wire, in a few kernels whatever the tensor count: the tensors of one dtype below
    DIRECT_BYTES in one ``torch._foreach_copy_`` (one batched kernel per ~64 tensors on CUDA: its fast path
    wants one dtype and matching strides), larger tensors and the pieces of chunked ones each in one copy.
    ``staging`` (a uint8 buffer on the sources' device, e.g. the GPU while ``buf`` is pinned host memory): the
    tensors below STAGED_DIRECT_BYTES are packed there first, span by span, and each span crosses to ``buf`` in
    one copy, instead of one device→host copy per tensor; larger ones go straight to ``buf``. It is used only
    when the bucket's sources are on its device. The typed views of the slots, the padding and the spans are made
    once per (buffer, bucket, staging) and reused. Sources of any strides, offsets or device are copied as they
    are (conjugate and negative views as their values); every copy is queued on the current stream (a device→host
    fill is asynchronous: the caller synchronises)."""
    if bucket_nbytes == 0:
        return
    if staging is not None and (not slots or tensors[slots[0].name].device != staging.device):
        staging = None
    plan = _fill_plan(buf, slots, bucket_nbytes, base, staging)
    for span in plan.spans:
        if span.clear is not None:
            span.clear.zero_()
        for get, single, targets, complex_ in span.batches:
            sources = get(tensors)
            torch._foreach_copy_(targets, _plain((sources,) if single else sources, complex_), non_blocking=True)
        if span.gaps:
            torch._foreach_zero_(span.gaps)
        if span.staged is not None:
            span.dest.copy_(span.staged, non_blocking=True)  # type: ignore[union-attr]
    for name, slot, target in plan.direct:
        source = piece_of(tensors[name], slot)
        if source.is_conj() or source.is_neg():
            source = source.resolve_conj().resolve_neg()
        target.copy_(source, non_blocking=True)


def _plain(sources, complex_: bool):
    """Conjugate or negative views' values as plain values (a batched device copy takes them as stored); checked
    with C-level calls only, as this runs for every tensor of every version: the conjugate bit only for complex
    dtypes (only their views carry it), the negative bit (e.g. ``.imag`` of a conjugate view) for every one."""
    if any(map(torch.Tensor.is_neg, sources)) or (complex_ and any(map(torch.Tensor.is_conj, sources))):
        return [t.resolve_conj().resolve_neg() for t in sources]
    return sources


@dataclass
class _Span:
    """Bytes of a bucket filled together: per dtype, (getter of the sources, one source only, target views, complex
    dtype), the padding views to zero (or the whole span, to zero first), and, when staged, the staging bytes and
    where in the buffer they go."""

    batches: list[tuple[Callable[[Mapping[str, torch.Tensor]], object], bool, list[torch.Tensor], bool]]
    gaps: list[torch.Tensor]
    clear: torch.Tensor | None = None  # the span's bytes, zeroed in one memset before the copies, instead of gaps
    staged: torch.Tensor | None = None
    dest: torch.Tensor | None = None


@dataclass
class _FillPlan:
    slots: tuple[TensorSlot, ...]  # held so its id (part of the key) is not reused while the plan lives
    spans: list[_Span]
    direct: list[tuple[str, TensorSlot, torch.Tensor]]  # (name, slot, its target view in the buffer)


# (id of the slots tuple, buffer address, size, device, base, staging address, staging size) -> plan; the views
# keep their buffers alive: a few entries only.
_FILL_VIEWS: collections.OrderedDict[tuple, _FillPlan] = collections.OrderedDict()
_FILL_VIEWS_KEPT = 64
_FILL_VIEWS_LOCK = threading.Lock()  # the training thread snapshots while send threads fill


def forget_fill_views(buffer: torch.Tensor) -> None:
    """Drop the views kept into ``buffer`` (filled, or staged through), which its owner is freeing: they would
    keep its memory alive."""
    ptr = buffer.data_ptr()
    with _FILL_VIEWS_LOCK:
        for key in [k for k in _FILL_VIEWS if k[1] == ptr or k[5] == ptr]:
            del _FILL_VIEWS[key]


def _fill_plan(buf: torch.Tensor, slots: tuple[TensorSlot, ...], nbytes: int, base: int,
               staging: torch.Tensor | None) -> _FillPlan:
    key = (id(slots), buf.data_ptr(), buf.numel(), str(buf.device), base,
           None if staging is None else staging.data_ptr(), None if staging is None else staging.numel())
    with _FILL_VIEWS_LOCK:
        found = _FILL_VIEWS.get(key)
        if found is not None and found.slots is slots:
            _FILL_VIEWS.move_to_end(key)
            return found
    plan = _plan_fill(buf[base : base + nbytes], slots, nbytes, staging)
    with _FILL_VIEWS_LOCK:
        _FILL_VIEWS[key] = plan
        while len(_FILL_VIEWS) > _FILL_VIEWS_KEPT:
            _FILL_VIEWS.popitem(last=False)
    return plan


def _plan_fill(out: torch.Tensor, slots: tuple[TensorSlot, ...], nbytes: int,
               staging: torch.Tensor | None) -> _FillPlan:
    """Which slots are copied on their own, and the spans of the rest (with their padding), for ``out`` (the
    bucket's bytes)."""
    if staging is not None and staging.numel() < 2 * _STAGE_ALIGN:
        staging = None  # too small to hold a span: every tensor is copied to the buffer itself
    limit = DIRECT_BYTES if staging is None else min(STAGED_DIRECT_BYTES, staging.numel() - _STAGE_ALIGN)
    direct = [slot for slot in slots if slot.parts > 1 or slot.nbytes >= limit or slot.dtype not in _BATCHED_DTYPES]
    direct_views = [(slot.name, slot, slot_view(out, slot)) for slot in direct if slot.nbytes]
    batched = {id(slot) for slot in direct}
    # Every byte not under a direct slot, in order: (start, end, slot or None for padding).
    pieces: list[tuple[int, int, TensorSlot | None]] = []
    cursor = 0
    for slot in slots:
        if slot.offset > cursor:
            pieces.append((cursor, slot.offset, None))
        if id(slot) not in batched and slot.nbytes:
            pieces.append((slot.offset, slot.offset + slot.nbytes, slot))
        cursor = max(cursor, slot.offset + slot.nbytes)
    if nbytes > cursor:
        pieces.append((cursor, nbytes, None))
    if staging is None:
        return _FillPlan(slots, [_span(out, pieces, 0)], direct_views)
    return _FillPlan(slots, [_staged_span(out, staging, run) for run in _windows(pieces, staging.numel())],
                     direct_views)


# A staged span keeps its bytes' offsets modulo this (a span's byte x sits at x - x0 + x0 % _STAGE_ALIGN for its
# first byte x0): typed views stay aligned as in the buffer, and device copies keep their wide loads.
_STAGE_ALIGN = 256


def _origin(start: int) -> int:
    """Where in the bucket a span whose first byte is ``start`` begins in the staging buffer's frame."""
    return start - start % _STAGE_ALIGN


def _windows(pieces: list[tuple[int, int, TensorSlot | None]], size: int
             ) -> list[list[tuple[int, int, TensorSlot | None]]]:
    """``pieces`` cut into runs of adjacent pieces that fit ``size`` bytes of staging each, counted from the run's
    :func:`_origin` (padding may be cut; a slot never is: each is at most ``size - _STAGE_ALIGN`` bytes)."""
    runs: list[list[tuple[int, int, TensorSlot | None]]] = []
    run: list[tuple[int, int, TensorSlot | None]] = []
    for start, end, slot in pieces:
        while start < end:
            if run and start != run[-1][1]:  # a direct slot lies between: a new run
                runs.append(run)
                run = []
            room = _origin(run[0][0] if run else start) + size - start  # bytes this run can still take
            if end - start <= room:
                run.append((start, end, slot))
                start = end
            elif slot is None and room > 0:  # padding: what fits, the rest opens the next run
                run.append((start, start + room, None))
                start += room
                runs.append(run)
                run = []
            else:  # a slot that does not fit: it opens the next run
                runs.append(run)
                run = []
    if run:
        runs.append(run)
    return runs


def _span(out: torch.Tensor, pieces: list[tuple[int, int, TensorSlot | None]], origin: int) -> _Span:
    """The batches and padding of ``pieces``, as views of ``out`` whose byte 0 is the pieces' byte ``origin``."""
    by_dtype: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
    gaps = []
    for start, end, slot in pieces:
        if slot is None:
            gaps.append(out[start - origin : end - origin])
            continue
        names, targets = by_dtype.setdefault(slot.dtype, ([], []))
        names.append(slot.name)
        targets.append(slot_view(out, slot, -origin))
    batches = [(operator.itemgetter(*names), len(names) == 1, targets, dtype.startswith("complex"))
               for dtype, (names, targets) in by_dtype.items()]
    if gaps:
        first, last = pieces[0][0] - origin, pieces[-1][1] - origin  # (direct slots between: copied after)
        if zero_whole_span(out.device.type, len(gaps), last - first):
            return _Span(batches, [], clear=out[first:last])  # type: ignore[arg-type]
    return _Span(batches, gaps)  # type: ignore[arg-type]


# What zeroing one padding view costs on an accelerator, as bytes of a memset in the same time: on an H200
# (2026-11-28, bench/fill_parts.py, docs/gpu-runs.md) torch._foreach_zero_ of a 64 MiB bucket's 4,000 padding
# views took 0.99 ms (~0.25 µs a view), a memset of all 64 MiB 0.042 ms (~1.6 TB/s): one view ~ 400 kB.
GAP_VIEW_AS_MEMSET_BYTES = 400_000


def zero_whole_span(device_type: str, gaps: int, span_bytes: int) -> bool:
    """Whether a fill zeroes a span's bytes in one memset before its copies (rather than its ``gaps`` padding
    views one by one): on an accelerator when the views would cost more; never on the CPU, where a memset is
    a pass over memory at copy speed (~6 ms for 64 MiB on this project's 2-core machine) and a view ~0.1 µs."""
    return device_type != "cpu" and gaps * GAP_VIEW_AS_MEMSET_BYTES > span_bytes


def _staged_span(out: torch.Tensor, staging: torch.Tensor, run: list[tuple[int, int, TensorSlot | None]]) -> _Span:
    first, last = run[0][0], run[-1][1]
    if all(slot is None for _, _, slot in run):  # padding only: zeroed where it is
        return _span(out, run, 0)
    origin = _origin(first)
    span = _span(staging, run, origin)
    span.staged, span.dest = staging[first - origin : last - origin], out[first:last]
    return span
