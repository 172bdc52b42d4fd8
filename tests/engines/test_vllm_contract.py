"""The ckpt_engine backend against the contract of the vLLM installed here, without starting an engine: vLLM
0.32 (the CPU build the other engine tests run) and 0.33 (the GPU build, where they cannot run here) share the
worker-side contract, and this is what fails first when a vLLM release changes it."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the engine tests run in scripts/test-engines.sh's environment")

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from ckpt_engine.workers.adapters.vllm.backend import (
    CkptEngineInitInfo,
    CkptEngineUpdateInfo,
    CkptEngineWeightTransferEngine,
)
from ckpt_engine.workers.adapters.vllm.plugin import register


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_engine_implements_vllms_engine_as_declared() -> None:
    assert not inspect.isabstract(CkptEngineWeightTransferEngine)
    for name in ("__init__", *WeightTransferEngine.__abstractmethods__):
        ours, theirs = getattr(CkptEngineWeightTransferEngine, name), getattr(WeightTransferEngine, name)
        assert parameters(ours) == parameters(theirs), name


def test_vllms_factory_builds_the_engine_and_parses_what_the_driver_sends() -> None:
    register()
    register()  # vLLM loads plugins more than once in a process
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=2, data_parallel_size=1),
                                  model_config=object())
    model = torch.nn.Linear(2, 2)
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="ckpt_engine"), vllm_config,
                                                       torch.device("cpu"), model)
    assert isinstance(engine, CkptEngineWeightTransferEngine) and engine.model is model
    init = engine.parse_init_info({"endpoint": "tcp://127.0.0.1:9", "engine": "e", "token": "t", "engine_key": "k",
                                   "poll_wait_s": 1.0, "take_timeout_s": 60.0, "staging": "host"})
    assert isinstance(init, CkptEngineInitInfo) and init.staging == "host"
    assert engine.parse_update_info({"version": 3}) == CkptEngineUpdateInfo(version=3)
    with pytest.raises(ValueError, match="Invalid init_info"):
        engine.parse_init_info({"endpoint": "tcp://127.0.0.1:9", "engine": "e", "unknown": 1})
    engine.shutdown()
