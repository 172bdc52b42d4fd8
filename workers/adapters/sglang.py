"""SGLang adapter: applies verified versions to a running SGLang server over its HTTP API.

    adapter = SGLangAdapter("http://127.0.0.1:30000", PushSettings("127.0.0.1", 29600, world_size=1 + tp))
    adapter.connect()                              # init_weights_update_group, concurrent with our join
    RolloutAgent(adapter.load, endpoint).start()

Schema-exact with SGLang 0.5.23 (``srt/managers/io_struct.py``, ``srt/entrypoints/http_server.py``); read,
not run: SGLang does not install on a CPU-only machine. Per version:

    pause_generation {mode: retract} -> begin_weight_update {} -> per batch, update_weights_from_distributed
    {names, dtypes, shapes, group_name, flush_cache, weight_version} while the batch is broadcast (one tensor
    per name, in order) -> end_weight_update {} -> continue_generation {}

``flush_cache`` and ``weight_version`` go with the last batch only: SGLang applies ``weight_version`` after
every successful request, so sending it earlier would label the server with the new version before its
last batch landed (and a flush refuses while requests wait, failing a batch that was applied).

No torn model: a batch that fails after an earlier one was applied leaves SGLang with a mix; the adapter then
keeps generation paused and reports the load torn, and the daemon re-sends the version this receiver served
last; once a version applies whole, generation continues. A failure before any weight was sent changes
nothing: generation continues and the version is refused.
"""

from __future__ import annotations

from typing import Any

import httpx
import torch

from ckpt_engine.plan.dtypes import dtype_name
from ckpt_engine.errors import ApplyRefused
from ckpt_engine.receive.collective import VersionPayload
from ckpt_engine.workers.adapters.engine_http import EngineUpdateError, checked
from ckpt_engine.workers.adapters.push_group import PushGroup, PushSettings, chunks, push_while, unique_tensors

__all__ = ["EngineUpdateError", "SGLangAdapter"]
Batch = list[tuple[str, torch.Tensor]]


class SGLangAdapter:
    def __init__(self, base_url: str, push: PushSettings, *, pause_mode: str = "retract",
                 api_key: str | None = None, group: PushGroup | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=push.timeout_s)
        self.push = push
        self.pause_mode = pause_mode  # "in_place" keeps requests, and then no flush can succeed: retract
        self.group = group or PushGroup(push)
        self.version: int | None = None
        self.torn: str | None = None  # SGLang holds a mix: generation stays paused until a whole version

    def connect(self) -> None:
        """Create the update group on the server and join it from here, concurrently (they rendezvous)."""
        body = {"master_address": self.push.master_address, "master_port": self.push.master_port,
                "rank_offset": 1, "world_size": self.push.world_size, "group_name": self.push.group_name,
                "backend": self.push.backend}
        push_while(lambda: self.post("/init_weights_update_group", body), self.group.join, self.push.timeout_s)

    def load(self, payload: VersionPayload) -> None:
        """LoadFn: push one verified version; raises if SGLang refuses it (ApplyRefused when nothing changed)."""
        if self.torn is None:
            self.post("/pause_generation", {"mode": self.pause_mode})
        sent = False
        try:
            self.post("/begin_weight_update", {})
            batches = chunks(unique_tensors(payload.tensors), self.push.chunk_bytes)
            for index, batch in enumerate(batches):
                last = index == len(batches) - 1
                sent = True
                push_while(lambda: self.post("/update_weights_from_distributed", _update(batch, self.push.group_name,
                                                                                        last, payload.version)),
                           lambda: self.group.broadcast(t for _, t in batch), self.push.timeout_s)
            self.post("/end_weight_update", {})
        except Exception as exc:
            self._close_session()
            if sent:  # some weights may have landed: a mix is not served
                self.torn = f"version {payload.version} failed part way: {exc}"
                self.version = None
                raise
            if self.torn is None:
                self.post("/continue_generation", {})
            raise ApplyRefused(f"SGLang refused version {payload.version} before any weight was sent: {exc}") from exc
        self.version, self.torn = payload.version, None
        self.post("/continue_generation", {})

    def weight_version(self) -> str | None:
        """The version label SGLang reports (``GET /model_info``)."""
        return checked(self.http.get("/model_info"), "/model_info").get("weight_version")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return checked(self.http.post(path, json=body), path)

    def close(self) -> None:
        self.group.close()
        self.http.close()

    def _close_session(self) -> None:
        try:
            self.post("/end_weight_update", {})
        except EngineUpdateError:  # no session open (it failed before one), or the server is gone
            pass


def _update(batch: Batch, group_name: str, last: bool, version: int) -> dict[str, Any]:
    """``UpdateWeightsFromDistributedReqInput`` of one batch."""
    return {"names": [name for name, _ in batch], "dtypes": [dtype_name(t.dtype) for _, t in batch],
            "shapes": [list(t.shape) for _, t in batch], "group_name": group_name, "flush_cache": last,
            "weight_version": str(version) if last else None}
