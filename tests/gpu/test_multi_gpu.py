"""Two or more GPUs: an NCCL sync group of one sender and receivers (cached, bypass_cpu, a corrupted bucket,
both digests); a member that never joins or dies mid-version fails the version within the timeouts and the
sender lives on; a colocated receiver on another GPU than the trainer's (CUDA IPC across devices, with the
devices numbered differently in the two processes); two trainer ranks that each own, cache and broadcast a
share of every version (three GPUs: NCCL refuses two ranks of one group on one device)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

import pytest
import torch

from ckpt_engine.errors import SyncTimeoutError
from ckpt_engine.plan.modes import mode_of
from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.collective import Receiver
from ckpt_engine.receive.colocated import IpcReceiver
from ckpt_engine.send.publisher import Ownership, Publisher
from ckpt_engine.transport.group import open_store, owner_part
from tests.gpu.common import (
    WireLog,
    cuda,
    cuda_count,
    perturb,
    requires_2_gpus,
    state_hashes,
    sync_group,
    visible_devices,
)
from tests.models import BUCKET_SIZE, AwkwardModel, load_into
from tests.procs import run_processes, start_processes

pytestmark = [pytest.mark.gpu, requires_2_gpus]
TIMEOUT_S = 20.0
MAX_RECEIVERS = 3


def nccl_sender(port: int, world: int, algo: str) -> dict:
    device = cuda(0)
    assert device.backend == "nccl"
    model = AwkwardModel(seed=1).to(device.torch_device)
    wire = WireLog()
    wire.corrupt = (3, 1)
    publisher = Publisher(sync_group(port, 0, world, device, TIMEOUT_S), bucket_size=BUCKET_SIZE, wire_hook=wire,
                          digest_algo=algo)
    out = []
    for version, bypass in ((1, False), (2, True), (3, False), (4, True)):
        if version in (3, 4):
            perturb(model, version)
        wire.version = version
        result = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass)).result(120)
        out.append({"ok": result.ok, "reason": result.reason, "ranks": sorted(result.committed_ranks),
                    "digest": result.version_digest, "state": state_hashes(model)})
    publisher.close()
    return {"versions": out, "wire": wire.buckets}


def nccl_receiver(port: int, world: int, rank: int) -> list:
    device = cuda(rank)
    model = AwkwardModel(seed=10 + rank).to(device.torch_device)
    out = []
    rx = Receiver(sync_group(port, rank, world, device, TIMEOUT_S), lambda p: load_into(model, p.tensors))
    while (result := rx.receive(TIMEOUT_S)) is not None:
        out.append((result.ok, result.loaded, result.bad_tensors, state_hashes(model)))
        if rx.group.broken is not None:
            break
    return out


@pytest.mark.parametrize("algo", ["torch-block64", "xxh3-64"])
def test_nccl_sync_group_of_a_sender_and_receivers(algo: str) -> None:
    world = min(cuda_count(), 1 + MAX_RECEIVERS)
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    sender, *receivers = run_processes([(nccl_sender, (store.port, world, algo))]
                                       + [(nccl_receiver, (store.port, world, r)) for r in range(1, world)],
                                       timeout_s=240)
    v1, v2, v3, v4 = sender["versions"]
    for v in (v1, v2, v4):
        assert v["ok"] and v["ranks"] == list(range(1, world)), v["reason"]
    assert not v3["ok"]
    assert sender["wire"][1] == sender["wire"][2] and v1["digest"] == v2["digest"]  # cached == bypass_cpu
    for rx in receivers:
        assert [r[0] for r in rx] == [True, True, False, True]
        assert rx[0][3] == v1["state"] and rx[1][3] == v2["state"] and rx[3][3] == v4["state"]
        assert not rx[2][1] and len(rx[2][2]) == 1 and rx[2][3] == v2["state"]  # caught, not loaded


def lonely_member(port: int, rank: int) -> dict:
    started = time.monotonic()
    try:
        sync_group(port, rank, 3, cuda(rank), timeout_s=5.0)
    except SyncTimeoutError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - started}
    return {"error": None, "elapsed": time.monotonic() - started}


def test_an_nccl_member_that_never_joins_fails_the_others_within_the_timeout() -> None:
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    members = run_processes([(lonely_member, (store.port, 0)), (lonely_member, (store.port, 1))], timeout_s=90)
    for member in members:
        assert member["error"] is not None and "could not rendezvous" in member["error"]
        assert member["elapsed"] < 5.0 + 10


def surviving_sender(port: int) -> dict:
    device = cuda(0)
    publisher = Publisher(sync_group(port, 0, 2, device, timeout_s=8.0), bucket_size=BUCKET_SIZE)
    started = time.monotonic()
    result = publisher.publish(1, named_tensors_of(AwkwardModel(seed=1).to(device.torch_device))).result(60)
    elapsed = time.monotonic() - started
    publisher.close()
    alive = torch.ones(4, device=device.torch_device).add_(1).sum().item()  # this process and its GPU work on
    return {"ok": result.ok, "reason": result.reason, "elapsed": elapsed, "alive": alive == 8.0}


def dying_member(port: int) -> None:
    sync_group(port, 1, 2, cuda(1), timeout_s=8.0)
    os._exit(17)  # joins (the communicator is built), then vanishes before the version arrives


def test_a_receiver_dying_fails_the_version_and_the_nccl_sender_lives() -> None:
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    ctx = mp.get_context("spawn")
    dying = ctx.Process(target=dying_member, args=(store.port,), daemon=True)
    dying.start()
    try:
        (sender,) = run_processes([(surviving_sender, (store.port,))], timeout_s=120)
    finally:
        dying.join(30)
    assert dying.exitcode == 17
    assert not sender["ok"] and sender["reason"] and sender["alive"]
    assert sender["elapsed"] < 8.0 * 3 + 10  # bounded by the collective timeouts


def cross_gpu_trainer(hub: str) -> dict:
    device = cuda(0)
    model = AwkwardModel(seed=1).to(device.torch_device)
    publisher = Publisher(device=device, bucket_size=BUCKET_SIZE, ipc_hub_name=hub, timeout_s=30)
    publisher.attach(None, ipc_peers={"other-gpu": 1})
    out = []
    for version, bypass in ((1, False), (2, True), (3, False)):
        perturb(model, version)
        result = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass)).result(60)
        out.append((result.ok, result.reason, state_hashes(model)))
    publisher.close()
    return {"versions": out, "uuid": str(torch.cuda.get_device_properties(0).uuid)}


def cross_gpu_rollout(hub: str) -> dict:
    device = cuda(0)  # started with the two GPUs swapped: the trainer's GPU is index 1 here
    model = AwkwardModel(seed=2).to(device.torch_device)
    out = []
    rx = IpcReceiver(hub, "other-gpu", 1, lambda p: load_into(model, p.tensors), device=device, timeout_s=30)
    while (result := rx.receive(60)) is not None:
        out.append((result.ok, result.reason, state_hashes(model)))
    slots = sorted({slot.device.index for slot in rx.slots.values()})
    rx.close()
    return {"versions": out, "slot_devices": slots, "own": str(torch.cuda.get_device_properties(0).uuid)}


def test_a_colocated_receiver_on_another_gpu_maps_the_trainers_slots(monkeypatch) -> None:
    hub = f"ckpt-gpu-test-{uuid.uuid4().hex[:8]}"
    first, second = visible_devices()[:2]
    with monkeypatch.context() as env:  # a spawned process takes the environment it is started with
        env.setenv("CUDA_VISIBLE_DEVICES", f"{second},{first}")
        rollout_run = start_processes([(cross_gpu_rollout, (hub,))])
    trainer_run = start_processes([(cross_gpu_trainer, (hub,))])
    (trainer,) = trainer_run.collect(180)
    (rollout,) = rollout_run.collect(60)
    assert rollout["own"] != trainer["uuid"]
    assert rollout["slot_devices"] == [1]  # the trainer's GPU, as this process numbers it
    for (ok, reason, state), (rok, rreason, held) in zip(trainer["versions"], rollout["versions"]):
        assert ok and rok, (reason, rreason)
        assert held == state


def owner_rank(port: int, rank: int) -> dict:
    """Trainer rank ``rank`` of 2 on GPU ``rank``: the same model on both (as after the gathers), each owning
    its share; its own group with the receiver on GPU 2, and the owners' group."""
    device = cuda(rank)
    model = AwkwardModel(seed=1).to(device.torch_device)
    group = sync_group(port, 0, 2, device, TIMEOUT_S, part=owner_part(rank))
    owners = sync_group(port, rank, 2, device, TIMEOUT_S, part="owners/")
    publisher = Publisher(group, bucket_size=BUCKET_SIZE // 4, keep_versions=2)
    publisher.attach(group, {}, owners)
    out = []
    for version, bypass in ((1, False), (2, True), (3, False)):
        if version == 3:
            perturb(model, version)
        result = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass),
                                   ownership=Ownership(rank, 2)).result(120)
        out.append({"ok": result.ok, "reason": result.reason, "digest": result.version_digest,
                    "state": state_hashes(model), "cache_bytes": publisher.cache.bytes_held})
    publisher.close()
    return {"versions": out}


def owners_receiver(port: int) -> list:
    device = cuda(2)
    model = AwkwardModel(seed=12).to(device.torch_device)
    groups = [sync_group(port, 1, 2, device, TIMEOUT_S, part=owner_part(o)) for o in range(2)]
    rx = Receiver(groups, lambda p: load_into(model, p.tensors))
    out = []
    while (result := rx.receive(TIMEOUT_S)) is not None:
        out.append((result.ok, result.reason, state_hashes(model)))
    return out


@pytest.mark.skipif(cuda_count() < 3, reason=f"needs 3 CUDA devices, this machine has {cuda_count()}")
def test_two_trainer_ranks_as_owners_of_one_version() -> None:
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    lead, other, received = run_processes([(owner_rank, (store.port, 0)), (owner_rank, (store.port, 1)),
                                           (owners_receiver, (store.port,))], timeout_s=240)
    assert len(received) == 3
    for v, w, (ok, reason, state) in zip(lead["versions"], other["versions"], received):
        assert v["ok"] and w["ok"] and ok, (v["reason"], w["reason"], reason)
        assert state == v["state"]
    assert lead["versions"][0]["digest"] == lead["versions"][1]["digest"]  # cached == bypass_cpu
    assert lead["versions"][2]["cache_bytes"] > 0 and other["versions"][2]["cache_bytes"] > 0
