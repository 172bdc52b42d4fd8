"""ckpt-engine as a vLLM weight-transfer backend (``--weight-transfer-config '{"backend": "ckpt_engine"}'``).

Registered in every vLLM process by the ``vllm.general_plugins`` entry point (plugin.py), constructed by vLLM
in each worker. vLLM drives it through its own weight-update API, which ckpt-engine's driver calls:

- ``init_weight_transfer_engine {init_info: {endpoint, engine, token?, ...}}``: each worker starts a
  receiver that registers with the daemon as a member of the engine;
- per version, once every worker has verified (staged) it: ``pause`` -> ``start_weight_update`` (layerwise
  reload begins) -> ``update_weights {update_info: {version}}`` (each worker loads its staged version with
  the model's ``load_weights``) -> ``finish_weight_update {weight_version}`` (reload ends; vLLM labels the
  weights) -> ``resume``.

This module imports vLLM: it is only imported by vLLM's engine factory, inside vLLM's processes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from ckpt_engine.errors import CkptEngineError
from ckpt_engine.plan.modes import STAGINGS
from ckpt_engine.workers.adapters.vllm.quiet import not_applied
from ckpt_engine.workers.adapters.vllm.shards import worker_shards
from ckpt_engine.workers.adapters.vllm.worker import (
    WorkerReceiver,
    WorkerSettings,
    begin_reload,
    end_reload,
    load_version,
    members_of,
    reset_reload,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


@dataclass
class CkptEngineInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``init_weight_transfer_engine``. ``engine`` names this vLLM instance (its workers apply
    each version together; its driver names the same engine)."""

    endpoint: str
    engine: str
    token: str | None = None
    engine_key: str | None = None  # what the engine's driver was issued: admits these workers to the engine
    host_id: str | None = None
    poll_wait_s: float = 1.0
    take_timeout_s: float = 60.0
    apply_timeout_s: float = 600.0
    staging: str | None = None  # auto | device | host | stream: this engine's, over the deployment's
    sharded: bool = False  # each worker receives only its tensor-parallel slices (docs/workers.md)

    def __post_init__(self) -> None:
        if not self.endpoint or not self.engine:
            raise ValueError("init_info needs the daemon's endpoint and the engine's name")
        if self.staging is not None and self.staging not in STAGINGS:
            raise ValueError(f"init_info staging must be one of {', '.join(STAGINGS)}, got {self.staging!r}")


@dataclass
class CkptEngineUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``update_weights``: the version every worker has staged, and how long to wait for it."""

    version: int
    timeout_s: float = 60.0


class CkptEngineWeightTransferEngine(WeightTransferEngine[CkptEngineInitInfo, CkptEngineUpdateInfo]):
    init_info_cls = CkptEngineInitInfo
    update_info_cls = CkptEngineUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WorkerReceiver | None = None
        self._applying: int | None = None  # the version loaded in the open update
        self._shapes: dict[str, tuple[int, ...]] | None = None  # sharded: the checkpoint's full shapes

    def init_transfer_engine(self, init_info: CkptEngineInitInfo) -> None:
        if self.receiver is not None:  # a new init: a new registration (e.g. another daemon)
            self.receiver.close()
        settings = WorkerSettings(endpoint=init_info.endpoint, engine=init_info.engine,
                                  members=members_of(self.vllm_config), token=init_info.token,
                                  engine_key=init_info.engine_key,
                                  host_id=init_info.host_id, poll_wait_s=init_info.poll_wait_s,
                                  take_timeout_s=init_info.take_timeout_s, apply_timeout_s=init_info.apply_timeout_s,
                                  staging=init_info.staging)  # type: ignore[arg-type]
        spec, self._shapes = (worker_shards(self.model, self.vllm_config.model_config.model) if init_info.sharded
                              else (None, None))
        self.receiver = WorkerReceiver(settings, self.device, spec)
        log.info("ckpt-engine receiver %s started for engine %s", self.receiver.agent.agent_id, init_info.engine)

    def start_weight_update(self) -> None:
        self._receiver()
        self._applying = None
        begin_reload(self.model)

    def receive_weights(self, update_info: CkptEngineUpdateInfo) -> None:
        staged = self._receiver().staged
        payload = staged.take(update_info.version, update_info.timeout_s)
        self._applying = update_info.version
        try:
            load_version(self.model, payload, self._shapes)
        except BaseException as exc:  # the model may hold a mix now: torn until a whole version is applied
            staged.finish(update_info.version, exc)
            self._applying = None
            reset_reload(self.model, self.model_config)
            if not isinstance(exc, Exception):
                raise
            raise not_applied(exc, update_info.version) from exc  # reported: vLLM logs it in one line (quiet.py)

    def finish_weight_update(self) -> None:
        version, self._applying = self._applying, None
        staged = self._receiver().staged
        try:
            end_reload(self.model, self.model_config)
        except BaseException as exc:
            if version is not None:
                staged.finish(version, exc)
                if isinstance(exc, Exception):
                    raise not_applied(exc, version) from exc
            raise
        if version is not None:
            staged.finish(version)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def _receiver(self) -> WorkerReceiver:
        if self.receiver is None:
            raise CkptEngineError("init_weight_transfer_engine was not called (no daemon endpoint yet)")
        return self.receiver
