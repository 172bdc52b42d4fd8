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
