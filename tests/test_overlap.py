"""Cached mode with the send overlapping the snapshot: bucket k goes on the wire once it is in the cache.

The rule (which versions overlap) and the fill progress are tested as tables and threads; the wiring with real
processes on a real gloo group: a send that really starts before the snapshot ends, and a snapshot that fails
part way, which the receivers hear at that bucket while the cache never lists the version.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt_engine.device import detect_device
from ckpt_engine.errors import CacheError, CkptEngineError
from ckpt_engine.plan.layout import Bucket, plan_layout
from ckpt_engine.plan.modes import overlaps_snapshot
from ckpt_engine.plan.tensors import NamedTensors, specs_of
from ckpt_engine.receive.collective import Receiver, VersionPayload
from ckpt_engine.send.cache import VersionCache
from ckpt_engine.send.filling import FillProgress, SnapshotFailed
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.transport.group import SyncGroup, open_store
from tests.procs import run_processes

HOST = "127.0.0.1"
TIMEOUT_S = 20.0
BUCKET = 4096


# ---- the rule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, delta, sparse_base, owners, gathers, host_wire, device_copy, wanted, expected", [
    ("cached", False, False, 1, False, False, True, None, True),  # a GPU trainer's plain model, by default
    ("cached", False, False, 1, False, True, False, None, False),  # a host memcpy would share the send's cores
    ("cached", False, False, 1, False, True, False, True, True),  # ... unless asked for
    ("cached", False, False, 1, False, False, True, False, False),  # asked not to
    ("cached", False, False, 1, True, True, True, None, True),  # a sharded model's gathers beside a gloo send
    ("cached", False, False, 1, True, False, True, True, False),  # ... beside NCCL: two communicators, two threads
    ("cached", False, False, 2, False, True, True, True, False),  # several owners vote from the send thread
    ("cached", True, False, 1, False, True, True, True, False),  # a delta is assembled from its parent
    ("cached", False, True, 1, False, True, True, True, False),  # a sparse send digests the whole version first
    ("bypass_cpu", False, False, 1, False, True, True, True, False),  # nothing is snapshotted
])
def test_which_versions_overlap(mode, delta, sparse_base, owners, gathers, host_wire, device_copy, wanted,
                                expected) -> None:
    assert overlaps_snapshot(mode, delta=delta, sparse_base=sparse_base, owner_ranks=owners, gathers=gathers,
                             host_wire=host_wire, device_copy=device_copy, wanted=wanted) is expected


class _Gathering(NamedTensors):
    def bucket_tensors(self, bucket: Bucket, to: int | None = None):
        return self.tensors


def test_tensors_that_assemble_buckets_themselves_are_taken_to_gather() -> None:
    assert not NamedTensors({}).gathers and _Gathering({}).gathers


# ---- fill progress -------------------------------------------------------------------------------------------
def test_a_bucket_is_handed_over_once_filled_and_in_order() -> None:
    progress = FillProgress(7, 3)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(progress.wait(k, TIMEOUT_S) for k in range(3)))
    reader.start()
    for k in range(3):
        progress.filled(k, f"mark{k}")
    reader.join(TIMEOUT_S)
    assert got == ["mark0", "mark1", "mark2"] and progress.done
    with pytest.raises(CkptEngineError, match="out of order"):
        FillProgress(7, 3).filled(1, None)


def test_a_failed_snapshot_reaches_the_reader_at_the_first_bucket_it_did_not_fill() -> None:
    progress = FillProgress(7, 4)
    progress.filled(0, None)
    progress.failed("OSError: device fell over")
    assert progress.wait(0, 0.0) is None  # filled before the failure: still readable
    with pytest.raises(SnapshotFailed, match="version 7 failed at bucket 1: OSError: device fell over"):
        progress.wait(1, TIMEOUT_S)


def test_a_stalled_snapshot_is_waited_for_a_bounded_time() -> None:
    with pytest.raises(SnapshotFailed, match=r"did not fill bucket 0 within 0.05 s"):
        FillProgress(3, 2).wait(0, 0.05)


# ---- the cache ----------------------------------------------------------------------------------------------
def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((512,), value + i) for i in range(6)}  # 2 KiB each: 3 buckets of 4 KiB


def test_a_begun_version_is_listed_only_once_whole_and_a_failed_one_never() -> None:
    cache = VersionCache(detect_device("cpu"), keep_versions=2)
    layout = plan_layout(specs_of(_tensors(0.0)), BUCKET)
    cached = cache.begin(1, layout)
    assert cache.versions() == []
    with pytest.raises(CacheError, match="already cached"):
        cache.begin(1, layout)
    cache.fill(cached, _tensors(1.0))
    cache.unlease(cached)
    assert cache.versions() == [1] and torch.equal(cache.get(1).tensor("w2"), torch.full((512,), 3.0))

    failing = cache.begin(2, layout)

    def provide(bucket: Bucket) -> dict[str, torch.Tensor]:
        if bucket.index == 1:
            raise RuntimeError("gather failed")
        return _tensors(2.0)

    with pytest.raises(RuntimeError, match="gather failed"):
        cache.fill(failing, provide)
    with pytest.raises(SnapshotFailed, match="failed at bucket 1"):
        failing.filling.wait(1, 0.0)  # type: ignore[union-attr]
    assert cache.versions() == [1]
    allocations = cache.allocations
    cache.unlease(failing)  # the send's lease ends: the buffer goes back to the pool
    cache.snapshot(3, layout, _tensors(3.0))
    assert cache.versions() == [1, 3] and cache.allocations == allocations


def test_a_version_of_no_bucket_is_filled_and_listed() -> None:
    cache = VersionCache(detect_device("cpu"), keep_versions=2)
    empty = plan_layout([], BUCKET)
    cached = cache.begin(4, empty)
    cache.fill(cached, {})
    cache.unlease(cached)
    assert cache.versions() == [4]
    with pytest.raises(CacheError, match="not waiting to be filled"):
        cache.fill(cached, {})


# ---- real processes ------------------------------------------------------------------------------------------
def _group(port: int, rank: int) -> SyncGroup:
    return SyncGroup(open_store(HOST, port, timeout_s=TIMEOUT_S), name="overlap", generation=0, rank=rank,
                     world_size=2, device=detect_device("cpu"), timeout_s=TIMEOUT_S, bind_host=HOST)


class _Snapshot(NamedTensors):
    """Tensors whose later buckets are handed to the snapshot only when told (the trainer's copies are slow),
    or not at all (a bucket whose copy fails)."""

    go_on: threading.Event
    fail_at: int | None = None
    last: int = 0
    went_on: bool = False  # the last bucket was handed over because go_on was set, not for want of time

    def bucket_tensors(self, bucket: Bucket, to: int | None = None):
        if bucket.index == self.fail_at:
            raise RuntimeError(f"the device lost bucket {bucket.index}'s tensors")
        if bucket.index == self.last:
            self.went_on = self.go_on.wait(5.0)
        return self.tensors


def overlapping_sender(port: int) -> dict:
    wire: list[int] = []
    first_out = threading.Event()

    def hook(k: int, buf: torch.Tensor) -> torch.Tensor:
        wire.append(k)
        first_out.set()
        return buf

    publisher = Publisher(_group(port, 0), bucket_size=BUCKET, wire_hook=hook, overlap_snapshot=True)
    named = _Snapshot(_tensors(1.0))
    named.go_on, named.last = first_out, 2
    first = publisher.publish(1, named).result(timeout_s=60)  # its last bucket waits for bucket 0 on the wire
    failing = _Snapshot(_tensors(2.0))
    failing.go_on, failing.last, failing.fail_at = threading.Event(), 99, 2
    second = publisher.publish(2, failing)  # returns: the failure is the transfer's, told to the receivers
    second_result = second.result(timeout_s=60)
    third = publisher.publish(3, NamedTensors(_tensors(3.0))).result(timeout_s=60)
    cached = publisher.cache.versions()
    publisher.close()
    return {"overlapped": named.went_on, "wire": wire, "first": (first.ok, first.reason),
            "second": (second_result.ok, second_result.reason, second.params_released.is_set()),
            "third": (third.ok, third.reason), "cached": cached}


def loading_receiver(port: int) -> dict:
    loaded: dict[int, float] = {}

    def load(payload: VersionPayload) -> None:
        loaded[payload.version] = float(payload.tensors["w5"][0])

    results = Receiver(_group(port, 1), load).serve()
    return {"results": [(r.version, r.ok, r.reason) for r in results], "loaded": loaded}


def test_the_send_starts_before_the_snapshot_ends_and_a_failed_snapshot_fails_the_version_where_it_stopped() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=10)
    sender, receiver = run_processes([(overlapping_sender, (store.port,)), (loading_receiver, (store.port,))],
                                     timeout_s=120)
    assert sender["overlapped"], "bucket 0 was not on the wire before the snapshot of the last bucket"
    assert sender["first"] == (True, None) and sender["third"] == (True, None)
    ok, reason, released = sender["second"]
    assert not ok and released
    assert "bucket 2 could not be prepared" in reason and "the device lost bucket 2's tensors" in reason
    assert sender["wire"] == [0, 1, 2, 0, 1, 0, 1, 2]  # version 2 stopped at its third bucket
    assert sender["cached"] == [1, 3]  # a version whose snapshot failed is never listed
    (v1, ok1, _), (v2, ok2, why2), (v3, ok3, _) = receiver["results"]
    assert (v1, ok1, v2, ok2, v3, ok3) == (1, True, 2, False, 3, True)
    assert "the device lost bucket 2's tensors" in why2
    assert receiver["loaded"] == {1: 6.0, 3: 8.0}


# ---- a GPU trainer on a host wire, simulated -------------------------------------------------------------------
# CUDA cannot run here. What the overlap relies on is simulated with torch.cuda.Event's API (2.13): a device→host
# copy is queued and lands later (a worker thread, 20 ms after it was queued); mark() returns an event that is
# set once the copies queued before it landed, with Event.synchronize() waiting for it; device.py's wait_for runs
# as it is, for a device of kind "cuda" with gloo (host) collectives. The send reads the cache on the host, so it
# must wait for each bucket's copy itself.
class _CopyEvent:
    def __init__(self) -> None:
        self._landed = threading.Event()

    def synchronize(self) -> None:
        if not self._landed.wait(TIMEOUT_S):
            raise RuntimeError("a simulated copy never landed")


def _simulate_async_copies() -> None:
    import queue
    import time

    import ckpt_engine.send.cache as cache_module
    import ckpt_engine.send.sources as sources_module
    from ckpt_engine import device as device_module
    from ckpt_engine.device import DeviceInfo

    copies: queue.Queue = queue.Queue()
    queued: list[_CopyEvent] = []

    def copier() -> None:
        while True:
            copy, event = copies.get()
            time.sleep(0.02)  # the copy engine is behind the queue
            copy()
            event._landed.set()

    threading.Thread(target=copier, daemon=True).start()
    real_fill = cache_module.fill_bucket

    def queued_fill(buf, slots, tensors, nbytes, base=0, *, staging=None) -> None:
        source = {name: t.clone() for name, t in tensors.items()}  # the device tensors stay as they were
        event = _CopyEvent()
        queued.append(event)
        copies.put((lambda: real_fill(buf, slots, source, nbytes, base, staging=staging), event))

    cuda_on_gloo = DeviceInfo("cuda", 0, "gloo", True, "none")  # type: ignore[arg-type]
    cache_module.fill_bucket = queued_fill
    cache_module.mark = lambda device: queued[-1] if queued else None
    cache_module.stream_synchronize = lambda device: [event.synchronize() for event in list(queued)]
    sources_module.wait_for = lambda device, point, host: device_module.wait_for(cuda_on_gloo, point, host=host) \
        if host else None  # a stream wait does not block the host: nothing to do for it here


def async_copy_sender(port: int) -> list:
    _simulate_async_copies()
    publisher = Publisher(_group(port, 0), bucket_size=BUCKET, keep_versions=1, overlap_snapshot=True)
    out = []
    for version in (1, 2, 3):
        result = publisher.publish(version, NamedTensors(_tensors(float(version)))).result(timeout_s=60)
        out.append((result.ok, result.reason))
    publisher.close()
    return out


def test_a_host_read_of_the_cache_waits_for_each_buckets_device_copy() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=10)
    sender, receiver = run_processes([(async_copy_sender, (store.port,)), (loading_receiver, (store.port,))],
                                     timeout_s=120)
    assert sender == [(True, None)] * 3
    assert receiver["loaded"] == {1: 6.0, 2: 7.0, 3: 8.0}  # w5 = version + 5: every byte landed before it left


# ---- live reads: the send fills its slots from the live tensors while the snapshot holds the loop ------------
# A GPU trainer's send fills device slots (CUDA IPC, NCCL): while the snapshot still holds the training loop it
# reads the live tensors (device to device) instead of waiting for each bucket's device→host copy and copying it
# back. Run here with host slots (a cache that colocated receivers cannot map): the same code.
def _colocated(name: str, received: list) -> threading.Thread:
    from ckpt_engine.receive.colocated import IpcReceiver

    def serve() -> None:
        rx = IpcReceiver(name, "rx", 1, lambda p: received.append({k: v.clone() for k, v in p.tensors.items()}),
                         device=detect_device("cpu"), timeout_s=TIMEOUT_S)
        while (result := rx.receive(TIMEOUT_S)) is not None:
            received.append(result.ok)
        rx.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _live_setup(hook):
    import uuid

    from ckpt_engine.send.sender import Sender
    from ckpt_engine.transport.same_host import IpcHub

    cpu = detect_device("cpu")
    name = f"ckpt-test-live-{uuid.uuid4().hex[:8]}"
    hub = IpcHub(name, cpu)
    sender = Sender(None, device=cpu, hub=hub, ipc_peers={"rx": 1}, timeout_s=TIMEOUT_S, wire_hook=hook)
    return VersionCache(cpu, keep_versions=2, shareable=False), hub, sender, name


def test_the_send_reads_the_live_tensors_while_the_snapshot_holds_the_loop() -> None:
    """Every bucket is on the wire before the snapshot copied more than bucket 0: read from the live tensors."""
    tensors = _tensors(1.0)
    layout = plan_layout(specs_of(tensors), BUCKET)
    last_out = threading.Event()
    cache, hub, sender, name = _live_setup(lambda k, buf: (last_out.set() if k == 2 else None, buf)[1])
    received: list = []
    receiver = _colocated(name, received)
    cached = cache.begin(1, layout)
    transfer = sender.send_cached(cache, 1, filling=cached)
    went_on = []

    def provide(bucket: Bucket) -> dict[str, torch.Tensor]:
        if bucket.index == 1:
            went_on.append(last_out.wait(TIMEOUT_S))  # the send read every bucket meanwhile
        return tensors

    cache.fill(cached, provide, live=tensors)
    result = transfer.result(TIMEOUT_S)
    cache.unlease(cached)
    hub.close()
    receiver.join(TIMEOUT_S)
    assert went_on == [True] and result.ok, result.reason
    assert cached.live is not None and cached.live.reads == 3
    assert received[1] is True and all(torch.equal(received[0][k], v) for k, v in tensors.items())
    assert cache.versions() == [1] and torch.equal(cache.get(1).tensor("w4"), tensors["w4"])


def test_once_the_loop_goes_on_the_send_reads_the_cache() -> None:
    """Bucket 0 is read live; the snapshot ends and the loop changes the tensors while bucket 0 is on the wire:
    the later buckets come from the cache, so the receiver gets the version as snapshotted, whole."""
    tensors = _tensors(1.0)
    snapshotted = {k: v.clone() for k, v in tensors.items()}
    layout = plan_layout(specs_of(tensors), BUCKET)
    loop_went_on = threading.Event()
    cache, hub, sender, name = _live_setup(lambda k, buf: (loop_went_on.wait(TIMEOUT_S) if k == 0 else None, buf)[1])
    received: list = []
    receiver = _colocated(name, received)
    cached = cache.begin(1, layout)
    transfer = sender.send_cached(cache, 1, filling=cached)
    read_live = threading.Event()

    def provide(bucket: Bucket) -> dict[str, torch.Tensor]:
        if bucket.index == 0:  # the send's first bucket is read from the live tensors before the snapshot ends
            read_live.set() if _wait_until(lambda: cached.live is not None and cached.live.reads == 1) else None
        return tensors

    cache.fill(cached, provide, live=tensors)
    for tensor in tensors.values():
        tensor.add_(100.0)  # the training loop's next step
    loop_went_on.set()
    result = transfer.result(TIMEOUT_S)
    cache.unlease(cached)
    hub.close()
    receiver.join(TIMEOUT_S)
    assert read_live.is_set() and result.ok, result.reason
    assert cached.live.reads == 1  # type: ignore[union-attr]
    assert received[1] is True and all(torch.equal(received[0][k], v) for k, v in snapshotted.items())


def _wait_until(condition, timeout_s: float = TIMEOUT_S) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
