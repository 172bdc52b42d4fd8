"""The version cache on a CUDA machine: pinned host memory holding exactly the device bytes; and a gloo sync
group fed from CUDA parameters (a host wire), where cached and bypass_cpu put the same bytes on the wire."""

from __future__ import annotations

import pytest

from ckpt_engine.device import detect_device, host_empty
from ckpt_engine.plan.layout import plan_layout
from ckpt_engine.plan.modes import mode_of
from ckpt_engine.plan.tensors import named_tensors_of, specs_of
from ckpt_engine.receive.collective import Receiver
from ckpt_engine.send.cache import VersionCache
from ckpt_engine.send.publisher import Publisher
from tests.gpu.common import WireLog, cuda, perturb, requires_cuda, state_hashes, sync_group, tensor_hash
from tests.models import BUCKET_SIZE, AwkwardModel, load_into
from tests.procs import run_processes

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_the_cache_is_pinned_and_holds_the_device_bytes() -> None:
    device = cuda(0)
    assert device.pinned_memory and host_empty(4096, device).is_pinned()
    model = AwkwardModel(seed=3).to(device.torch_device)
    named = named_tensors_of(model)
    assert not named.tensors["transposed"].is_contiguous()  # a strided device source too
    layout = plan_layout(specs_of(named.tensors), BUCKET_SIZE)
    cache = VersionCache(device, keep_versions=1)
    for version in (1, 2, 3):  # later versions reuse the pooled buffer: still pinned
        perturb(model, version)
        cached = cache.snapshot(version, layout, named.tensors)
        assert cached.buffer.is_pinned() and cached.buffer.device.type == "cpu"
        for name, tensor in named.tensors.items():
            assert tensor_hash(cached.tensor(name)) == tensor_hash(tensor), (version, name)
    assert cache.allocations == 1
    publisher = Publisher(device=device, bucket_size=BUCKET_SIZE, keep_versions=1)
    assert publisher.cache.snapshot(1, layout, named.tensors).buffer.is_pinned()


def host_wire_sender(port: int) -> dict:
    device = detect_device("cuda", "gloo", index=cuda(0).index)  # CUDA parameters, gloo on host memory
    model = AwkwardModel(seed=1).to(device.torch_device)
    wire = WireLog()
    publisher = Publisher(sync_group(port, 0, 2, device), bucket_size=BUCKET_SIZE, wire_hook=wire)
    results, states = [], []
    for version, bypass in ((1, False), (2, True), (3, True), (4, False)):
        if version == 3:
            perturb(model, version)
        wire.version = version
        result = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass)).result(60)
        results.append((result.ok, result.reason, result.version_digest, result.mode))
        states.append(state_hashes(model))
    publisher.close()
    return {"results": results, "states": states, "wire": wire.buckets, "digest_algo": device.digest_algo}


def host_wire_receiver(port: int) -> dict:
    device = detect_device("cuda", "gloo", index=cuda(0).index)
    model = AwkwardModel(seed=9).to(device.torch_device)
    states = []
    results = Receiver(sync_group(port, 1, 2, device),
                       lambda p: (load_into(model, p.tensors), states.append(state_hashes(model)))).serve()
    return {"ok": [r.ok for r in results], "states": states}


def test_gloo_group_fed_from_cuda_parameters_cached_and_bypass_identical() -> None:
    from ckpt_engine.transport.group import open_store

    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    sender, receiver = run_processes([(host_wire_sender, (store.port,)), (host_wire_receiver, (store.port,))],
                                     timeout_s=180)
    assert sender["digest_algo"] == "xxh3-64"
    assert [r[0] for r in sender["results"]] == [True] * 4, sender["results"]
    assert [r[3] for r in sender["results"]] == ["cached", "bypass_cpu", "bypass_cpu", "cached"]
    wire, digests = sender["wire"], [r[2] for r in sender["results"]]
    assert wire[1] == wire[2] and wire[3] == wire[4] and wire[1] != wire[3]  # same weights, same bytes
    assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2]
    assert receiver["ok"] == [True] * 4 and receiver["states"] == sender["states"]
