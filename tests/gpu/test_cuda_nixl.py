"""The nixl transport on one GPU: a rollout process pulls every version from the trainer over NIXL (UCX picks
cuda_ipc / cuda_copy itself) into device staging, cached (from the pinned cache) and bypass_cpu (from the
trainer's device send slots), and holds exactly the trainer's weights. Skipped without NIXL."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckpt_engine.codec import decode, encode
from ckpt_engine.plan.modes import mode_of
from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.assembly import VersionAssembler
from ckpt_engine.receive.pulled import pull
from ckpt_engine.send.publisher import Publisher, Route
from ckpt_engine.server.decisions.assignments import pull_assignments
from ckpt_engine.transport.messages import PullOffer
from ckpt_engine.transport.nixl import NixlEndpoint, nixl_missing
from ckpt_engine.workers.pull_server import PullServer
from tests.gpu.common import cuda, perturb, requires_cuda, state_hashes
from tests.models import BUCKET_SIZE, AwkwardModel, load_into
from tests.procs import run_processes

pytestmark = [pytest.mark.gpu, requires_cuda]
VERSIONS = 6  # odd versions cached, even ones bypass_cpu


def _store(port: int, master: bool = False) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=master, timeout=timedelta(seconds=120))


def nixl_trainer(port: int) -> dict:
    device = cuda(0)
    store = _store(port)
    model = AwkwardModel(seed=1).to(device.torch_device)
    publisher = Publisher(device=device, bucket_size=BUCKET_SIZE, keep_versions=2, timeout_s=60)
    pulls = PullServer()
    route = Route(None, {})  # (pullers only)
    out: dict = {"states": [], "sent": []}
    for version in range(1, VERSIONS + 1):
        perturb(model, version)
        bypass = version % 2 == 0
        transfer = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass), route=lambda: route,
                                     pulled=True)
        pulls.release(before=version)
        if bypass:  # (offered once the send kept its device slots)
            transfer.result(60)
            offer = pulls.offer(publisher.cache, version, None, device.digest_algo, 60, publisher.own_digests,
                                kept=publisher.kept(version))
        else:
            offer = pulls.offer(publisher.cache, version, None, device.digest_algo, 60, publisher.own_digests)
        store.set(f"offer/{version}", encode(offer))
        out["states"].append(state_hashes(model))
        store.get(f"done/{version}")
        sent = transfer.result(60)
        out["sent"].append((sent.ok, sent.reason))
        out["regions"] = [s.region.mem for s in offer.sources]
    pulls.close()
    publisher.close()
    return out


def nixl_rollout(port: int) -> dict:
    device = cuda(0)
    store = _store(port)
    model = AwkwardModel(seed=2).to(device.torch_device)
    assembler = VersionAssembler(device, lambda payload: load_into(model, payload.tensors), staging="device")
    endpoint = NixlEndpoint("rollout")
    out: dict = {"ok": [], "states": []}
    for version in range(1, VERSIONS + 1):
        offer = decode(PullOffer, store.get(f"offer/{version}"))
        mode = "bypass_cpu" if version % 2 == 0 else "cached"
        [(_, assignment)] = pull_assignments(version, mode, None, {"rollout": 1}, offer)
        result = pull(assembler, endpoint, assignment.offer, 60)  # type: ignore[arg-type]
        out["ok"].append((result.ok, result.reason))
        out["states"].append(state_hashes(model))
        store.set(f"done/{version}", json.dumps(result.ok))
    endpoint.close()
    return out


def test_a_rollout_process_pulls_every_version_over_nixl_byte_exact() -> None:
    missing = nixl_missing()
    if missing:
        pytest.skip(missing)
    master = _store(0, master=True)
    trainer, rollout = run_processes([(nixl_trainer, (master.port,)), (nixl_rollout, (master.port,))], timeout_s=240)
    assert trainer["sent"] == [(True, None)] * VERSIONS
    assert rollout["ok"] == [(True, None)] * VERSIONS
    assert rollout["states"] == trainer["states"]  # the rollout holds exactly the trainer's weights, each version
    assert trainer["regions"] == ["VRAM"]  # the last (bypass_cpu) version was read from device memory
