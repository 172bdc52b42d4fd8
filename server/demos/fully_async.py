"""The fully-async demo: the daemon from deploy/engine.yaml, a 2-rank FSDP2 trainer (gloo) training a small
transformers causal LM on synthetic data, and 2 rollout processes generating tokens with their own copy of
the model, which receives a new verified version every few steps while training goes on.

Run: ``ckpt-engine demo`` (``--bypass-cpu``, ``--steps``, ``--sync-every``; ``--help`` for the rest).
Exits non-zero when a version fails or a rollout's final weights differ from the trainer's last version.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import queue
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from ckpt_engine.server.launch import DaemonProcess, free_port, write_config
from ckpt_engine.server.launch import start_daemon as launch_daemon

from ckpt_engine.control.messages import TERMINAL


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    vocab: int


def build_model(size: ModelSize, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.hidden * 8 // 3,
                         num_hidden_layers=size.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def synthetic_batch(size: ModelSize, gen: torch.Generator, batch: int = 8, length: int = 24) -> torch.Tensor:
    """Sequences that count upwards: a model that learns them predicts token + 1."""
    start = torch.randint(0, size.vocab, (batch, 1), generator=gen)
    return (start + torch.arange(length)) % size.vocab


def trainer(rank: int, port: int, zmq: str, size: ModelSize, steps: int, sync_every: int,
            bypass: bool | None) -> dict:
    import torch.distributed as dist
    from ckpt_engine.workers.trainer_agent import TrainerAgent
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    model = build_model(size, seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.5).start()
    gen = torch.Generator().manual_seed(rank)
    versions = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        tokens = synthetic_batch(size, gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train_s = time.perf_counter() - started
        if step % sync_every == 0:
            if rank == 0:
                agent.wait_idle(120)  # one version in flight: the previous one has ended by now in practice
            held = len(agent.held_seconds)
            version = agent.push(step, bypass_cpu=bypass)
            if rank == 0 and version is not None:
                versions.append(version)
                held_ms = agent.held_seconds[-1] * 1e3 if len(agent.held_seconds) > held else float("nan")
                print(f"[trainer] step {step:3d}  loss {loss.item():.3f}  step {train_s * 1e3:6.1f} ms  "
                      f"-> version {version} requested, loop held {held_ms:.1f} ms", flush=True)
        elif rank == 0:
            agent.step(step)
            print(f"[trainer] step {step:3d}  loss {loss.item():.3f}  step {train_s * 1e3:6.1f} ms", flush=True)
        else:
            agent.step(step)
    agent.wait_idle(120)
    agent.close()
    dist.destroy_process_group()
    return {"versions": versions}


def rollout(index: int, zmq: str, size: ModelSize, stop: mp.Event, report: mp.Queue) -> None:
    from ckpt_engine.workers.adapters.torch_module import ModuleAdapter
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.send.publisher import version_digest_of

    torch.set_num_threads(1)
    model = build_model(size, seed=100 + index).eval()
    adapter = ModuleAdapter(model)
    agent = RolloutAgent(adapter.load, zmq, poll_wait_s=0.5).start()
    prompt = torch.tensor([[10, 11, 12, 13]])
    last = "unset"
    while not stop.is_set():
        with adapter.serving() as version, torch.no_grad():
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        if version != last:
            print(f"[rollout {index}] generating with version {version}: {out[0, 4:].tolist()}", flush=True)
            last = version
        stop.wait(0.3)
    settings = agent.settings
    digest = version_digest_of(named_tensors_of(model), bucket_size=settings.bucket_size,  # type: ignore[union-attr]
                               alignment=settings.alignment)  # type: ignore[union-attr]
    agent.close()
    report.put((index, adapter.version, digest))


def start_daemon(config: Path | None, workdir: Path, bypass: bool) -> DaemonProcess:
    """The daemon from ``config`` as given (None: the built-in defaults deploy/engine.yaml lists), on free
    ports with its files in ``workdir``."""
    overrides: dict = {"bucket_size_mb": 4, **({"bypass_cpu": True} if bypass else {})}
    # the demo's agents (started from here) and its HTTP calls find the role tokens in its credentials file
    return launch_daemon(write_config(workdir, config, test_timeouts=False, **overrides), timeout_s=60,
                         log_path=workdir / "daemon.log")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckpt-engine demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="engine YAML (default: the built-in defaults, as in "
                                                       "deploy/engine.yaml)")
    parser.add_argument("--bypass-cpu", action="store_true", help="sync with bypass_cpu instead of the YAML's mode")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hold", type=float, default=0.0, help="keep the daemon up this many seconds after the "
                                                               "run, to look at its page (Ctrl-C ends it sooner)")
    args = parser.parse_args(argv)
    size = ModelSize(args.hidden, args.layers, args.vocab)
    with tempfile.TemporaryDirectory(prefix="ckpt-engine-demo-") as tmp:
        daemon = start_daemon(Path(args.config) if args.config else None, Path(tmp), args.bypass_cpu)
        url, zmq = daemon.url, daemon.zmq
        print(f"[demo] daemon up: {url} (zmq {zmq}), config {args.config or 'built-in defaults'}"
              f"{' + bypass_cpu' if args.bypass_cpu else ''}", flush=True)
        # the file's path, not the token: a token printed ends up in terminal scrollback and CI logs
        print(f"[demo] operator page: {url}/ (paste the \"rollout\" token of {daemon.credentials_path}: it "
              f"reads, and writes nothing over HTTP)", flush=True)
        try:
            code = _run(args, size, url, zmq)
            _hold(args.hold)
            return code
        finally:
            code = daemon.stop(signal.SIGTERM, 60)
            print(f"[demo] daemon stopped (exit {code})", flush=True)


def _hold(seconds: float) -> None:
    if seconds > 0:
        print(f"[demo] holding the daemon for {seconds:.0f} s (Ctrl-C ends it)", flush=True)
        try:
            time.sleep(seconds)
        except KeyboardInterrupt:
            pass


def _run(args: argparse.Namespace, size: ModelSize, url: str, zmq: str) -> int:
    ctx = mp.get_context("spawn")
    stop, report = ctx.Event(), ctx.Queue()
    rollouts = [ctx.Process(target=rollout, args=(i, zmq, size, stop, report), daemon=True) for i in (1, 2)]
    for proc in rollouts:
        proc.start()
    _wait_for_agents(url, 2)
    port = free_port()
    bypass = True if args.bypass_cpu else None
    trainers = [ctx.Process(target=_run_trainer, args=(r, port, zmq, size, args.steps, args.sync_every, bypass),
                            daemon=True) for r in (0, 1)]
    for proc in trainers:
        proc.start()
    printed: set[int] = set()
    while any(p.is_alive() for p in trainers):
        _print_new_versions(url, printed)
        time.sleep(0.3)
    _print_new_versions(url, printed)
    history = _get(url, "/versions", limit=1000).json()["versions"]
    committed = [v for v in history if v["status"] == "committed"]
    latest = committed[0] if committed else None
    if latest is not None:
        _wait_for_rollouts(url, latest["id"])
    stop.set()
    finals = {}
    for _ in rollouts:
        try:
            index, version, digest = report.get(timeout=120)
            finals[index] = (version, digest)
        except queue.Empty:
            break
    for proc in rollouts + trainers:
        proc.join(30)
    return _summary(history, latest, finals, [p.exitcode for p in trainers])


def _get(url: str, path: str, **params: object) -> httpx.Response:
    """A read of the daemon's API with the operator's token from the demo daemon's credentials file."""
    from ckpt_engine.control.auth import client_token

    return httpx.get(f"{url}{path}", params=params, headers={"Authorization": f"Bearer {client_token('operator')}"})


def _run_trainer(*args) -> None:
    trainer(*args)


def _wait_for_agents(url: str, receivers: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agents = _get(url, "/receivers").json()["agents"]
        if sum(a["role"] == "receiver" for a in agents) >= receivers:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{receivers} rollout processes did not register within {timeout_s}s")


def _wait_for_rollouts(url: str, version: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agents = _get(url, "/receivers").json()["agents"]
        if all(version in a["versions"] for a in agents if a["role"] == "receiver"):
            return
        time.sleep(0.2)


def _print_new_versions(url: str, printed: set[int]) -> None:
    for record in reversed(_get(url, "/versions", limit=50).json()["versions"]):
        if record["id"] in printed or record["status"] not in TERMINAL:
            continue
        printed.add(record["id"])
        stages = record["stages"]
        held = stages.get("snapshot", stages.get("held", 0.0))
        total = (record["updated_at"] - record["created_at"]) * 1e3
        print(f"[daemon] version {record['id']} {record['status']}: step {record['step']}, {record['mode']}, "
              f"{record['bytes'] / (1 << 20):.1f} MiB in {record['buckets']} buckets, "
              f"{sum(r.get('ok', False) for r in record['receivers'])}/{len(record['receivers'])} receivers, "
              f"request->commit {total:.0f} ms, trainer held {held * 1e3:.1f} ms"
              + (f" - {record['reason']}" if record["reason"] else ""), flush=True)


def _summary(history: list[dict], latest: dict | None, finals: dict, trainer_codes: list) -> int:
    print("\nversion history (newest first)")
    print(f"{'id':>4} {'step':>5} {'mode':<10} {'status':<10} {'MiB':>6} {'bkts':>4} {'rx ok':>5}  digest")
    for r in history:
        ok_rx = sum(1 for x in r["receivers"] if x.get("ok"))
        print(f"{r['id']:>4} {r['step'] if r['step'] is not None else '-':>5} {r['mode']:<10} {r['status']:<10} "
              f"{r['bytes'] / (1 << 20):>6.2f} {r['buckets']:>4} {ok_rx:>3}/{len(r['receivers'])}  "
              f"{r['version_digest'] or r['reason']}")
    failures = []
    if any(code != 0 for code in trainer_codes):
        failures.append(f"trainer ranks exited with {trainer_codes}")
    if latest is None:
        failures.append("no version committed")
    failures += [f"version {r['id']} {r['status']}: {r['reason']}" for r in history if r["status"] != "committed"]
    for index in (1, 2):
        version, digest = finals.get(index, (None, None))
        if latest is not None and digest == latest["version_digest"]:
            print(f"check: rollout {index} final weights digest {digest} == trainer's last version "
                  f"{latest['id']} ({latest['version_digest']})")
        else:
            failures.append(f"rollout {index} holds version {version} with digest {digest}, expected "
                            f"{latest['version_digest'] if latest else None}")
    for failure in failures:
        print(f"FAILED: {failure}")
    print("RESULT:", "OK" if not failures else "FAILED")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
