"""Helpers of the GPU tests, importable in the spawned processes they start. Nothing here initialises CUDA
at import time, so the tests are collected (and skip) on machines without it."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import xxhash
from torch import nn

from ckpt_engine.device import DeviceInfo, detect_device
from ckpt_engine.plan.hashing import host_buffer
from ckpt_engine.transport.group import SyncGroup, open_store

HOST = "127.0.0.1"


def cuda_count() -> int:
    """Visible CUDA devices (0 without a driver, a CUDA build or a device); does not create a context."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver install: no usable GPU
        return 0


requires_cuda = pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA device (torch.cuda.is_available() is "
                                                            "False here)")
requires_2_gpus = pytest.mark.skipif(cuda_count() < 2, reason=f"needs 2 CUDA devices, this machine has {cuda_count()}")


def cuda(index: int = 0) -> DeviceInfo:
    """This process on CUDA device ``index`` (also its current device, as NCCL wants)."""
    torch.cuda.set_device(index)
    return detect_device("cuda", index=index)


def sync_group(port: int, rank: int, world: int, device: DeviceInfo, timeout_s: float = 30.0,
               name: str = "gpu-test", part: str = "") -> SyncGroup:
    return SyncGroup(open_store(HOST, port, timeout_s=timeout_s), name=name, generation=0, rank=rank,
                     world_size=world, device=device, timeout_s=timeout_s, bind_host=HOST if device.backend == "gloo"
                     else None, part=part)


def tensor_hash(tensor: torch.Tensor) -> int:
    """xxh3 of a tensor's bytes wherever it lives."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return xxhash.xxh3_64_intdigest(host_buffer(flat))


def state_hashes(module: nn.Module) -> dict[str, int]:
    """Hash of every parameter and buffer by name (tied names included)."""
    items = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return {name: tensor_hash(t) for name, t in items}


def perturb(module: nn.Module, step: int) -> None:
    """An optimizer-like in-place change of every floating tensor (and the int64 counters), on any device."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for tensor in list(module.parameters()) + [b for b in module.buffers() if b.dtype == torch.int64]:
            if tensor.numel() == 0:
                continue
            if tensor.dtype == torch.int64:
                tensor.add_(1)
            else:
                noise = torch.randn(tensor.shape, generator=gen).to(tensor.dtype) * 0.01
                tensor.add_(noise.to(tensor.device))


class WireLog:
    """A sender wire hook that records the hash of every bucket put on the wire, by version (the version is
    set by the test before each publish), and can flip one byte of one bucket of one version."""

    def __init__(self) -> None:
        self.version = 0
        self.buckets: dict[int, list[int]] = {}
        self.corrupt: tuple[int, int] | None = None  # (version, bucket)

    def __call__(self, k: int, buf: torch.Tensor) -> torch.Tensor:
        if self.corrupt == (self.version, k):
            buf = buf.clone()
            buf[0] ^= 0xFF  # the bucket's first tensor's first byte
        self.buckets.setdefault(self.version, []).append(tensor_hash(buf))
        return buf


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_entries() -> set[str]:
    """/dev/shm files this process maps or holds open (tests/procs.py: never the whole of /dev/shm, which other
    users of the machine share)."""
    from tests.procs import shm_files

    return shm_files()


def visible_devices() -> list[str]:
    """This process's CUDA devices as CUDA_VISIBLE_DEVICES names them (indexes when it is unset)."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is None:
        return [str(i) for i in range(cuda_count())]
    return [d.strip() for d in named.split(",") if d.strip()][: cuda_count()]


def memory(device: DeviceInfo) -> dict[str, Any]:
    """This process's device memory after releasing what CUDA IPC receivers have let go of."""
    torch.cuda.synchronize(device.torch_device)
    torch.cuda.ipc_collect()
    free, _ = torch.cuda.mem_get_info(device.torch_device)
    return {"allocated": torch.cuda.memory_allocated(device.torch_device), "device_free": free, "fds": open_fds(),
            "shm": len(shm_entries())}
