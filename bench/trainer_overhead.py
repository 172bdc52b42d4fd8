"""Trainer step time while a cached-mode sync runs in the background, against idle.

Two processes on a 2-rank gloo sync group: the trainer (rank 0) trains a small transformers Llama causal LM
(forward + backward + AdamW, ``torch.set_num_threads(1)``) in a loop; a receiver (rank 1) receives versions of
a *separate* synthetic model (float32 tensors) with a no-op ``load``. Rounds alternate: an idle phase of a few
training steps, then a sync phase: ``publisher.publish(v, named)`` (cached: returns after the snapshot), then
training steps go on until ``transfer.done()`` (every receiver verified and acknowledged). A step counts as
"during sync" if it started while the transfer was in flight. The step that served the sync pays the snapshot
(``publish()``); that hold is reported separately.
"""

from __future__ import annotations

import time
from typing import Any

from ckpt_engine.bench.common import (
    MiB,
    Progress,
    expect_close,
    fmt_ms,
    fmt_s,
    master_store,
    run_processes,
    stats,
    sync_group,
)

HIDDEN, LAYERS, VOCAB, BATCH, LENGTH = 256, 2, 2048, 4, 32
IDLE_STEPS = 5
MAX_SYNC_STEPS = 200


def _child(rank: int, results: Any, port: int, args: dict) -> dict | None:
    import torch

    torch.set_num_threads(1)
    group = sync_group(rank, 2, port, args["timeout_s"], "trainer-bench")
    if rank == 0:
        return _trainer(group, args, results)
    from ckpt_engine.receive.collective import Receiver

    receiver = Receiver(group, lambda payload: None)
    cpu: list[float] = []
    for _ in range(args["rounds"] + 1):
        started = time.process_time()
        result = receiver.receive(300.0)
        if result is None or not result.ok:
            raise RuntimeError(f"receive failed: {result}")
        cpu.append(time.process_time() - started)
    expect_close(receiver)
    return {"cpu": cpu[1:]}  # (the first is the warm-up sync)


def _trainer(group: Any, args: dict, results: Any) -> dict:
    import torch

    from ckpt_engine.demos.fully_async import ModelSize, build_model, synthetic_batch
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Publisher

    size = ModelSize(HIDDEN, LAYERS, VOCAB)
    model = build_model(size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    per = args["mib"] * MiB // 4 // args["tensors"]
    sync_tensors = {f"w{i}": torch.randn(per) for i in range(args["tensors"])}
    named = NamedTensors(sync_tensors)
    publisher = Publisher(group, bucket_size=args["bucket_size"], keep_versions=1)

    def train_step() -> float:
        t0 = time.perf_counter()
        tokens = synthetic_batch(size, gen, BATCH, LENGTH)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - t0

    for _ in range(5):  # warm-up steps
        train_step()
    # warm-up sync (first layout, first buffers), not reported
    publisher.publish(1, named).result(300)
    idle: list[float] = []
    during: list[float] = []
    held: list[float] = []
    sync_seconds: list[float] = []
    steps_per_sync: list[int] = []
    send_cpu: list[float] = []
    for r in range(args["rounds"]):
        for _ in range(IDLE_STEPS):
            idle.append(train_step())
        sync_tensors["w0"].add_(1.0)  # a new version of the synced model
        t0 = time.perf_counter()
        process0, loop0 = time.process_time(), time.thread_time()
        transfer = publisher.publish(r + 2, named)
        held.append(time.perf_counter() - t0)
        n = 0
        while not transfer.done() and n < MAX_SYNC_STEPS:
            during.append(train_step())
            n += 1
        result = transfer.result(300)
        sync_seconds.append(time.perf_counter() - t0)
        # this process's CPU besides the training loop's thread: the send (its thread, gloo's threads)
        send_cpu.append((time.process_time() - process0) - (time.thread_time() - loop0))
        if not result.ok:
            raise RuntimeError(f"version {r + 2}: {result.reason}")
        steps_per_sync.append(n)
        results.put(("progress", 0, f"  round {r + 1}/{args['rounds']}: idle median "
                                    f"{stats(idle[-IDLE_STEPS:])['median'] * 1e3:.1f} ms, {n} steps during a "
                                    f"{sync_seconds[-1]:.3f}s sync"))
    publisher.close()
    return {"idle": idle, "during": during, "held": held, "sync_seconds": sync_seconds,
            "steps_per_sync": steps_per_sync, "send_cpu": send_cpu,
            "model_params": sum(p.numel() for p in model.parameters())}


def run(opts: dict, progress: Progress) -> dict:
    args = {"mib": 128 if opts["quick"] else 256, "tensors": 100, "rounds": 4 if opts["quick"] else 20,
            "bucket_size": opts["bucket_size"], "timeout_s": opts["timeout_s"]}
    store = master_store(args["timeout_s"])
    progress(f"  trainer: Llama {HIDDEN}/{LAYERS} layers, batch {BATCH}×{LENGTH}; synced model {args['mib']} MiB; "
             f"{args['rounds']} rounds")
    trainer, receiver = run_processes(_child, [(store.port, args)] * 2, deadline_s=900, progress=progress,
                                      name="trainer")
    del store
    idle, during = stats(trainer["idle"]), stats(trainer["during"])
    # Cores the sync keeps busy while it runs (the trainer's send besides its loop, and the receiver): beyond the
    # cores the loop leaves free, the loop's steps must give up time.
    busy = [(send + got) / seconds for send, got, seconds in
            zip(trainer["send_cpu"], receiver["cpu"], trainer["sync_seconds"])]
    return {"send_cpu": stats(trainer["send_cpu"]), "receiver_cpu": stats(receiver["cpu"]),
            "sync_cores": stats(busy), "args": args, "raw": trainer, "idle": idle, "during": during,
            "held": stats(trainer["held"]),
            "sync_seconds": stats(trainer["sync_seconds"]), "ratio": during["median"] / idle["median"],
            "steps_per_sync": trainer["steps_per_sync"], "model_params": trainer["model_params"]}


def render(result: dict, machine: dict) -> list[str]:
    a = result["args"]
    return [
        f"Trainer: transformers `LlamaForCausalLM` (hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, "
        f"{result['model_params'] / 1e6:.1f} M parameters), batch {BATCH}×{LENGTH} tokens, forward + backward + "
        f"AdamW, 1 torch thread. Synced model: {a['mib']} MiB in {a['tensors']} float32 tensors, cached mode, 1 "
        f"receiver process. {a['rounds']} rounds of {IDLE_STEPS} idle steps + one sync (steps go on until the "
        "transfer is done). Both processes share the machine's "
        f"{machine['usable_cores']} cores with the sender's background thread.",
        "",
        "| Measure | Median (min–max) | Samples |",
        "|---|---:|---:|",
        f"| training step, idle (ms) | {fmt_ms(result['idle'])} | {result['idle']['n']} |",
        f"| training step while a cached sync is in flight (ms) | {fmt_ms(result['during'])} "
        f"| {result['during']['n']} |",
        f"| **ratio during ÷ idle** | **{result['ratio']:.3f}** | |",
        f"| trainer held by `publish()` (snapshot) per sync (ms) | {fmt_ms(result['held'])} | {result['held']['n']} |",
        f"| sync time, publish → every receiver verified (ms) | {fmt_ms(result['sync_seconds'])} | "
        f"{result['sync_seconds']['n']} |",
        "",
        f"Steps that overlapped each sync: {', '.join(map(str, result['steps_per_sync']))}.",
        "",
    ] + _render_cpu(result, machine)


def _render_cpu(result: dict, machine: dict) -> list[str]:
    if "sync_cores" not in result:
        return []
    return [
        "Where the steps' time goes: the CPU the sync itself uses while it runs (`time.process_time()`: the trainer "
        "process's send thread and gloo's threads, i.e. its CPU less the training loop thread's, and the receiver "
        "process's), per sync, and the cores that keeps busy (÷ the sync's time). The loop takes one core of the "
        f"{machine['usable_cores']}; what the sync needs beyond the rest it takes from the loop.",
        "",
        "| Measure | Median (min–max) |",
        "|---|---:|",
        f"| trainer process, send (s per sync) | {fmt_s(result['send_cpu'])} |",
        f"| receiver process (s per sync) | {fmt_s(result['receiver_cpu'])} |",
        f"| cores the sync keeps busy while it runs | {fmt_s(result['sync_cores'], 2)} |",
        "",
    ]
