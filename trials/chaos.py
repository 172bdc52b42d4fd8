"""Randomized fault trials: ``ckpt-engine chaos`` (or ``python -m ckpt_engine.trials.chaos``).

A cluster is the real daemon, a 2-rank FSDP2 trainer job and 2-3 rollout receivers on 127.0.0.1, each its
own process (trials/procs.py); every agent reaches the daemon's ZMQ port through its own TCP proxy
(trials/proxy.py), so its control connection can be cut. Each trial:

1. requests a version (cached, sparse or bypass_cpu, at random) and, at a random point of it, injects one
   fault: kill -9 of a receiver, a trainer rank or the daemon; SIGSTOP of one of them for a random stall
   (up to past the heartbeat timeout); a cut of one agent's ZMQ connection for a random time; a receiver
   whose engine refuses a version, fails half way through applying it (torn), or cannot allocate staging;
   a burst of well-formed hostile messages from a holder of the rollout token; the history's file system
   refusing writes (RLIMIT_FSIZE); a second daemon started on the same history; or 60 HTTP requests that
   wait on a stalled trainer while /health is probed;
2. recovers as an operator or supervisor would: restarts what was killed (the whole trainer job when a rank
   died, as torchrun does), SIGCONTs what was stalled, lets the connection back;
3. checks the invariants (trials/checks.py) and that the next sync after recovery commits.

Results go to ``--json`` and, with ``--report``, into docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from ckpt_engine.control.messages import TERMINAL
from ckpt_engine.server.launch import REPO, free_port, start_daemon, write_config
from ckpt_engine.trials.checks import (
    Limits,
    applied_violations,
    history_violations,
    read_jsonl,
    storage_violations,
    wait_violations,
)
from ckpt_engine.trials.hostile import hostile_messages
from ckpt_engine.trials.proxy import Proxy

FAULTS = ("kill_receiver", "kill_trainer", "kill_daemon", "stop_receiver", "stop_trainer", "stop_daemon",
          "drop_receiver", "drop_trainer",
          # what the outside probe found (issue 15): a receiver failing at each stage of its receive path, a
          # hostile peer with valid credentials, storage faults, a second daemon, a slow control plane
          "refuse_receiver", "tear_receiver", "starve_receiver", "hostile_peer", "fill_disk", "second_daemon",
          "slow_control",
          # the third outside round (issue 25): the owner set of versions changes between two versions (trainer
          # rank 1 silent past its window when one is planned, in every mode), and a holder of the trainer or
          # rollout token registering with claims on live agents' places
          "owners_change", "hostile_registrant",
          # the fourth round (issue 35): a registration that polls but never joins a version's group
          "silent_member")
HEALTH_LIMIT_S = 1.0  # the Kubernetes probe in deploy/ times out at 1 s
SYNC_BODIES = ({"sparse": True}, {"sparse": False}, {"sparse": False, "bypass_cpu": True})
TIMEOUTS = {"connect_s": 8, "collective_s": 6, "ack_s": 8, "heartbeat_s": 3, "version_s": 20}
PG_TIMEOUT_S = 8  # the trainer job's own process group
LIMITS = Limits(version_s=TIMEOUTS["version_s"] + TIMEOUTS["heartbeat_s"], trainer_exit_s=PG_TIMEOUT_S,
                margin_s=5)
FRESH_S = 1.0  # agents poll every 0.3 s
RECOVER_S = 60  # a cluster that is not whole again within this is a failed trial (and is rebuilt)


@dataclass
class Trial:
    index: int
    fault: str
    target: str
    transport: str
    receivers: int
    sync_body: dict
    fault_after_s: float
    stall_s: float = 0.0
    health_limit_s: float = HEALTH_LIMIT_S  # the slowest /health a trial accepts
    in_flight: int | None = None
    in_flight_status: str = "none"  # of the version the fault hit: committed / failed / cancelled / none
    in_flight_reason: str | None = None
    recovery_s: float | None = None  # fault -> the next version committed
    resumed_at: float | None = None  # stop faults: when SIGCONT was sent
    waits: list[tuple[str, float]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Cluster:
    """One daemon, one 2-rank trainer job and some receivers, every process started and killed by us."""

    def __init__(self, workdir: Path, receivers: int, transport: str) -> None:
        self.workdir, self.receivers, self.transport = workdir, receivers, transport
        workdir.mkdir(parents=True, exist_ok=True)
        # a fixed rendezvous port: a restarted daemon is found where the agents expect it
        self.config = write_config(workdir, bucket_size_mb=0.25, keep_versions=3, sparse=True, min_receivers=1,
                                   transport=transport, timeouts=TIMEOUTS)
        data = yaml.safe_load(self.config.read_text())
        data["store"]["rendezvous_port"] = free_port()
        self.config.write_text(yaml.safe_dump(data))
        self.url = f"http://127.0.0.1:{data['http']['port']}"
        self.zmq_port = int(data["zmq"]["endpoint"].rsplit(":", 1)[1])
        self.procs: dict[str, subprocess.Popen] = {}
        self._daemon_starts = 0
        self.proxies = {name: Proxy("127.0.0.1", self.zmq_port) for name in self.agent_names()}
        self.http = httpx.Client(base_url=self.url, timeout=5)

    def agent_names(self) -> list[str]:
        return ["trainer0", "trainer1"] + [f"receiver{i}" for i in range(self.receivers)]

    # ---- processes ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.start_daemon()
        self.start_trainers()
        for i in range(self.receivers):
            self.start_receiver(i)

    def start_daemon(self) -> None:
        self._daemon_starts += 1  # one log per daemon run: a restarted daemon does not overwrite the last one's
        daemon = start_daemon(self.config, log_path=self.workdir / f"daemon.{self._daemon_starts}.log",
                              export_credentials=False)
        self.procs["daemon"] = daemon.proc
        self.http.headers["Authorization"] = f"Bearer {daemon.token}"
        self.daemon = daemon

    def tokens(self) -> dict[str, str | None]:
        return self.daemon.tokens()

    def start_trainers(self) -> None:
        port = free_port()
        for rank in (0, 1):
            self._agent(f"trainer{rank}", "trainer", {"rank": rank, "pg_port": port, "pg_timeout_s": PG_TIMEOUT_S})

    def start_receiver(self, index: int) -> None:
        self._agent(f"receiver{index}", "receiver", {"index": index})

    def _agent(self, name: str, role: str, args: dict) -> None:
        args = {**args, "workdir": str(self.workdir), "zmq": self.proxies[name].endpoint}
        self._spawn(name, [sys.executable, "-m", "ckpt_engine.trials.procs", role, json.dumps(args)])

    def _spawn(self, name: str, argv: list[str]) -> None:
        with (self.workdir / f"{name}.log").open("a") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                                env={**os.environ,
                                                     "CKPT_ENGINE_CREDENTIALS": str(self.workdir / "credentials.json")})

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def signal(self, name: str, sig: int) -> None:
        if self.alive(name):
            os.kill(self.procs[name].pid, sig)

    def dump_stacks(self) -> None:
        """Every live process prints its threads' stacks into its log (SIGUSR1): where each one waits."""
        for name in self.procs:
            self.signal(name, signal.SIGUSR1)

    def kill(self, name: str) -> None:
        if self.alive(name):
            self.procs[name].kill()
            self.procs[name].wait(10)

    def stop(self) -> None:
        (self.workdir / "stop").touch()
        for name in self.procs:
            self.signal(name, signal.SIGCONT)
        deadline = time.monotonic() + 15
        for name, proc in self.procs.items():
            if name != "daemon":
                _wait(proc, deadline)
        self.signal("daemon", signal.SIGTERM)
        _wait(self.procs["daemon"], time.monotonic() + 15)
        for proxy in self.proxies.values():
            proxy.close()
        self.http.close()

    # ---- control plane -----------------------------------------------------------------------------
    def whole(self) -> bool:
        """Every process runs and the daemon knows exactly the live agents (dead ones have been dropped)."""
        live = {self.procs[n].pid for n in self.agent_names() if self.alive(n)}
        if len(live) != len(self.agent_names()) or not self.alive("daemon"):
            return False
        try:
            agents = self.http.get("/receivers").json()["agents"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        # ...and every one of them heartbeating (a supervisor's readiness check): one just woken from a stall
        # is still registered but may be dropped any moment, and the daemon leaves it out of quorums
        fresh = all(a["seconds_since_seen"] <= FRESH_S for a in agents)
        # ...and every receiver ready for the next regular version (after a restart of the daemon or of the
        # receiver, it first gets a version of its own from the cache when there is one)
        serving = all(a.get("joins_next") for a in agents if a["role"] == "receiver")
        return {a["pid"] for a in agents} == live and fresh and serving

    def wait_whole(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.whole():
                return True
            time.sleep(0.2)
        return False

    def request(self, body: dict, *, conflict_wait_s: float = 0.0) -> tuple[int | None, str]:
        """POST /sync; ``conflict_wait_s``: retry a 409 (a catch-up or repair in flight) for that long."""
        deadline = time.monotonic() + conflict_wait_s
        while True:
            try:
                reply = self.http.post("/sync", json=body)
            except httpx.HTTPError as exc:
                return None, f"http error: {exc}"
            if reply.status_code != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        data = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        version = data.get("version") or (data.get("record") or {}).get("id")
        return version, f"{reply.status_code} {data.get('error', '')}".strip()

    def record(self, version: int) -> dict | None:
        try:
            reply = self.http.get(f"/versions/{version}")
        except httpx.HTTPError:
            return None
        return reply.json() if reply.status_code == 200 else None

    def wait_terminal(self, version: int, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = self.record(version)
            if record is not None and record["status"] in TERMINAL:
                return record
            time.sleep(0.1)
        return self.record(version)

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.http.get("/status").json().get("in_flight") is None:
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        return False

    def wait_repaired(self, timeout_s: float) -> list[str]:
        """Wait until no receiver is torn (the daemon repairs them from the cache); the ones still torn."""
        deadline = time.monotonic() + timeout_s
        while True:
            agents = self.http.get("/receivers").json()["agents"]
            torn = [a["agent_id"] for a in agents if a.get("state") == "torn"]
            if not torn or time.monotonic() > deadline:
                return torn
            time.sleep(0.2)

    def history(self) -> dict[int, dict]:
        return {v["id"]: v for v in self.http.get("/versions", params={"limit": 1000}).json()["versions"]}

    def applied(self) -> list[dict]:
        out = []
        for path in sorted(self.workdir.glob("receiver*.applied.jsonl")):
            out += read_jsonl(path.read_text())
        return out


def _wait(proc: subprocess.Popen, deadline: float) -> None:
    try:
        proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ---- one trial ---------------------------------------------------------------------------------------------
def run_trial(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    """Fault, recovery and checks of one trial; fills in ``trial``."""
    first_new = max(cluster.history(), default=0) + 1
    version, _ = cluster.request(trial.sync_body)
    trial.in_flight = version
    time.sleep(trial.fault_after_s)
    fault_at = time.monotonic()
    inject(cluster, trial, rng)
    recover(cluster, trial, fault_at)
    if version is not None:
        record = cluster.wait_terminal(version, LIMITS.version_s + LIMITS.margin_s)
        trial.in_flight_status = record["status"] if record else "unknown"
        trial.in_flight_reason = record.get("reason") if record else None
    if trial.fault in ("refuse_receiver", "tear_receiver"):  # it was for the in-flight version, not the next
        (cluster.workdir / f"{trial.target}.arm").write_text("disarm")
    if not supervise(cluster, trial, RECOVER_S) or not cluster.wait_idle(LIMITS.version_s + LIMITS.margin_s):
        trial.violations.append(f"the cluster was not whole and idle within {RECOVER_S}s of recovery")
        return
    next_version, answer = cluster.request({"sparse": rng.random() < 0.5}, conflict_wait_s=LIMITS.version_s)
    record = cluster.wait_terminal(next_version, LIMITS.version_s + LIMITS.margin_s) if next_version else None
    if record is None or record["status"] != "committed":
        cluster.dump_stacks()
        trial.violations.append(f"the next sync after recovery did not commit: {answer} "
                                f"{record and (record['status'], record.get('reason'))}")
    else:
        trial.recovery_s = round(time.monotonic() - fault_at, 2)
    check(cluster, trial, first_new)


def inject(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    action, _, kind = trial.fault.partition("_")
    name = trial.target
    if trial.fault in _SPECIAL:
        _SPECIAL[trial.fault](cluster, trial, rng)
    elif action == "kill":
        cluster.kill(name)
        if kind == "trainer":  # the surviving rank must give up by itself within its timeout
            survivor = "trainer1" if name == "trainer0" else "trainer0"
            trial.waits.append((f"{survivor} exit after its peer died", _time_to_exit(cluster, survivor)))
    elif action == "stop":
        cluster.signal(name, signal.SIGSTOP)
        time.sleep(trial.stall_s)
        cluster.signal(name, signal.SIGCONT)
        trial.resumed_at = time.monotonic()
    else:
        cluster.proxies[name].drop(trial.stall_s)
        time.sleep(trial.stall_s)


_ARMED = {"refuse_receiver": "refuse", "tear_receiver": "torn", "starve_receiver": "alloc"}


def _arm(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    (cluster.workdir / f"{trial.target}.arm").write_text(_ARMED[trial.fault])
    time.sleep(trial.stall_s)


def _hostile(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    from ckpt_engine.control.client import ControlClient, ControlReplyError

    token = cluster.tokens().get("rollout")
    client = ControlClient(f"tcp://127.0.0.1:{cluster.zmq_port}", timeout_s=5, token=token)
    try:
        reply = client.request("register", {"role": "receiver", "host": "hostile", "pid": 1, "device": "cpu"})
        mine = {"agent_id": reply["agent_id"], "session": reply["session"]}
        victims = [a["agent_id"] for a in cluster.http.get("/receivers").json()["agents"]]
        messages = hostile_messages(rng, victims, mine, trial.in_flight)
        deadline = time.monotonic() + trial.stall_s
        while time.monotonic() < deadline:
            message = next(messages)
            try:
                client.request(message["type"], message["body"])
            except ControlReplyError as exc:  # refusals are expected; a bug of ours is not
                if exc.error == "internal error":
                    trial.violations.append(f"a hostile message got an internal error: {exc}")
    finally:
        client.close()


def _fill_disk(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    import resource

    pid = cluster.procs["daemon"].pid
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # every write fails: EFBIG
    try:
        time.sleep(trial.stall_s)
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _second_daemon(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    started = time.monotonic()
    second = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "serve", "--config", str(cluster.config)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    if second.returncode != 2 or "in use by another daemon" not in second.stderr:
        trial.violations.append(f"a second daemon on the same history exited {second.returncode}: "
                                f"{second.stderr.strip()[-300:]}")
    trial.waits.append(("second daemon refused", round(time.monotonic() - started, 2)))


def _slow_control(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    import concurrent.futures

    cached = [v for v, r in cluster.history().items() if r.get("cached")]
    # Clients built before the window: an httpx client costs ~30 ms of this process's CPU (its TLS context),
    # which 60 of them at once would charge to /health. The probe opens a new connection each time (no
    # keep-alive), so the daemon's accept path is measured, not the harness.
    waiting = httpx.Client(base_url=cluster.url, headers=dict(cluster.http.headers), timeout=30,
                           limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
    probe = httpx.Client(base_url=cluster.url, timeout=5, limits=httpx.Limits(max_keepalive_connections=0))
    pool = concurrent.futures.ThreadPoolExecutor(64)

    def slow(i: int) -> float:
        path = f"/versions/{cached[i % len(cached)]}" if cached else "/versions"
        began = time.monotonic()
        (waiting.delete(path) if cached else waiting.get(path, params={"limit": 1000})).raise_for_status()
        return time.monotonic() - began

    # Both ranks: an eviction is answered as soon as every rank that holds a share of the version confirmed
    # it, so with one rank running the requests would not wait at all.
    for rank in ("trainer0", "trainer1"):
        cluster.signal(rank, signal.SIGSTOP)
    try:
        pending = [pool.submit(slow, i) for i in range(60)]
        worst, deadline = 0.0, time.monotonic() + trial.stall_s
        while time.monotonic() < deadline:
            began = time.monotonic()
            try:
                probe.get("/health")
            except httpx.HTTPError:
                pass
            worst = max(worst, time.monotonic() - began)
            time.sleep(0.1)
        trial.waits.append(("slowest /health", round(worst, 3)))
        if worst > trial.health_limit_s:
            trial.violations.append(f"/health took {worst:.2f}s while requests waited on the trainer")
    finally:
        for rank in ("trainer0", "trainer1"):  # (before the waiting requests are waited for)
            cluster.signal(rank, signal.SIGCONT)
        trial.resumed_at = time.monotonic()
        probe.close()
    try:
        waited = 0
        for future in pending:
            try:
                waited += future.result(timeout=60) >= min(trial.stall_s, 1.0) / 2
            except httpx.HTTPStatusError as exc:  # (a 409 or 503 is an answer: the daemon's choice)
                waited += exc.response.status_code in (429, 503)
            except Exception as exc:  # noqa: BLE001 - the daemon must answer; how is its choice
                trial.violations.append(f"a waiting request got no answer: {exc}")
        trial.notes.append(f"{waited} of {len(pending)} requests waited on the stopped trainer")
        if cached and not waited:  # (then /health was timed while nothing waited: the trial proved nothing)
            trial.violations.append("none of the 60 requests waited on the stopped trainer")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        waiting.close()


def _owners_change(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    """Trainer rank 1 falls silent (SIGSTOP) past its silence window, within the heartbeat: a version planned
    then has rank 0 as its only owner; rank 1 runs again and the next versions have both (2 -> 1 -> 2 owners,
    in the trial's mode, sparse included). Every one of them must commit."""
    if not cluster.wait_idle(LIMITS.version_s + LIMITS.margin_s):
        trial.violations.append("the cluster was not idle before the owner set changed")
        return
    rank1 = next((a for a in cluster.http.get("/receivers").json()["agents"]
                  if a["role"] == "trainer" and a["rank"] == 1), None)
    if rank1 is None:
        trial.violations.append("trainer rank 1 is not registered")
        return
    window = FRESH_S + TIMEOUTS["heartbeat_s"] / 2  # poll wait (0.3 s) + half a heartbeat, with a margin
    cluster.signal("trainer1", signal.SIGSTOP)
    try:
        started = time.monotonic()
        while time.monotonic() - started < TIMEOUTS["heartbeat_s"] - 0.5:
            seen = {a["agent_id"]: a for a in cluster.http.get("/receivers").json()["agents"]}.get(rank1["agent_id"])
            if seen is None or seen["seconds_since_seen"] > window:
                break
            time.sleep(0.1)
        version, answer = cluster.request(trial.sync_body, conflict_wait_s=5.0)
    finally:
        cluster.signal("trainer1", signal.SIGCONT)
        trial.resumed_at = time.monotonic()
    if version is None:
        trial.violations.append(f"the version planned while rank 1 was silent was refused: {answer}")
        return
    record = cluster.wait_terminal(version, LIMITS.version_s + LIMITS.margin_s)
    trial.notes.append(f"version {version}: {record['owners'] if record else '?'} owner(s) while rank 1 was silent")
    if record is None or record["status"] != "committed":
        trial.violations.append(f"version {version} of owner rank 0 alone did not commit: "
                                f"{record and (record['status'], record.get('reason'))}")


def _hostile_registrant(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    """Registrations with the trainer and the rollout tokens that claim live agents' places: trainer ranks of
    the live job (its pids too), and workers, member counts and a driver of a live engine. Each must be refused
    (409) naming the live agent, and the cluster's own agents keep receiving (the next sync commits)."""
    from ckpt_engine.control.client import ControlClient, ControlReplyError

    tokens = cluster.tokens()
    endpoint = f"tcp://127.0.0.1:{cluster.zmq_port}"
    trainer = ControlClient(endpoint, timeout_s=5, token=tokens.get("trainer"))
    rollout = ControlClient(endpoint, timeout_s=5, token=tokens.get("rollout"))
    engine = f"chaos-engine-{trial.index}"
    ours: list[tuple[ControlClient, dict]] = []

    def register(client: ControlClient, body: dict) -> dict:
        reply = client.request("register", {"host": "hostile", "pid": 1, "device": "cpu", **body})
        ours.append((client, {"agent_id": reply["agent_id"], "session": reply["session"]}))
        return reply

    try:
        live = {a["rank"]: a for a in cluster.http.get("/receivers").json()["agents"] if a["role"] == "trainer"}
        # an engine of one worker and its driver, as a real engine would register (ours: unregistered after)
        key = register(rollout, {"role": "driver", "engine": engine, "members": 1})["engine_key"]
        register(rollout, {"role": "receiver", "engine": engine, "driven": True, "members": 1, "engine_key": key})
        claims = [(trainer, {"role": "trainer", "rank": rank, "trainer_ranks": 2, "pid": live[rank]["pid"],
                             "host": live[rank]["host"]}) for rank in sorted(live)]
        claims += [(trainer, {"role": "trainer", "rank": 0, "trainer_ranks": 1, "framework": "verl"}),
                   (rollout, {"role": "receiver", "engine": engine, "driven": True, "members": 1, "engine_key": key}),
                   (rollout, {"role": "receiver", "engine": engine, "driven": True, "members": 2, "engine_key": key}),
                   (rollout, {"role": "receiver", "engine": engine}),
                   (rollout, {"role": "driver", "engine": engine, "members": 1}),
                   (rollout, {"role": "receiver", "engine": f"{engine}-free", "driven": True, "members": 2})]
        for client, claim in rng.sample(claims, len(claims)):
            try:
                register(client, claim)
            except ControlReplyError as exc:
                keyless = exc.error == "forbidden" and "engine_key" not in claim and claim.get("driven")
                if not keyless and (exc.error != "conflict" or not (exc.record or {}).get("live_agent")):
                    trial.violations.append(f"a registration claiming {claim} got {exc.error}: {exc.detail}")
                continue
            trial.violations.append(f"a registration claiming {claim} was accepted while the place is held")
        time.sleep(trial.stall_s)
    finally:
        for client, identity in ours:
            try:
                client.request("unregister", identity)
            except Exception:  # noqa: BLE001 - it expires with its heartbeat anyway
                pass
        trainer.close()
        rollout.close()


def _silent_member(cluster: Cluster, trial: Trial, rng: random.Random) -> None:
    """A receiver registered with the rollout token that keeps polling (so it looks alive) and never joins a
    version's group, while a version is synced. It may cost that version (a plain version has one group),
    and must be the one benched: no receiver of the cluster is ever recorded as the absent one."""
    import threading

    from ckpt_engine.control.client import ControlClient

    client = ControlClient(f"tcp://127.0.0.1:{cluster.zmq_port}", timeout_s=5, token=cluster.tokens().get("rollout"))
    reply = client.request("register", {"role": "receiver", "host": "silent", "pid": 1, "device": "cpu"})
    identity = {"agent_id": reply["agent_id"], "session": reply["session"]}
    first = max(cluster.history(), default=0) + 1
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                client.request("poll", {**identity, "wait_s": 0.2})
            except Exception:  # noqa: BLE001 - the daemon may be restarting: keep trying until told to stop
                stop.wait(0.2)

    poller = threading.Thread(target=poll, name="chaos-silent-member", daemon=True)
    poller.start()
    try:
        cluster.wait_idle(LIMITS.version_s)
        version, _ = cluster.request(trial.sync_body, conflict_wait_s=LIMITS.version_s)
        if version is not None:
            cluster.wait_terminal(version, LIMITS.version_s + LIMITS.margin_s)
    finally:
        stop.set()
        poller.join(10)
        try:
            client.request("unregister", identity)
        except Exception:  # noqa: BLE001 - it expires with its heartbeat anyway
            pass
        client.close()
    for version, record in cluster.history().items():
        for entry in (record.get("receivers") or []) if version >= first else []:
            absent = "the trainer saw it absent" in (entry.get("reason") or "")
            if absent and entry.get("agent_id") != identity["agent_id"]:
                trial.violations.append(f"version {version}: receiver {entry.get('agent_id')} recorded absent "
                                        f"while the silent member {identity['agent_id']} was the one missing")


_SPECIAL = {"refuse_receiver": _arm, "tear_receiver": _arm, "starve_receiver": _arm, "hostile_peer": _hostile,
            "fill_disk": _fill_disk, "second_daemon": _second_daemon, "slow_control": _slow_control,
            "owners_change": _owners_change, "hostile_registrant": _hostile_registrant,
            "silent_member": _silent_member}


def _time_to_exit(cluster: Cluster, name: str) -> float:
    started = time.monotonic()
    try:
        cluster.procs[name].wait(LIMITS.trainer_exit_s + LIMITS.margin_s + 10)
    except subprocess.TimeoutExpired:
        cluster.kill(name)
    return round(time.monotonic() - started, 2)


def _wait_storage_back(cluster: Cluster, trial: Trial, limit_s: float = 10.0) -> None:
    """A degraded daemon refuses new versions (503, truthfully) until a write succeeds again: wait for that,
    within the history's retry backoff plus a margin."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            if not httpx.get(f"{cluster.url}/health", timeout=2).json().get("degraded"):
                trial.waits.append(("storage noticed back", round(time.monotonic() - started, 2)))
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    trial.violations.append(f"the daemon still reported degraded storage {limit_s:.0f}s after the disk came back")


def recover(cluster: Cluster, trial: Trial, fault_at: float) -> None:
    """Restart whatever is not running any more, as a supervisor would."""
    if trial.fault == "starve_receiver":  # memory comes back
        (cluster.workdir / f"{trial.target}.arm").write_text("unalloc")
    if not cluster.alive("daemon"):
        cluster.start_daemon()
    if trial.fault == "fill_disk":  # the daemon retries its storage with a backoff of at most 5 s
        _wait_storage_back(cluster, trial)
    trainers = ("trainer0", "trainer1")
    if _may_end_the_job(trial):
        # A stall near or past the job's timeout ends it: the peer's collective times out before the stalled
        # rank runs again (or not at all), and the peer then leaves its loop at once. Give it that long.
        settled = max(fault_at + PG_TIMEOUT_S, trial.resumed_at or fault_at) + 2
        while all(cluster.alive(t) for t in trainers) and time.monotonic() < settled:
            time.sleep(0.2)
        for survivor in trainers:
            if cluster.alive(survivor) and not all(cluster.alive(t) for t in trainers):
                # the peer waited from the stall's start; the stalled rank only runs again from SIGCONT
                own = survivor == trial.target and trial.resumed_at is not None
                since = trial.resumed_at if own and trial.resumed_at is not None else fault_at
                _time_to_exit(cluster, survivor)
                trial.waits.append((f"{survivor} exit after {'its own stall' if own else 'its peer stalled'}",
                                    round(time.monotonic() - since, 2)))
    if not all(cluster.alive(t) for t in trainers):
        for t in trainers:
            cluster.kill(t)
        cluster.start_trainers()
    for i in range(cluster.receivers):
        if not cluster.alive(f"receiver{i}"):
            cluster.start_receiver(i)


def supervise(cluster: Cluster, trial: Trial, timeout_s: float) -> bool:
    """Wait until the cluster is whole again, restarting any process that died meanwhile (as a supervisor
    would). A death the fault does not explain is a violation: e.g. a trainer rank must survive a daemon
    or receiver fault, because training must never depend on the control plane or on rollouts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [name for name in cluster.procs if not cluster.alive(name)]
        for name in dead:
            code = cluster.procs[name].returncode
            explained = name.startswith("trainer") and (trial.fault == "kill_trainer" or _may_end_the_job(trial))
            if not explained:
                trial.violations.append(f"{name} exited (code {code}) after a fault on {trial.target}")
        if dead:
            recover(cluster, trial, time.monotonic())
        if cluster.whole():
            return True
        time.sleep(0.2)
    return False


def _may_end_the_job(trial: Trial) -> bool:
    """A trainer rank stalled for about the job's collective timeout or longer: its peer gives up. A shorter
    stall must not end the job."""
    return trial.fault == "stop_trainer" and trial.stall_s >= PG_TIMEOUT_S - 1


def check(cluster: Cluster, trial: Trial, first_new: int) -> None:
    history = cluster.history()
    applied = cluster.applied()
    trial.violations += applied_violations(applied, history)
    trial.violations += history_violations({v: r for v, r in history.items() if v >= first_new}, LIMITS)
    trial.violations += wait_violations([w for w in trial.waits if not w[0].startswith(("slowest", "second"))], LIMITS)
    if trial.fault == "fill_disk":  # nothing else went wrong: what a receiver applied must be recorded committed
        trial.violations += storage_violations(applied, {v: r for v, r in history.items() if v >= first_new})
    torn = cluster.wait_repaired(LIMITS.version_s + LIMITS.margin_s)
    if torn:
        trial.violations.append(f"receivers {torn} still torn {LIMITS.version_s + LIMITS.margin_s:.0f}s after "
                                "recovery (no repair)")
    agents = cluster.http.get("/receivers").json()["agents"]
    trainers = {a["pid"] for a in agents if a["role"] == "trainer"}
    ours = {cluster.procs[t].pid for t in ("trainer0", "trainer1") if cluster.alive(t)}
    if not trainers <= ours:
        trial.violations.append(f"trainer agents {trainers} are not the cluster's trainer ranks {ours}")


def plan_trial(index: int, rng: random.Random, fault: str, cluster: Cluster, typical_sync_s: float) -> Trial:
    kind = fault.partition("_")[2]
    target = ("daemon" if kind in ("daemon", "disk", "control") else rng.choice(["trainer0", "trainer1"])
              if kind == "trainer" else "daemon" if kind == "peer" else f"receiver{rng.randrange(cluster.receivers)}")
    if fault in ("drop_trainer", "slow_control", "owners_change", "hostile_registrant", "silent_member"):
        target = {"drop_trainer": "trainer0", "slow_control": "daemon",  # (trainer0 is the rank that talks to it)
                  "owners_change": "trainer1", "hostile_registrant": "daemon", "silent_member": "daemon"}[fault]
    longest = PG_TIMEOUT_S + 3 if fault == "stop_trainer" else 2.5 * TIMEOUTS["heartbeat_s"]  # past the timeouts
    stalls = {"hostile_peer": (1.0, 4.0), "hostile_registrant": (0.2, 1.0),
              "fill_disk": (0.5, 3.0 * TIMEOUTS["heartbeat_s"]),
              "slow_control": (1.0, 4.0), "starve_receiver": (0.5, 4.0), "refuse_receiver": (0.0, 0.5),
              "tear_receiver": (0.0, 0.5)}
    low, high = stalls.get(fault, (0.3, longest))
    stall = rng.uniform(low, high) if fault.startswith(("stop", "drop")) or fault in stalls else 0.0
    return Trial(index, fault, target, cluster.transport, cluster.receivers, rng.choice(SYNC_BODIES),
                 round(rng.uniform(0, 1.5 * typical_sync_s), 3), round(stall, 2))


# ---- a run -------------------------------------------------------------------------------------------------
def warm_up(cluster: Cluster) -> float:
    """Syncs until three commit; returns their median duration (the window faults are dropped into)."""
    if not cluster.wait_whole(RECOVER_S):
        raise RuntimeError("the cluster did not come up")
    durations: list[float] = []
    for _ in range(10):
        started = time.monotonic()
        version, _ = cluster.request({"sparse": False})
        record = cluster.wait_terminal(version, LIMITS.version_s) if version else None
        if record and record["status"] == "committed":
            durations.append(time.monotonic() - started)
        if len(durations) == 3:
            return statistics.median(durations)
        cluster.wait_idle(LIMITS.version_s)
    raise RuntimeError("warm-up syncs did not commit")


def run(trials: int, per_cluster: int, seed: int, workdir: Path, log=print,
        health_limit_s: float = HEALTH_LIMIT_S, kinds: Sequence[str] = FAULTS) -> list[Trial]:
    """``health_limit_s``: the slowest /health accepted while requests wait on a stopped trainer (the probe's
    1 s by default; the test suite, on shared loaded machines, allows more). ``kinds``: the fault kinds drawn
    from, in turn (all by default; one to study it alone)."""
    rng = random.Random(seed)
    results: list[Trial] = []
    faults = [kinds[i % len(kinds)] for i in range(trials)]
    rng.shuffle(faults)
    cluster_index = 0
    while len(results) < trials:
        transport = ("collective", "auto")[cluster_index % 2]
        receivers = 2 + (cluster_index // 2) % 2
        cluster = Cluster(workdir / f"cluster{cluster_index}", receivers, transport)
        cluster_index += 1
        try:
            cluster.start()
            typical = warm_up(cluster)
            log(f"cluster {cluster_index}: {receivers} receivers, transport {transport}, sync {typical:.2f}s")
            for _ in range(min(per_cluster, trials - len(results))):
                trial = plan_trial(len(results), rng, faults[len(results)], cluster, typical)
                trial.health_limit_s = health_limit_s
                run_trial(cluster, trial, rng)
                results.append(trial)
                log(_line(trial))
                if trial.violations and not cluster.whole():
                    break  # start from a fresh cluster
        finally:
            cluster.stop()
    return results


def _line(trial: Trial) -> str:
    verdict = "ok" if not trial.violations else "VIOLATION: " + "; ".join(trial.violations)
    return (f"trial {trial.index:3d} {trial.fault:14s} {trial.target:9s} at +{trial.fault_after_s:.2f}s "
            f"stall {trial.stall_s:.1f}s  in-flight {trial.in_flight_status:9s} recovery "
            f"{trial.recovery_s if trial.recovery_s is not None else '-'}s  {verdict}")


# ---- report ------------------------------------------------------------------------------------------------
def summarize(trials: list[Trial]) -> dict:
    by_fault: dict[str, dict] = {}
    for fault in FAULTS:
        mine = [t for t in trials if t.fault == fault]
        if not mine:
            continue
        recoveries = [t.recovery_s for t in mine if t.recovery_s is not None]
        outcomes: dict[str, int] = {}
        for t in mine:
            outcomes[t.in_flight_status] = outcomes.get(t.in_flight_status, 0) + 1
        by_fault[fault] = {"trials": len(mine), "outcomes": outcomes,
                           "violations": sum(len(t.violations) for t in mine),
                           "recovery_median_s": statistics.median(recoveries) if recoveries else None,
                           "recovery_max_s": max(recoveries) if recoveries else None}
    waits = [w for t in trials for w in t.waits]
    return {"trials": len(trials), "violations": sum(len(t.violations) for t in trials), "by_fault": by_fault,
            "worst_recovery_s": max((t.recovery_s for t in trials if t.recovery_s is not None), default=None),
            "longest_survivor_wait_s": max((s for _, s in waits), default=None)}


def markdown(summary: dict, trials: list[Trial], command: str, seconds: float) -> str:
    rows = ["| fault | trials | the version it hit: committed / failed / cancelled / none | violations | "
            "recovery median | recovery max |", "|---|---:|---|---:|---:|---:|"]
    for fault, s in summary["by_fault"].items():
        o = s["outcomes"]
        hit = " / ".join(str(o.get(k, 0)) for k in ("committed", "failed", "cancelled", "none"))
        rows.append(f"| {fault} | {s['trials']} | {hit} | {s['violations']} | {_s(s['recovery_median_s'])} | "
                    f"{_s(s['recovery_max_s'])} |")
    found = [f"- trial {t.index} ({t.fault} {t.target}): {v}" for t in trials for v in t.violations]
    return "\n".join([
        f"Command: `{command}`. {summary['trials']} trials in {seconds / 60:.0f} min, "
        f"**{summary['violations']} invariant violations**. Worst recovery (fault to the next committed "
        f"version): {_s(summary['worst_recovery_s'])}. Longest wait of a trainer rank whose peer died or "
        f"stalled, before it gave up: {_s(summary['longest_survivor_wait_s'])} (limit "
        f"{LIMITS.trainer_exit_s + LIMITS.margin_s:.0f} s).",
        "",
        f"Timeouts: {', '.join(f'{k} {v}' for k, v in TIMEOUTS.items())}; trainer process group {PG_TIMEOUT_S} s. "
        f"Clusters alternate between the collective transport and `auto` (same-host shared memory), "
        f"and between 2 and 3 receivers.",
        "",
        *rows,
        "",
        *(found or ["No violations."]),
    ])


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def write_report(path: Path, body: str) -> None:
    begin, end = "<!-- chaos:begin -->", "<!-- chaos:end -->"
    text = path.read_text()
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.replace("(filled in by the chaos run)", block)
    path.write_text(text)


def main(argv: list[str] | None = None, prog: str = "python -m ckpt_engine.trials.chaos") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--per-cluster", type=int, default=25, help="trials before a fresh cluster is built")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=_fault_kinds, default=FAULTS,
                        help="comma-separated fault kinds to draw from (default: all of them)")
    parser.add_argument("--workdir", type=Path, default=None, help="logs of every process (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write every trial as JSON")
    parser.add_argument("--report", type=Path, default=None, help="update the chaos section of this markdown file")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="run nothing: write --report from an earlier run's --json output")
    args = parser.parse_args(argv)
    if args.from_json:
        return _report_from_json(args.from_json, args.report)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ckpt-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"{args.trials} trials, seed {args.seed}, logs in {workdir}", flush=True)
    with (workdir / "trials.log").open("a", buffering=1) as trials_log:
        def log(line: str) -> None:
            print(line, flush=True)
            trials_log.write(line + "\n")

        trials = run(args.trials, args.per_cluster, args.seed, workdir, log=log, kinds=args.faults)
    summary = summarize(trials)
    print(json.dumps(summary, indent=2))
    command = f"ckpt-engine chaos --trials {args.trials} --seed {args.seed}"
    if args.faults != FAULTS:
        command += f" --faults {','.join(args.faults)}"
    seconds = time.monotonic() - started
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "seconds": seconds, "summary": summary,
                                         "trials": [asdict(t) for t in trials]}, indent=1))
    if args.report:
        write_report(args.report, markdown(summary, trials, command, seconds))
    return 1 if summary["violations"] else 0


def _fault_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {unknown or [text]}; known: {', '.join(FAULTS)}")
    return kinds


def _report_from_json(path: Path, report: Path | None) -> int:
    data = json.loads(path.read_text())
    trials = [Trial(**{**t, "waits": [tuple(w) for w in t["waits"]]}) for t in data["trials"]]
    body = markdown(summarize(trials), trials, data["command"], data["seconds"])
    if report:
        write_report(report, body)
    else:
        print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
