"""Pure layout planner: order, alignment, chunked tensors, determinism, mismatch detection."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.layout import Packer, TensorSpec, check_same_layout, layout_digest, plan_layout
from ckpt_engine.plan.owners import plan_owners
from ckpt_engine.plan.tensors import fill_bucket, slot_view, specs_of


def specs(*sizes: int, dtype: str = "float32") -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", dtype, (n,)) for i, n in enumerate(sizes)]


def test_keeps_registration_order_and_aligns_offsets() -> None:
    layout = plan_layout(specs(3, 100, 1, 64), bucket_size=4096)
    assert [s.name for s in layout.slots] == ["t0", "t1", "t2", "t3"]
    assert [s.offset for s in layout.slots] == [0, 256, 768, 1024]
    assert all(s.offset % 256 == 0 for s in layout.slots)
    assert len(layout.buckets) == 1 and layout.buckets[0].nbytes == 1280


def test_splits_buckets_at_the_size_limit() -> None:
    # 800-byte tensors: the second would end at 1024 + 800 > 1600, so each starts a new bucket.
    layout = plan_layout(specs(200, 200, 200), bucket_size=1600)
    assert [len(b.slots) for b in layout.buckets] == [1, 1, 1]
    assert [b.nbytes for b in layout.buckets] == [1024, 1024, 1024]
    assert [b.flat_offset for b in layout.buckets] == [0, 1024, 2048]
    assert layout.total_bytes == 3072
    # 400-byte tensors: two fit (0..400, 512..912), the third starts a new bucket.
    layout = plan_layout(specs(100, 100, 100), bucket_size=1000)
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["t0", "t1"], ["t2"]]


def test_a_tensor_larger_than_a_bucket_travels_in_pieces_of_one_bucket() -> None:
    layout = plan_layout(specs(10, 1000, 10), bucket_size=1024)  # t1: 4000 bytes in pieces of 1024
    assert [[(s.name, s.part, s.start, s.nbytes) for s in b.slots] for b in layout.buckets] == [
        [("t0", 0, 0, 40)], [("t1", 0, 0, 1024)], [("t1", 1, 1024, 1024)], [("t1", 2, 2048, 1024)],
        [("t1", 3, 3072, 928)], [("t2", 0, 0, 40)]]
    assert layout.max_bucket_bytes == 1024 and layout.chunked
    # one slot per tensor, the chunked one whole, its pieces back to back from its first one
    assert [(s.name, s.nbytes, s.parts) for s in layout.slots] == [("t0", 40, 1), ("t1", 4000, 4), ("t2", 40, 1)]
    first = layout.buckets[layout.slots[1].bucket].flat_offset
    assert [layout.buckets[b].flat_offset for b in range(1, 5)] == [first + 1024 * k for k in range(4)]
    assert layout.num_tensors == 3 and len(layout.pieces) == 6 and layout.payload_bytes == 4080
    assert layout.buckets[2].continues and not layout.buckets[1].continues


def test_a_chunked_tensor_is_one_view_in_a_version_buffer_and_its_pieces_fill_buckets() -> None:
    tensors = {"a": torch.arange(7, dtype=torch.float32), "big": torch.randn(33, 17),
               "c": torch.tensor([True, False])}
    layout = plan_layout(specs_of(tensors), bucket_size=512, alignment=8)
    assert layout.chunked and layout.max_bucket_bytes <= 512
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for bucket in layout.buckets:  # each bucket filled on its own, as a sender does
        scratch = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
        fill_bucket(scratch, bucket.slots, tensors, bucket.nbytes)
        flat[bucket.flat_offset : bucket.flat_offset + bucket.nbytes] = scratch
    for slot in layout.slots:
        view = slot_view(flat, slot, layout.buckets[slot.bucket].flat_offset)
        assert torch.equal(view, tensors[slot.name]), slot.name


def test_pieces_have_whole_elements_and_one_owner() -> None:
    layout = plan_layout([TensorSpec("z", "complex128", (40,)), TensorSpec("w", "float32", (3000,))],
                         bucket_size=100, alignment=8)
    assert all(s.nbytes % 16 == 0 for s in layout.pieces if s.name == "z")  # complex128: 16 bytes an element
    assert max(b.nbytes for b in layout.buckets) == 96  # whole elements within the bucket size
    tiny = plan_layout([TensorSpec("z", "complex128", (4,))], bucket_size=10, alignment=8)
    assert [b.nbytes for b in tiny.buckets] == [16] * 4  # a bucket smaller than one element: one a piece
    owners = plan_owners(layout, 3).of
    for bucket in layout.buckets:
        if bucket.continues:
            assert owners[bucket.index] == owners[bucket.index - 1]
    assert len(set(owners)) == 2  # the two tensors: two owners; a rank's share holds whole tensors


def test_a_chunked_layout_has_a_digest_of_its_own_kind() -> None:
    base = specs(10, 1000)
    chunked = plan_layout(base, 1024)
    assert chunked.digest != layout_digest(base, 1024, 256)  # what a planner without pieces would compute
    assert plan_layout(specs(10, 100), 1024).digest == layout_digest(specs(10, 100), 1024, 256)


def test_the_packer_says_which_buckets_a_tensor_lies_in() -> None:
    packer = Packer(1024)
    assert packer.add(TensorSpec("a", "float32", (10,))) == range(0, 1)
    assert packer.add(TensorSpec("b", "float32", (1000,))) == range(1, 5)
    assert packer.continues(2) and not packer.continues(1)
    assert packer.add(TensorSpec("c", "float32", (10,))) == range(5, 6)


def test_zero_dim_and_empty_tensors() -> None:
    layout = plan_layout([TensorSpec("s", "bfloat16", ()), TensorSpec("e", "float32", (0, 4)),
                          TensorSpec("x", "bool", (3,))], bucket_size=1024)
    slots = {s.name: s for s in layout.slots}
    assert slots["s"].nbytes == 2 and slots["e"].nbytes == 0 and slots["x"].nbytes == 3
    assert layout.payload_bytes == 5
    assert plan_layout([], bucket_size=1024).buckets == ()


def test_same_input_same_layout_and_digest() -> None:
    a = plan_layout(specs(5, 7, 9), 512)
    b = plan_layout(specs(5, 7, 9), 512)
    assert a == b and a.digest == b.digest


@pytest.mark.parametrize("change", [
    lambda s: list(reversed(s)),
    lambda s: [TensorSpec(s[0].name, "bfloat16", s[0].shape)] + s[1:],
    lambda s: [TensorSpec(s[0].name, s[0].dtype, (5, 1))] + s[1:],
    lambda s: [TensorSpec("renamed", s[0].dtype, s[0].shape)] + s[1:],
])
def test_digest_changes_with_order_dtype_shape_and_name(change) -> None:
    base = specs(5, 7, 9)
    assert plan_layout(change(base), 512).digest != plan_layout(base, 512).digest


def test_digest_changes_with_bucket_size_and_alignment() -> None:
    base = specs(5, 7, 9)
    digests = {plan_layout(base, 512).digest, plan_layout(base, 1024).digest, plan_layout(base, 512, 64).digest}
    assert len(digests) == 3


def test_mismatch_is_a_clear_error() -> None:
    local = plan_layout(specs(5, 7), 512)
    check_same_layout(local, local.digest)
    with pytest.raises(LayoutMismatchError, match="layout mismatch with rank 3"):
        check_same_layout(local, plan_layout(specs(5, 8), 512).digest, peer="rank 3")


@pytest.mark.parametrize("kwargs, match", [
    ({"bucket_size": 0}, "bucket_size"),
    ({"bucket_size": 64, "alignment": 12}, "alignment"),
    ({"bucket_size": 64, "alignment": 4}, "alignment"),
])
def test_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(LayoutError, match=match):
        plan_layout(specs(1), **kwargs)


def test_rejects_duplicate_names() -> None:
    with pytest.raises(LayoutError, match="appears twice"):
        plan_layout([TensorSpec("a", "float32", (1,)), TensorSpec("a", "float32", (2,))], 64)


@pytest.mark.parametrize("alignment", [8, 16, 256])
def test_items_wider_than_the_alignment_are_placed_on_their_own_width(alignment: int) -> None:
    """Found by the outside attack of 2026-11-28: at alignment 8 a complex128 after an 8-byte tensor sat at offset
    8, and its typed view (16-byte items) could not be made: the fill crashed."""
    tensors = {"a": torch.arange(1, dtype=torch.int64), "c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex128),
               "b": torch.ones(3, dtype=torch.bfloat16), "d": torch.tensor([5 + 6j], dtype=torch.complex128)}
    layout = plan_layout(specs_of(tensors), bucket_size=1 << 20, alignment=alignment)
    for slot in layout.slots:
        assert slot.offset % max(alignment, torch.empty(0, dtype=tensors[slot.name].dtype).element_size()) == 0
    bucket = layout.buckets[0]
    buf = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
    fill_bucket(buf, bucket.slots, tensors, bucket.nbytes)
    for slot in layout.slots:
        assert torch.equal(slot_view(buf, slot), tensors[slot.name])


@pytest.mark.parametrize("bucket_size", [16, 24, 40, 48, 100])
def test_every_tensor_has_its_typed_view_in_the_whole_version_buffer_at_alignment_8(bucket_size: int) -> None:
    """Found by the second outside attack: at alignment 8 a bucket could start 8 bytes past a 16-byte boundary
    (a complex128 opening it had no view in the whole buffer), and once buckets round to 16 bytes a chunked
    tensor's pieces had to be multiples of 16 as well to lie end to end."""
    gen = torch.Generator().manual_seed(bucket_size)
    tensors = {"f": torch.randn(1, dtype=torch.float64, generator=gen),
               "z": torch.randn(5, dtype=torch.complex128, generator=gen),
               "m": torch.rand(3, generator=gen) > 0.5,
               "h": torch.randn(7, generator=gen).to(torch.bfloat16),
               "w": torch.randn(9, dtype=torch.complex64, generator=gen)}
    layout = plan_layout(specs_of(tensors), bucket_size=bucket_size, alignment=8)
    flat = torch.full((layout.total_bytes,), 0xCD, dtype=torch.uint8)
    for bucket in layout.buckets:
        assert bucket.flat_offset % 16 == 0
        fill_bucket(flat, bucket.slots, tensors, bucket.nbytes, bucket.flat_offset)
    for slot in layout.slots:  # (a chunked tensor's slot spans its pieces: they must lie end to end)
        assert torch.equal(slot_view(flat, slot, layout.buckets[slot.bucket].flat_offset), tensors[slot.name])
