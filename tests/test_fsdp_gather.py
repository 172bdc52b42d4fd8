"""Bucketed all-gather of FSDP2 shards equals DTensor.full_tensor(), also for uneven and empty shards."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.workers.fsdp import rows_per_rank
from tests.daemon_harness import free_port
from tests.procs import run_processes


def test_rows_follow_torch_chunk() -> None:
    for dim0 in range(12):
        for world in (1, 2, 3, 4):
            expected = [c.shape[0] for c in torch.arange(dim0).chunk(world)] if dim0 else []
            expected += [0] * (world - len(expected))
            assert rows_per_rank(dim0, world) == expected


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 3)        # weight rows 3 -> [2, 1]; bias 3
        self.b = nn.Linear(4, 1)        # weight rows 1 -> [1, 0]
        self.c = nn.Parameter(torch.randn(7, 2).bfloat16())
        self.d = nn.Parameter(torch.randn(1))  # rows [1, 0]: an empty shard on rank 1
        self.register_buffer("steps", torch.arange(3))  # a plain (unsharded) tensor in the same buckets
        self.e = nn.Parameter(torch.randn(9, 5))  # 180 bytes: three pieces of 64-byte buckets, cut mid-row
        self.f = nn.Parameter(torch.randn(11, 3).bfloat16())  # 66 bytes: two pieces, rows [6, 5]


def gather_rank(rank: int, port: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import specs_of
    from ckpt_engine.workers.fsdp import ShardedTensors, sharded_tensors_of

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    model = Odd()
    fully_shard(model)
    named = sharded_tensors_of(model)
    assert isinstance(named, ShardedTensors)
    from ckpt_engine.plan.tensors import byte_view, piece_of

    layout = plan_layout(specs_of(named.tensors), bucket_size=64, alignment=8)
    gathered, pieces = {}, {}
    for bucket in layout.buckets:
        got = named.bucket_tensors(bucket)
        for slot in bucket.slots:
            if slot.is_piece:  # only the piece's elements are gathered: put them together here
                part = piece_of(got[slot.name], slot)
                assert part.numel() * part.element_size() == slot.nbytes
                pieces.setdefault(slot.name, []).append(byte_view(part.contiguous()).clone())
                if slot.part == slot.parts - 1:
                    dtype = named.tensors[slot.name].dtype
                    gathered[slot.name] = torch.cat(pieces[slot.name]).view(dtype).view(slot.shape)
            else:
                gathered[slot.name] = got[slot.name].clone()
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in named.tensors.items()}
    dist.destroy_process_group()
    same = {k: torch.equal(gathered[k].view(torch.uint8) if gathered[k].dim() else gathered[k],
                           full[k].view(torch.uint8) if full[k].dim() else full[k]) for k in full}
    return {"same": same, "buckets": len(layout.buckets), "chunked": sorted(s.name for s in layout.slots if s.chunked)}


@pytest.mark.multiproc
def test_bucketed_gather_matches_full_tensor() -> None:
    port = free_port()
    r0, r1 = run_processes([(gather_rank, (0, port)), (gather_rank, (1, port))], timeout_s=120)
    assert r0["buckets"] > 1 and r0["chunked"] == ["e", "f"]
    for result in (r0, r1):
        assert result["same"] and all(result["same"].values()), result["same"]
