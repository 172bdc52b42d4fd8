"""What a tensor-parallel vLLM worker keeps of each checkpoint tensor, read from its live model's layers.

vLLM's own direct-reshard resolution (``vllm/distributed/weight_transfer/m2n_layout.py``, 0.32 and 0.33) maps a
checkpoint tensor onto a live parameter 1:1 and gives up on fused parameters: ``qkv_proj`` (q, k, v), and
``gate_up_proj`` (gate, up) receive whole checkpoint tensors, and in a Llama-style model those are most of the
bytes. Their loaders (``vllm/model_executor/layers/linear.py``) read one contiguous range of each checkpoint
tensor per TP rank; this module derives that range from the layer the name maps to (through the model's own
``hf_to_vllm_mapper``), with the layer's own attributes:

- ``QKVParallelLinear``: q rows ``r·nh·hd`` (+``nh·hd``); k and v rows ``⌊r/R⌋·nkv·hd`` (+``nkv·hd``; v with
  ``v_head_size``), nh/nkv the per-rank head counts, R = ``num_kv_head_replicas`` (KV heads replicated when TP
  exceeds them);
- ``MergedColumnParallelLinear`` shard k: rows ``r·s_k/T`` (+``s_k/T``), s_k = ``output_sizes[k]``;
- ``ColumnParallelLinear``: rows ``r·O/T``; ``RowParallelLinear`` weight: columns ``r·I/T`` (its bias: whole);
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: rows ``shard_indices.org_vocab_start_index`` to
  ``org_vocab_end_index`` (the loader zero-fills the padding rows itself).

Anything else is kept whole, with the reason: replicated parameters (norms), quantized or packed parameters,
names the mapper does not place. The receiver puts each received range at its place in a tensor of the full
shape (plan/shards.py ``placed``) and hands that to the model's ``load_weights``: vLLM's loader then reads exactly
the range it was sent and writes it where it always does, fused sub-blocks included.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.layout import TensorSpec
from ckpt_engine.plan.shards import Slice, placed, split_piece_name


@dataclass
class DerivedSpec:
    """A worker's shard spec, and why each tensor it keeps whole is kept whole."""

    spec: dict[str, tuple[Slice, ...]] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)


def checkpoint_specs(model_dir: str | Path) -> list[TensorSpec]:
    """The checkpoint tensors (names, full shapes) of the model vLLM loaded, from its safetensors headers (no
    tensor is read): what a worker's shard spec is derived against, and the full shapes its pieces are placed
    in. A ConfigError when the directory has no safetensors file (a hub id: pass the local snapshot)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        raise ConfigError(f"sharded delivery reads the checkpoint's tensor shapes from the model's *.safetensors "
                          f"files; {str(model_dir)!r} has none (serve vLLM from a local model directory)")
    out = []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                piece = handle.get_slice(name)
                out.append(TensorSpec(name, str(piece.get_dtype()).lower(), tuple(piece.get_shape())))
    return out


def worker_shards(model: torch.nn.Module, model_dir: str | Path) -> tuple[dict[str, tuple[Slice, ...]],
                                                                        dict[str, tuple[int, ...]]]:
    """A TP worker's shard spec (what its loaders read of each checkpoint tensor) and the checkpoint's full
    shapes (where its pieces are placed at apply time): what ``sharded=True`` starts a worker with."""
    specs = checkpoint_specs(model_dir)
    return derive_spec(model, specs).spec, {t.name: t.shape for t in specs}


def placed_items(items: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]],
                 aliases: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A sharded version's tensors for vLLM's ``load_weights``: each piece at its place in a tensor of the full
    checkpoint shape under the checkpoint's name (the loader reads this rank's range of it, as from a
    checkpoint file), whole tensors as they came. The rest of each full tensor is never written (on the
    CPU its pages are never touched; on a GPU it is allocated for the time the loader holds it). ``aliases``
    (the version's tied names): a tied name the checkpoint does not store (``lm_head.weight`` of a tied
    embedding) takes the full shape of the tensor it is tied to."""
    for name, tensor in items:
        base, part = split_piece_name(name)
        if part is None:
            yield name, tensor
            continue
        shape = shapes.get(base)
        if shape is None and aliases and name in aliases:
            shape = shapes.get(split_piece_name(aliases[name])[0])
        if shape is None:
            raise ConfigError(f"a piece of {base!r}, which the checkpoint does not have")
        yield base, placed(tensor, tuple(shape), part)


def derive_spec(model: torch.nn.Module, tensors: list[TensorSpec]) -> DerivedSpec:
    """The slices of ``tensors`` (checkpoint names, full shapes) that this TP rank of ``model`` keeps."""
    stacked = _stacked_mapping(model)
    out = DerivedSpec()
    for tensor in tensors:
        target, shard_id = _vllm_name(tensor.name, stacked)
        found = _layer_of(model, target)
        if found is None:
            out.whole[tensor.name] = f"no parameter {target!r} in the model"
            continue
        layer, leaf = found
        part = _slice(layer, leaf, shard_id, tensor)
        if isinstance(part, str):
            out.whole[tensor.name] = part
        else:
            out.spec[tensor.name] = (part,)
    return out


def _stacked_mapping(model: torch.nn.Module) -> dict[str, tuple[str, object]]:
    """Every ``orig_to_new_stacked`` entry of the mappers the model's modules declare (checkpoint substring ->
    (fused parameter substring, shard id))."""
    mapping: dict[str, tuple[str, object]] = {}
    for module in model.modules():
        mapper = getattr(type(module), "hf_to_vllm_mapper", None)
        mapping.update(getattr(mapper, "orig_to_new_stacked", None) or {})
    return mapping


def _vllm_name(name: str, stacked: dict[str, tuple[str, object]]) -> tuple[str, object | None]:
    for old, (new, shard_id) in stacked.items():
        if old in name:  # as vLLM's WeightsMapper: the first occurrence is replaced
            return name.replace(old, new, 1), shard_id
    return name, None


def _layer_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str] | None:
    path, _, leaf = name.rpartition(".")
    try:
        layer = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    return (layer, leaf) if isinstance(getattr(layer, leaf, None), torch.nn.Parameter) else None


def _slice(layer: torch.nn.Module, leaf: str, shard_id: object | None, tensor: TensorSpec) -> Slice | str:
    """This rank's range of ``tensor`` for the parameter ``leaf`` of ``layer``, or why it is kept whole."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    param = getattr(layer, leaf)
    for flag in ("packed_dim", "packed_factor", "marlin_tile_size"):
        if getattr(param, flag, None) is not None:
            return f"a packed parameter ({flag})"
    if getattr(param, "is_sharded_weight", False):
        return "a weight the checkpoint stores already sharded"
    method = type(getattr(layer, "quant_method", None)).__name__
    if method not in ("NoneType", "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return f"quantized ({method})"
    kinds = ((VocabParallelEmbedding, "vocab"), (QKVParallelLinear, "qkv"), (MergedColumnParallelLinear, "merged"),
             (ColumnParallelLinear, "column"), (RowParallelLinear, "row"))
    kind = next((name for cls, name in kinds if isinstance(layer, cls)), None)
    if kind is None:
        return f"{type(layer).__name__}: replicated on every rank"
    return layer_range(kind, layer, leaf, shard_id, tensor)


def layer_range(kind: str, layer: object, leaf: str, shard_id: object | None, tensor: TensorSpec) -> Slice | str:
    """This TP rank's range of checkpoint ``tensor`` for the parameter ``leaf`` of a parallel layer of ``kind``
    (vocab, qkv, merged, column or row: vLLM's VocabParallelEmbedding / ParallelLMHead, QKVParallelLinear,
    MergedColumnParallelLinear, ColumnParallelLinear, RowParallelLinear), read from the attributes such a layer
    has: a live one, or one computed as its constructor computes them (verl's rollout workers, which hold no
    vLLM model: workers/adapters/verl/shards.py). Or why it is kept whole."""
    tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if tp_size == 1:
        return "tensor parallel size 1"
    if kind == "vocab":
        return _vocab(layer, tensor)
    if kind == "qkv":
        return _qkv(layer, shard_id, tensor, tp_rank)
    if kind == "merged":
        sizes = layer.output_sizes  # type: ignore[attr-defined]
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(sizes):
            return f"merged shard id {shard_id!r} unknown"
        size = sizes[shard_id] // tp_size
        return _checked(tensor, sizes[shard_id], 0, tp_rank * size, size)
    if kind == "column":
        size = layer.output_size_per_partition  # type: ignore[attr-defined]
        return _checked(tensor, size * tp_size, 0, tp_rank * size, size)
    if kind == "row":
        if leaf == "bias" or len(tensor.shape) < 2:
            return "a row-parallel bias (every rank adds it whole)"
        size = layer.input_size_per_partition  # type: ignore[attr-defined]
        return _checked(tensor, size * tp_size, 1, tp_rank * size, size)
    return f"{type(layer).__name__}: no rule for it"


def _qkv(layer, shard_id: object, tensor: TensorSpec, tp_rank: int) -> Slice | str:
    if shard_id == "q":
        size = layer.num_heads * layer.head_size
        return _checked(tensor, layer.total_num_heads * layer.head_size, 0, tp_rank * size, size)
    if shard_id in ("k", "v"):
        head = layer.head_size if shard_id == "k" else layer.v_head_size
        size = layer.num_kv_heads * head
        rank = tp_rank // layer.num_kv_head_replicas
        return _checked(tensor, layer.total_num_kv_heads * head, 0, rank * size, size)
    return f"qkv shard id {shard_id!r} unknown (a checkpoint with q, k and v fused)"


def _vocab(layer, tensor: TensorSpec) -> Slice | str:
    indices = layer.shard_indices
    start, end = indices.org_vocab_start_index, indices.org_vocab_end_index
    if end <= start:
        return "this rank holds only padding rows of the vocabulary"
    if indices.num_added_elements:
        return "added vocabulary (LoRA) rows"
    return _checked(tensor, layer.org_vocab_size, 0, start, end - start)


def _checked(tensor: TensorSpec, expected: int, dim: int, start: int, length: int) -> Slice | str:
    """The slice, when the checkpoint tensor has the size along ``dim`` the layer was built for."""
    if len(tensor.shape) <= dim or tensor.shape[dim] != expected:
        return f"shape {tensor.shape} is not what the layer loads ({expected} along dim {dim})"
    if length < 1 or start + length > expected:
        return f"range {start}+{length} of {expected} along dim {dim}"
    return Slice(dim, start, length)
