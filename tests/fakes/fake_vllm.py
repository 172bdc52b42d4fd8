"""A fake vLLM server for tests: the native weight-transfer routes (dev mode) with their request schemas,
the start -> update -> finish lifecycle enforced, the version label published only after finish, and
tensors really received over the update group (NCCL engine semantics, gloo here).

Run: python -m tests.fakes.fake_vllm --port N [--fail-finish]
"""

from __future__ import annotations

from typing import Literal, Optional

from fastapi import FastAPI, HTTPException
from pydantic import Field

from tests.fakes.engine_base import Strict as _Strict
from tests.fakes.engine_base import UpdateGroup, add_state_route, serve


class NcclInitInfo(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


class InitWeightTransferEngineRequest(_Strict):
    init_info: NcclInitInfo


class NcclUpdateInfo(_Strict):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = Field(1 << 30, gt=0)
    packed_num_buffers: int = Field(2, gt=0)


class UpdateWeightsRequest(_Strict):
    update_info: NcclUpdateInfo


class FinishWeightUpdateRequest(_Strict):
    weight_version: Optional[str] = None


def create_app(fail_finish: bool) -> FastAPI:
    app = FastAPI()
    group = UpdateGroup()
    state = {"calls": [], "weights": {}, "staged": {}, "weight_version": "default", "paused": False,
             "updating": False}

    @app.post("/init_weight_transfer_engine")
    def init_engine(req: InitWeightTransferEngineRequest) -> dict:
        info = req.init_info
        state["calls"].append({"call": "init_weight_transfer_engine"})
        group.join(info.master_address, info.master_port, info.rank_offset, info.world_size,
                   "weight_update_group", "gloo")
        return {}

    @app.post("/pause")
    def pause(mode: Literal["abort", "wait", "keep"] = "abort") -> dict:
        state["calls"].append({"call": "pause", "mode": mode})
        state["paused"] = True
        return {}

    @app.post("/resume")
    def resume() -> dict:
        state["calls"].append({"call": "resume"})
        state["paused"] = False
        return {}

    @app.get("/is_paused")
    def is_paused() -> dict:
        return {"is_paused": state["paused"]}

    @app.post("/start_weight_update")
    def start() -> dict:
        state["calls"].append({"call": "start_weight_update"})
        if not state["paused"]:
            raise HTTPException(409, "pause the engine before updating weights")
        state["updating"], state["staged"] = True, {}
        return {}

    @app.post("/update_weights")
    def update(req: UpdateWeightsRequest) -> dict:
        info = req.update_info
        state["calls"].append({"call": "update_weights", "names": info.names})
        if not state["updating"]:
            raise HTTPException(409, "start_weight_update first")
        if info.packed:
            raise HTTPException(400, "this fake implements packed=False only")
        state["staged"].update(group.receive(info.names, info.dtype_names, info.shapes))
        return {}

    @app.post("/finish_weight_update")
    def finish(req: FinishWeightUpdateRequest) -> dict:
        state["calls"].append({"call": "finish_weight_update", "weight_version": req.weight_version})
        if not state["updating"]:
            raise HTTPException(409, "no weight update in progress")
        state["updating"] = False
        if fail_finish:
            raise HTTPException(500, "injected failure in finish_weight_update")
        state["weights"].update(state["staged"])
        if req.weight_version is not None:
            state["weight_version"] = req.weight_version  # published only after a successful finish
        return {}

    @app.get("/weight_info")
    def weight_info() -> dict:
        return {"weight_version": state["weight_version"], "num_params": len(state["weights"])}

    add_state_route(app, state)
    return app


if __name__ == "__main__":
    serve(create_app, "fail-finish")
