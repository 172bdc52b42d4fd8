"""End-to-end example: a trainer process trains a small model and publishes a new version every few steps;
two receiver processes (rollout stand-ins holding their own copy of the model) receive, verify and load each
version. Everything runs for real on this machine: gloo sync group over a TCP store on 127.0.0.1.

Run: ``ckpt-engine demo-library`` (or ``python -m ckpt_engine.demos.library``).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import queue
import sys
import time

import torch
from torch import nn

from ckpt_engine.config import EngineConfig, load_config
from ckpt_engine.device import detect_device
from ckpt_engine.plan.hashing import version_digest, xxh3_digest
from ckpt_engine.plan.modes import mode_of
from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.collective import Receiver, VersionPayload
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.transport.group import SyncGroup, open_store

HOST = "127.0.0.1"
RECEIVERS = 2


class TinyLM(nn.Module):
    """A small decoder-style model: embedding, two transformer layers, tied output head."""

    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def model_digest(model: nn.Module) -> str:
    """Digest of the model's current bytes, to show receivers end identical to the trainer."""
    values = []
    for tensor in model.state_dict(keep_vars=False).values():
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        values.append(xxh3_digest(str(tensor.dtype), tuple(tensor.shape), raw))
    return version_digest("xxh3-64", "model-state", values)


def _group(config: EngineConfig, port: int, rank: int) -> SyncGroup:
    store = open_store(HOST, port, timeout_s=config.timeouts.connect_s)
    return SyncGroup(store, name="demo", generation=0, rank=rank, world_size=RECEIVERS + 1,
                     device=detect_device(config.device, config.backend), timeout_s=config.timeouts.collective_s,
                     bind_host=HOST)


def run_receiver(rank: int, port: int, config: EngineConfig, report: mp.Queue) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[receiver {rank}] %(message)s")
    torch.manual_seed(100 + rank)  # starts from different weights than the trainer
    model = TinyLM().eval()
    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())

    def load(payload: VersionPayload) -> None:
        with torch.no_grad():
            for name, target in targets.items():
                target.copy_(payload.tensors[name])

    receiver = Receiver(_group(config, port, rank), load, verify=config.verify)
    for result in receiver.serve(begin_timeout_s=config.timeouts.ack_s * 10):
        report.put(("version", rank, result.version, result.ok, result.reason))
    report.put(("final", rank, model_digest(model)))


def run_trainer(port: int, config: EngineConfig, steps: int, sync_every: int, both_modes: bool) -> list[dict]:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    publisher = Publisher(_group(config, port, 0), bucket_size=config.bucket_size, alignment=config.alignment,
                          keep_versions=config.keep_versions, ack_timeout_s=config.timeouts.ack_s)
    rows: list[dict] = []
    in_flight = None
    version = 0
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 512, (8, 32))
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % sync_every:
            continue
        if in_flight is not None:  # one version in flight at a time
            rows.append(_row(*in_flight))
        version += 1
        bypass = (version % 2 == 0) if both_modes else config.bypass_cpu
        started = time.perf_counter()
        transfer = publisher.publish(version, named_tensors_of(model), mode=mode_of(bypass), step=step)
        transfer.params_released.wait()
        held = time.perf_counter() - started
        in_flight = (transfer, step, held, started, loss.item())
    if in_flight is not None:
        rows.append(_row(*in_flight))
    publisher.close()
    rows.append({"final": model_digest(model)})
    return rows


def _row(transfer, step: int, held: float, started: float, loss: float) -> dict:
    result = transfer.result(timeout_s=600)
    return {"version": result.version, "step": step, "mode": result.mode, "ok": result.ok, "reason": result.reason,
            "mb": result.bytes_sent / (1 << 20), "buckets": result.buckets, "tensors": result.tensors,
            "held_ms": held * 1e3, "verified_ms": (result.finished_at - started) * 1e3,
            "digest": result.version_digest, "receivers": len(result.committed_ranks), "loss": loss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckpt-engine demo-library", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="engine YAML (default: the built-in defaults, as in "
                                                       "deploy/engine.yaml)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--mode", choices=["config", "both"], default="both",
                        help="'both' alternates cached and bypass_cpu versions; 'config' uses bypass_cpu from YAML")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[trainer] %(message)s")
    # The demo model is ~2 MiB: small buckets so a version spans several, on the CPU path every machine has.
    config = (load_config(args.config) if args.config else EngineConfig()).model_copy(
        update={"bucket_size_mb": 1.0, "device": "cpu", "backend": "gloo"})
    store = open_store(HOST, 0, is_master=True, timeout_s=config.timeouts.connect_s)
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    procs = [ctx.Process(target=run_receiver, args=(r, store.port, config, report), daemon=True)
             for r in range(1, RECEIVERS + 1)]
    for proc in procs:
        proc.start()
    try:
        rows = run_trainer(store.port, config, args.steps, args.sync_every, args.mode == "both")
        finals = _collect_finals(report, procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return _print_report(rows, finals)


def _collect_finals(report: mp.Queue, procs: list) -> dict[int, str]:
    finals: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while len(finals) < len(procs) and time.monotonic() < deadline:
        try:
            item = report.get(timeout=1)
        except queue.Empty:
            continue
        if item[0] == "final":
            finals[item[1]] = item[2]
    return finals


def _print_report(rows: list[dict], finals: dict[int, str]) -> int:
    print(f"{'ver':>3} {'step':>4} {'mode':<10} {'MiB':>6} {'bkts':>4} {'tensors':>7} {'held ms':>8} "
          f"{'verified ms':>11} {'rx ok':>5}  digest")
    failures = 0
    for row in rows[:-1]:
        failures += not row["ok"]
        print(f"{row['version']:>3} {row['step']:>4} {row['mode']:<10} {row['mb']:>6.2f} {row['buckets']:>4} "
              f"{row['tensors']:>7} {row['held_ms']:>8.1f} {row['verified_ms']:>11.1f} "
              f"{row['receivers']:>3}/{RECEIVERS}  {row['digest']}"
              + ("" if row["ok"] else f"  FAILED: {row['reason']}"))
    trainer_digest = rows[-1]["final"]
    same = all(finals.get(r) == trainer_digest for r in range(1, RECEIVERS + 1))
    print(f"trainer final model digest {trainer_digest}; receivers: "
          + ", ".join(f"rank {r}={finals.get(r, 'missing')}" for r in range(1, RECEIVERS + 1)))
    print("RESULT:", "OK - every version verified, receivers identical to the trainer" if same and not failures
          else "FAILED")
    return 0 if same and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
