"""Disk round trip with safetensors, the baseline most RL stacks start from: the trainer writes every tensor
with ``safetensors.torch.save_file``, each receiver reads the file with ``load_file`` and copies every tensor
into its own preallocated tensors.

These helpers are run as two more variants (``disk_local`` and ``disk_shm``) of the side-by-side comparison
in :mod:`ckpt_engine.bench.sync_bench`, in the same processes and rounds as the other variants: the sender saves, a
barrier tells the receivers the file is complete, they load and copy, and a second barrier ends the timing.

- ``disk_local``: a temporary directory on the local disk (``/tmp``), not ``/dev/shm``. The sender writes,
  ``fsync``s the file and drops its pages from the page cache (``posix_fadvise(DONTNEED)``, this file only),
  so the receivers read it from the device: a real disk round trip, not a memory copy through the page cache.
- ``disk_shm``: a temporary directory on ``/dev/shm`` (tmpfs, i.e. memory): the same round trip without a
  device, the best case for a file-based handoff on one host.

Files are deleted after every repetition and the directories when the run ends (also on failure).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

DISK_VARIANTS = ("disk_local", "disk_shm")


def make_dirs() -> dict[str, str]:
    """One private temporary directory per disk variant (the caller removes them with :func:`remove_dirs`)."""
    local_root = "/tmp" if os.path.realpath("/tmp") != "/dev/shm" else str(Path(__file__).resolve().parent / "results")
    dirs = {"disk_local": tempfile.mkdtemp(prefix="ckpt-bench-disk-", dir=local_root)}
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        dirs["disk_shm"] = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm")
    return dirs


def remove_dirs(dirs: Mapping[str, str]) -> None:
    for path in dirs.values():
        shutil.rmtree(path, ignore_errors=True)


def save(tensors: Mapping[str, torch.Tensor], path: str, *, durable: bool = False) -> float:
    """Write every tensor to ``path``; ``durable``: also fsync it and drop it from the page cache, so that
    readers get it from the device. Returns the seconds it took."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    save_file(dict(tensors), path)
    if durable:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def load_into(path: str, targets: Mapping[str, torch.Tensor]) -> float:
    """Read ``path`` and copy every tensor into ``targets`` (same names); returns the seconds it took."""
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    loaded = load_file(path)
    if len(loaded) != len(targets):
        raise RuntimeError(f"{path}: {len(loaded)} tensors, expected {len(targets)}")
    for name, target in targets.items():
        target.copy_(loaded[name])
    del loaded
    return time.perf_counter() - t0


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
