"""A small transformers causal LM built from a config (no downloads)."""

from __future__ import annotations

import torch


def tiny_llama(seed: int, *, hidden: int = 64, layers: int = 2, vocab: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         initializer_range=0.5)  # large enough that two seeds generate differently
    return LlamaForCausalLM(config)


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    from ckpt_engine.plan.hashing import host_buffer

    return {name: bytes(host_buffer(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()))
            for name, t in tensors.items()}


def sharded_tiny_llama(rank: int, port: int, timeout_s: float, *, world: int = 2, seed: int = 0):
    """tiny_llama on an FSDP2 job of ``world`` gloo ranks (this process is ``rank``), sharded per layer."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    model = tiny_llama(seed=seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model
