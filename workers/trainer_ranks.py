"""What the ranks of one training job tell each other at a step boundary, on the job's own process group:
rank 0's assignment (whether a version is due, and how to send it) and, for sparse versions, the merged change
flags. Every collective here runs under ``job_collective`` (bounded: a lost rank fails it, never hangs it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ckpt_engine.codec import MAX_MESSAGE_BYTES, decode, encode
from ckpt_engine.control.messages import Assignment
from ckpt_engine.errors import CkptEngineError, ProtocolError
from ckpt_engine.workers.fsdp import job_collective

_UNSENDABLE = -1  # the length rank 0 announces when its assignment cannot be encoded


class TrainerRanks:
    """The job's ``group`` (None: one rank, nothing to agree on)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1

    def global_rank(self, rank: int) -> int:
        if self.group is None:  # only asked with several trainer ranks, which have a group
            raise CkptEngineError("a trainer rank's global rank needs its process group, and this trainer has none")
        return dist.get_global_rank(self.group, rank)

    def broadcast_assignment(self, mine: Assignment | None) -> Assignment | None:
        """Rank 0's ``mine`` (None: nothing due) on every rank, in the one wire form: its length, then, when one
        is due, its bytes. Raises TrainerGroupError on every rank when a rank is lost, or when rank 0's
        assignment cannot be sent or read (the ranks would go on out of step)."""
        raw, unsendable = b"", None
        if mine is not None:
            try:
                raw = encode(mine)
            except (ProtocolError, ValueError, OverflowError) as exc:
                unsendable = f"{type(exc).__name__}: {exc}"
        device = group_device(self.group)
        with job_collective("agreeing on the next version"):
            length = torch.tensor([_UNSENDABLE if unsendable else len(raw)], dtype=torch.int64, device=device)
            dist.broadcast(length, src=self.global_rank(0), group=self.group)
            size = int(length.item())
            if size == _UNSENDABLE:
                raise CkptEngineError(f"rank 0's assignment could not be sent: {unsendable or 'see rank 0'}")
            if not 0 <= size <= MAX_MESSAGE_BYTES:
                raise ProtocolError(f"rank 0 announced an assignment of {size} bytes")
            if size:
                blob = torch.frombuffer(bytearray(raw or bytes(size)), dtype=torch.uint8).to(device)
                dist.broadcast(blob, src=self.global_rank(0), group=self.group)
                raw = blob.cpu().numpy().tobytes()
            if mine is not None or not size:
                return mine
            return decode(Assignment, raw)

    def all_reduce_max(self, vector: list[int]) -> list[int]:
        """Sparse versions: every rank's change flags merged."""
        reduced = torch.tensor(vector, dtype=torch.int64, device=group_device(self.group))
        with job_collective("agreeing on the changed tensors"):
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.group)
        return reduced.tolist()


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective on the trainer's group must live (NCCL/HCCL: the current device)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")
