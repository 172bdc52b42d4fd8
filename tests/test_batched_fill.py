"""Batched bucket fills (plan/tensors.py ``fill_bucket``): the bytes of every odd tensor land exactly where the
layout says, padding zeroed, through every path a fill takes — the tensors of one dtype in one batched copy,
big tensors and pieces of chunked ones on their own, and, for a device→host snapshot, packed in a staging
buffer span by span (run here with a host staging buffer: the same code). Few copy calls, not one per tensor."""

from __future__ import annotations

import pytest
import torch

import ckpt_engine.plan.tensors as tensors_mod
from ckpt_engine.device import detect_device
from ckpt_engine.plan.layout import plan_layout
from ckpt_engine.plan.tensors import byte_view, fill_bucket, forget_fill_views, piece_of, specs_of, staging_bytes
from ckpt_engine.send.cache import VersionCache

BUCKET = 8 << 10


def odd_tensors(seed: int = 0, small: int = 40) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    base = randn(40, 30)
    complex_base = torch.randn(5, 3, generator=gen, dtype=torch.complex64)
    out = {
        "fp32": randn(17, 5),
        "bf16": randn(33, 7, dtype=torch.bfloat16),
        "fp16": randn(5, 3, dtype=torch.float16),
        "mask": torch.randint(0, 2, (13,), generator=gen).bool(),
        "steps": torch.randint(0, 1 << 40, (9,), generator=gen, dtype=torch.int64),
        "scalar": randn(1).reshape(()),
        "empty": torch.empty(0, 4),
        "transposed": randn(6, 10).t(),  # non-contiguous
        "strided": base[::3, 1::2],  # strided with a storage offset
        "offset": base.reshape(-1)[7:107],  # contiguous, storage offset not word-aligned
        "conj": complex_base.conj(),  # conjugate view: its values go on the wire
        "neg": torch._neg_view(randn(4, 4)),  # negative view
        "imag": torch.randn(6, generator=gen, dtype=torch.complex64).conj().imag,  # a real negative view
        "int8": torch.randint(-100, 100, (11,), generator=gen, dtype=torch.int8),
        "big": randn(BUCKET // 4 + 999),  # larger than a bucket: pieces
        "mid": randn(700),  # 2,800 bytes: on its own once the direct threshold is lowered
        "fp8": randn(19).to(torch.float8_e4m3fn),
    }
    if hasattr(torch, "uint32"):
        out["u32"] = torch.randint(0, 1 << 31, (21,), generator=gen).to(torch.uint32)  # copied on its own
    for i in range(small):
        out[f"small.{i}"] = randn(1 + i % 7, dtype=(torch.float32, torch.bfloat16, torch.int64)[i % 3])
    out["bigger"] = randn(3 * BUCKET // 4 + 5)  # a chunked tensor whose last piece is short
    return out


def reference(layout, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The version's wire bytes built independently of fill_bucket: each slot's values, in row-major order."""
    out = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for bucket in layout.buckets:
        for slot in bucket.slots:
            raw = byte_view(tensors[slot.name])
            start = bucket.flat_offset + slot.offset
            out[start : start + slot.nbytes] = raw[slot.start : slot.start + slot.nbytes]
    return out


def fill_all(layout, tensors, *, staging: torch.Tensor | None = None, whole: bool = True) -> torch.Tensor:
    """Every bucket filled into one dirty buffer at its flat offset (whole), or into one dirty bucket buffer."""
    out = torch.full((layout.total_bytes,), 0xAB, dtype=torch.uint8)
    slot = torch.full((max(layout.max_bucket_bytes, 1),), 0xCD, dtype=torch.uint8)
    for bucket in layout.buckets:
        if whole:
            fill_bucket(out, bucket.slots, tensors, bucket.nbytes, bucket.flat_offset, staging=staging)
        else:
            fill_bucket(slot, bucket.slots, tensors, bucket.nbytes, staging=staging)
            out[bucket.flat_offset : bucket.flat_offset + bucket.nbytes] = slot[: bucket.nbytes]
    return out


@pytest.fixture(params=["default", "low-direct"])
def direct(request, monkeypatch) -> int:
    """The default threshold (every small test tensor batched) and one low enough that "mid" goes on its own."""
    if request.param == "low-direct":
        monkeypatch.setattr(tensors_mod, "DIRECT_BYTES", 2048)
        monkeypatch.setattr(tensors_mod, "STAGED_DIRECT_BYTES", 1024)
    return tensors_mod.DIRECT_BYTES


@pytest.fixture(params=["views", "memset"])
def zeroing(request, monkeypatch) -> str:
    """Padding zeroed view by view (the CPU's way) or by one memset of each span first (an accelerator's, forced
    here so that the CPU runs the same plan)."""
    if request.param == "memset":
        monkeypatch.setattr(tensors_mod, "zero_whole_span", lambda device_type, gaps, span_bytes: True)
    return request.param


@pytest.mark.parametrize("staging_size", [None, 1 << 20, 3000, 700, 64])
@pytest.mark.parametrize("whole", [True, False])
def test_every_odd_tensor_lands_byte_exact_with_zeroed_padding(direct: int, zeroing: str, staging_size: int | None,
                                                              whole: bool) -> None:
    """Staging of the bucket's size or more, smaller than some tensors (those go on their own), and smaller than
    the padding between them (the padding is cut): the same bytes as without staging, as the reference."""
    tensors = odd_tensors()
    layout = plan_layout(specs_of(tensors), BUCKET, alignment=64)
    assert layout.chunked
    staging = None if staging_size is None else torch.full((staging_size,), 0xEF, dtype=torch.uint8)
    want = reference(layout, tensors)
    for _ in range(2):  # the second fill reuses the cached plan over dirty staging
        got = fill_all(layout, tensors, staging=staging, whole=whole)
        assert torch.equal(got, want)
    forget_fill_views(staging if staging is not None else torch.empty(0))


def test_a_sharded_models_gathered_pieces_fill_like_whole_tensors() -> None:
    """FSDP2's gathers hand a piece of a chunked tensor as its own flat view into the gathered bytes (workers/
    fsdp.py), and whole tensors as views with a storage offset: the same bytes as from the full tensors."""
    tensors = odd_tensors(seed=3, small=5)
    layout = plan_layout(specs_of(tensors), BUCKET, alignment=64)

    def gathered(bucket) -> dict[str, torch.Tensor]:
        out = {}
        for slot in bucket.slots:
            full = tensors[slot.name].resolve_conj().resolve_neg().contiguous()
            raw = torch.cat([torch.zeros(24, dtype=torch.uint8), byte_view(full)])  # a gather buffer, offset
            typed = raw[24:].view(full.dtype)
            out[slot.name] = piece_of(typed, slot) if slot.is_piece else typed.view(full.shape)
        return out

    staging = torch.empty(4096, dtype=torch.uint8)
    for stage in (None, staging):
        out = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        for bucket in layout.buckets:
            fill_bucket(out, bucket.slots, gathered(bucket), bucket.nbytes, bucket.flat_offset, staging=stage)
        assert torch.equal(out, reference(layout, tensors))


def test_sources_on_another_device_than_the_staging_are_filled_directly() -> None:
    """Staging is for sources on its own device: host sources of a bucket bound for host memory skip it."""
    tensors = odd_tensors(small=3)
    layout = plan_layout(specs_of(tensors), BUCKET, alignment=64)
    staging = torch.empty(4096, dtype=torch.uint8, device="meta")  # no bytes: using it would fail
    assert torch.equal(fill_all(layout, tensors, staging=staging), reference(layout, tensors))


class CopyCalls:
    def __init__(self, monkeypatch) -> None:
        self.batched: list[int] = []
        self.single = 0
        foreach, copy = torch._foreach_copy_, torch.Tensor.copy_

        def counted_foreach(targets, sources, non_blocking=False):
            self.batched.append(len(targets))
            return foreach(targets, sources, non_blocking=non_blocking)

        def counted_copy(target, source, non_blocking=False):
            self.single += 1
            return copy(target, source, non_blocking=non_blocking)

        monkeypatch.setattr(torch, "_foreach_copy_", counted_foreach)
        monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)


@pytest.mark.parametrize("count", [100, 4000])
def test_a_bucket_of_many_small_tensors_takes_a_few_copy_calls(monkeypatch, count: int) -> None:
    """One batched copy per dtype for the small tensors (a device runs each as one kernel per ~64 tensors),
    one copy per big tensor; staged, one more copy per staged span (the device→host copy)."""
    gen = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": torch.randn(65, 64, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
               for i in range(count)}
    tensors["huge"] = torch.randn(tensors_mod.DIRECT_BYTES // 4 + 1, generator=gen)
    layout = plan_layout(specs_of(tensors), 64 << 20)
    assert len(layout.buckets) == 1
    bucket = layout.buckets[0]
    out = torch.empty(layout.total_bytes, dtype=torch.uint8)
    fill_bucket(out, bucket.slots, tensors, bucket.nbytes)  # plan made (not counted)
    staging = torch.empty(staging_bytes(layout.max_bucket_bytes), dtype=torch.uint8)
    fill_bucket(out, bucket.slots, tensors, bucket.nbytes, staging=staging)
    calls = CopyCalls(monkeypatch)
    fill_bucket(out, bucket.slots, tensors, bucket.nbytes)
    assert calls.batched == [count // 2, count // 2] and calls.single == 1
    calls.batched, calls.single = [], 0
    fill_bucket(out, bucket.slots, tensors, bucket.nbytes, staging=staging)
    spans = -(-(layout.total_bytes - tensors["huge"].numel() * 4) // staging.numel())
    assert len(calls.batched) <= 2 * spans + 1 and sum(calls.batched) == count
    assert calls.single <= spans + 2  # each staged span's copy, and the big tensor
    monkeypatch.undo()
    assert torch.equal(out, reference(layout, tensors))


@pytest.mark.parametrize("staged", [False, True])
def test_a_staged_snapshot_caches_the_same_bytes(staged: bool) -> None:
    """VersionCache(staged=True) is how a GPU trainer snapshots (small tensors packed on the device, one copy per
    span to pinned memory); run on the CPU it must cache exactly what the direct snapshot caches, also for a
    delta, and hold one staging buffer of at most STAGING_BYTES however many versions."""
    tensors = odd_tensors(seed=5)
    layout = plan_layout(specs_of(tensors), BUCKET, alignment=64)
    cache = VersionCache(detect_device("cpu"), keep_versions=2, staged=staged)
    want = reference(layout, tensors)
    for version in (1, 2, 3):
        cached = cache.snapshot(version, layout, tensors)
        assert torch.equal(cached.buffer[: layout.total_bytes], want)
    assert (cache._staging is not None) == staged
    if staged:
        assert cache._staging.numel() == staging_bytes(layout.max_bucket_bytes) <= tensors_mod.STAGING_BYTES
    changed = {name: t for name, t in tensors.items() if name in ("fp32", "bf16", "big")}
    changed["fp32"] = changed["fp32"] + 1
    changed_layout = plan_layout(specs_of(changed), BUCKET, alignment=64)
    delta = cache.snapshot_delta(4, 3, changed_layout, changed)
    assert torch.equal(delta.tensor("fp32"), changed["fp32"]) and torch.equal(delta.tensor("mask"), tensors["mask"])
    assert torch.equal(delta.tensor("big"), tensors["big"])


@pytest.mark.parametrize(("device_type", "gaps", "span_bytes", "memset"), [
    ("cpu", 4000, 64 << 20, False),     # never on the CPU: a memset is a pass over memory there
    ("cuda", 4000, 64 << 20, True),     # H200: 4,000 views 0.99 ms, the memset 0.04 ms
    ("cuda", 100, 64 << 20, False),     # 100 views ~25 µs: less than a 64 MiB memset
    ("cuda", 1, 1000, True),            # one view of a tiny span: the memset is as cheap
    ("npu", 2000, 512 << 20, True),
    ("cuda", 0, 1 << 20, False),
])
def test_a_span_is_zeroed_in_one_memset_where_its_views_would_cost_more(device_type: str, gaps: int,
                                                                         span_bytes: int, memset: bool) -> None:
    assert tensors_mod.zero_whole_span(device_type, gaps, span_bytes) is memset
