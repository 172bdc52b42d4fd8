"""SGLang adapter: applies verified versions to a running SGLang server over its HTTP API.

    adapter = SGLangAdapter("http://127.0.0.1:30000", PushSettings("127.0.0.1", 29600, world_size=1 + tp))
    adapter.connect()                              # init_weights_update_group, concurrent with our join
    RolloutAgent(adapter.load, endpoint).start()

Per version: ``pause_generation`` -> batches of ``update_weights_from_distributed`` (names, dtypes, shapes,
group_name, weight_version, flush_cache on the last batch), each concurrent with our broadcasts ->
``continue_generation`` (always, also after a failure). A reply without ``success`` is a failure, so the
receiver reports the version failed and the daemon records it. No sglang import anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from ckpt_engine.errors import CkptEngineError
from ckpt_engine.receiver import VersionPayload
from ckpt_engine.dtypes import dtype_name
from ckpt_engine.workers.adapters.push_group import PushGroup, PushSettings, chunks, push_while, unique_tensors

log = logging.getLogger(__name__)


class EngineUpdateError(CkptEngineError):
    """The inference engine refused or failed an update."""


class SGLangAdapter:
    def __init__(self, base_url: str, push: PushSettings, *, pause_mode: str = "retract",
                 api_key: str | None = None, group: PushGroup | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=push.timeout_s)
        self.push = push
        self.pause_mode = pause_mode
        self.group = group or PushGroup(push)
        self.version: int | None = None

    def connect(self) -> None:
        """Create the update group on the server and join it from here, concurrently."""
        body = {"master_address": self.push.master_address, "master_port": self.push.master_port,
                "rank_offset": 1, "world_size": self.push.world_size, "group_name": self.push.group_name,
                "backend": self.push.backend}
        push_while(lambda: self._post("/init_weights_update_group", body), self.group.join, self.push.timeout_s)

    def load(self, payload: VersionPayload) -> None:
        """LoadFn: push one verified version; raises (so the receiver reports failure) if SGLang refuses it."""
        self._post("/pause_generation", {"mode": self.pause_mode})
        try:
            batches = chunks(unique_tensors(payload.tensors), self.push.chunk_bytes)
            for index, batch in enumerate(batches):
                body = {"names": [n for n, _ in batch], "dtypes": [dtype_name(t.dtype) for _, t in batch],
                        "shapes": [list(t.shape) for _, t in batch], "group_name": self.push.group_name,
                        "weight_version": str(payload.version), "flush_cache": index == len(batches) - 1}
                push_while(lambda: self._post("/update_weights_from_distributed", body),
                           lambda: self.group.broadcast(t for _, t in batch), self.push.timeout_s)
            self.version = payload.version
        finally:
            self._post("/continue_generation", {})

    def weight_version(self) -> str | None:
        """The version label SGLang reports (``GET /model_info``)."""
        return self._get("/model_info").get("weight_version")

    def close(self) -> None:
        self.group.close()
        self.http.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return _checked(self.http.post(path, json=body), path)

    def _get(self, path: str) -> dict[str, Any]:
        return _checked(self.http.get(path), path)


def _checked(response: httpx.Response, path: str) -> dict[str, Any]:
    if response.status_code >= 400:
        raise EngineUpdateError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
    try:
        body = response.json() if response.content else {}
    except ValueError:
        body = {}
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineUpdateError(f"{path}: engine reports failure: {body.get('message')}")
    return body if isinstance(body, dict) else {}
