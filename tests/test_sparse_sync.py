"""Sparse sync between real processes: only changed tensors travel, receivers end byte-equal, and a
receiver that does not hold the base refuses the version instead of loading a wrong model."""

from __future__ import annotations

import pytest

from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.collective import Receiver
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.transport.group import open_store
from tests.models import BUCKET_SIZE, AwkwardModel, load_into, state_bytes
from tests.procs import run_processes
from tests.test_sync_multiproc import _sync_group

pytestmark = pytest.mark.multiproc


def sparse_sender(port: int) -> dict:
    model = AwkwardModel(seed=1)
    publisher = Publisher(_sync_group(port, 0, 4), bucket_size=BUCKET_SIZE, keep_versions=4)
    out, states = [], []

    def publish(version: int, base: int | None) -> None:
        result = publisher.publish(version, named_tensors_of(model), sparse_base=base).result(60)
        out.append({"ok": result.ok, "reason": result.reason, "bytes": result.bytes_sent, "skipped":
                    result.tensors_skipped, "tensors": result.tensors, "base": result.base_version,
                    "digest": result.version_digest})
        states.append(state_bytes(model))

    publish(1, None)
    model.perturb(2, fraction=0.1)
    publish(2, 1)  # sparse against version 1, which the receivers hold
    model.perturb(3, fraction=0.1)
    publish(3, 1)  # wrong base: receivers hold version 2
    publish(4, 3)  # base 3 was never applied by them: refused as well
    publish(5, None)  # a full version heals everything
    model.perturb(6, fraction=0.5)
    publish(6, 5)
    publish(7, 6)  # nothing changed: no bucket goes, the version still commits
    full_bytes = publisher.layout_for(named_tensors_of(model)).total_bytes
    publisher.close()
    return {"results": out, "states": states, "full_bytes": full_bytes}


def plain_receiver(port: int, rank: int, stream: bool = False) -> dict:
    model = AwkwardModel(seed=rank + 20)
    states = {}

    def load(payload) -> None:
        tensors = dict(payload.items())  # (a streamed version: bucket by bucket)
        load_into(model, tensors) if not payload.sparse else _load_some(model, tensors)
        states[payload.version] = state_bytes(model)

    staging = {"staging": "stream", "streams": True} if stream else {}
    results = Receiver(_sync_group(port, rank, 4), load, **staging).serve()
    return {"results": [(r.version, r.ok, r.reason, r.version_digest) for r in results], "states": states}


def _load_some(model, tensors) -> None:
    import torch

    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)


def test_sparse_versions_send_only_changes_and_refuse_a_wrong_base() -> None:
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    sender, rx1, rx2, rx3 = run_processes([(sparse_sender, (store.port,)), (plain_receiver, (store.port, 1)),
                                           (plain_receiver, (store.port, 2)), (plain_receiver, (store.port, 3, True))],
                                          timeout_s=180)
    v1, v2, v3, v4, v5, v6, v7 = sender["results"]
    assert v1["ok"] and v1["skipped"] == 0 and v1["base"] is None
    assert v2["ok"] and v2["base"] == 1 and v2["skipped"] > 0.8 * (v2["skipped"] + v2["tensors"])
    assert v2["bytes"] < 0.25 * sender["full_bytes"]  # about the changed bytes, not the model
    assert not v3["ok"] and "applies to version 1" in v3["reason"] and "holds version 2" in v3["reason"]
    assert not v4["ok"]
    assert v5["ok"] and v5["base"] is None and v6["ok"] and v6["base"] == 5
    assert v7["ok"] and v7["base"] == 6 and v7["bytes"] == 0 and v7["digest"] == v6["digest"], v7
    for rx in (rx1, rx2, rx3):  # (device and stream staging)
        oks = [ok for _, ok, _, _ in rx["results"]]
        assert oks == [True, True, False, False, True, True, True], rx["results"]
        for index in (0, 1, 4, 5, 6):  # after every applied version, byte-equal to the trainer
            assert rx["states"][index + 1] == sender["states"][index]
        # the whole-model digest they report is the version's, also for sparse versions
        assert [d for _, ok, _, d in rx["results"] if ok] == [v["digest"] for v in (v1, v2, v5, v6, v7)]
