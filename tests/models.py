"""A test model that covers every awkward case of the sync path."""

from __future__ import annotations

import torch
from torch import nn

from ckpt_engine.plan.hashing import host_buffer

BUCKET_SIZE = 64 * 1024
SMALL_TENSORS = 2000


class AwkwardModel(nn.Module):
    """fp32/bf16/fp16 params, int64 and bool buffers, a 0-dim and an empty tensor, a tensor larger than the
    bucket, a non-contiguous buffer, tied weights and ~2,000 small tensors."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        self.embed = nn.Parameter(randn(40, 16))
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed  # tied: one tensor under two names
        self.proj = nn.Linear(16, 16)
        self.proj.weight.data = randn(16, 16)
        self.proj.bias.data = randn(16)
        self.bf16 = nn.Parameter(randn(33, 7, dtype=torch.bfloat16))
        self.fp16 = nn.Parameter(randn(5, 3, dtype=torch.float16))
        self.scalar = nn.Parameter(randn(1).reshape(()))
        self.empty = nn.Parameter(torch.empty(0, 4))
        self.big = nn.Parameter(randn(BUCKET_SIZE // 4 + 999))  # larger than one bucket
        self.register_buffer("steps", torch.randint(0, 1 << 40, (9,), generator=gen, dtype=torch.int64))
        self.register_buffer("mask", torch.randint(0, 2, (13,), generator=gen).bool())
        self.register_buffer("transposed", randn(6, 10).t())  # non-contiguous source
        self.small = nn.ParameterList(nn.Parameter(randn(1 + i % 7)) for i in range(SMALL_TENSORS))

    def perturb(self, step: int, fraction: float = 1.0) -> None:
        """Change the weights in place, as an optimizer step would."""
        gen = torch.Generator().manual_seed(1000 + step)
        with torch.no_grad():
            tensors = list(self.parameters()) + [self.steps, self.transposed]
            for i, tensor in enumerate(tensors):
                if tensor.numel() == 0 or (i % 100) >= fraction * 100:
                    continue
                if tensor.dtype == torch.int64:
                    tensor.add_(1)
                else:
                    tensor.add_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype) * 0.01)
            self.mask.logical_not_()


def state_bytes(module: nn.Module) -> dict[str, bytes]:
    """Exact bytes of every parameter and buffer, by name (tied names included)."""
    out = {}
    for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    ):
        flat = tensor.detach().contiguous().reshape(-1)
        out[name] = bytes(host_buffer(flat.view(torch.uint8)))
    return out


def load_into(module: nn.Module, tensors: dict[str, torch.Tensor], partial: bool = False) -> None:
    """In-place copy of received tensors into the module, as the transformers adapter does; ``partial``
    (a sparse version) copies what is there."""
    targets = dict(module.named_parameters(remove_duplicate=False))
    targets.update(dict(module.named_buffers(remove_duplicate=False)))
    missing = set(targets) - set(tensors)
    if missing and partial:
        targets = {name: t for name, t in targets.items() if name in tensors}
    elif missing:
        raise KeyError(f"received version lacks {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name])
