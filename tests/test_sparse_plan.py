"""Sparse planning (pure): what changed, what is skipped, when a full sync is needed."""

from __future__ import annotations

import pytest

from ckpt_engine.layout import TensorSpec, plan_layout
from ckpt_engine.sparse import manifest_of, plan_sparse


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
            "algo": manifest_of(1, "torch-mix64", layout, list(range(10)))}[base_change]
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
