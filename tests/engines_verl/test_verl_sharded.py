"""Sharded delivery to verl's rollout workers (issue 37), through the real verl 0.9.1 backend: 2 actor ranks and
2 rollout workers as the 2 TP ranks of one vLLM replica (``sharded: true``, ``tensor_parallel_size: 2``). Each
worker derives from the model's config.json and checkpoint the ranges vLLM's parallel layers of its TP rank load
(workers/adapters/verl/shards.py), receives only those (about half the bytes), byte-exact against the trainer's
slices, and hands verl's loader each range at its place in a tensor of the checkpoint's full shape."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl tests run in scripts/test-verl.sh's environment")

from ckpt_engine.plan.shards import Slice, cut, spec_from_wire
from ckpt_engine.server.launch import start_daemon, write_config
from tests.engines_verl.verl_harness import LLAMA, Cluster, fingerprint, llama_weights, save_llama

pytestmark = pytest.mark.multiproc
TIMEOUTS = {"timeout_s": 60.0, "load_timeout_s": 60.0}


def expected_spec(tp_rank: int) -> dict[str, tuple[Slice, ...]]:
    """What vLLM's layers of TP rank ``tp_rank`` of 2 load of LLAMA, worked out by hand: 2 of the 4 query heads
    (16 rows each), 1 of the 2 KV heads, half the MLP width, half the attention width of o_proj's columns, and
    the vocabulary padded to 256 and split evenly (rank 0 rows 0-127, rank 1 the 72 rows 128-199)."""
    vocab = Slice(0, 0, 128) if tp_rank == 0 else Slice(0, 128, 72)
    spec = {"model.embed_tokens.weight": (vocab,), "lm_head.weight": (vocab,)}
    for layer in range(LLAMA["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        spec.update({f"{prefix}.self_attn.q_proj.weight": (Slice(0, 32 * tp_rank, 32),),
                     f"{prefix}.self_attn.k_proj.weight": (Slice(0, 16 * tp_rank, 16),),
                     f"{prefix}.self_attn.v_proj.weight": (Slice(0, 16 * tp_rank, 16),),
                     f"{prefix}.self_attn.o_proj.weight": (Slice(1, 32 * tp_rank, 32),),
                     f"{prefix}.mlp.gate_proj.weight": (Slice(0, 48 * tp_rank, 48),),
                     f"{prefix}.mlp.up_proj.weight": (Slice(0, 48 * tp_rank, 48),),
                     f"{prefix}.mlp.down_proj.weight": (Slice(1, 48 * tp_rank, 48),)})
    return spec


def _check_sliced(sync: dict, steps: int) -> list[int]:
    """Every rollout worker got exactly its TP rank's slices of the trainer's tensors; returns their bytes."""
    weights = llama_weights(steps)
    total = sum(t.numel() * t.element_size() for _, t in weights)
    received = []
    for actor in sync["actors"]:
        assert "raised" not in actor, actor
    for tp_rank, rollout in enumerate(sync["rollouts"]):
        assert "raised" not in rollout, rollout
        spec = spec_from_wire(rollout["spec"])
        assert spec == expected_spec(tp_rank), spec
        # byte-exact against the trainer's own slices, under the checkpoint's names and full shapes
        assert rollout["received"] == fingerprint([(n, cut(t, spec[n][0]) if n in spec else t) for n, t in weights])
        assert rollout["shapes"] == [tuple(t.shape) for _, t in weights]
        assert 0.4 * total < rollout["bytes"] < 0.6 * total, (rollout["bytes"], total)  # (norms go whole to both)
        received.append(rollout["bytes"])
    return received


def test_tp2_rollout_workers_each_receive_only_their_slices(tmp_path: Path) -> None:
    model = save_llama(tmp_path / "model")
    cluster = Cluster(2, 2, {"sharded": True, "tensor_parallel_size": 2, "model_path": model, **TIMEOUTS})
    try:
        for steps in (1, 2):
            sync = cluster.update_weights(steps, model="llama")
            _check_sliced(sync, steps)
            versions = {r["version"] for r in sync["rollouts"]}
            assert versions == {sync["actors"][0]["metrics"]["ckpt_engine/version"]}
            sent = [a["metrics"][f"ckpt_engine/bytes_sent_rank{rank}"] for rank, a in enumerate(sync["actors"])]
            assert all(s > 0 for s in sent), sent  # both actor ranks own buckets and send each class its pieces
    finally:
        cluster.close()


def test_sharded_verl_syncs_with_a_daemon_are_judged_by_class_and_roll_back(tmp_path: Path) -> None:
    model = save_llama(tmp_path / "model")
    daemon = start_daemon(write_config(tmp_path, transport="collective", keep_versions=2))
    cluster = None
    try:
        http = daemon.client()
        cluster = Cluster(2, 2, {"endpoint": daemon.zmq, "sharded": True, "tensor_parallel_size": 2,
                                 "model_path": model, **TIMEOUTS})
        versions = []
        for steps in (1, 2):
            sync = cluster.update_weights(steps, model="llama")
            received = _check_sliced(sync, steps)
            version = sync["actors"][0]["metrics"]["ckpt_engine/version"]
            record = http.get(f"/versions/{version}").json()
            assert record["status"] == "committed", record
            entries = record["receivers"]
            assert len({e["shard_class"] for e in entries}) == 2, entries  # one class per TP rank
            assert len({e["version_digest"] for e in entries}) == 2  # each its class's own digest
            assert sorted(e["bytes"] for e in entries) == sorted(received), (entries, received)
            versions.append(version)
        workers = [a for a in http.get("/receivers").json()["agents"] if a["role"] == "receiver"]
        assert len({a["shard_class"] for a in workers}) == 2 and all(a["sharded_tensors"] for a in workers)

        # a rollback to the first version reaches each TP rank as its slices of that version
        push = http.post(f"/versions/{versions[0]}/push")
        assert push.status_code == 202, push.text
        deadline = time.monotonic() + 30
        while http.get("/status").json()["queued_push"] != push.json()["version"] and time.monotonic() < deadline:
            time.sleep(0.2)
        sync = cluster.update_weights(3, model="llama")
        for tp_rank, rollout in enumerate(sync["rollouts"]):
            spec = expected_spec(tp_rank)
            assert rollout["received"] == fingerprint([(n, cut(t, spec[n][0]) if n in spec else t)
                                                       for n, t in llama_weights(1)]), tp_rank
        record = http.get(f"/versions/{push.json()['version']}").json()
        assert record["status"] == "committed" and record["source_version"] == versions[0], record
    finally:
        if cluster is not None:
            cluster.close()
        daemon.stop()


def test_the_derivation_as_a_table(tmp_path: Path, monkeypatch) -> None:
    """TP 4 over 2 KV heads: each KV head is replicated on 2 ranks, as vLLM's QKVParallelLinear does; the padded
    vocabulary (256) in 4 ranges, the last one 8 rows; a size vLLM cannot split, or a model outside the family,
    is refused by name."""
    import json

    from ckpt_engine.errors import ConfigError
    from ckpt_engine.workers.adapters.verl.shards import tp_rank_of_this_worker, worker_shards

    model = save_llama(tmp_path / "model")
    for rank in range(4):
        shards = worker_shards(model, rank, 4)
        spec = shards.spec
        assert spec["model.layers.0.self_attn.q_proj.weight"] == (Slice(0, 16 * rank, 16),)
        assert spec["model.layers.0.self_attn.k_proj.weight"] == (Slice(0, 16 * (rank // 2), 16),)
        assert spec["model.layers.1.mlp.down_proj.weight"] == (Slice(1, 24 * rank, 24),)
        assert spec["lm_head.weight"] == ((Slice(0, 64 * rank, 64),) if rank < 3 else (Slice(0, 192, 8),))
        norms = ("input_layernorm", "post_attention_layernorm")
        assert set(shards.whole) == {"model.norm.weight",
                                     *(f"model.layers.{n}.{norm}.weight" for n in (0, 1) for norm in norms)}
        assert shards.shapes["lm_head.weight"] == (200, 64)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        worker_shards(model, 0, 3)
    config = json.loads((Path(model) / "config.json").read_text())
    (Path(model) / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        worker_shards(model, 0, 2)
    monkeypatch.setenv("RANK", "5")  # verl's worker rank 5: TP rank 1 of the third replica of TP 2
    assert tp_rank_of_this_worker(2) == 1
