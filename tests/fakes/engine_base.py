"""What the fake inference servers share: the update group (joined the way SGLang and vLLM join theirs:
a TCP store client at master_address:master_port, prefix '<group_name>/', this worker's rank = rank_offset)
and receiving named tensors by broadcast from rank 0, in request order."""

from __future__ import annotations

import datetime
import hashlib
import threading

import torch
import torch.distributed as dist
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict

from ckpt_engine.dtypes import DTYPE_BY_NAME


class Strict(BaseModel):
    """Request bodies as the real servers define them; a field they do not know is an error here."""

    model_config = ConfigDict(extra="forbid")


class UpdateGroup:
    def __init__(self) -> None:
        self.pg = None
        self.group_name: str | None = None
        self.lock = threading.Lock()

    def join(self, address: str, port: int, rank: int, world_size: int, group_name: str, backend: str) -> None:
        if backend not in ("gloo", "nccl"):
            raise HTTPException(400, f"unsupported backend {backend}")
        store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        prefixed = dist.PrefixStore(f"{group_name}/", store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)  # CPU stand-in for NCCL
        self.group_name = group_name

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        if self.pg is None:
            raise HTTPException(400, "no update group: call the init endpoint first")
        if not len(names) == len(dtypes) == len(shapes):
            raise HTTPException(400, "names, dtypes and shapes differ in length")
        out = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            if dtype not in DTYPE_BY_NAME:  # the real servers do getattr(torch, dtype)
                raise HTTPException(400, f"unknown dtype {dtype!r}")
            tensor = torch.empty(shape, dtype=DTYPE_BY_NAME[dtype])
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.pg.broadcast([tensor], opts).wait(datetime.timedelta(seconds=60))
            out[name] = tensor
        return out


def checksum(tensor: torch.Tensor) -> str:
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(bytes(flat.tolist())).hexdigest()


def add_state_route(app: FastAPI, state: dict) -> None:
    """GET /_fake/state: what the fake server was asked and what it holds, for the tests to inspect."""

    @app.get("/_fake/state")
    def fake_state() -> dict:
        return {"calls": state["calls"], "paused": state["paused"], "weight_version": state["weight_version"],
                "checksums": {k: checksum(v) for k, v in state["weights"].items()}}


def serve(create_app, failure_flag: str) -> None:
    """``python -m tests.fakes.<server> --port N [--<failure_flag>]``"""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(f"--{failure_flag}", action="store_true")
    args = parser.parse_args()
    uvicorn.run(create_app(getattr(args, failure_flag.replace("-", "_"))), host="127.0.0.1", port=args.port,
                log_level="warning")
