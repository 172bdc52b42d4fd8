"""vLLM adapters; no vllm import anywhere at module level.

1. ``VLLMWeightTransferClient``: vLLM's native weight-transfer HTTP flow (dev-mode routes, feature-detected):
   ``init_weight_transfer_engine`` once, then per version ``pause`` -> ``start_weight_update`` ->
   ``update_weights`` (batches, concurrent with our broadcasts) -> ``finish_weight_update`` with the version
   label -> ``resume`` (always, also after a failure). vLLM publishes the label only after finish succeeds.

2. ``CkptEngineWorkerExtension``: a class for ``--worker-extension-cls`` whose methods, called through
   ``collective_rpc``, start a RolloutAgent inside every vLLM worker that loads verified versions with the
   model's own ``load_weights``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from ckpt_engine.dtypes import dtype_name
from ckpt_engine.receiver import VersionPayload
from ckpt_engine.workers.adapters.engine_http import Batch, EngineHttpAdapter, EngineUpdateError
from ckpt_engine.workers.adapters.push_group import PushGroup, PushSettings, unique_tensors

log = logging.getLogger(__name__)


class VLLMWeightTransferClient(EngineHttpAdapter):
    def __init__(self, base_url: str, push: PushSettings, *, pause_mode: str = "keep", api_key: str | None = None,
                 group: PushGroup | None = None) -> None:
        super().__init__(base_url, push, pause_mode=pause_mode, api_key=api_key, group=group)

    def supported(self) -> bool:
        """Whether the server exposes the native weight-transfer routes (needs a recent vLLM in dev mode)."""
        return self.http.get("/weight_info").status_code == 200

    def connect(self) -> None:
        if not self.supported():
            raise EngineUpdateError("this vLLM server has no native weight-transfer API (GET /weight_info); start "
                                    "it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config, or use "
                                    "CkptEngineWorkerExtension")
        init_info = {"master_address": self.push.master_address, "master_port": self.push.master_port,
                     "rank_offset": 1, "world_size": self.push.world_size}
        self.join_while(lambda: self.post("/init_weight_transfer_engine", {"init_info": init_info}))

    def load(self, payload: VersionPayload) -> None:
        """LoadFn: push one verified version and label it; raises if vLLM refuses any step."""

        def update(batch: Batch, last: bool) -> dict:
            return self.post("/update_weights", {"update_info": {
                "names": [n for n, _ in batch], "dtype_names": [dtype_name(t.dtype) for _, t in batch],
                "shapes": [list(t.shape) for _, t in batch], "packed": False}})

        self.post(f"/pause?mode={self.pause_mode}")
        try:
            self.post("/start_weight_update", {})
            self.push_batches(payload, update)
            self.post("/finish_weight_update", {"weight_version": str(payload.version)})
            self.version = payload.version
        finally:
            self.post("/resume")

    def weight_version(self) -> str | None:
        return self.get("/weight_info").get("weight_version")


class CkptEngineWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls ckpt_engine.workers.adapters.vllm.
    CkptEngineWorkerExtension``). vLLM provides ``self.model_runner.model`` with ``load_weights``.

    From the driver: ``llm.collective_rpc("ckpt_engine_start", args=("tcp://daemon:8766",))``.
    """

    def ckpt_engine_start(self, endpoint: str, token: str | None = None) -> str:
        from ckpt_engine.workers.rollout_agent import RolloutAgent

        agent = getattr(self, "_ckpt_engine_agent", None)
        if agent is None:
            agent = RolloutAgent(self.ckpt_engine_load, endpoint, token=token).start()
            self._ckpt_engine_agent = agent
        return agent.agent_id

    def ckpt_engine_load(self, payload: VersionPayload) -> None:
        """Hand a verified version to the model's ``load_weights``; every tensor must be taken."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        named = unique_tensors(payload.tensors)
        loaded = model.load_weights(_cloned(named))
        if loaded is not None:
            missing = {name for name, _ in named} - set(loaded)
            if missing:
                raise EngineUpdateError(f"vLLM did not load {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")
        self._ckpt_engine_version = payload.version

    def ckpt_engine_status(self) -> dict[str, Any]:
        agent = getattr(self, "_ckpt_engine_agent", None)
        return {"agent_id": agent.agent_id if agent else None,
                "version": getattr(self, "_ckpt_engine_version", None)}

    def ckpt_engine_stop(self) -> None:
        agent = getattr(self, "_ckpt_engine_agent", None)
        if agent is not None:
            agent.close()
            self._ckpt_engine_agent = None


def _cloned(named: list[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    # load_weights may keep references past the call; the payload's views are reused by the next version.
    for name, tensor in named:
        yield name, tensor.clone()


__all__ = ["CkptEngineWorkerExtension", "EngineUpdateError", "VLLMWeightTransferClient"]
