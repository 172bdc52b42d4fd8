"""End-to-end sync between real processes over real gloo groups.

Layout of the main scenario: two trainer processes share a default process group (as FSDP ranks would);
trainer 0 is also the sender of a separate sync group whose other members are two receiver processes.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from ckpt_engine.device import detect_device
from ckpt_engine.errors import SyncTimeoutError
from ckpt_engine.plan.modes import mode_of
from ckpt_engine.plan.tensors import NamedTensors, named_tensors_of
from ckpt_engine.receive.collective import Receiver, VersionPayload
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.server.launch import free_port
from ckpt_engine.transport.group import SyncGroup, open_store
from tests.models import BUCKET_SIZE, AwkwardModel, load_into, state_bytes
from tests.procs import context as procs_context
from tests.procs import run_processes

pytestmark = pytest.mark.multiproc
HOST = "127.0.0.1"
TIMEOUT_S = 20.0
CORRUPT_VERSION = 4
CORRUPT_BUCKET = 1


def _sync_group(port: int, rank: int, world: int, timeout_s: float = TIMEOUT_S, generation: int = 0) -> SyncGroup:
    store = open_store(HOST, port, timeout_s=timeout_s)
    return SyncGroup(store, name="test", generation=generation, rank=rank, world_size=world,
                     device=detect_device("cpu"), timeout_s=timeout_s, bind_host=HOST)


def _default_group_allreduce(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return float(t.item())


def _flip_one_byte(bucket_index: int, buf: torch.Tensor) -> torch.Tensor:
    if bucket_index != CORRUPT_BUCKET:
        return buf
    corrupted = buf.clone()
    corrupted[100] ^= 0xFF
    return corrupted


def trainer(rank: int, default_port: int, sync_port: int, algo: str) -> dict:
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{default_port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out: dict = {"allreduce": [_default_group_allreduce(rank + 1)]}
    if rank == 1:  # a plain FSDP peer: only the default group, alongside the sync group of rank 0
        for _ in range(3):
            out["allreduce"].append(_default_group_allreduce(rank + 1))
        dist.destroy_process_group()
        return out
    model = AwkwardModel(seed=1)
    corrupting = {"on": False}

    def hook(k: int, buf: torch.Tensor) -> torch.Tensor:
        return _flip_one_byte(k, buf) if corrupting["on"] else buf

    group = _sync_group(sync_port, 0, 3)
    publisher = Publisher(group, bucket_size=BUCKET_SIZE, digest_algo=algo, wire_hook=hook)
    out["allreduce"].append(_default_group_allreduce(rank + 1))  # default group still works next to it
    results, states = [], []
    plan = [(1, False), (2, True), (3, False), (CORRUPT_VERSION, True), (5, True)]
    for version, bypass in plan:
        if version == 2:
            model.perturb(version)
        if version == 5:
            model.perturb(version)
        corrupting["on"] = version == CORRUPT_VERSION
        transfer = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass), step=version * 10)
        result = transfer.result(timeout_s=60)
        results.append(result)
        states.append(state_bytes(model))
        if version in (2, 4):
            out["allreduce"].append(_default_group_allreduce(rank + 1))
    publisher.close()
    out.update(results=results, states=states, layout_buckets=len(publisher.layout_for(
        named_tensors_of(model)).buckets), cache_versions=publisher.cache.versions())
    dist.destroy_process_group()
    return out


def receiver(rank: int, sync_port: int, seed: int) -> dict:
    model = AwkwardModel(seed=seed)
    group = _sync_group(sync_port, rank, 3)
    loaded: list[int] = []

    def load(payload: VersionPayload) -> None:
        load_into(model, payload.tensors)
        loaded.append(payload.version)

    rx = Receiver(group, load)
    results, states = [], []
    while (result := rx.receive(begin_timeout_s=60)) is not None:
        results.append(result)
        states.append(state_bytes(model))
    return {"results": results, "states": states, "loaded": loaded}


@pytest.mark.parametrize("algo", ["xxh3-64", "torch-block64"])
def test_two_receivers_bit_identical_in_both_modes(algo: str) -> None:
    sync_store = open_store(HOST, 0, is_master=True, timeout_s=TIMEOUT_S)
    default_port = free_port()
    trainer0, trainer1, rx1, rx2 = run_processes([
        (trainer, (0, default_port, sync_store.port, algo)),
        (trainer, (1, default_port, sync_store.port, algo)),
        (receiver, (1, sync_store.port, 7)),
        (receiver, (2, sync_store.port, 8)),
    ], timeout_s=240)

    # The trainers' own default group kept working before, during and after the sync group's life.
    assert trainer0["allreduce"] == [3.0] * 4 and trainer1["allreduce"] == [3.0] * 4
    assert trainer0["layout_buckets"] > 2  # the model really spans several buckets

    sent = {r.version: r for r in trainer0["results"]}
    for version in (1, 2, 3, 5):
        assert sent[version].ok, sent[version].reason
        assert sorted(sent[version].committed_ranks) == [1, 2]
    assert sent[1].mode == "cached" and sent[2].mode == "bypass_cpu"
    # Version 2 (bypass) and 3 (cached) carry the same weights: same version digest in both modes.
    assert sent[2].version_digest == sent[3].version_digest
    assert sent[1].version_digest != sent[2].version_digest

    for rx in (rx1, rx2):
        assert rx["loaded"] == [1, 2, 3, 5]
        for index, result in enumerate(rx["results"]):
            version = index + 1
            if version == CORRUPT_VERSION:
                continue
            assert result.ok and result.version == version
            # Byte-for-byte equal to what the trainer held when it published (tied names included).
            assert rx["states"][index] == trainer0["states"][index]

    # The corrupted version was detected, named the tensor, and was not loaded: the receivers still hold v3.
    assert not sent[CORRUPT_VERSION].ok
    for rx in (rx1, rx2):
        bad = rx["results"][CORRUPT_VERSION - 1]
        assert not bad.ok and not bad.loaded
        assert len(bad.bad_tensors) == 1 and bad.bad_tensors[0] in bad.reason
        assert rx["states"][CORRUPT_VERSION - 1] == trainer0["states"][2]
    assert trainer0["cache_versions"] == [1, 3]  # versions 1 and 3 were cached; bypass versions never are


def lonely_sender(sync_port: int, timeout_s: float) -> dict:
    started = time.monotonic()
    try:
        _sync_group(sync_port, 0, 3, timeout_s=timeout_s)
    except SyncTimeoutError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - started}
    return {"error": None, "elapsed": time.monotonic() - started}


def lonely_receiver(sync_port: int, timeout_s: float) -> dict:
    try:
        _sync_group(sync_port, 1, 3, timeout_s=timeout_s)
    except SyncTimeoutError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_receiver_that_never_joins_fails_the_sender_within_timeout() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=10)
    timeout_s = 3.0
    sender, present = run_processes([
        (lonely_sender, (store.port, timeout_s)),
        (lonely_receiver, (store.port, timeout_s)),
    ], timeout_s=60)
    assert sender["error"] is not None and "could not rendezvous" in sender["error"]
    # (its own timeout, with slack for a loaded machine; not the store's 10 s)
    assert timeout_s * 0.9 <= sender["elapsed"] < 10
    assert present["error"] is not None


def dying_receiver(sync_port: int) -> None:
    _sync_group(sync_port, 2, 3, timeout_s=5)
    os._exit(17)  # joins the group, then vanishes before the version arrives


def steady_receiver(sync_port: int) -> dict:
    group = _sync_group(sync_port, 1, 3, timeout_s=5)
    rx = Receiver(group, lambda payload: None)
    result = rx.receive(begin_timeout_s=30)
    return {"ok": result.ok if result else None, "reason": result.reason if result else None,
            "broken": group.broken is not None}


def publishing_sender(sync_port: int) -> dict:
    group = _sync_group(sync_port, 0, 3, timeout_s=5)
    model = AwkwardModel(seed=1)
    publisher = Publisher(group, bucket_size=BUCKET_SIZE)
    started = time.monotonic()
    result = publisher.publish(1, named_tensors_of(model)).result(timeout_s=60)
    return {"ok": result.ok, "reason": result.reason, "elapsed": time.monotonic() - started}


def test_receiver_dying_mid_version_fails_the_version_without_hanging() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=10)
    sender, steady = _run_with_dying_peer(store.port)
    assert not sender["ok"] and sender["reason"]
    assert sender["elapsed"] < 45  # bounded by the collective timeouts (5 s, a few of them), never a hang
    assert steady["ok"] is False and steady["broken"]


def _run_with_dying_peer(port: int) -> tuple[dict, dict]:
    """The dying receiver runs outside run_processes, which would report its exit as a failure."""
    ctx = procs_context()
    dying = ctx.Process(target=dying_receiver, args=(port,), daemon=True)
    dying.start()
    try:
        sender, steady = run_processes([(publishing_sender, (port,)), (steady_receiver, (port,))], timeout_s=90)
    finally:
        dying.join(timeout=10)
    assert dying.exitcode == 17
    return sender, steady



def member(rank: int, port: int, generations: list[tuple[int, int]]) -> list:
    """Take part in each (generation, world_size) the rank belongs to: sender publishes, others receive."""
    out = []
    model = AwkwardModel(seed=rank)
    for generation, world in generations:
        group = _sync_group(port, rank, world, generation=generation)
        if rank == 0:
            publisher = Publisher(group, bucket_size=BUCKET_SIZE)
            result = publisher.publish(generation + 1, named_tensors_of(model)).result(timeout_s=60)
            publisher.close()
            out.append((result.ok, sorted(result.committed_ranks)))
        else:
            received = Receiver(group, lambda payload: load_into(model, payload.tensors)).serve()
            out.append([r.ok for r in received])
            group.close()
    return out


def test_group_is_rebuilt_for_new_membership_under_a_new_prefix() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=10)
    # generation 0: sender + receiver 1; generation 1: a second receiver joins.
    sender, first, second = run_processes([
        (member, (0, store.port, [(0, 2), (1, 3)])),
        (member, (1, store.port, [(0, 2), (1, 3)])),
        (member, (2, store.port, [(1, 3)])),
    ], timeout_s=120)
    assert sender == [(True, [1]), (True, [1, 2])]
    assert first == [[True], [True]] and second == [[True]]


def aborting_sender(port: int) -> list:
    group = _sync_group(port, 0, 3)
    model = AwkwardModel(seed=1)

    def hook(k: int, buf: torch.Tensor) -> torch.Tensor:
        if state["fail"] and k == 1:
            raise RuntimeError("device fell over while filling")
        return buf

    state = {"fail": True}
    publisher = Publisher(group, bucket_size=BUCKET_SIZE, wire_hook=hook)
    first = publisher.publish(1, named_tensors_of(model), mode="bypass_cpu").result(timeout_s=60)
    state["fail"] = False
    second = publisher.publish(2, named_tensors_of(model), mode="bypass_cpu").result(timeout_s=60)
    publisher.close()
    return [(first.ok, first.reason), (second.ok, second.reason)]


def recording_receiver(rank: int, port: int) -> list:
    model = AwkwardModel(seed=rank + 10)
    loaded: list[int] = []

    def load(payload: VersionPayload) -> None:
        load_into(model, payload.tensors)
        loaded.append(payload.version)

    results = Receiver(_sync_group(port, rank, 3), load).serve()
    return [(r.ok, r.reason) for r in results] + [loaded]


def test_sender_abort_mid_version_loads_nothing_and_the_group_stays_usable() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=10)
    sender, rx1, rx2 = run_processes([
        (aborting_sender, (store.port,)),
        (recording_receiver, (1, store.port)),
        (recording_receiver, (2, store.port)),
    ], timeout_s=120)
    assert sender[0][0] is False and "device fell over" in sender[0][1]
    assert sender[1] == (True, None)
    for rx in (rx1, rx2):
        (ok1, reason1), (ok2, _), loaded = rx
        assert not ok1 and "sender aborted version 1" in reason1 and "device fell over" in reason1
        assert ok2 and loaded == [2]


def growing_sender(port: int) -> list:
    group = _sync_group(port, 0, 2)
    publisher = Publisher(group, bucket_size=BUCKET_SIZE)
    tensors = {"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int64)}
    first = publisher.publish(1, NamedTensors(dict(tensors))).result(timeout_s=60)
    tensors["c"] = torch.full((5,), 7, dtype=torch.bfloat16)  # the model changed shape: a new layout
    second = publisher.publish(2, NamedTensors(dict(tensors))).result(timeout_s=60)
    third = publisher.publish(3, NamedTensors(dict(tensors))).result(timeout_s=60)  # same layout, not resent
    publisher.close()
    return [first.ok, second.ok, third.ok]


def names_receiver(port: int) -> list:
    seen: list[list[str]] = []
    Receiver(_sync_group(port, 1, 2), lambda payload: seen.append(sorted(payload.tensors))).serve()
    return seen


def test_layout_change_within_a_group_is_sent_again() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=10)
    sender, seen = run_processes([(growing_sender, (store.port,)), (names_receiver, (store.port,))], timeout_s=120)
    assert sender == [True, True, True]
    assert seen == [["a", "b"], ["a", "b", "c"], ["a", "b", "c"]]
