"""The agent as rank 0 of a small group with an inference engine's workers, for engines that take weights
by collective broadcast (SGLang's ``update_weights_from_distributed``).

The engine's HTTP call that receives a batch and the broadcasts of that batch rendezvous inside the
collective, so they must run concurrently: :func:`push_while` runs the HTTP call on a thread while this
side broadcasts.

Only versions the agent has already verified are pushed; the engine then confirms what it loaded.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from ckpt_engine.device import DeviceInfo, detect_device
from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.transport.group import SyncGroup, open_store

T = TypeVar("T")
Batch = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class PushSettings:
    """Where the engine's workers meet the agent: ``world_size`` = engine workers + 1 (the agent, rank 0)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = 300.0
    chunk_bytes: int = 512 << 20


def torch_group_prefix(group_name: str, device_type: str) -> str:
    """The store prefix under which a process group made the way SGLang makes its update group does its
    rendezvous, as one PrefixStore (whose keys are ``prefix + "/" + key``). SGLang's
    ``init_custom_process_group`` wraps the store in ``PrefixStore(group_name)``, and torch's
    ``_new_process_group_helper`` adds ``PrefixStore(f"{group_name}/")`` and ``PrefixStore(f"{device}/")``;
    PrefixStore joins with "/", so the first NCCL key is ``g/g//cuda//0`` (read from sglang 0.5.23 and torch
    2.13 / 2.14, checked byte-exact by the fake in tests/fakes/fake_sglang.py, which builds its group with
    torch's own helper)."""
    return f"{group_name}/{group_name}//{device_type}/"


class PushGroup:
    def __init__(self, settings: PushSettings, device: DeviceInfo | None = None) -> None:
        self.settings = settings
        self.device = device or detect_device(backend="gloo" if settings.backend == "gloo" else "auto")
        # rank 0 hosts the store, as in SGLang's own rendezvous (torch's tcp:// handler, is_master for rank 0)
        store = open_store(settings.master_address, settings.master_port, is_master=True, timeout_s=settings.timeout_s)
        self._store: torch.distributed.TCPStore | None = store
        self.group: SyncGroup | None = None

    def join(self) -> None:
        """Rendezvous with the engine's workers (blocks until they join or the timeout passes)."""
        s = self.settings
        if self._store is None:
            raise CkptEngineError("this push group was closed: make a new one to join again")
        self.group = SyncGroup(self._store, name=s.group_name, generation=0, rank=0, world_size=s.world_size,
                               device=self.device, timeout_s=s.timeout_s,
                               prefix=torch_group_prefix(s.group_name, self.device.comm_device.type))

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        if self.group is None:
            raise CkptEngineError("push group not joined yet")
        for index, tensor in enumerate(tensors):
            self.group.broadcast_and_wait(tensor.contiguous().to(self.device.comm_device), f"push tensor {index}")

    def close(self) -> None:
        """Leave the group and stop hosting the store (its port is free for a new group)."""
        if self.group is not None:
            self.group.close()
        self.group = None
        self._store = None


def push_while(call: Callable[[], T], work: Callable[[], None], timeout_s: float) -> T:
    """Run ``call`` (the engine's HTTP request) on a thread while ``work`` (our side of the collective)
    runs here; return the call's result, or raise the first failure of either."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(call)
        work()
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise SyncTimeoutError(f"the engine did not answer within {timeout_s}s") from None


def distinct(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop alias names (tied weights are one tensor object in a payload): each tensor is pushed once. Weak
    references: a streamed payload lets tensors go as it moves on, and a new one may reuse a dead one's id."""
    seen: dict[int, weakref.ref] = {}
    for name, tensor in items:
        ref = seen.get(id(tensor))
        if ref is not None and ref() is tensor:
            continue
        seen[id(tensor)] = weakref.ref(tensor)
        yield name, tensor


def batches(items: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[tuple[Batch, bool]]:
    """Consecutive (batch, is_last) of at most ``limit`` bytes (a larger tensor goes alone). One item ahead: a
    batch is known to be the last only once the payload ended (streamed: after its trailer verified)."""
    batch: Batch = []
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if batch and size + nbytes > limit:
            yield batch, False
            batch, size = [], 0
        batch.append((name, tensor))
        size += nbytes
    if batch:
        yield batch, True
