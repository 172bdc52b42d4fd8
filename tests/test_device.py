"""Device selection on a CPU-only torch (the NPU path is import-safe and refuses cleanly without hardware)."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.device import comm_empty, detect_device, host_empty, npu_module, synchronize
from ckpt_engine.errors import DeviceError


def test_auto_picks_cpu_and_gloo_without_accelerators() -> None:
    if torch.cuda.is_available() or npu_module() is not None:
        pytest.skip("an accelerator is present")
    info = detect_device()
    assert (info.kind, info.backend, info.pinned_memory, info.ipc_kind) == ("cpu", "gloo", False, "shm")
    assert info.comm_device == torch.device("cpu") and info.digest_algo == "xxh3-64"


def test_host_memory_without_pinning_never_crashes() -> None:
    info = detect_device("cpu")
    buf = host_empty(1024, info)
    assert buf.numel() == 1024 and not buf.is_pinned()
    assert comm_empty(8, info).device.type == "cpu"
    synchronize(info)


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_missing_accelerator_is_a_clear_error(device: str) -> None:
    if (device == "cuda" and torch.cuda.is_available()) or (device == "npu" and npu_module() is not None):
        pytest.skip(f"{device} is present")
    with pytest.raises(DeviceError, match="not available"):
        detect_device(device)


@pytest.mark.parametrize("device, backend", [("cpu", "nccl"), ("cpu", "hccl"), ("cpu", "mpi")])
def test_backend_must_fit_the_device(device: str, backend: str) -> None:
    with pytest.raises(DeviceError):
        detect_device(device, backend)


def test_unknown_device_name() -> None:
    with pytest.raises(DeviceError, match="device must be one of"):
        detect_device("tpu")


def test_npu_probe_is_import_safe() -> None:
    # Without torch_npu installed this returns None instead of raising.
    assert npu_module() is None or hasattr(npu_module(), "is_available")
