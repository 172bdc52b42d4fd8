"""torch-block64 on CUDA equals the CPU computation (and the plain-Python reference) on random buckets of every
wire dtype, through both implementations (torch.compile of the digest, and eager torch ops across chunk edges)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from ckpt_engine.plan import hashing
from ckpt_engine.plan.dtypes import DTYPE_BY_NAME
from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.plan.tensors import fill_bucket
from tests.gpu.common import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
DTYPES = sorted(DTYPE_BY_NAME)


def random_tensors(seed: int, count: int, max_elems: int) -> dict[str, torch.Tensor]:
    """Random bytes viewed as every dtype, in shapes from 0-dim and empty to 2-D (bool: 0 or 1)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        name = DTYPES[i % len(DTYPES)]
        dtype = DTYPE_BY_NAME[name]
        shape = rng.choice([(), (0,), (rng.randint(1, max_elems),),
                            (rng.randint(1, 9), rng.randint(1, max_elems // 9 + 1))])
        numel = 1
        for dim in shape:
            numel *= dim
        high = 2 if dtype == torch.bool else 256
        raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        out[f"t{i}.{name}"] = raw.view(dtype).reshape(shape)
    return out


def digests(tensors: dict[str, torch.Tensor], device: str, bucket_size: int) -> list[int]:
    """On "cpu" always with the eager ops (the fixture's choice is for CUDA; the CPU's compiled form is checked by
    tests/test_hashing.py)."""
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    layout = plan_layout(specs, bucket_size=bucket_size)
    out: list[int] = []
    chosen = os.environ.get(hashing.KERNEL_ENV)
    if device == "cpu":
        os.environ[hashing.KERNEL_ENV] = "eager"
    try:
        for bucket in layout.buckets:
            buf = torch.full((bucket.nbytes,), 0xA5, dtype=torch.uint8)  # padding is not zero: it must not count
            fill_bucket(buf, bucket.slots, tensors, bucket.nbytes)
            out += hashing.bucket_digests(bucket, buf.to(device), "torch-block64", layout.digest).cpu().tolist()
    finally:
        if chosen is None:
            os.environ.pop(hashing.KERNEL_ENV, None)
        else:
            os.environ[hashing.KERNEL_ENV] = chosen
    return out


def _raw(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.reshape(-1).view(torch.uint8).tolist()) if tensor.numel() else b""


@pytest.fixture(params=["compiled", "eager"])
def kernel(request, monkeypatch) -> str:
    """Each test runs with the compiled digest (the default on CUDA: Triton) and with plain torch ops."""
    monkeypatch.setenv(hashing.KERNEL_ENV, request.param)
    used = hashing.device_digest_kernel(torch.device("cuda"))
    if used != request.param:
        pytest.fail(f"asked for the {request.param} digest kernel, got {used}: "
                    f"{hashing.compile_failure(torch.device('cuda'))}")
    return used


def test_the_default_on_cuda_is_the_compiled_digest(monkeypatch) -> None:
    monkeypatch.delenv(hashing.KERNEL_ENV, raising=False)
    assert hashing.device_digest_kernel(torch.device("cuda")) == "compiled", \
        hashing.compile_failure(torch.device("cuda"))


@pytest.mark.parametrize("chunk_rows", [7, 1 << 17])
def test_cuda_digests_equal_cpu_on_every_dtype(kernel: str, chunk_rows: int, monkeypatch) -> None:
    monkeypatch.setattr(hashing, "_CHUNK_ROWS", chunk_rows)
    for seed in range(4):
        tensors = random_tensors(seed, 3 * len(DTYPES), 300)
        cpu = digests(tensors, "cpu", bucket_size=1 << 12)
        assert digests(tensors, "cuda", bucket_size=1 << 12) == cpu, (kernel, seed)
        reference = [hashing.reference_block64_digest(name.split(".")[1], tuple(t.shape), _raw(t))
                     for name, t in tensors.items()]
        assert cpu == reference


def test_cuda_digests_equal_cpu_on_a_multi_chunk_bucket(kernel: str) -> None:
    """A 72 MiB bucket: one tensor over several 32 MiB eager chunks, then 3,000 small ones sharing the last."""
    gen = torch.Generator().manual_seed(11)
    tensors = {"big": torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen).view(torch.bfloat16)}
    tensors |= {f"s{i}": torch.randn(1 + i % 700, generator=gen) for i in range(3000)}
    assert digests(tensors, "cuda", bucket_size=1 << 30) == digests(tensors, "cpu", bucket_size=1 << 30)


def test_a_flipped_bit_changes_only_its_tensor_on_cuda(kernel: str) -> None:
    tensors = random_tensors(99, 40, 5000)
    before = digests(tensors, "cuda", bucket_size=1 << 16)
    name = next(n for n, t in tensors.items() if t.numel() > 100)
    tensors[name].reshape(-1).view(torch.uint8)[77] ^= 1
    after = digests(tensors, "cuda", bucket_size=1 << 16)
    assert [a != b for a, b in zip(before, after)] == [n == name for n in tensors]
