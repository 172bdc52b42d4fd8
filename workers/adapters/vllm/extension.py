"""The older way in: ``--worker-extension-cls ckpt_engine.workers.adapters.vllm.CkptEngineWorkerExtension``
(or ``LLM(..., worker_extension_cls=...)``), for vLLM deployments without the weight-transfer backend.

Every worker runs a receiver that verifies and stages versions; a staged version is applied on the worker's
own thread by ``collective_rpc("ckpt_engine_apply", args=(version,))``, inside vLLM's layerwise reload (a
processed model cannot take ``load_weights`` directly). ckpt-engine's driver makes that call when every worker
has staged the version (workers/adapters/vllm/control.py, ``ExtensionControl``).

    driver = EngineDriver(ExtensionControl(llm), "tcp://daemon:8766", engine="vllm-0").start()
    llm.collective_rpc("ckpt_engine_start", args=("tcp://daemon:8766",),
                       kwargs={"engine": "vllm-0", "engine_key": driver.engine_key})

(``start_vllm_driver(ExtensionControl(llm), ...)`` does both.)
"""

from __future__ import annotations

import socket
from typing import Any

from ckpt_engine.errors import CkptEngineError
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


class CkptEngineWorkerExtension:
    """Mixed into vLLM's worker class; vLLM provides ``self.model_runner``, ``self.vllm_config``, ``self.device``."""

    def ckpt_engine_start(self, endpoint: str, token: str | None = None, engine: str | None = None,
                          poll_wait_s: float = 1.0, take_timeout_s: float = 60.0, engine_key: str | None = None,
                          staging: str | None = None, sharded: bool = False) -> str:
        """Start this worker's receiver (once); returns its agent id. ``engine_key``: the engine's driver's;
        ``staging``: this engine's staging policy (auto, device, host, stream; default: the deployment's);
        ``sharded``: receive only this worker's slices of each checkpoint tensor (its TP rank's, derived from
        the live model's layers against the checkpoint's shapes: shards.py)."""
        receiver: WorkerReceiver | None = getattr(self, "_ckpt_engine_receiver", None)
        if receiver is None:
            settings = WorkerSettings(endpoint=endpoint, engine=engine or default_engine_name(),
                                      members=members_of(self.vllm_config), token=token,  # type: ignore[attr-defined]
                                      engine_key=engine_key, staging=staging,  # type: ignore[arg-type]
                                      poll_wait_s=poll_wait_s, take_timeout_s=take_timeout_s)
            spec = None
            if sharded:
                spec, self._ckpt_engine_shapes = worker_shards(self.model_runner.model,  # type: ignore[attr-defined]
                                                               self.vllm_config.model_config.model)  # type: ignore[attr-defined]
            receiver = WorkerReceiver(settings, self.device, spec)  # type: ignore[attr-defined]
            self._ckpt_engine_receiver: WorkerReceiver | None = receiver
        return receiver.agent.agent_id

    def ckpt_engine_apply(self, version: int, timeout_s: float = 60.0) -> int:
        """Apply the staged ``version`` to the model (on this worker's thread, between forward passes)."""
        from vllm.config import set_current_vllm_config

        staged = self._ckpt_engine().staged
        payload = staged.take(version, timeout_s)
        model = self.model_runner.model  # type: ignore[attr-defined]
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            try:
                begin_reload(model)
                load_version(model, payload, getattr(self, "_ckpt_engine_shapes", None))
                end_reload(model, model_config)
            except BaseException as exc:  # the model may hold a mix now: torn until a whole version is applied
                staged.finish(version, exc)
                reset_reload(model, model_config)
                if not isinstance(exc, Exception):
                    raise
                raise not_applied(exc, version) from exc  # reported: vLLM logs it in one line (quiet.py)
        staged.finish(version)
        self._ckpt_engine_version = version
        return version

    def ckpt_engine_status(self) -> dict[str, Any]:
        receiver: WorkerReceiver | None = getattr(self, "_ckpt_engine_receiver", None)
        return {"agent_id": receiver.agent.agent_id if receiver else None,
                "staged": receiver.staged.staged if receiver else None,
                "version": getattr(self, "_ckpt_engine_version", None)}

    def ckpt_engine_stop(self) -> None:
        receiver: WorkerReceiver | None = getattr(self, "_ckpt_engine_receiver", None)
        if receiver is not None:
            receiver.close()
            self._ckpt_engine_receiver = None

    def _ckpt_engine(self) -> WorkerReceiver:
        receiver: WorkerReceiver | None = getattr(self, "_ckpt_engine_receiver", None)
        if receiver is None:
            raise CkptEngineError("call ckpt_engine_start first")
        return receiver


def default_engine_name() -> str:
    return f"vllm-{socket.gethostname()}"
