"""A fake SGLang server for tests: the real weight-update endpoints with their request schemas (unknown
fields rejected), the pause/continue flow enforced, and tensors really received over the update group.

Run: python -m tests.fakes.fake_sglang --port N [--fail-update]
"""

from __future__ import annotations

from typing import Literal, Optional

from fastapi import FastAPI, HTTPException

from tests.fakes.engine_base import Strict as _Strict
from tests.fakes.engine_base import UpdateGroup, add_state_route, serve


class InitWeightsUpdateGroupReqInput(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None
    torch_empty_cache: bool = False


class PauseGenerationReqInput(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Strict):
    torch_empty_cache: bool = True


def create_app(fail_update: bool) -> FastAPI:
    app = FastAPI()
    group = UpdateGroup()
    state = {"calls": [], "weights": {}, "weight_version": None, "paused": False}

    @app.post("/init_weights_update_group")
    def init_group(req: InitWeightsUpdateGroupReqInput) -> dict:
        state["calls"].append({"call": "init_weights_update_group", **req.model_dump()})
        group.join(req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/pause_generation")
    def pause(req: PauseGenerationReqInput) -> dict:
        state["calls"].append({"call": "pause_generation", "mode": req.mode})
        state["paused"] = True
        return {}

    @app.post("/continue_generation")
    def resume(req: ContinueGenerationReqInput) -> dict:
        state["calls"].append({"call": "continue_generation"})
        state["paused"] = False
        return {}

    @app.post("/update_weights_from_distributed")
    def update(req: UpdateWeightsFromDistributedReqInput) -> dict:
        state["calls"].append({"call": "update_weights_from_distributed", "names": req.names,
                               "weight_version": req.weight_version, "flush_cache": req.flush_cache})
        if req.group_name != group.group_name:
            raise HTTPException(400, f"unknown group {req.group_name}")
        received = group.receive(req.names, req.dtypes, req.shapes)  # always drain: the sender is broadcasting
        if fail_update:
            return {"success": False, "message": "injected failure: weights not applied"}
        state["weights"].update(received)
        if req.weight_version is not None:
            state["weight_version"] = req.weight_version
        return {"success": True, "message": "Succeeded to update model weights."}

    @app.get("/model_info")
    def model_info() -> dict:
        return {"model_path": "fake", "is_generation": True, "weight_version": state["weight_version"]}

    add_state_route(app, state)
    return app


if __name__ == "__main__":
    serve(create_app, "fail-update")
