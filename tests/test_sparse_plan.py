"""Sparse planning (pure): what changed, what is skipped, when a full sync is needed."""

from __future__ import annotations

import pytest

from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.plan.sparse import agreed_changes, agreement_vector, changed_layout, manifest_of, plan_sparse


def full_layout(n: int = 10):
    return plan_layout([TensorSpec(f"t{i}", "float32", (16,)) for i in range(n)], bucket_size=256)


def test_only_changed_tensors_are_planned_in_order() -> None:
    layout = full_layout()
    base = manifest_of(1, "xxh3-64", layout, list(range(10)))
    new = manifest_of(2, "xxh3-64", layout, [0, 1, 99, 3, 4, 5, 98, 7, 8, 9])
    plan = plan_sparse(layout, new, base, bucket_size=256, alignment=256)
    assert plan.changed == ("t2", "t6") and plan.skipped == 8 and plan.skipped_bytes == 8 * 64
    assert [s.name for s in plan.layout.slots] == ["t2", "t6"]
    assert base.updated(2, {"t2": 99, "t6": 98}).version_digest == new.version_digest


@pytest.mark.parametrize("base_change", ["none", "layout", "algo"])
def test_full_sync_when_the_base_does_not_fit(base_change: str) -> None:
    layout = full_layout()
    new = manifest_of(2, "xxh3-64", layout, list(range(10)))
    base = {"none": None,
            "layout": manifest_of(1, "xxh3-64", full_layout(11), list(range(11))),
            "algo": manifest_of(1, "torch-block64", layout, list(range(10)))}[base_change]
    assert plan_sparse(layout, new, base, bucket_size=256, alignment=256) is None


def test_nothing_changed_is_an_empty_version() -> None:
    layout = full_layout()
    base = manifest_of(1, "xxh3-64", layout, list(range(10)))
    plan = plan_sparse(layout, manifest_of(2, "xxh3-64", layout, list(range(10))), base, bucket_size=256,
                       alignment=256)
    assert plan.changed == () and plan.layout.buckets == () and plan.skipped == 10


def test_updating_unknown_tensors_is_an_error() -> None:
    base = manifest_of(1, "xxh3-64", full_layout(), list(range(10)))
    with pytest.raises(KeyError):
        base.updated(2, {"nope": 1})


def _reduce_max(vectors: list[list[int]]) -> list[int]:
    return [max(column) for column in zip(*vectors)]


def test_ranks_agree_on_the_union_of_their_changed_shards() -> None:
    rank0 = agreement_vector(4, [1, 2, 3, 4], [1, 9, 3, 4])
    rank1 = agreement_vector(4, [5, 6, 7, 8], [5, 6, 7, 0])
    assert agreed_changes(_reduce_max([rank0, rank1])) == (4, [1, 3])
    layout = plan_layout([TensorSpec(f"t{i}", "float32", (4,)) for i in range(4)], 256, 256)
    assert [s.name for s in changed_layout(layout, [3, 1], bucket_size=256, alignment=256).slots] == ["t1", "t3"]


@pytest.mark.parametrize("other", [
    agreement_vector(None, [1, 2], [1, 2]),  # e.g. rank 0 no longer caches the parent
    agreement_vector(3, [1, 2], [1, 2]),  # digests of another version than rank 0's
    agreement_vector(4, None, [1, 2]),  # first version, or the model changed shape
    agreement_vector(4, [1, 2, 3], [1, 2]),
])
def test_any_rank_that_cannot_build_on_the_parent_makes_it_full(other: list[int]) -> None:
    mine = agreement_vector(4, [1, 2], [1, 2])
    assert agreed_changes(_reduce_max([mine, other])) is None


def test_nothing_changed_on_any_rank() -> None:
    assert agreed_changes(_reduce_max([agreement_vector(2, [1], [1])] * 3)) == (2, [])
