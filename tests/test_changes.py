"""Finding what changed since the previous cached version from this process's own tensors."""

from __future__ import annotations

import torch

from ckpt_engine.plan.changes import ChangeTracker, ShardDigester
from ckpt_engine.plan.layout import plan_layout
from ckpt_engine.plan.tensors import NamedTensors, specs_of


def model() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(10, 3), "b": torch.arange(5), "empty": torch.zeros(0), "h": torch.randn(4).half()}


def test_host_tensors_hashed_in_place_equal_the_bucketed_digests() -> None:
    tensors = model()
    layout = plan_layout(specs_of(tensors), 1024, 256)
    in_place = ShardDigester("xxh3-64", 1024, 256).digests(NamedTensors(tensors), layout)
    strided = dict(tensors, a=tensors["a"].t().contiguous().t())  # not contiguous: goes through a bucket
    assert not strided["a"].is_contiguous()
    assert ShardDigester("xxh3-64", 1024, 256).digests(NamedTensors(strided), layout) == in_place
    mix = ShardDigester("torch-block64", 1024, 256)
    assert len(mix.digests(NamedTensors(tensors), layout)) == 4


def test_the_tracker_finds_the_changed_tensors_against_a_cached_parent() -> None:
    tensors = model()
    layout = plan_layout(specs_of(tensors), 1024, 256)
    tracker = ChangeTracker("xxh3-64", 1024, 256)
    cached = {1}
    assert tracker.delta(tracker.vector(1, NamedTensors(tensors), layout, cached.__contains__), layout) is None
    tensors["h"] += 1
    parent, changed = tracker.delta(tracker.vector(2, NamedTensors(tensors), layout, cached.__contains__), layout)
    assert parent == 1 and [s.name for s in changed.slots] == ["h"]
    tensors["b"] += 1  # the parent (version 2) is not cached: nothing to share with
    assert tracker.delta(tracker.vector(3, NamedTensors(tensors), layout, cached.__contains__), layout) is None
