"""A bridge into vLLM's own ``nccl`` weight-transfer backend, for vLLM deployments that cannot load the
ckpt_engine backend: a RolloutAgent next to the server verifies each version, then pushes it to the server's
workers with vLLM's native flow.

Schema-exact with vLLM 0.32/0.33 (``vllm/distributed/weight_transfer/nccl_common.py``, ``nccl_engine.py``):

- ``init_info`` (``NCCLWeightTransferInitInfo``): ``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``packed`` (+ ``packed_buffer_size_bytes``, ``packed_num_buffers`` when packed);
- ``update_info`` (``NCCLWeightTransferUpdateInfo``): ``names``, ``dtype_names``, ``shapes`` only;
- the rendezvous is vLLM's own: this side calls vLLM's ``nccl_common.trainer_init`` (a
  ``StatelessProcessGroup`` + ``PyNcclCommunicator`` as rank 0), the workers join as ``rank_offset`` + their rank;
- non-packed transfers broadcast one tensor per name, in ``names`` order, from rank 0.

It needs vLLM and CUDA in the bridge's own process (vLLM's communicator is NCCL): it cannot run on a CPU machine.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine.errors import ConfigError, SyncTimeoutError
from ckpt_engine.plan.dtypes import dtype_name
from ckpt_engine.receive.collective import VersionPayload
from ckpt_engine.workers.adapters.push_group import Batch, batches, distinct
from ckpt_engine.workers.adapters.vllm.control import HttpControl


def init_info(master_address: str, master_port: int, world_size: int) -> dict[str, Any]:
    """The worker-side init info, as ``NCCLWeightTransferInitInfo`` takes it (non-packed)."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
            "world_size": world_size, "packed": False}


def update_info(batch: Batch) -> dict[str, Any]:
    """One batch's update info, as ``NCCLWeightTransferUpdateInfo`` takes it: nothing else is accepted."""
    return {"names": [name for name, _ in batch], "dtype_names": [dtype_name(t.dtype) for _, t in batch],
            "shapes": [list(t.shape) for _, t in batch]}


class VLLMWeightTransferClient:
    """``load`` is a LoadFn: pause -> start -> per batch, update_weights while the batch is broadcast ->
    finish with the version label -> resume (always)."""

    def __init__(self, base_url: str, *, master_address: str, master_port: int, workers: int,
                 api_key: str | None = None, timeout_s: float = 300.0, chunk_bytes: int = 512 << 20) -> None:
        self.control = HttpControl(base_url, api_key=api_key, timeout_s=timeout_s)
        self.master_address, self.master_port, self.world_size = master_address, master_port, workers + 1
        self.timeout_s, self.chunk_bytes = timeout_s, chunk_bytes
        self.communicator: Any = None
        self.version: int | None = None

    def connect(self) -> None:
        """Rendezvous with the server's workers: vLLM's own trainer side, concurrently with the init request."""
        if not torch.cuda.is_available():
            raise ConfigError("vLLM's NCCL weight transfer needs CUDA in this process; on other machines use the "
                              "ckpt_engine backend (--weight-transfer-config '{\"backend\": \"ckpt_engine\"}')")
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        info = init_info(self.master_address, self.master_port, self.world_size)
        self.communicator = _while(lambda: self.control.start_workers(info), lambda: trainer_init(info),
                                   self.timeout_s)

    def load(self, payload: VersionPayload) -> None:
        if self.communicator is None:
            raise ConfigError("connect() first")
        control = self.control
        control.pause()
        try:
            control.start()
            for batch, _ in batches(distinct(payload.items()), self.chunk_bytes):
                info = update_info(batch)
                _while(functools.partial(control.update, info), functools.partial(self._broadcast, batch),
                       self.timeout_s)
            control.finish(str(payload.version))
            self.version = payload.version
        finally:
            control.resume()

    def _broadcast(self, batch: Batch) -> None:
        stream = torch.cuda.current_stream()
        for _, tensor in batch:
            self.communicator.broadcast(tensor.contiguous().cuda(), src=0, stream=stream)
        stream.synchronize()


def _while(call: Callable[[], Any], work: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``call`` (the server's request) on a thread while ``work`` (our side of the collective) runs
    here; returns what ``work`` returned, or raises the first failure."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(call)
        result = work()
        try:
            future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise SyncTimeoutError(f"the vLLM server did not answer within {timeout_s}s") from None
        return result
