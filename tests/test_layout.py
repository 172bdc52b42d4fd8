"""Pure layout planner: order, alignment, oversize tensors, determinism, mismatch detection."""

from __future__ import annotations

import pytest

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.layout import TensorSpec, check_same_layout, plan_layout


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


def test_tensor_larger_than_a_bucket_gets_its_own() -> None:
    layout = plan_layout(specs(10, 1000, 10), bucket_size=1024)
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["t0"], ["t1"], ["t2"]]
    assert layout.buckets[1].nbytes == 4096 and layout.max_bucket_bytes == 4096


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
