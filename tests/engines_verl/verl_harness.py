"""Drives the ckpt_engine verl backend exactly as verl 0.9.1's CheckpointEngineManager.update_weights does
(prepare on every actor rank and rollout worker -> build_topology in the driver -> init_process_group on all ->
send_weights on every actor rank and receive_weights on every rollout worker at once -> finalize), with each
actor rank and rollout worker a process of its own (gloo). The backend is constructed by verl's own registry,
as verl constructs it (actor ranks with is_master, rollout workers without), and the rollout side reads
receive_weights() through verl's own ensure_async_iterator, as verl's server adapters do.

The driver talks to its processes over multiprocessing queues of the test (not the product's wire).
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

BUCKET_SIZE = 64 << 10
MODULE = "ckpt_engine.workers.adapters.verl"


def model_weights(global_steps: int, changing: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """What an actor's generator yields for a sync: full tensors, mixed dtypes, one larger than a bucket;
    the values depend on the step, so every sync is a new version. ``changing``: only tensors whose name
    contains it take this step's values (the others keep step 0's, as frozen parts of a model do)."""
    if changing is not None:
        frozen = model_weights(0)
        return [(name, tensor if changing in name else frozen[i][1])
                for i, (name, tensor) in enumerate(model_weights(global_steps))]
    gen = torch.Generator().manual_seed(1000 + global_steps)
    out: list[tuple[str, torch.Tensor]] = [
        ("model.embed_tokens.weight", torch.randn(64, 96, generator=gen).to(torch.bfloat16))]
    for layer in range(3):
        prefix = f"model.layers.{layer}"
        out += [(f"{prefix}.self_attn.qkv_proj.weight", torch.randn(96, 64, generator=gen)),
                (f"{prefix}.mlp.up_proj.weight", torch.randn(48, 96, generator=gen).to(torch.float16)),
                (f"{prefix}.input_layernorm.weight", torch.randn(96, generator=gen))]
    out += [("model.norm.weight", torch.randn(96, generator=gen)),
            ("lm_head.weight", torch.randn(160, 160, generator=gen)),  # 100 KiB: larger than a bucket
            ("model.rotary.inv_freq_steps", torch.arange(7, dtype=torch.int64) * (global_steps + 1))]
    return out


# a small Llama as vLLM's Llama-family models load it (checkpoint names of transformers' LlamaForCausalLM): 4 query
# heads over 2 KV heads, a vocabulary of 200 (vLLM pads it to 256: TP rank 0 keeps rows 0-127, rank 1 128-199)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 200,
         "num_hidden_layers": 2, "tie_word_embeddings": False, "torch_dtype": "float32"}


def llama_weights(global_steps: int) -> list[tuple[str, torch.Tensor]]:
    """What an actor's generator yields for a sync of the LLAMA model: its full tensors, new values each step."""
    c = LLAMA
    hidden, width = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes = [("model.embed_tokens.weight", (c["vocab_size"], hidden))]
    for layer in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes += [(f"{prefix}.input_layernorm.weight", (hidden,)),
                   (f"{prefix}.self_attn.q_proj.weight", (width, hidden)),
                   (f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
                   (f"{prefix}.self_attn.v_proj.weight", (kv, hidden)),
                   (f"{prefix}.self_attn.o_proj.weight", (hidden, width)),
                   (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
                   (f"{prefix}.mlp.gate_proj.weight", (c["intermediate_size"], hidden)),
                   (f"{prefix}.mlp.up_proj.weight", (c["intermediate_size"], hidden)),
                   (f"{prefix}.mlp.down_proj.weight", (hidden, c["intermediate_size"]))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (c["vocab_size"], hidden))]
    gen = torch.Generator().manual_seed(2000 + global_steps)
    return [(name, torch.randn(*shape, generator=gen)) for name, shape in shapes]


def save_llama(directory) -> str:
    """LLAMA's config.json and a safetensors checkpoint (step 0's weights) in ``directory``, as the rollout
    loads a model: what a sharded rollout worker derives its slices from."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA))
    save_file(dict(llama_weights(0)), str(path / "model.safetensors"))
    return str(path)


def fingerprint(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(name, dtype, shape, sha256 of the bytes) per tensor, in order: byte-exact comparison."""
    rows = []
    for name, tensor in named:
        data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        rows.append((name, str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(data).hexdigest()))
    return rows


def _construct(role: str, rank: int, engine_kwargs: dict[str, Any], how: str):
    """``engine_kwargs["_bucket_size"]``: verl's bucket size for this cluster (default BUCKET_SIZE)."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    engine_kwargs = dict(engine_kwargs)
    bucket_size = engine_kwargs.pop("_bucket_size", BUCKET_SIZE)

    if how == "custom_backend_module":
        from verl.utils.import_utils import import_external_libs

        import_external_libs(MODULE)  # what verl does with checkpoint_engine.custom_backend_module
    else:
        import verl  # noqa: F401 - the verl.plugins entry point registers the backend at import
    if role == "actor":  # as ActorRolloutRefWorker.init_model; rollout workers as CheckpointEngineWorker
        return CheckpointEngineRegistry.new("ckpt_engine", is_master=rank == 0, bucket_size=bucket_size,
                                            **engine_kwargs)
    return CheckpointEngineRegistry.new("ckpt_engine", bucket_size=bucket_size, **engine_kwargs)


def _flip(bucket: int, buf: torch.Tensor) -> torch.Tensor:
    corrupted = buf.clone()
    corrupted[0] ^= 0xFF  # the first byte of the bucket's first tensor
    return corrupted


def worker(role: str, rank: int, engine_kwargs: dict[str, Any], how: str, commands: mp.Queue,
           results: mp.Queue) -> None:
    """One actor rank or rollout worker: runs the driver's commands on its engine until told to stop."""
    try:
        import os

        os.environ["RANK"] = str(rank)  # (verl's worker groups give every worker its rank so)
        engine = _construct(role, rank, engine_kwargs, how)
        corrupt = {"bucket": None}
        side = engine.side  # (the actor's or the rollout worker's: backend.py)
        side._wire_hook = lambda k, buf: _flip(k, buf) if k == corrupt["bucket"] else buf
        results.put(("ok", {"class": type(engine).__name__, "side": type(side).__name__, "mode": side.mode}))
    except BaseException:  # noqa: BLE001 - everything goes back to the driver, which fails the test
        results.put(("error", traceback.format_exc()))
        return
    while True:
        command, args = commands.get(timeout=300)
        if command == "stop":
            return
        try:
            if command == "prepare":
                value: Any = engine.prepare()
            elif command == "init":
                value = engine.init_process_group(**args)
            elif command == "finalize":
                value = engine.finalize()
            elif command == "send":
                corrupt["bucket"] = args.get("corrupt_bucket")
                weights = (llama_weights(args["global_steps"]) if args.get("model") == "llama"
                           else model_weights(args["global_steps"], args.get("changing")))
                metrics = asyncio.run(engine.send_weights(iter(weights), global_steps=args["global_steps"]))
                value = {"metrics": metrics, "sent": fingerprint(weights)}
            elif command == "receive":
                value = asyncio.run(_receive(engine, args["global_steps"], args.get("stop_after")))
            elif command == "corrupt_cache":  # one byte of this rank's cached share of a version, in memory
                cached = side._publisher.cache.get(args["version"])
                cached.buffer[cached.buffer.numel() // 2] ^= 0x5A
                value = None
            else:
                raise ValueError(command)
            results.put(("ok", value))
        except BaseException as exc:  # noqa: BLE001 - the driver checks what each rank raised
            results.put(("raised", f"{type(exc).__name__}: {exc}"))


async def _receive(engine, global_steps: int, stop_after: int | None = None) -> dict[str, Any]:
    """``stop_after``: a loader that stops reading after that many tensors."""
    from verl.workers.rollout.utils import ensure_async_iterator

    weights = engine.receive_weights(global_steps=global_steps)  # not awaited: verl does not await it
    got: list[tuple[str, torch.Tensor]] = []
    try:
        async for name, tensor in ensure_async_iterator(weights):
            got.append((name, tensor.clone()))  # as SGLang's bucketer does with views
            if stop_after is not None and len(got) >= stop_after:
                break
    except Exception as exc:  # noqa: BLE001 - what verl's adapter would see, for the test to check
        return {"raised": f"{type(exc).__name__}: {exc}", "yielded": len(got)}
    shards = getattr(engine.side, "shards", None)
    if shards is not None:  # sharded: the ranges this worker keeps of each full tensor it was handed
        from ckpt_engine.plan.shards import cut, spec_to_wire

        ranges = [(name, cut(tensor, shards.spec[name][0]) if name in shards.spec else tensor) for name, tensor in got]
        return {"received": fingerprint(ranges), "shapes": [tuple(t.shape) for _, t in got],
                "spec": spec_to_wire(shards.spec), "bytes": engine.side.last_bytes, "version": engine.side.last_version}
    return {"received": fingerprint(got), "version": engine.side.last_version, "bytes": engine.side.last_bytes}


class Cluster:
    """``actors`` actor ranks and ``rollouts`` rollout workers, and the driver's side of the manager."""

    def __init__(self, actors: int, rollouts: int, engine_kwargs: dict[str, Any], how: str = "entry_point") -> None:
        ctx = mp.get_context("spawn")
        self.roles = [("actor", r) for r in range(actors)] + [("rollout", r) for r in range(rollouts)]
        self.actors, self.rollouts = actors, rollouts
        self.commands = [ctx.Queue() for _ in self.roles]
        self.results = [ctx.Queue() for _ in self.roles]
        self.procs = [ctx.Process(target=worker, args=(role, rank, engine_kwargs, how, c, r), daemon=True)
                      for (role, rank), c, r in zip(self.roles, self.commands, self.results)]
        for proc in self.procs:
            proc.start()
        self.constructed = self._collect(range(len(self.roles)), 240)

    def _collect(self, indices, timeout_s: float) -> list[Any]:
        out = []
        for i in indices:
            try:
                status, value = self.results[i].get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"{self.roles[i]} did not answer within {timeout_s}s") from None
            if status == "error":
                raise AssertionError(f"{self.roles[i]} failed:\n{value}")
            out.append(value if status == "ok" else {"raised": value})
        return out

    def _all(self, command: str, args: list[Any], timeout_s: float = 120) -> list[Any]:
        for q, a in zip(self.commands, args):
            q.put((command, a))
        return self._collect(range(len(self.roles)), timeout_s)

    def update_weights(self, global_steps: int, corrupt: tuple[int, int] | None = None,
                       stop_after: dict[int, int] | None = None, changing: str | None = None,
                       after_init: Callable[[], None] | None = None, model: str | None = None) -> dict[str, Any]:
        """One sync as CheckpointEngineManager.update_weights runs it. ``corrupt``: (actor rank, bucket) whose
        bytes that actor flips on the wire; ``stop_after``: rollout rank -> tensors its loader reads."""
        from ckpt_engine.workers.adapters.verl.backend import CkptEngineCheckpointEngine

        metadata = self._all("prepare", [None] * len(self.roles))
        actor_kwargs, rollout_kwargs = CkptEngineCheckpointEngine.build_topology(self.actors, self.rollouts, metadata)
        for kwargs, size in ((actor_kwargs, self.actors), (rollout_kwargs, self.rollouts)):
            assert all(len(v) == size for v in kwargs.values())  # what the manager checks
        per_rank = [{k: v[i] for k, v in actor_kwargs.items()} for i in range(self.actors)]
        per_rank += [{k: v[i] for k, v in rollout_kwargs.items()} for i in range(self.rollouts)]
        started = time.monotonic()
        inits = self._all("init", per_rank)
        if any(v is not None for v in inits):  # verl's update_weights raises here: the sync ends, nothing moves
            self._all("finalize", [None] * len(self.roles))
            return {"metadata": metadata, "inits": inits, "init_s": time.monotonic() - started}
        if after_init is not None:  # (what happens between the manager's steps: a test's fault)
            after_init()
        sends = [{"global_steps": global_steps, "changing": changing, "model": model,
                  "corrupt_bucket": corrupt[1] if corrupt and corrupt[0] == r else None} for r in range(self.actors)]
        for i, (role, rank) in enumerate(self.roles):  # send and receive together, as the manager does
            receive = {"global_steps": global_steps, "stop_after": (stop_after or {}).get(rank)}
            self.commands[i].put(("send", sends[rank]) if role == "actor" else ("receive", receive))
        moved = self._collect(range(len(self.roles)), 180)
        finals = self._all("finalize", [None] * len(self.roles))
        assert all(v is None for v in finals), finals
        return {"metadata": metadata, "actors": moved[: self.actors], "rollouts": moved[self.actors:]}

    def corrupt_cache(self, actor: int, version: int) -> None:
        """One byte of actor rank ``actor``'s host-cached share of ``version`` changes in memory."""
        self.commands[actor].put(("corrupt_cache", {"version": version}))
        assert self._collect([actor], 60) == [None]

    def close(self) -> None:
        for q in self.commands:
            q.put(("stop", None))
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
