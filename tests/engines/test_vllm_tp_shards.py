"""Sharded delivery against a real vLLM 0.32 CPU engine with tensor_parallel_size=2 (issue 30, groundwork).

Each TP worker derives from its live layers the range of every checkpoint tensor it keeps
(workers/adapters/vllm/shards.py); the test sends it only those ranges, places each at its place in a tensor of
the full shape whose other elements are NaN (so a loader reading a byte it was not sent poisons the model), and
hands them to the model's own ``load_weights`` under vLLM's layerwise reload, as the engine path does. The tokens
must equal transformers' with the same weights, version after version, and each worker must receive less than
the whole model (counted).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(600)

from tests.engines.vllm_helpers import llama, make_llm, reference_tokens, save_model, vllm_tokens  # noqa: E402


def apply_only_my_ranges(self, seed: int) -> tuple[int, int, dict[str, str]]:
    """On every worker: this version's tensors cut to the worker's ranges, loaded; (bytes received, bytes of the
    version, tensors kept whole and why)."""
    from vllm.config import set_current_vllm_config

    from ckpt_engine.plan.shards import cut, placed
    from ckpt_engine.plan.tensors import named_tensors_of, specs_of
    from ckpt_engine.workers.adapters.vllm.shards import derive_spec
    from ckpt_engine.workers.adapters.vllm.worker import begin_reload, end_reload, load_version
    from tests.engines.vllm_helpers import llama as model_of

    model = self.model_runner.model
    named = named_tensors_of(model_of(seed))
    derived = derive_spec(model, specs_of(named.tensors))
    received, weights = 0, {}
    for name, tensor in named.tensors.items():
        slices = derived.spec.get(name)
        if not slices:
            weights[name] = tensor.clone()
            received += tensor.numel() * tensor.element_size()
            continue
        (part,) = slices
        piece = cut(tensor, part).clone()  # what the wire carries
        received += piece.numel() * piece.element_size()
        weights[name] = placed(piece, tuple(tensor.shape), part, rest=float("nan"))
    weights.update({alias: weights[canonical] for alias, canonical in named.aliases.items()})

    class Payload:
        def items(self):
            return iter(weights.items())

    with set_current_vllm_config(self.vllm_config):
        begin_reload(model)
        load_version(model, Payload())  # type: ignore[arg-type]
        end_reload(model, self.vllm_config.model_config)
    total = sum(t.numel() * t.element_size() for t in named.tensors.values())
    return received, total, derived.whole


def test_tp2_workers_load_only_their_ranges_and_generate_transformers_tokens(tmp_path: Path, monkeypatch) -> None:
    # one NUMA node and 2 cores here: no per-rank binding; a small KV cache; functions sent to the workers
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = make_llm(save_model(tmp_path / "model", 1), tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert vllm_tokens(llm) == reference_tokens(llama(1))
        for seed in (2, 3):
            out = llm.collective_rpc(apply_only_my_ranges, args=(seed,))
            assert vllm_tokens(llm) == reference_tokens(llama(seed))
            for received, total, whole in out:
                # 2 query heads, 1 KV head: k and v are replicated on both ranks; norms are whole on every rank
                assert received < 0.6 * total, (received, total)
                assert all("replicated" in why for why in whole.values()), whole
    finally:
        del llm


def test_a_tp2_engine_through_the_daemon_gets_only_its_slices(tmp_path: Path, monkeypatch) -> None:
    """The whole path: each TP worker of a real vLLM engine (worker extension, ``sharded=True``) declares the
    slices it keeps, the daemon makes each its own class, the trainer sends each only its pieces, each worker
    verifies its class's digest, the driver applies the version on both, and the tokens equal transformers'."""
    from ckpt_engine.workers.adapters.vllm import ExtensionControl, start_vllm_driver
    from tests.daemon_harness import start_daemon, write_config
    from tests.engines.test_vllm import _TIMEOUTS, receivers_of, sync, wait_for
    from tests.engines.vllm_helpers import TrainerLoop, hf_tensors

    for name, value in (("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        monkeypatch.setenv(name, value)
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_TIMEOUTS, bucket_size_mb=1))
    state = {"tensors": hf_tensors(llama(seed=1))}
    trainer = TrainerLoop(daemon.zmq, lambda: state["tensors"])
    llm = make_llm(save_model(tmp_path / "model", 1), tensor_parallel_size=2, distributed_executor_backend="mp",
                   worker_extension_cls="ckpt_engine.workers.adapters.vllm.CkptEngineWorkerExtension")
    control = ExtensionControl(llm)
    driver = start_vllm_driver(control, daemon.zmq, engine="vllm-tp2", sharded=True)
    try:
        with daemon.client() as http:
            workers = wait_for(lambda: len(receivers_of(http)) == 2 and receivers_of(http), 60, "both TP workers")
            assert len({w["shard_class"] for w in workers}) == 2 and all(w["sharded_tensors"] for w in workers)
            for seed in (2, 3):
                pushed = llama(seed=seed)
                state["tensors"] = hf_tensors(pushed)
                total = sum(t.numel() * t.element_size() for t in state["tensors"].tensors.values())
                record = sync(http)
                assert record["status"] == "committed", record
                assert driver.wait_for_version(record["id"], 60)
                with control.serving(timeout_s=120):
                    assert vllm_tokens(llm) == reference_tokens(pushed)
                entries = record["receivers"]
                assert len({e["shard_class"] for e in entries}) == 2, entries
                for entry in entries:  # (1 KV head: k and v replicated on both ranks; norms whole)
                    assert entry["ok"] and entry["bytes"] < 0.6 * total, (entry, total)
    finally:
        driver.close()
        trainer.close()
        llm.llm_engine.engine_core.shutdown()
        daemon.stop()
