"""Everything device-specific lives here: which accelerator, which collective backend, pinned host memory,
same-host IPC kind, and synchronisation. Other modules ask this one instead of calling torch.cuda/torch.npu."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ckpt_engine.errors import DeviceError

log = logging.getLogger(__name__)

DeviceKind = Literal["cuda", "npu", "cpu"]
Backend = Literal["nccl", "hccl", "gloo"]
IpcKind = Literal["cuda_ipc", "npu_ipc", "shm"]
DigestAlgo = Literal["xxh3-64", "torch-block64"]

_BACKEND_FOR: dict[str, Backend] = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_IPC_FOR: dict[str, IpcKind] = {"cuda": "cuda_ipc", "npu": "npu_ipc", "cpu": "shm"}


def npu_module():
    """``torch.npu`` after importing torch_npu, or None when torch_npu is not installed or has no device."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - a broken torch_npu must not break CPU/CUDA users
        log.warning("torch_npu is installed but failed to import: %s", exc)
        return None
    module = getattr(torch, "npu", None)
    if module is None or not module.is_available():
        return None
    return module


def _available(kind: DeviceKind) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "npu":
        return npu_module() is not None
    return True


@dataclass(frozen=True)
class DeviceInfo:
    """The device this process moves weights on, and what follows from it."""

    kind: DeviceKind
    index: int | None
    backend: Backend
    pinned_memory: bool
    ipc_kind: IpcKind

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind if self.index is None else f"{self.kind}:{self.index}")

    @property
    def comm_device(self) -> torch.device:
        """Where buffers handed to the collective must live (gloo works on host memory)."""
        return torch.device("cpu") if self.backend == "gloo" else self.torch_device

    @property
    def digest_algo(self) -> DigestAlgo:
        """xxhash over host bytes on CPU; torch ops on the device elsewhere (no copy to host)."""
        return "xxh3-64" if self.comm_device.type == "cpu" else "torch-block64"


def detect_device(
    device: str = "auto", backend: str = "auto", index: int | None = None
) -> DeviceInfo:
    """Pick the device (auto: cuda, then npu, then cpu) and the backend (auto: nccl / hccl / gloo)."""
    kind = _pick_kind(device)
    chosen_backend = _pick_backend(kind, backend)
    if kind != "cpu" and index is None:
        index = _module(kind).current_device()
    return DeviceInfo(
        kind=kind,
        index=index if kind != "cpu" else None,
        backend=chosen_backend,
        pinned_memory=kind != "cpu" and _available(kind),
        ipc_kind=_IPC_FOR[kind],
    )


def _pick_kind(device: str) -> DeviceKind:
    if device == "auto":
        for kind in ("cuda", "npu"):
            if _available(kind):
                return kind
        return "cpu"
    if device not in _BACKEND_FOR:
        raise DeviceError(f"device must be one of auto, cuda, npu, cpu; got {device!r}")
    if not _available(device):  # type: ignore[arg-type]
        raise DeviceError(f"device {device!r} was requested but is not available in this process")
    return device  # type: ignore[return-value]


def _pick_backend(kind: DeviceKind, backend: str) -> Backend:
    if backend == "auto":
        return _BACKEND_FOR[kind]
    if backend not in ("nccl", "hccl", "gloo"):
        raise DeviceError(f"backend must be one of auto, nccl, hccl, gloo; got {backend!r}")
    if backend != "gloo" and backend != _BACKEND_FOR[kind]:
        raise DeviceError(f"backend {backend!r} does not run on device {kind!r}")
    return backend  # type: ignore[return-value]


def _module(kind: DeviceKind):
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        module = npu_module()
        if module is None:
            raise DeviceError("torch_npu is not available")
        return module
    raise DeviceError("the CPU has no device module")


def host_empty(nbytes: int, info: DeviceInfo) -> torch.Tensor:
    """A uint8 host buffer, pinned where the device runtime supports it, plain memory otherwise."""
    if info.pinned_memory:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # e.g. locked-memory limits: fall back rather than fail the sync
            log.warning("pinned allocation of %d bytes failed (%s); using pageable memory", nbytes, exc)
    return torch.empty(nbytes, dtype=torch.uint8)


def comm_empty(nbytes: int, info: DeviceInfo) -> torch.Tensor:
    """A uint8 buffer on the collective's device."""
    return torch.empty(nbytes, dtype=torch.uint8, device=info.comm_device)


def collect_shared(info: DeviceInfo) -> None:
    """Free the device memory this process shared by IPC, freed here and since let go by every process that
    mapped it: torch keeps such blocks (its IPC "limbo") until asked or until it shares again, so slots replaced
    by larger ones would otherwise stay allocated. A no-op off CUDA."""
    if info.comm_device.type == "cuda":
        torch.cuda.ipc_collect()


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued device work (copies) on this device to finish; a no-op on CPU. The device is named:
    the calling thread's current device may be another one."""
    if info.kind != "cpu":
        _module(info.kind).synchronize(info.torch_device)


def current_stream(info: DeviceInfo) -> Any | None:
    """The calling thread's current stream on the device (None on CPU)."""
    return None if info.kind == "cpu" else _module(info.kind).current_stream(info.torch_device)


def stream_synchronize(info: DeviceInfo) -> None:
    """Wait until the work queued so far on the calling thread's current stream has finished (a no-op on CPU).
    Before another process may read (or overwrite) memory this stream wrote (or read): same-host IPC."""
    stream = current_stream(info)
    if stream is not None:
        stream.synchronize()


def new_stream(info: DeviceInfo) -> Any | None:
    """A stream of its own on the device (None on CPU), for work that must not queue behind, or hold up, the
    caller's: a background transfer next to a training loop."""
    return None if info.kind == "cpu" else _module(info.kind).Stream(device=info.torch_device)


@contextlib.contextmanager
def on_stream(info: DeviceInfo, stream: Any | None, after: Any | None = None) -> Iterator[None]:
    """Run the enclosed device work on ``stream``, which first waits for what ``after`` (e.g. the caller's stream
    when it handed over its tensors) had queued by now. Nothing happens on CPU or without a stream."""
    if info.kind == "cpu" or stream is None:
        yield
        return
    if after is not None:
        stream.wait_stream(after)
    with _module(info.kind).stream(stream):
        yield


def mark(info: DeviceInfo) -> Any | None:
    """A point in the calling thread's current stream (None on CPU, where queued work is already done): another
    stream can wait for it (:func:`wait_for`) without waiting for everything queued after it."""
    if info.kind == "cpu":
        return None
    event = _module(info.kind).Event()
    event.record(current_stream(info))
    return event


def wait_for(info: DeviceInfo, point: Any | None, *, host: bool) -> None:
    """What comes next runs after ``point`` (see :func:`mark`): with ``host``, this thread waits for it (the CPU
    reads what the work before it wrote, e.g. a device→host copy); else only the work queued from now on on the
    calling thread's current stream does (the device reads it), without blocking the thread."""
    if point is None or info.kind == "cpu":
        return
    if host:
        point.synchronize()
        return
    stream = current_stream(info)
    if stream is None:
        raise RuntimeError(f"no current stream on {info.kind}")  # (only the CPU has none: returned above)
    stream.wait_event(point)


def set_current(info: DeviceInfo) -> None:
    """Bind this thread to the device index (collectives on NCCL/HCCL need it)."""
    if info.kind != "cpu" and info.index is not None:
        _module(info.kind).set_device(info.index)


def free_memory(info: DeviceInfo) -> tuple[int, int]:
    """(free bytes on the device, available host bytes) now. On the CPU both are the host's: a receiver's
    "device" there is host memory too."""
    host = host_available()
    if info.kind == "cpu":
        return host, host
    free, _ = _module(info.kind).mem_get_info(info.torch_device)
    return int(free), host


def host_available() -> int:
    """The kernel's estimate of memory available to new allocations without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size)
