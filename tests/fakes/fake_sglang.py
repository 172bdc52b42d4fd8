"""A fake SGLang server mirroring sglang 0.5.23, which cannot be installed on a CPU-only machine (its wheel
pins CUDA packages). Read from its wheel (paths in the sglang package):

- request bodies: ``srt/managers/io_struct.py`` (msgspec Structs: unknown keys are ignored, ints coerced from
  strings, a body is required; a bad one is a 400 ``{"object": "error", ...}``, not a 422);
- routes and replies: ``srt/entrypoints/http_server.py`` (200 / 400 with ``{"success", "message"}``;
  pause and continue always 200 ``{"message", "status": "ok"}``; ``GET /model_info`` has ``weight_version``,
  initially ``"default"``);
- an update runs only inside ``begin_weight_update`` / ``end_weight_update``, and is refused before any
  broadcast is posted otherwise (``scheduler_components/weight_updater.py``);
- the update group is joined the way ``srt/utils/common.py: init_custom_process_group`` joins it: torch's
  ``tcp://`` rendezvous (rank 0 hosts the store), ``PrefixStore(group_name, store)``, then torch's own
  ``_new_process_group_helper`` with that group name (gloo here, standing in for NCCL), rank = rank_offset +
  tp_rank; tensors arrive one broadcast per name, in order, names / dtypes / shapes zipped without a length
  check; ``weight_version`` is recorded after a successful update only when it is not null;
- a flush (``flush_cache``) refuses while generation is paused ``in_place`` (requests still there).

Run: python -m tests.fakes.fake_sglang --port N [--fail-second-update]
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any, Literal

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

_TIMEOUT = datetime.timedelta(seconds=60)


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")  # msgspec's typed dict: unknown keys dropped
    rid: str | None = None  # every BaseReq has these two
    http_worker_ipc: str | None = None


class InitWeightsUpdateGroupReqInput(_Req):  # io_struct.py:2126
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Req):  # io_struct.py:2146
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(_Req):  # io_struct.py:2002
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class PauseGenerationReqInput(_Req):  # io_struct.py:1927
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Req):  # io_struct.py:1949
    torch_empty_cache: bool = True


class BeginWeightUpdateReqInput(_Req):  # io_struct.py:2197
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(_Req):  # io_struct.py:2208
    pass


class UpdateGroup:
    def __init__(self) -> None:
        self.groups: dict[str, Any] = {}

    def join(self, req: InitWeightsUpdateGroupReqInput, tp_rank: int = 0) -> None:
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world
        from torch.distributed.rendezvous import rendezvous

        if not dist.is_initialized():  # SGLang's worker has its default (tensor-parallel) group already
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        rank = req.rank_offset + tp_rank
        store, rank, world_size = next(rendezvous(f"tcp://{req.master_address}:{req.master_port}", rank,
                                                  req.world_size, timeout=_TIMEOUT))
        store.set_timeout(_TIMEOUT)
        store = dist.PrefixStore(req.group_name, store)
        backend = "gloo" if req.backend == "nccl" else req.backend  # CPU stand-in for NCCL
        pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=req.group_name,
                                          backend_options=None, timeout=_TIMEOUT, device_id=None)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        self.groups[req.group_name] = pg

    def destroy(self, group_name: str) -> tuple[bool, str]:  # model_runner_components/weight_updater.py:146
        try:
            if group_name in self.groups:
                dist.destroy_process_group(self.groups.pop(group_name))
                return True, "Succeeded to destroy custom process group."
            return False, "The group to be destroyed does not exist."
        except Exception as exc:  # noqa: BLE001 - as SGLang
            return False, f"Failed to destroy custom process group: {exc}."

    def receive(self, req: UpdateWeightsFromDistributedReqInput) -> dict[str, torch.Tensor]:
        pg = self.groups[req.group_name]
        out, works = {}, []
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):  # not strict, as in SGLang
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            works.append(dist.broadcast(weight, src=0, group=pg, async_op=True))
            out[name] = weight
        for work in works:
            work.wait()
        return out


def checksum(tensor: torch.Tensor) -> str:
    return hashlib.sha256(bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())).hexdigest()


def create_app(fail_second_update: bool) -> FastAPI:
    app = FastAPI()
    group = UpdateGroup()
    state: dict[str, Any] = {"calls": [], "weights": {}, "weight_version": "default", "paused": None,
                             "session": False, "updates": 0}

    @app.exception_handler(RequestValidationError)
    def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"object": "error", "message": str(exc.errors()), "type": "Bad Request", "param": None,
                             "code": 400}, status_code=400)

    def answer(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/init_weights_update_group")
    def init_group(req: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        state["calls"].append({"call": "init_weights_update_group", **req.model_dump()})
        if req.group_name in group.groups:
            return answer(False, "Failed to initialize custom process group: group name has already been created.")
        try:
            group.join(req)
        except Exception as exc:  # noqa: BLE001 - SGLang catches everything after its asserts
            return answer(False, f"Failed to initialize custom process group: {exc}.")
        return answer(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    def destroy_group(req: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        state["calls"].append({"call": "destroy_weights_update_group", "group_name": req.group_name})
        return answer(*group.destroy(req.group_name))

    @app.post("/pause_generation")
    def pause(req: PauseGenerationReqInput) -> dict:
        state["calls"].append({"call": "pause_generation", "mode": req.mode})
        state["paused"] = req.mode
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    def resume(req: ContinueGenerationReqInput) -> dict:
        state["calls"].append({"call": "continue_generation"})
        state["paused"] = None
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/begin_weight_update")
    def begin(req: BeginWeightUpdateReqInput) -> JSONResponse:
        state["calls"].append({"call": "begin_weight_update"})
        if state["session"]:
            return answer(False, "a weight-update session is already open; call end_weight_update() first")
        state["session"] = True
        return answer(True, "Success")

    @app.post("/end_weight_update")
    def end(req: EndWeightUpdateReqInput) -> JSONResponse:
        state["calls"].append({"call": "end_weight_update"})
        if not state["session"]:
            return answer(False, "no weight-update session is open; call begin_weight_update() first")
        state["session"] = False
        return answer(True, "Success")

    @app.post("/update_weights_from_distributed")
    def update(req: UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        state["calls"].append({"call": "update_weights_from_distributed", "names": req.names,
                               "weight_version": req.weight_version, "flush_cache": req.flush_cache})
        if not state["session"]:  # refused before any broadcast is posted
            return answer(False, "update_weights_from_distributed must run between begin_weight_update() and "
                                 "end_weight_update()")
        if req.group_name not in group.groups:
            return answer(False, f"Group {req.group_name} not in {list(group.groups)}. Please call "
                                 "`init_weights_update_group` first.")
        try:  # scheduler_components/weight_updater.py:199-211
            received = group.receive(req)
        except Exception as exc:  # noqa: BLE001 - as SGLang: nothing of this batch was loaded
            return answer(False, f"Failed to receive weights: {exc}")
        state["updates"] += 1
        if fail_second_update and state["updates"] == 2:
            return answer(False, "Failed to receive weights: injected failure (the first batch was applied)")
        state["weights"].update(received)
        if req.weight_version is not None:
            state["weight_version"] = req.weight_version
        if req.flush_cache and state["paused"] == "in_place":
            return answer(False, "Weights were updated, but the cache was not flushed because requests are still "
                                 "running or queued. Retract or finish them, then call /flush_cache.")
        return answer(True, "Succeeded to update parameter online.")

    @app.get("/model_info")
    def model_info() -> dict:
        return {"model_path": "fake", "is_generation": True, "weight_version": state["weight_version"]}

    @app.get("/_fake/state")
    def fake_state() -> dict:
        return {"calls": state["calls"], "paused": state["paused"], "weight_version": state["weight_version"],
                "session": state["session"], "checksums": {k: checksum(v) for k, v in state["weights"].items()}}

    return app


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail-second-update", action="store_true")
    args = parser.parse_args()
    uvicorn.run(create_app(args.fail_second_update), host="127.0.0.1", port=args.port, log_level="warning")
