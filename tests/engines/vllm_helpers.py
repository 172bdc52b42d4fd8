"""A tiny Llama saved with transformers (no download), greedy tokens from transformers as the reference, a
vLLM ``LLM`` on the CPU build, and a trainer agent serving versions from the test process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.daemon_harness import TrainerLoop  # noqa: F401 - the engine tests take it from here

PROMPT = [1, 17, 33, 90, 4]
NEW_TOKENS = 8
# head_dim 64: vLLM's CPU attention supports 32/64/80/96/112/128 (16 is refused)
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.5)


def llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def save_model(directory: Path, seed: int) -> Path:
    llama(seed).save_pretrained(directory)
    return directory


def reference_tokens(model) -> list[int]:
    """Greedy tokens of the transformers model: what vLLM must generate with the same weights."""
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return out[0, len(PROMPT):].tolist()


def make_llm(model_dir: Path, **options: Any):
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               max_model_len=128, max_num_seqs=2, gpu_memory_utilization=0.1, **options)


def vllm_tokens(llm) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def hf_tensors(model, extra: dict[str, torch.Tensor] | None = None, after: str | None = None):
    """The model's tensors as the trainer sends them; ``extra`` tensors are inserted right after ``after``
    (a name the engine does not know, in the middle of the model: its apply fails half way)."""
    from ckpt_engine.plan.tensors import NamedTensors, named_tensors_of

    named = named_tensors_of(model)
    if not extra:
        return named
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named.tensors.items():
        tensors[name] = tensor
        if name == after:
            tensors.update(extra)
    return NamedTensors(tensors, named.aliases)
