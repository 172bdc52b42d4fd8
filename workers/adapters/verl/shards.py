"""Sharded delivery to verl's rollout workers: what each one keeps of every checkpoint tensor.

verl's vLLM rollout runs vLLM's own parallel layers: each of verl's rollout workers (a CheckpointEngineWorker)
feeds the vLLM worker on its GPU, TP rank ``RANK % tensor_parallel_size`` of its replica, whose loaders read
one contiguous range of each checkpoint tensor. The worker holds no vLLM model to read its layers from (vLLM
runs in other processes), so the layers' attributes are computed here from the model's ``config.json`` as
vLLM's constructors compute them (QKVParallelLinear's per-rank and replicated KV heads, MergedColumnParallel's
output sizes, VocabParallelEmbedding's padded vocabulary ranges), and the ranges come from the same rules the
vLLM path applies to live layers (workers/adapters/vllm/shards.py ``layer_range``). Checkpoint names are
mapped to layers the way vLLM's Llama-family models stack them (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``), for the architectures listed in ``FAMILY``; any other tensor is kept whole, with the reason.

Only tensor parallelism within a replica (pipeline and data-parallel sizes 1), unquantized weights.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.layout import TensorSpec
from ckpt_engine.plan.shards import Slice
from ckpt_engine.workers.adapters.vllm.shards import checkpoint_specs, layer_range

# Architectures whose vLLM model uses these layers for these checkpoint names (vllm/model_executor/models/
# llama.py, and qwen2.py, qwen3.py, mistral through llama.py)
FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

# checkpoint name suffix -> (kind of vLLM layer, shard id in its fused parameter)
_RULES = ((re.compile(r"(^|\.)embed_tokens\.weight$"), ("vocab", None)),
          (re.compile(r"(^|\.)lm_head\.weight$"), ("vocab", None)),
          (re.compile(r"\.self_attn\.q_proj\.(weight|bias)$"), ("qkv", "q")),
          (re.compile(r"\.self_attn\.k_proj\.(weight|bias)$"), ("qkv", "k")),
          (re.compile(r"\.self_attn\.v_proj\.(weight|bias)$"), ("qkv", "v")),
          (re.compile(r"\.self_attn\.o_proj\.(weight|bias)$"), ("o", None)),
          (re.compile(r"\.mlp\.gate_proj\.weight$"), ("merged", 0)),
          (re.compile(r"\.mlp\.up_proj\.weight$"), ("merged", 1)),
          (re.compile(r"\.mlp\.down_proj\.weight$"), ("down", None)))


@dataclass
class WorkerShards:
    """A rollout worker's shard spec, the checkpoint's full shapes (where its pieces are placed for verl's
    loader), and why each tensor it keeps whole is kept whole."""

    tp_rank: int
    tp_size: int
    spec: dict[str, tuple[Slice, ...]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)


def tp_rank_of_this_worker(tp_size: int) -> int:
    """This rollout worker's TP rank in its replica: verl's worker group gives every worker its ``RANK`` and
    lays out each replica's workers one after the other (verl's ServerAdapter: ``rollout_rank = RANK %
    rollout_world_size``)."""
    rank = os.environ.get("RANK")
    if rank is None or not rank.isdigit():
        raise ConfigError(f"sharded delivery: this rollout worker has no RANK in its environment (verl's worker "
                          f"group sets it), got {rank!r}")
    return int(rank) % tp_size


def worker_shards(model_path: str | Path, tp_rank: int, tp_size: int) -> WorkerShards:
    """What TP rank ``tp_rank`` of ``tp_size`` keeps of the checkpoint in ``model_path`` (a local directory with
    ``config.json`` and ``*.safetensors``, as the vLLM rollout loads it)."""
    config = _config(model_path)
    layers = _layers(config, tp_rank, tp_size)
    tensors = checkpoint_specs(model_path)
    out = WorkerShards(tp_rank, tp_size, shapes={t.name: t.shape for t in tensors})
    for tensor in tensors:
        rule = next((kind for pattern, kind in _RULES if pattern.search(tensor.name)), None)
        if rule is None:
            out.whole[tensor.name] = "replicated on every rank (or no rule for it)"
            continue
        kind, shard_id = rule
        leaf = tensor.name.rpartition(".")[2]
        part = _range(kind, layers, leaf, shard_id, tensor)
        if isinstance(part, str):
            out.whole[tensor.name] = part
        else:
            out.spec[tensor.name] = (part,)
    return out


def _range(kind: str, layers: dict[str, SimpleNamespace], leaf: str, shard_id: object,
           tensor: TensorSpec) -> Slice | str:
    if kind in ("o", "down"):
        return layer_range("row", layers[kind], leaf, None, tensor)
    return layer_range(kind, layers[kind], leaf, shard_id, tensor)


def _config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"sharded delivery reads the model's config.json: {path}: {exc}") from None
    architectures = config.get("architectures") or []
    if not any(a in FAMILY for a in architectures):
        raise ConfigError(f"sharded delivery to verl's rollout workers knows vLLM's layers of {', '.join(FAMILY)}; "
                          f"{path} is {architectures} (set sharded: false)")
    return config


def _divide(what: str, total: int, parts: int, by: str = "the tensor parallel size") -> int:
    if total % parts:
        raise ConfigError(f"sharded delivery: {what} ({total}) is not divisible by {by} ({parts}), which vLLM "
                          "requires")
    return total // parts


def _layers(config: dict, tp_rank: int, tp_size: int) -> dict[str, SimpleNamespace]:
    """The attributes vLLM's layers of this model have on TP rank ``tp_rank`` (as their constructors set them)."""
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"TP rank {tp_rank} outside a tensor parallel size of {tp_size}")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_size = int(config.get("head_dim") or hidden // heads)
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    common = {"tp_rank": tp_rank, "tp_size": tp_size}
    # QKVParallelLinear: heads split; KV heads split, or replicated when the TP size exceeds them
    per_rank_heads = _divide("num_attention_heads", heads, tp_size)
    if tp_size >= kv_heads:
        kv_per_rank, replicas = 1, _divide("the tensor parallel size", tp_size, kv_heads, "num_key_value_heads")
    else:
        kv_per_rank, replicas = _divide("num_key_value_heads", kv_heads, tp_size), 1
    qkv = SimpleNamespace(**common, total_num_heads=heads, num_heads=per_rank_heads,
                          total_num_kv_heads=kv_heads, num_kv_heads=kv_per_rank, num_kv_head_replicas=replicas,
                          head_size=head_size, v_head_size=head_size)
    # VocabParallelEmbedding / ParallelLMHead: the vocabulary padded to VOCAB_PADDING, split evenly
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = _divide("the padded vocabulary", padded, tp_size)
    indices = SimpleNamespace(org_vocab_start_index=min(tp_rank * per_rank, vocab),
                              org_vocab_end_index=min((tp_rank + 1) * per_rank, vocab), num_added_elements=0)
    return {"qkv": qkv,
            "vocab": SimpleNamespace(**common, shard_indices=indices, org_vocab_size=vocab),
            "merged": SimpleNamespace(**common, output_sizes=[inter, inter]),
            "o": SimpleNamespace(**common, input_size_per_partition=_divide("the attention width", heads * head_size,
                                                                            tp_size)),
            "down": SimpleNamespace(**common, input_size_per_partition=_divide("intermediate_size", inter, tp_size))}
