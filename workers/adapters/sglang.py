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

from ckpt_engine.dtypes import dtype_name
from ckpt_engine.receiver import VersionPayload
from ckpt_engine.workers.adapters.engine_http import Batch, EngineHttpAdapter, EngineUpdateError
from ckpt_engine.workers.adapters.push_group import PushGroup, PushSettings

__all__ = ["EngineUpdateError", "SGLangAdapter"]


class SGLangAdapter(EngineHttpAdapter):
    def __init__(self, base_url: str, push: PushSettings, *, pause_mode: str = "retract",
                 api_key: str | None = None, group: PushGroup | None = None) -> None:
        super().__init__(base_url, push, pause_mode=pause_mode, api_key=api_key, group=group)

    def connect(self) -> None:
        """Create the update group on the server and join it from here, concurrently."""
        body = {"master_address": self.push.master_address, "master_port": self.push.master_port,
                "rank_offset": 1, "world_size": self.push.world_size, "group_name": self.push.group_name,
                "backend": self.push.backend}
        self.join_while(lambda: self.post("/init_weights_update_group", body))

    def load(self, payload: VersionPayload) -> None:
        """LoadFn: push one verified version; raises (so the receiver reports failure) if SGLang refuses it."""

        def update(batch: Batch, last: bool) -> dict:
            return self.post("/update_weights_from_distributed", {
                "names": [n for n, _ in batch], "dtypes": [dtype_name(t.dtype) for _, t in batch],
                "shapes": [list(t.shape) for _, t in batch], "group_name": self.push.group_name,
                "weight_version": str(payload.version), "flush_cache": last})

        self.post("/pause_generation", {"mode": self.pause_mode})
        try:
            self.push_batches(payload, update)
            self.version = payload.version
        finally:
            self.post("/continue_generation", {})

    def weight_version(self) -> str | None:
        """The version label SGLang reports (``GET /model_info``)."""
        return self.get("/model_info").get("weight_version")
