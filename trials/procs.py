"""The processes of a fault trial, each started as ``python -m ckpt_engine.trials.procs ROLE JSON_ARGS`` so the
harness can kill -9, SIGSTOP and restart any of them independently.

- ``trainer``: one rank of a 2-rank FSDP2 (``fully_shard``, gloo) job training a small MLP on random data
  and serving versions at step boundaries through a ``TrainerAgent``. When its peer dies, its next
  collective times out after ``pg_timeout_s`` and it exits (code 3), as a torchrun worker would.
- ``receiver``: a ``RolloutAgent`` holding the same MLP unsharded. After every load it computes the digest
  of its own weights and appends ``{version, manifest_digest, model_digest}`` to its log, the evidence for
  the invariant "no receiver ever applied a version whose digest differs from the manifest". The harness
  arms faults at a stage of its receive path by writing ``receiverN.arm``: ``refuse`` (its engine refuses
  the next version before changing anything), ``torn`` (the next apply fails half way), ``disarm`` (whatever
  is armed and not yet met), ``alloc`` (its
  address space is capped so the next staging cannot be allocated) and ``unalloc`` (the cap is lifted).

Both run until the file ``stop`` appears in their work directory.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

WIDTH, DEPTH = 256, 6


def build_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


class EventLog:
    """Append-only JSON lines, flushed per line (a kill -9 loses at most the line being written)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)

    def write(self, **fields) -> None:
        self._file.write(json.dumps({"t": time.time(), **fields}) + "\n")


def trainer(args: dict) -> int:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ckpt_engine.workers.trainer_agent import TrainerAgent

    workdir, rank = Path(args["workdir"]), int(args["rank"])
    log = EventLog(workdir / f"trainer{rank}.jsonl")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['pg_port']}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=args["pg_timeout_s"]))
    model = build_model(seed=0)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    # frozen layers: half the model never changes, so sparse versions have something to skip
    optimizer = torch.optim.SGD([p for layer in list(model)[: DEPTH // 2] for p in layer.parameters()], lr=1e-3)
    agent = TrainerAgent(model, args["zmq"], poll_wait_s=0.3).start()
    log.write(event="started", pid=os.getpid())
    gen = torch.Generator().manual_seed(rank)
    step = 0
    try:
        while not (workdir / "stop").exists():
            step += 1
            batch = torch.randn(8, WIDTH, generator=gen)
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            version = agent.step(step)
            if version is not None:
                log.write(event="served", version=version, step=step)
            time.sleep(0.02)
    except Exception as exc:  # noqa: BLE001 - a collective that timed out because a peer died or stalled
        log.write(event="exit", reason=f"{type(exc).__name__}: {exc}"[:300])
        os._exit(3)  # like a torchrun worker: the job is restarted as a whole
    agent.wait_idle(30)
    agent.close()
    dist.destroy_process_group()
    return 0


class _ArmedAdapter:
    """The receiver's ModuleAdapter with the faults the harness arms (see the module doc)."""

    def __init__(self, model: nn.Module, arm_file: Path, log: EventLog) -> None:
        from ckpt_engine.workers.adapters.torch_module import ModuleAdapter

        self.arm_file, self.log = arm_file, log
        self.armed: str | None = None
        armed = self

        class Adapter(ModuleAdapter):
            copied = 0

            def load(self, payload) -> None:
                self.copied = 0
                self.half = max(1, len(payload.tensors) // 2)
                super().load(payload)

            def _copy(self, name: str, target: torch.Tensor, source: torch.Tensor) -> None:
                super()._copy(name, target, source)
                self.copied += 1
                if armed.armed == "torn" and self.copied == self.half:  # half of what it carries is new
                    armed.armed = None
                    raise RuntimeError("injected: the engine failed half way through the apply")

        self.adapter = Adapter(model)

    def check(self, agent) -> None:
        """Read an armed fault (a watcher thread calls this every 0.1 s)."""
        if not self.arm_file.exists():
            return
        fault = self.arm_file.read_text().strip()
        self.arm_file.unlink()
        self.log.write(event="armed", fault=fault)
        if fault == "alloc":
            import resource

            assembler = getattr(agent, "_shared_assembler", None)
            if assembler is not None:  # the next version allocates its staging anew, under the cap
                assembler._staging = None
                assembler._view_cache.clear()
            used = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (used + (16 << 20), resource.RLIM_INFINITY))
        elif fault == "unalloc":
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        elif fault == "disarm":  # the trial is over: a fault its version never met does not leak into the next
            self.armed = None
        else:
            self.armed = fault

    def load(self, payload) -> None:
        from ckpt_engine.errors import ApplyRefused

        if self.armed == "refuse":
            self.armed = None
            raise ApplyRefused("injected: the engine refused the version before changing anything")
        self.adapter.load(payload)


def receiver(args: dict) -> int:
    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.send.publisher import version_digest_of
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    workdir, index = Path(args["workdir"]), int(args["index"])
    log = EventLog(workdir / f"receiver{index}.applied.jsonl")
    model = build_model(seed=100 + index)
    armed = _ArmedAdapter(model, workdir / f"receiver{index}.arm", EventLog(workdir / f"receiver{index}.faults.jsonl"))
    agent: RolloutAgent | None = None

    def load(payload) -> None:
        armed.load(payload)
        settings = agent.settings if agent is not None else None
        bucket = settings.bucket_size if settings else 1 << 20
        alignment = settings.alignment if settings else 256
        digest = version_digest_of(named_tensors_of(model), bucket_size=bucket, alignment=alignment)
        log.write(receiver=index, version=payload.version, sparse=payload.sparse,
                  manifest_digest=payload.version_digest, model_digest=digest)

    agent = RolloutAgent(load, args["zmq"], poll_wait_s=0.3)
    agent.start()
    while not (workdir / "stop").exists():
        armed.check(agent)
        time.sleep(0.1)
    agent.close()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the trials ask for stacks when a sync hangs
    torch.set_num_threads(1)
    role, args = argv[0], json.loads(argv[1])
    return {"trainer": trainer, "receiver": receiver}[role](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
