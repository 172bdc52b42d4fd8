"""The CUDA IPC same-host path between two processes on one GPU: a trainer publishing from CUDA parameters
and a colocated receiver mapping its device slots. Byte-identical in both modes, nothing retained over 50
versions, old slots released after they are replaced, and a corrupted bucket caught with either digest."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn

from ckpt_engine.plan.modes import mode_of
from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.colocated import IpcReceiver
from ckpt_engine.send.publisher import Publisher
from tests.gpu.common import WireLog, cuda, memory, perturb, requires_cuda, state_hashes
from tests.models import BUCKET_SIZE, AwkwardModel, load_into
from tests.procs import run_processes, start_processes

pytestmark = [pytest.mark.gpu, requires_cuda]
VERSIONS = 50
GROWN = 3  # versions after VERSIONS with a larger tensor: new, larger slots replace the old ones
BLOB = 4 << 20  # float32 elements: a 16 MiB tensor, so each shared slot holds a bucket of ~16 MiB (then ~48 MiB)
# Slots are as large as the layout's largest bucket, never larger than the bucket size (a larger tensor travels in
# pieces: issue 27). A bucket size above the grown model's bytes lets the one bucket, and so the slots, grow.
IPC_BUCKET_SIZE = 16 * BLOB  # bytes: 64 MiB
SAMPLE_AT = (10, VERSIONS)


class GpuModel(nn.Module):
    """The awkward test model plus one large tensor (sizes the shared slots)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.awkward = AwkwardModel(seed)
        self.blob = nn.Parameter(torch.randn(BLOB, generator=torch.Generator().manual_seed(seed)))


def ipc_trainer(hub: str) -> dict:
    device = cuda(0)
    model = GpuModel(seed=1).to(device.torch_device)
    wire = WireLog()
    publisher = Publisher(device=device, bucket_size=IPC_BUCKET_SIZE, ipc_hub_name=hub, timeout_s=30,
                          wire_hook=wire)
    publisher.attach(None, ipc_peers={"colocated": 1})
    grown = torch.zeros(2 * BLOB, device=device.torch_device)
    out: dict = {"results": [], "states": [], "memory": {}}
    for version in range(1, VERSIONS + GROWN + 1):
        if version % 2 == 1:  # odd versions cached, the next even one bypass_cpu with the same weights
            perturb(model, version)
            grown.add_(1)
        named = named_tensors_of(model)
        if version > VERSIONS:
            named.tensors["grown"] = grown
        wire.version = version
        result = publisher.publish(version, named, mode=mode_of(version % 2 == 0)).result(120)
        out["results"].append((result.ok, result.reason, result.committed_ranks, result.version_digest))
        out["states"].append(state_hashes(model))
        if version in SAMPLE_AT:
            out["memory"][version] = memory(device)
        if version == VERSIONS:
            out["slot_bytes_before"] = [slot.nbytes for slot in publisher.hub.slots]  # type: ignore[union-attr]
    out["memory"]["grown"] = memory(device)
    out["slot_bytes"] = [slot.nbytes for slot in publisher.hub.slots]  # type: ignore[union-attr]
    publisher.close()
    out["wire"] = wire.buckets
    return out


def ipc_rollout(hub: str) -> dict:
    device = cuda(0)
    model = GpuModel(seed=2).to(device.torch_device)
    out: dict = {"ok": [], "states": [], "memory": {}, "mapped": []}
    rx = IpcReceiver(hub, "colocated", 1, lambda p: load_into(model, p.tensors), device=device, timeout_s=30)
    while (result := rx.receive(120)) is not None:
        out["ok"].append((result.ok, result.reason))
        out["states"].append(state_hashes(model))
        out["mapped"].append(sorted(slot.data_ptr() for slot in rx.slots.values()))
        if len(out["ok"]) in SAMPLE_AT:
            out["memory"][len(out["ok"])] = memory(device)
    rx.close()
    return out


def test_cuda_ipc_is_byte_identical_and_releases_what_it_maps() -> None:
    hub = f"ckpt-gpu-test-{uuid.uuid4().hex[:8]}"
    trainer, rollout = run_processes([(ipc_trainer, (hub,)), (ipc_rollout, (hub,))], timeout_s=240)
    total = VERSIONS + GROWN
    assert [r[0] for r in trainer["results"]] == [True] * total, [r for r in trainer["results"] if not r[0]][:3]
    assert all(r[2] == [1] for r in trainer["results"])
    assert rollout["ok"] == [(True, None)] * total
    assert rollout["states"] == trainer["states"]  # the receiver holds exactly the trainer's weights
    wire, digests = trainer["wire"], [r[3] for r in trainer["results"]]
    for odd in range(1, total, 2):  # cached and bypass_cpu of the same weights: same bytes, same digest
        assert wire[odd] == wire[odd + 1] and digests[odd - 1] == digests[odd], odd
    assert len(set(digests[::2])) == len(digests[::2])

    # Nothing grows from version 10 to 50: device memory, file descriptors, /dev/shm entries, mappings.
    for side in (trainer, rollout):
        early, late = side["memory"][SAMPLE_AT[0]], side["memory"][SAMPLE_AT[1]]
        assert late["allocated"] - early["allocated"] <= 1 << 20, (early, late)
        assert late["fds"] <= early["fds"] + 2 and late["shm"] <= early["shm"], (early, late)
    assert len({tuple(m) for m in rollout["mapped"][:VERSIONS]}) == 1  # mapped once, reused for every version
    # Larger slots replaced the old ones: the old ones were unmapped and freed (not held for the receiver). The
    # slots hold the largest bucket: the blob's 16 MiB (4 * BLOB bytes) and the rest, then the grown tensor's 32 MiB.
    small, big = trainer["slot_bytes_before"][0], trainer["slot_bytes"][0]
    assert 4 * BLOB <= small < 5 * BLOB and big >= small + 8 * BLOB, (small, big)
    assert big <= IPC_BUCKET_SIZE and rollout["mapped"][-1] != rollout["mapped"][0]
    grown = trainer["memory"]["grown"]["allocated"] - trainer["memory"][VERSIONS]["allocated"]
    expected = 2 * (big - small)  # the tensor itself was allocated from the start
    assert grown <= expected + (4 << 20), f"{grown - expected} bytes more than the larger slots need"


def corrupting_trainer(hub: str, algo: str, corrupt: tuple[int, int] | None = (2, 1)) -> dict:
    device = cuda(0)
    model = AwkwardModel(seed=1).to(device.torch_device)
    wire = WireLog()
    wire.corrupt = corrupt  # (version, bucket) whose first byte flips on the wire
    publisher = Publisher(device=device, bucket_size=BUCKET_SIZE, ipc_hub_name=hub, timeout_s=30, wire_hook=wire,
                          digest_algo=algo)
    publisher.attach(None, ipc_peers={"colocated": 1})
    out = []
    for version, bypass in ((1, False), (2, True), (3, True)):
        perturb(model, version)
        wire.version = version
        result = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass)).result(60)
        out.append((result.ok, result.reason, state_hashes(model)))
    publisher.close()
    return {"versions": out}


def corrupting_rollout(hub: str) -> list:
    device = cuda(0)
    model = AwkwardModel(seed=2).to(device.torch_device)
    out = []
    rx = IpcReceiver(hub, "colocated", 1, lambda p: load_into(model, p.tensors), device=device, timeout_s=30)
    while (result := rx.receive(60)) is not None:
        out.append((result.ok, result.loaded, result.bad_tensors, state_hashes(model)))
    rx.close()
    return out


@pytest.mark.parametrize("algo", ["xxh3-64", "torch-block64"])
def test_a_cuda_receiver_verifies_either_digest_and_catches_a_flipped_byte(algo: str) -> None:
    """xxh3-64: a CUDA receiver of a CPU-hashing sender (both hash host copies of device bytes)."""
    hub = f"ckpt-gpu-test-{uuid.uuid4().hex[:8]}"
    trainer, rollout = run_processes([(corrupting_trainer, (hub, algo)), (corrupting_rollout, (hub,))],
                                     timeout_s=180)
    (ok1, _, state1), (ok2, reason2, _), (ok3, _, state3) = trainer["versions"]
    assert ok1 and ok3 and not ok2 and "rank 1" in reason2
    (r1, _, _, held1), (r2, loaded2, bad2, held2), (r3, _, _, held3) = rollout
    assert r1 and r3 and not r2 and not loaded2 and len(bad2) == 1
    assert held1 == state1 and held2 == state1 and held3 == state3  # the bad version never reached the model


def test_cuda_ipc_when_the_trainer_uses_expandable_segments(monkeypatch) -> None:
    """RL trainers often run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the shared slots come from
    that allocator then."""
    hub = f"ckpt-gpu-test-{uuid.uuid4().hex[:8]}"
    with monkeypatch.context() as env:  # a spawned process takes the environment it is started with
        env.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        trainer_run = start_processes([(corrupting_trainer, (hub, "torch-block64", None))])
    (rollout,) = run_processes([(corrupting_rollout, (hub,))], timeout_s=180)
    (trainer,) = trainer_run.collect(60)
    assert [v[0] for v in trainer["versions"]] == [True] * 3, [v[1] for v in trainer["versions"]]
    assert [r[3] for r in rollout] == [v[2] for v in trainer["versions"]]
