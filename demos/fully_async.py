"""The fully-async demo: the daemon from deploy/engine.yaml, a 2-rank FSDP2 trainer (gloo) training a small
transformers causal LM on synthetic data, and 2 rollout processes generating tokens with their own copy of
the model, which receives a new verified version every few steps while training goes on.

Run: ``ckpt-engine demo`` (``--config``, ``--bypass-cpu``, ``--steps``, ``--sync-every``, ``--tear``,
``--hold``; ``--help`` for the rest). Exits non-zero when a version fails or a rollout's final weights differ
from the trainer's last version.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import multiprocessing.synchronize
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from ckpt_engine.control.messages import TERMINAL
from ckpt_engine.server.launch import REPO, DaemonProcess, free_port, write_config
from ckpt_engine.server.launch import start_daemon as launch_daemon

DEFAULT_CONFIG = REPO / "deploy" / "engine.yaml"
BUCKET_SIZE_MB = 4.0  # the demo's model is ~12 MiB: sent in several buckets, as a large model is in 512 MiB ones
QUIET_WAIT_S = 60.0


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


def trainer(rank: int, port: int, url: str, zmq: str, size: ModelSize, steps: int, sync_every: int,
            bypass: bool | None, trained: mp.Queue, release: multiprocessing.synchronize.Event) -> dict:
    """Trains ``steps`` steps, pushing a version every ``sync_every``; then says so on ``trained`` and stays
    attached (its trainer rank and its share of the cache on the page; a sync asked meanwhile is served) until
    ``release``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ckpt_engine.workers.trainer_agent import TrainerAgent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the demo's: it releases this process
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
            _step_until_quiet(agent, rank, step, url)  # one version in flight: the previous one, or a repair
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
    _step_until_quiet(agent, rank, steps, url)
    agent.wait_idle(120)
    trained.put(rank)
    flag = torch.zeros(1)
    while True:  # held: rank 0 decides for both when to stop (one more collective on one rank would hang)
        flag.fill_(1.0 if release.is_set() else 0.0)
        dist.broadcast(flag, 0)
        if flag.item():
            break
        agent.step(steps)
        time.sleep(0.25)
    agent.close()
    dist.destroy_process_group()
    return {"versions": versions}


def _step_until_quiet(agent, rank: int, step: int, url: str, timeout_s: float = QUIET_WAIT_S) -> None:
    """Every rank: step (serving what the daemon assigns meanwhile, such as the repair of a torn rollout, which
    every owner rank sends its share of) until rank 0 finds nothing in flight and no receiver torn, so the next
    push is not refused (409) by a version still in flight. Rank 0 decides for all: one more collective on one
    rank would hang."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    flag = torch.zeros(1)
    while True:
        if rank == 0:
            flag.fill_(1.0 if _quiet(url) or time.monotonic() > deadline else 0.0)
        dist.broadcast(flag, 0)
        if flag.item():
            return
        agent.step(step)
        time.sleep(0.1)


def _quiet(url: str) -> bool:
    status = _get(url, "/status").json()
    return status["in_flight"] is None and not status["torn"]


def _wait_quiet(url: str, timeout_s: float = QUIET_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not _quiet(url) and time.monotonic() < deadline:
        time.sleep(0.1)


def rollout(index: int, zmq: str, size: ModelSize, stop: multiprocessing.synchronize.Event,
            check: multiprocessing.synchronize.Event, report: mp.Queue,
            tear: int | None) -> None:
    """Generates with the version its model holds until ``stop``; once ``check`` is set, reports the digest of its
    weights (and goes on: the demo keeps it attached while it holds). ``tear``: the apply of that version fails
    half way, once (--tear)."""
    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.send.publisher import version_digest_of
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the demo's: it stops this process
    torch.set_num_threads(1)
    model = build_model(size, seed=100 + index).eval()
    adapter = _tearing_adapter(model, tear)
    agent = RolloutAgent(adapter.load, zmq, poll_wait_s=0.5).start()
    print(f"[rollout {index}] registered as receiver agent {agent.agent_id}"
          + (f"; its apply of version {tear} will fail half way (--tear)" if tear is not None else ""), flush=True)
    prompt = torch.tensor([[10, 11, 12, 13]])
    last, reported = "unset", False
    while not stop.is_set():
        with adapter.serving() as version, torch.no_grad():
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
            if check.is_set() and not reported:  # (under serving(): no version is applied meanwhile)
                settings = agent.settings
                digest = version_digest_of(named_tensors_of(model),
                                           bucket_size=settings.bucket_size,  # type: ignore[union-attr]
                                           alignment=settings.alignment)  # type: ignore[union-attr]
                report.put((index, version, digest))
                reported = True
        if version != last:
            print(f"[rollout {index}] generating with version {version}: {out[0, 4:].tolist()}", flush=True)
            last = version
        stop.wait(0.3)
    agent.close()


def _tearing_adapter(model, tear: int | None):
    """A ModuleAdapter; with ``tear``, one whose apply of that version fails half way through, once, as an
    out-of-memory would: the model is then torn (it serves nothing) until the daemon repairs it."""
    from ckpt_engine.workers.adapters.torch_module import ModuleAdapter

    class TearOnce(ModuleAdapter):
        tearing, torn_once = False, False

        def load(self, payload) -> None:
            self.tearing = payload.version == tear and not self.torn_once
            self.torn_once = self.torn_once or self.tearing
            super().load(payload)

        def _copy(self, name, target, source) -> None:
            if self.tearing and name == middle:
                self.tearing = False
                raise RuntimeError(f"injected by the demo (--tear {tear}): the apply failed half way through")
            super()._copy(name, target, source)

    adapter = (TearOnce if tear is not None else ModuleAdapter)(model)
    middle = list(adapter.targets)[len(adapter.targets) // 2]
    return adapter


def start_daemon(config: Path | None, workdir: Path, bypass: bool, bucket_size_mb: float) -> DaemonProcess:
    """The daemon from ``config`` (None: the built-in defaults, which deploy/engine.yaml lists) with
    ``bucket_size_mb``, on free loopback ports, with its history and credentials in ``workdir``."""
    overrides: dict = {"bucket_size_mb": bucket_size_mb, **({"bypass_cpu": True} if bypass else {})}
    # the demo's agents (started from here) and its HTTP calls find the role tokens in its credentials file
    return launch_daemon(write_config(workdir, config, test_timeouts=False, **overrides), timeout_s=60,
                         log_path=workdir / "daemon.log", spawner=_own_session)


def _own_session(config_path: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """``ckpt-engine serve`` out of the terminal's process group: Ctrl-C is the demo's, which releases its agents
    first (they unregister) and then stops the daemon."""
    return subprocess.Popen([sys.executable, "-m", "ckpt_engine.cli", "serve", "--config", str(config_path)],
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            start_new_session=True)


def status_command(url: str, credentials: Path | None) -> str:
    """The exact command that watches this daemon from another terminal (any directory): this installation's
    ckpt-engine, the daemon's address and the file its operator token is in (the path: a token printed ends up in
    terminal scrollback and CI logs)."""
    script = Path(sys.executable).with_name("ckpt-engine")  # (the venv's: not resolved, a venv's python is a link)
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "ckpt_engine.cli"]
    return shlex.join([*cli, "--url", url, *(["--credentials", str(credentials)] if credentials else []),
                       "status", "--watch"])


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckpt-engine demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None,
                        help="engine YAML (default: deploy/engine.yaml); the demo gives it free ports, a temporary "
                             "history and credentials file, and --bucket-size-mb")
    parser.add_argument("--bucket-size-mb", type=float, default=BUCKET_SIZE_MB,
                        help=f"bucket size instead of the YAML's (default {BUCKET_SIZE_MB:g}: the small model is "
                             "sent in several buckets, as a large one is)")
    parser.add_argument("--bypass-cpu", action="store_true", help="sync with bypass_cpu instead of the YAML's mode")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--tear", type=int, default=None, metavar="VERSION",
                        help="rollout 2's apply of this version fails half way (injected): its model is torn until "
                             "the daemon repairs it with a whole version from the trainer's cache")
    parser.add_argument("--hold", type=float, default=0.0, help="keep the daemon, the trainer ranks and the rollouts "
                                                               "up this many seconds after the run, to look at the "
                                                               "page (Ctrl-C ends it sooner)")
    args = parser.parse_args(argv)
    pushes = args.steps // args.sync_every
    if args.tear is not None and not 1 <= args.tear < pushes:
        # (a torn receiver is repaired with the version it served last: a later version brings it up to date)
        parser.error(f"--tear takes a version from 1 to {pushes - 1}: a later version must bring the repaired "
                     f"rollout up to date (--steps {args.steps} --sync-every {args.sync_every} make {pushes})")
    if args.tear is not None and args.bypass_cpu:
        parser.error("--tear needs cached versions: a repair re-sends one from the trainer's cache, and bypass_cpu "
                     "caches none")
    size = ModelSize(args.hidden, args.layers, args.vocab)
    config = Path(args.config) if args.config else (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    # SIGTERM ends the demo as Ctrl-C does: the agents are released and the daemon (in a session of its own) stopped
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="ckpt-engine-demo-") as tmp:
        daemon = start_daemon(config, Path(tmp), args.bypass_cpu, args.bucket_size_mb)
        url, zmq = daemon.url, daemon.zmq
        print(f"[demo] daemon up: {url} (zmq {zmq}), config {_shown(config) if config else 'built-in defaults'}"
              f" with bucket_size_mb {args.bucket_size_mb:g}{' and bypass_cpu' if args.bypass_cpu else ''}, on free "
              f"ports with a temporary history and credentials file", flush=True)
        _print_how_to_look(daemon)
        try:
            return _run(args, size, daemon)
        except KeyboardInterrupt:
            print("[demo] interrupted", flush=True)
            return 130
        finally:
            code = daemon.stop(signal.SIGTERM, 60)
            print(f"[demo] daemon stopped (exit {code})", flush=True)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _print_how_to_look(daemon: DaemonProcess) -> None:
    # the file's path, not the token: a token printed ends up in terminal scrollback and CI logs
    print(f"[demo] operator page: {daemon.url}/ (paste the \"rollout\" token of {daemon.credentials_path}: it "
          f"reads, and writes nothing over HTTP); API reference: {daemon.url}/docs", flush=True)
    print(f"[demo] in a terminal: {status_command(daemon.url, daemon.credentials_path)}", flush=True)


def _hold(seconds: float, daemon: DaemonProcess, printed: set[int]) -> None:
    if seconds <= 0:
        return
    print(f"[demo] holding the daemon, the trainer ranks and the rollouts for {seconds:.0f} s (Ctrl-C ends it):",
          flush=True)
    _print_how_to_look(daemon)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            _print_new_versions(daemon.url, printed)  # (a sync, push or evict asked meanwhile)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    except httpx.HTTPError as exc:
        print(f"[demo] the daemon stopped answering ({exc}): holding no longer", flush=True)


def _run(args: argparse.Namespace, size: ModelSize, daemon: DaemonProcess) -> int:
    url, zmq = daemon.url, daemon.zmq
    ctx = mp.get_context("spawn")
    stop, check, report, trained, release = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Event()
    rollouts = [ctx.Process(target=rollout, args=(i, zmq, size, stop, check, report, args.tear if i == 2 else None),
                            daemon=True) for i in (1, 2)]
    for proc in rollouts:
        proc.start()
    trainers: list = []
    done: set[int] = set()
    try:
        _wait_for_agents(url, 2)
        port = free_port()
        bypass = True if args.bypass_cpu else None
        trainers = [ctx.Process(target=_run_trainer, args=(r, port, url, zmq, size, args.steps, args.sync_every,
                                                           bypass, trained, release), daemon=True) for r in (0, 1)]
        for proc in trainers:
            proc.start()
        printed: set[int] = set()
        while len(done) < len(trainers) and not any(p.exitcode is not None for p in trainers):
            _print_new_versions(url, printed)
            try:
                done.add(trained.get(timeout=0.3))
            except queue.Empty:
                pass
        _wait_quiet(url)  # (a repair the daemon started after the last version: --tear)
        _print_new_versions(url, printed)
        history = _get(url, "/versions", limit=1000).json()["versions"]
        committed = [v for v in history if v["status"] == "committed"]
        latest = committed[0] if committed else None
        if latest is not None:
            _wait_for_rollouts(url, latest["version_digest"], committed)
        check.set()
        finals = {}
        for _ in rollouts:
            try:
                index, version, digest = report.get(timeout=120)
                finals[index] = (version, digest)
            except queue.Empty:
                break
        code = _summary(history, latest, finals, sorted({0, 1} - done), args.tear)
        _hold(args.hold, daemon, printed)
    finally:
        release.set()
        stop.set()
        for proc in trainers + rollouts:
            if proc in trainers and len(done) < len(trainers):  # interrupted while training: nothing to keep
                proc.terminate()
            proc.join(60)
            if proc.exitcode is None:
                proc.kill()
                proc.join(10)
    exits = [p.exitcode for p in trainers + rollouts]
    if any(exits):
        print(f"[demo] FAILED: trainer ranks and rollouts exited with {exits}", flush=True)
        return 1
    return code


def _get(url: str, path: str, **params: str | int | float | bool | None) -> httpx.Response:
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


def _wait_for_rollouts(url: str, digest: str, committed: list[dict], timeout_s: float = 60) -> None:
    """Until every receiver serves a committed version with ``digest`` (the newest one, or a repair's copy of it)."""
    digests = {r["id"]: r["version_digest"] for r in committed}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agents = _get(url, "/receivers").json()["agents"]
        if all(digests.get(a["serving"]) == digest for a in agents if a["role"] == "receiver"):
            return
        time.sleep(0.2)


def _print_new_versions(url: str, printed: set[int]) -> None:
    for record in reversed(_get(url, "/versions", limit=50).json()["versions"]):
        if record["id"] in printed or record["status"] not in TERMINAL:
            continue
        printed.add(record["id"])
        stages = record["stages"]
        held = stages.get("snapshot", stages.get("held", 0.0))
        total = ((record["committed_at"] or record["updated_at"]) - record["created_at"]) * 1e3
        purpose = {"repair": "a repair: v{} again, for receivers a failed apply left torn",
                   "catch_up": "a catch-up: v{} again, for receivers that joined late",
                   "push": "a re-push of v{}"}.get(record["purpose"], "")
        print(f"[daemon] version {record['id']} {record['status']}"
              + (f" ({purpose.format(record['source_version'])})" if purpose else "")
              + f": step {record['step']}, {record['mode']}, "
              f"{record['bytes'] / (1 << 20):.1f} MiB in {record['buckets']} buckets, "
              f"{sum(r.get('ok', False) for r in record['receivers'])}/{len(record['receivers'])} receivers, "
              f"request->commit {total:.0f} ms, trainer held {held * 1e3:.1f} ms"
              + (f" - {record['reason']}" if record["reason"] else ""), flush=True)


def _summary(history: list[dict], latest: dict | None, finals: dict, untrained: list[int],
             tear: int | None) -> int:
    print("\nversion history (newest first)")
    print(f"{'id':>4} {'step':>5} {'mode':<10} {'status':<10} {'purpose':<8} {'MiB':>6} {'bkts':>4} {'rx ok':>5}  "
          "digest")
    for r in history:
        ok_rx = sum(1 for x in r["receivers"] if x.get("ok"))
        print(f"{r['id']:>4} {r['step'] if r['step'] is not None else '-':>5} {r['mode']:<10} {r['status']:<10} "
              f"{r['purpose']:<8} {r['bytes'] / (1 << 20):>6.2f} {r['buckets']:>4} {ok_rx:>3}/{len(r['receivers'])}  "
              f"{r['version_digest'] or r['reason']}")
    failures = []
    if untrained:
        failures.append(f"trainer rank(s) {untrained} did not finish training")
    if latest is None:
        failures.append("no version committed")
    failures += [f"version {r['id']} {r['status']}: {r['reason']}" for r in history if r["status"] != "committed"]
    if tear is not None:
        failures += _check_tear(history, tear)
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


def _check_tear(history: list[dict], tear: int) -> list[str]:
    """--tear: the version tore a receiver's model, and a later version made it whole again: a repair from the
    cache, or (bypass_cpu: nothing cached to repair from) the next version it took, whole."""
    record = next((r for r in history if r["id"] == tear), None)
    torn = [e for e in (record or {}).get("receivers", []) if e.get("torn")]
    if not torn:
        return [f"--tear {tear}: version {tear} tore no receiver" + ("" if record else " (there was none)")]
    failures = []
    for entry in torn:
        repair = next((r for r in reversed(history) if r["purpose"] == "repair" and r["status"] == "committed"
                       and r["id"] > tear and any(e["agent_id"] == entry["agent_id"] and e["ok"]
                                                  for e in r["receivers"])), None)
        later = next((r for r in history if r["status"] == "committed" and r["id"] > tear
                      and any(e["agent_id"] == entry["agent_id"] and e["ok"] for e in r["receivers"])), None)
        if repair is not None:
            print(f"check: version {tear} tore rollout 2's model (receiver {entry['rank']}, agent "
                  f"{entry['agent_id']}); version {repair['id']} repaired it with a whole copy of version "
                  f"{repair['source_version']}")
        elif later is not None:
            print(f"check: version {tear} tore rollout 2's model (receiver {entry['rank']}, agent "
                  f"{entry['agent_id']}); nothing cached to repair it from, version {later['id']} made it whole")
        else:
            failures.append(f"--tear {tear}: agent {entry['agent_id']} was never made whole again")
    return failures


if __name__ == "__main__":
    sys.exit(main())
