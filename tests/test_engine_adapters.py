"""SGLang and vLLM adapters against local fake servers that enforce those servers' endpoints and request
schemas and really receive the tensors over the update group (gloo standing in for NCCL)."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import time
from typing import Iterator

import httpx
import pytest
import torch
from torch import nn

from ckpt_engine.device import detect_device
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.receiver import VersionPayload
from ckpt_engine.tensors import named_tensors_of
from ckpt_engine.workers.adapters.push_group import PushGroup, PushSettings
from ckpt_engine.workers.adapters.sglang import EngineUpdateError, SGLangAdapter
from ckpt_engine.workers.adapters.vllm import CkptEngineWorkerExtension, VLLMWeightTransferClient
from tests.daemon_harness import ROOT, free_port
from tests.tiny_lm import tiny_llama

pytestmark = pytest.mark.multiproc


@contextlib.contextmanager
def fake_server(module: str, *flags: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *flags], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/_fake/state", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(f"{module} did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def payload(version: int = 7) -> VersionPayload:
    model = tiny_llama(seed=3)
    named = named_tensors_of(model)
    tensors = dict(named.tensors)
    for alias, canonical in named.aliases.items():
        tensors[alias] = tensors[canonical]  # as the receiver hands them over: one object under both names
    return VersionPayload(version=version, step=70, mode="cached", version_digest="x", tensors=tensors)


def sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())).hexdigest()


def push_settings(chunk_bytes: int = 64 << 10) -> PushSettings:
    return PushSettings("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=30, chunk_bytes=chunk_bytes)


def cpu_group(settings: PushSettings) -> PushGroup:
    return PushGroup(settings, detect_device("cpu", "gloo"))


def test_sglang_update_flow_in_order_with_version_label() -> None:
    version = payload()
    with fake_server("tests.fakes.fake_sglang") as url:
        settings = push_settings()
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()
        adapter.load(version)
        state = httpx.get(f"{url}/_fake/state").json()
        adapter.close()
    calls = [c["call"] for c in state["calls"]]
    assert calls[:2] == ["init_weights_update_group", "pause_generation"] and calls[-1] == "continue_generation"
    updates = [c for c in state["calls"] if c["call"] == "update_weights_from_distributed"]
    assert len(updates) > 1 and len(calls) == len(updates) + 3
    assert all(u["weight_version"] == "7" for u in updates)
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
    assert "lm_head.weight" not in state["checksums"]  # the tied alias is pushed once, under its first name
    expected = {name: sha(t) for name, t in version.tensors.items() if name != "lm_head.weight"}
    assert state["checksums"] == expected and state["weight_version"] == "7" and not state["paused"]


def test_sglang_refused_update_is_a_failure_and_generation_resumes() -> None:
    with fake_server("tests.fakes.fake_sglang", "--fail-update") as url:
        settings = push_settings()
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()
        with pytest.raises(EngineUpdateError, match="injected failure"):
            adapter.load(payload())
        state = httpx.get(f"{url}/_fake/state").json()
        adapter.close()
    assert state["calls"][-1]["call"] == "continue_generation" and not state["paused"]
    assert adapter.version is None and state["weight_version"] is None


def test_vllm_native_flow_publishes_the_label_after_finish() -> None:
    version = payload(9)
    with fake_server("tests.fakes.fake_vllm") as url:
        settings = push_settings()
        client = VLLMWeightTransferClient(url, settings, group=cpu_group(settings))
        client.connect()
        client.load(version)
        label = client.weight_version()
        state = httpx.get(f"{url}/_fake/state").json()
        client.close()
    calls = [c["call"] for c in state["calls"]]
    assert calls[:3] == ["init_weight_transfer_engine", "pause", "start_weight_update"]
    assert calls[-2:] == ["finish_weight_update", "resume"] and calls.count("update_weights") > 1
    assert state["calls"][-2]["weight_version"] == "9" and label == "9"
    expected = {name: sha(t) for name, t in version.tensors.items() if name != "lm_head.weight"}
    assert state["checksums"] == expected


def test_vllm_failed_finish_keeps_the_old_label_and_resumes() -> None:
    with fake_server("tests.fakes.fake_vllm", "--fail-finish") as url:
        settings = push_settings()
        client = VLLMWeightTransferClient(url, settings, group=cpu_group(settings))
        client.connect()
        with pytest.raises(EngineUpdateError, match="HTTP 500"):
            client.load(payload(9))
        assert client.weight_version() == "default"
        state = httpx.get(f"{url}/_fake/state").json()
        client.close()
    assert state["calls"][-1]["call"] == "resume" and not state["paused"] and client.version is None


def test_vllm_client_detects_a_server_without_the_native_api() -> None:
    with fake_server("tests.fakes.fake_sglang") as url:  # no /weight_info there
        settings = push_settings()
        client = VLLMWeightTransferClient(url, settings, group=cpu_group(settings))
        assert not client.supported()
        with pytest.raises(EngineUpdateError, match="no native weight-transfer API"):
            client.connect()
        client.close()


class VLLMStyleModel(nn.Module):
    """vLLM's model contract: load_weights(iterable of (name, tensor)) -> names it loaded."""

    def __init__(self, inner: nn.Module, skip: set[str] = frozenset()) -> None:
        super().__init__()
        self.inner = inner
        self.skip = skip

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name in self.skip:
                    continue
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


class _Runner:
    def __init__(self, model: nn.Module) -> None:
        self.model = model


class FakeWorker(CkptEngineWorkerExtension):
    def __init__(self, model: nn.Module) -> None:
        self.model_runner = _Runner(model)


def test_worker_extension_loads_through_load_weights() -> None:
    version = payload(4)
    worker = FakeWorker(VLLMStyleModel(tiny_llama(seed=11)))
    worker.ckpt_engine_load(version)
    params = dict(worker.model_runner.model.inner.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in version.tensors.items() if n in params)
    assert worker.ckpt_engine_status()["version"] == 4


def test_worker_extension_reports_tensors_the_model_did_not_take() -> None:
    worker = FakeWorker(VLLMStyleModel(tiny_llama(seed=11), skip={"model.norm.weight"}))
    with pytest.raises(CkptEngineError, match="did not load 1 tensor"):
        worker.ckpt_engine_load(payload(5))
