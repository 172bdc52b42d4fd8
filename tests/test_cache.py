"""Version cache: retention, eviction accounting, buffer reuse, leases."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.device import detect_device
from ckpt_engine.errors import CacheError, ConfigError, LayoutMismatchError
from ckpt_engine.plan.layout import plan_layout
from ckpt_engine.plan.tensors import specs_of
from ckpt_engine.send.cache import VersionCache


def model(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((100, 10), scale), "b": torch.arange(7, dtype=torch.int64), "h": torch.ones(3).half()}


@pytest.fixture()
def cache() -> VersionCache:
    return VersionCache(detect_device("cpu"), keep_versions=2)


def snapshot(cache: VersionCache, version: int, tensors: dict[str, torch.Tensor]):
    layout = plan_layout(specs_of(tensors), bucket_size=1024)
    return cache.snapshot(version, layout, tensors, step=version)


def test_keeps_the_newest_versions_and_accounts_bytes(cache: VersionCache) -> None:
    first = snapshot(cache, 1, model(1.0))
    snapshot(cache, 2, model(2.0))
    snapshot(cache, 3, model(3.0))
    assert cache.versions() == [2, 3]
    assert cache.bytes_by_version() == {2: first.nbytes, 3: first.nbytes}
    assert cache.bytes_held == 2 * first.nbytes
    assert torch.equal(cache.get(3).tensor("w"), model(3.0)["w"])
    assert torch.equal(cache.get(2).tensor("b"), model()["b"])
    with pytest.raises(CacheError, match="version 1 is not in the cache"):
        cache.get(1)


def test_snapshot_is_a_copy_not_a_view(cache: VersionCache) -> None:
    tensors = model(1.0)
    snapshot(cache, 1, tensors)
    tensors["w"].add_(5)
    assert torch.equal(cache.get(1).tensor("w"), model(1.0)["w"])


def test_buffers_are_reused_over_twenty_versions(cache: VersionCache) -> None:
    for version in range(1, 21):
        snapshot(cache, version, model(float(version)))
    assert cache.allocations == 2
    assert cache.bytes_allocated == 2 * cache.get(20).nbytes
    assert cache.versions() == [19, 20]


def test_explicit_eviction_frees_and_reuses(cache: VersionCache) -> None:
    snapshot(cache, 1, model())
    freed = cache.evict(1)
    assert freed > 0 and cache.versions() == [] and cache.bytes_held == 0
    snapshot(cache, 2, model())
    assert cache.allocations == 1
    with pytest.raises(CacheError):
        cache.evict(1)


def test_a_leased_version_keeps_its_buffer_until_released(cache: VersionCache) -> None:
    snapshot(cache, 1, model(1.0))
    with cache.lease(1) as held:
        snapshot(cache, 2, model(2.0))
        snapshot(cache, 3, model(3.0))  # evicts 1, but 1 is leased: its buffer must not be reused
        assert cache.versions() == [2, 3]
        assert torch.equal(held.tensor("w"), model(1.0)["w"])
        assert cache.allocations == 3
    snapshot(cache, 4, model(4.0))  # now the released buffer comes back from the pool
    assert cache.allocations == 3


def test_tensors_must_match_the_layout(cache: VersionCache) -> None:
    layout = plan_layout(specs_of(model()), bucket_size=1024)
    wrong = model()
    wrong["w"] = torch.zeros(10, 100)
    with pytest.raises(LayoutMismatchError, match="'w'"):
        cache.snapshot(1, layout, wrong)
    assert cache.versions() == []


def test_rejects_duplicate_versions_and_bad_settings(cache: VersionCache) -> None:
    snapshot(cache, 1, model())
    with pytest.raises(CacheError, match="already cached"):
        snapshot(cache, 1, model())
    with pytest.raises(ConfigError):
        VersionCache(detect_device("cpu"), keep_versions=0)


def test_latest(cache: VersionCache) -> None:
    assert cache.latest() is None
    snapshot(cache, 4, model())
    snapshot(cache, 9, model())
    assert cache.latest().version == 9 and 4 in cache and 5 not in cache


def delta(cache: VersionCache, version: int, parent: int, changed: dict[str, torch.Tensor]):
    return cache.snapshot_delta(version, parent, plan_layout(specs_of(changed), bucket_size=1024), changed,
                                step=version)


def big_model(scale: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64,), scale + i) for i in range(10)}


def test_a_delta_stores_only_changed_tensors_and_shares_the_rest(cache: VersionCache) -> None:
    whole = snapshot(cache, 1, big_model(0.0))
    changed = {"t3": torch.full((64,), -1.0)}
    second = delta(cache, 2, 1, changed)
    assert not second.is_whole and second.parent == 1 and second.changed == ("t3",)
    assert second.nbytes == 256 and second.shared_bytes == whole.layout.total_bytes - 256 - 0
    assert cache.bytes_held == whole.nbytes + second.nbytes  # the 9 unchanged tensors are held once
    expected = big_model(0.0) | changed
    assert all(torch.equal(second.tensor(n), t) for n, t in expected.items())
    # the whole layout's buckets assemble from both buffers, byte-equal to a whole snapshot of the same tensors
    out = torch.empty(whole.layout.max_bucket_bytes, dtype=torch.uint8)
    reference = VersionCache(detect_device("cpu"))
    ref = snapshot(reference, 2, expected)
    for bucket in whole.layout.buckets:
        assert torch.equal(second.fill(bucket.index, out), ref.bucket(bucket.index))
    with pytest.raises(CacheError, match="delta"):
        second.bucket(0)


def test_a_delta_that_fails_while_filling_gives_its_buffer_back(cache: VersionCache) -> None:
    snapshot(cache, 1, big_model(0.0))

    def broken(bucket):
        raise RuntimeError("the device went away")

    changed = plan_layout(specs_of({"t3": torch.zeros(64)}), bucket_size=1024)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="went away"):
            cache.snapshot_delta(2, 1, changed, broken)
    assert cache.versions() == [1] and cache.allocations == 2  # one buffer for the deltas, reused each time
    second = delta(cache, 2, 1, {"t3": torch.full((64,), -1.0)})  # the id is free again
    assert second.tensor("t3").eq(-1.0).all() and cache.allocations == 2


def test_a_version_id_being_filled_as_a_delta_is_refused_to_another_snapshot(cache: VersionCache) -> None:
    import threading

    snapshot(cache, 1, big_model(0.0))
    changed = {"t3": torch.full((64,), -1.0)}
    entered, go = threading.Event(), threading.Event()

    def slow(bucket):
        entered.set()
        if not go.wait(60):
            raise TimeoutError("the test never let the fill go on")
        return changed

    filling = threading.Thread(target=lambda: cache.snapshot_delta(
        2, 1, plan_layout(specs_of(changed), bucket_size=1024), slow, step=2))
    filling.start()
    try:
        assert entered.wait(60)
        with pytest.raises(CacheError, match="version 2 is already cached"):
            snapshot(cache, 2, big_model(5.0))
    finally:
        go.set()
        filling.join(60)
    assert cache.get(2).tensor("t3").eq(-1.0).all() and cache.get(2).tensor("t0").eq(0.0).all()


def test_evicting_the_parent_keeps_shared_bytes_until_no_delta_uses_them(cache: VersionCache) -> None:
    whole = snapshot(cache, 1, big_model(0.0))
    delta(cache, 2, 1, {"t0": torch.full((64,), 5.0)})
    third = delta(cache, 3, 2, {"t1": torch.full((64,), 6.0)})  # evicts 1; its bytes stay for t2..t9
    assert cache.versions() == [2, 3]
    assert third.tensor("t0").eq(5.0).all() and third.tensor("t1").eq(6.0).all() and third.tensor("t9").eq(9.0).all()
    assert cache.bytes_held == whole.nbytes + 2 * 256
    snapshot(cache, 4, big_model(1.0))
    snapshot(cache, 5, big_model(2.0))  # no delta left: the first buffer is free again and gets reused
    assert cache.bytes_held == 2 * whole.nbytes
    assert cache.allocations <= 4


def test_a_delta_needs_a_cached_parent_with_those_tensors(cache: VersionCache) -> None:
    snapshot(cache, 1, big_model(0.0))
    with pytest.raises(CacheError, match="version 7 is not in the cache"):
        delta(cache, 2, 7, {"t0": torch.zeros(64)})
    with pytest.raises(LayoutMismatchError, match="not in version 1"):
        delta(cache, 2, 1, {"nope": torch.zeros(64)})
    assert cache.versions() == [1]
