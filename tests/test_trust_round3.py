"""Trust, round 3 (issue 25): what an outside tester found on main at d694ede, one section per finding, each
against the real daemon (or the real library object where the finding is in it)."""

from __future__ import annotations

import os
import resource
import stat
import time
from pathlib import Path

import pytest
import torch

from ckpt_engine.control.auth import TOKEN_MAX_LENGTH, Credentials, read_credentials, write_credentials
from ckpt_engine.control.client import ControlReplyError
from ckpt_engine.control.messages import Register
from ckpt_engine.errors import ConfigError
from tests.daemon_harness import start_daemon, timeouts, write_config
from tests.raw_agent import RawAgent
from tests.test_elastic import wait_until

pytestmark = pytest.mark.multiproc


# ---- 4. one limit per value: a token of any length the config allows works for every agent ---------------
def test_the_longest_token_the_config_allows_works_for_agents(tmp_path: Path) -> None:
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    assert Register.model_fields["token"].metadata[0].max_length == TOKEN_MAX_LENGTH
    longest = {"trainer_token": "t" * TOKEN_MAX_LENGTH, "rollout_token": "r" * (TOKEN_MAX_LENGTH - 1)}
    daemon = start_daemon(write_config(tmp_path, auth={"credentials_file": str(tmp_path / "credentials.json"),
                                                       **longest}))
    agent = None
    try:
        agent = TrainerAgent(lambda: {"w": torch.ones(4)}, daemon.zmq, token=longest["trainer_token"]).start()
        receiver = RawAgent(daemon, "receiver", token=longest["rollout_token"])
        receiver.poll()
        with daemon.client() as http:
            roles = sorted(a["role"] for a in http.get("/receivers").json()["agents"])
        assert roles == ["receiver", "trainer"]
        receiver.close()
    finally:
        if agent is not None:
            agent.close()
        daemon.stop()
    with pytest.raises(ConfigError):
        from ckpt_engine.config import parse_config

        parse_config({"auth": {"rollout_token": "r" * (TOKEN_MAX_LENGTH + 1)}})


# ---- 5. a full disk with nothing pending: /health, /status, the metric and the refusal agree ----------------
def test_a_full_disk_with_nothing_pending_is_reported_degraded_everywhere(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path))
    try:
        with daemon.client() as http:
            resource.prlimit(daemon.proc.pid, resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            try:
                refused = http.post("/sync", json={})
                assert refused.status_code == 503 and "history" in refused.json()["detail"], refused.text
                started = time.monotonic()
                while time.monotonic() - started < 3.0:  # several ticks and storage retries
                    health, status = http.get("/health").json(), http.get("/status").json()
                    assert health["degraded"] and status["degraded"] and not status["storage"]["ok"], (health, status)
                    assert "ckpt_engine_storage_degraded 1.0" in http.get("/metrics").text
                    time.sleep(0.3)
            finally:
                resource.prlimit(daemon.proc.pid, resource.RLIMIT_FSIZE,
                                 (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            wait_until(lambda: not http.get("/health").json()["degraded"], 30, "storage to be noticed back")
            assert http.get("/status").json()["storage"]["ok"]
        log = daemon.log_path.read_text()
        assert log.count("history storage works again") == 1, log[-2000:]
    finally:
        daemon.stop()


# ---- 6. secrets: O_EXCL temp files, mode 0600, a private directory ---------------------------------------
def test_credentials_are_not_written_into_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    target = shared / ".credentials.json"
    # another user's trap: the temporary name the daemon used to take, pre-created 0666
    trap = shared / f".{target.name}.{os.getpid()}.tmp"
    trap.write_text("")
    os.chmod(trap, 0o666)
    os.chown(trap, 4242, 4242)
    tokens = Credentials(operator="o" * 32, trainer="t" * 32, rollout="r" * 32)
    with pytest.raises(ConfigError, match=str(target)):
        write_credentials(target, tokens)
    assert not target.exists() and trap.read_text() == ""


def test_credentials_written_privately_never_reuse_a_file_another_user_made(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    target = private / "credentials.json"
    trap = private / f".{target.name}.{os.getpid()}.tmp"
    os.symlink(tmp_path / "elsewhere", trap)  # a link to follow, had the name been predictable
    tokens = Credentials(operator="o" * 32, trainer="t" * 32, rollout="r" * 32)
    write_credentials(target, tokens)
    info = os.lstat(target)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid() and stat.S_ISREG(info.st_mode)
    assert read_credentials(target) == tokens
    assert not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in private.iterdir()) == sorted([target.name, trap.name])  # no temp file left


def test_serve_and_check_config_refuse_a_credentials_directory_others_can_write(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.daemon_harness import ROOT

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    config = write_config(tmp_path, auth={"credentials_file": str(shared / "credentials.json")})
    for command in (["check-config", str(config)], ["serve", "--config", str(config)]):
        result = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", *command], capture_output=True,
                                text=True, timeout=60, cwd=ROOT)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr)
        assert str(shared) in result.stderr and "777" in result.stderr, result.stderr


def test_with_every_token_configured_a_group_writable_credentials_folder_is_left_alone(tmp_path: Path) -> None:
    """Found by the outside attack on issue 28: a kubelet's fsGroup pass makes the volume's folders 2770, and the
    sidecar (every token from a Secret) then refused to start again. It needs nothing of the file: it starts,
    writes nothing there, and says why; with a token left to the file it still refuses."""
    from ckpt_engine.control.auth import daemon_credentials

    folder = tmp_path / "auth"
    folder.mkdir()
    os.chmod(folder, 0o2770)
    target = folder / "credentials.json"
    fixed = {"operator": "o" * 32, "trainer": "t" * 32, "rollout": "r" * 32}
    assert daemon_credentials(target, fixed) == Credentials(**fixed)
    assert not target.exists()
    with pytest.raises(ConfigError, match="other users can write"):
        daemon_credentials(target, {**fixed, "rollout": None})


# ---- 7. every ZMQ message is validated by its HTTP twin's model ---------------------------------------------
@pytest.mark.parametrize(("kind", "body"), [
    ("latest", {"status": ["failed"]}), ("latest", {"status": "bogus"}), ("versions", {"status": 3}),
    ("versions", {"limit": True}), ("versions", {"before": "soon"}), ("version", {"version": [1]}),
    ("push", {"version": 1.5}), ("evict", {"version": True}),
    # agents' messages too (found by the outside attack: "ok": "1", "torn": "true", "serving": true were taken)
    ("poll", {"agent_id": "a" * 12, "session": "s" * 48, "wait_s": "1"}),
    ("report", {"agent_id": "a" * 12, "session": "s" * 48, "version": 1, "event": "received", "ok": "1"}),
    ("report", {"agent_id": "a" * 12, "session": "s" * 48, "version": 1, "event": "received", "serving": True}),
    ("register", {"role": "receiver", "host": "h", "device": "cpu", "pid": "1"}),
])
def test_zmq_reads_refuse_wrong_typed_fields_as_http_does(shared_daemon, kind: str, body: dict) -> None:
    from ckpt_engine.control.client import ControlClient

    role = "rollout" if kind in ("poll", "report", "register") else "operator"
    client = ControlClient(shared_daemon.zmq, timeout_s=5, token=shared_daemon.tokens()[role])
    try:
        with pytest.raises(ControlReplyError) as refused:
            client.request(kind, body)
        assert refused.value.error == "bad request", refused.value
        field = list(body)[-1]  # (the wrong-typed one)
        assert field in str(refused.value.detail), refused.value.detail
    finally:
        client.close()
    with shared_daemon.client() as http:
        if kind in ("latest", "versions"):
            query = {k: (v if not isinstance(v, list) else v[0]) for k, v in body.items()}
            answer = http.get("/versions/latest" if kind == "latest" else "/versions", params=query)
            if query != {"status": "failed"}:  # (as a query string, ["failed"] reads as "failed": valid)
                assert answer.status_code == 422, answer.text
    assert "Traceback" not in shared_daemon.log_path.read_text()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    from tests.daemon_harness import RUNNING

    daemon = start_daemon(write_config(tmp_path_factory.mktemp("shared-daemon")))
    yield daemon
    daemon.stop()
    if daemon in RUNNING:
        RUNNING.remove(daemon)


# ---- 2. membership claims never change what a live agent receives ------------------------------------------
def test_an_impostor_worker_of_a_live_engine_is_refused_and_the_engine_keeps_receiving(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path))
    agents = []
    try:
        trainer = RawAgent(daemon, "trainer")
        driver = RawAgent(daemon, "driver", engine="eng", members=1)
        key = driver.reply["engine_key"]
        worker = RawAgent(daemon, "receiver", engine="eng", driven=True, members=1, engine_key=key)
        agents += [trainer, worker, driver]
        # (even one holding the engine's key: the claims themselves conflict with live agents)
        for impostor in ({"engine": "eng", "driven": True, "members": 1, "engine_key": key},
                         {"engine": "eng", "driven": True, "members": 2, "engine_key": key}, {"engine": "eng"}):
            with pytest.raises(ControlReplyError) as refused:
                RawAgent(daemon, "receiver", **impostor)
            assert refused.value.error == "conflict", refused.value
            assert worker.agent_id in str(refused.value.detail) or driver.agent_id in str(refused.value.detail)
        with pytest.raises(ControlReplyError) as keyless:  # and without the key, not even a free slot
            RawAgent(daemon, "receiver", engine="eng2", driven=True, members=2)
        assert keyless.value.error == "forbidden", keyless.value
        with pytest.raises(ControlReplyError, match="has a driver already"):
            RawAgent(daemon, "driver", engine="eng", members=1)
        with pytest.raises(ControlReplyError, match="registered and alive") as second_job:
            RawAgent(daemon, "trainer", trainer_ranks=1)  # a second plain trainer job is told, not ignored
        assert trainer.agent_id in str(second_job.value.detail)
        with daemon.client() as http:
            for agent in agents:
                agent.poll()
            joins = {a["agent_id"]: a.get("joins_next") for a in http.get("/receivers").json()["agents"]}
            assert joins[worker.agent_id] is True and len(joins) == 3, joins
            accepted = http.post("/sync", json={})
            assert accepted.status_code == 202, accepted.text
            version = accepted.json()["version"]
            assert worker.poll()["version"] == version  # the live worker is in the version
    finally:
        for agent in agents:
            agent.close()
        daemon.stop()


# ---- 3. timings that depend on each other: a poll never waits past the heartbeat -------------------------
def test_a_poll_wait_longer_than_the_heartbeat_is_clamped_on_both_sides(tmp_path: Path) -> None:
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    # (the heartbeat is the subject; 6 s: an agent whose polls wait 3 s has 3 s to spare on a loaded machine)
    heartbeat_s = 6.0
    daemon = start_daemon(write_config(tmp_path, timeouts=timeouts(heartbeat_s=heartbeat_s)))
    agent = None
    try:
        raw = RawAgent(daemon, "receiver")
        started = time.monotonic()
        assert raw.poll(wait_s=30) is None
        assert time.monotonic() - started < 15  # the daemon waited heartbeat/2 (3 s), not 30 s
        agent = TrainerAgent(lambda: {"w": torch.ones(4)}, daemon.zmq, poll_wait_s=15).start()
        assert agent.poll_wait_s == heartbeat_s / 2
        first = agent.agent_id
        with daemon.client() as http:
            deadline = time.monotonic() + heartbeat_s + 2  # past a heartbeat: waiting 15 s, it would have expired
            while time.monotonic() < deadline:
                assert agent.agent_id == first
                trainers = [a for a in http.get("/receivers").json()["agents"] if a["role"] == "trainer"]
                assert [a["agent_id"] for a in trainers] == [first], trainers
                time.sleep(0.5)
        raw.close()
    finally:
        if agent is not None:
            agent.close()
        daemon.stop()


# ---- 1. the owner set changes between versions, in every mode -------------------------------------------------
def sparse_owner_trainer(rank: int, port: int, zmq: str, workdir: str) -> dict:
    """A 2-rank FSDP2 job training its first layer at every step (the rest stays: sparse versions skip it),
    serving versions until ``workdir/stop``; rank 0 says what it served (full tensors' bytes)."""
    from torch.distributed.tensor import DTensor

    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.workers.trainer_agent import TrainerAgent
    from tests.test_owners import _stopping
    from tests.tiny_lm import sharded_tiny_llama, tensor_bytes

    model = sharded_tiny_llama(rank, port, 60)
    optimizer = torch.optim.SGD(model.model.layers[0].parameters(), lr=0.5)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.2).start()
    served: dict[int, dict] = {}
    step = 0
    corrupt = Path(workdir) / f"corrupt-rank{rank}"
    while not _stopping(workdir, 2):
        step += 1
        if corrupt.exists():  # one byte of this rank's cached share of a version changes in memory
            cached = agent.publisher.cache.get(int(corrupt.read_text()))
            cached.buffer[cached.buffer.numel() // 2] ^= 0x5A
            corrupt.unlink()
        tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        version = agent.step(step)
        if version is not None:
            full = {n: t.full_tensor() if isinstance(t, DTensor) else t
                    for n, t in named_tensors_of(model).tensors.items()}
            served[version] = tensor_bytes(full)
        time.sleep(0.02)
    agent.wait_idle(60)
    agent.close()
    return {"served": served if rank == 0 else {}}


@pytest.mark.parametrize("mode", ["sparse", "bypass_cpu"])
def test_versions_commit_across_owner_count_changes(tmp_path: Path, mode: str) -> None:
    """2 owners -> 1 (rank 1 stalled past its silence window when the version is planned) -> 2 -> 2: every
    version commits, byte-exact at both receivers, and sparse versions are sparse again once every owner and
    receiver holds the same base (found by the outside test: a sparse 1 -> 2 change failed every later version)."""
    import signal

    from tests.daemon_harness import ROOT, TEST_TIMEOUTS, free_port, silent_after
    from tests.procs import start_processes
    from tests.test_fsdp_sync import transformers_receiver

    sparse = mode == "sparse"
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", bucket_size_mb=0.02,
                                       transport="collective", sparse=sparse, keep_versions=3))
    # rank 1 (polls wait 0.2 s) is left out of a version planned this long after its last poll; it is dropped
    # only after a whole heartbeat, which leaves a loaded machine seconds to plan the version and wake it
    silent_s = silent_after(TEST_TIMEOUTS["heartbeat_s"], 0.2) + 0.2
    receivers = start_processes([(transformers_receiver, (daemon.zmq, 5, str(tmp_path / "rx-stop"))),
                                 (transformers_receiver, (daemon.zmq, 6, str(tmp_path / "rx-stop")))])
    port = free_port()
    job = start_processes([(sparse_owner_trainer, (r, port, daemon.zmq, str(tmp_path))) for r in range(2)])
    body = {"wait": True, "timeout_s": 60, **({"bypass_cpu": True, "sparse": False} if not sparse else {})}
    records = []
    try:
        with daemon.client() as http:
            def agents() -> list[dict]:
                return http.get("/receivers").json()["agents"]

            wait_until(lambda: sorted(a["role"] for a in agents()) == ["receiver"] * 2 + ["trainer"] * 2, 60,
                       "the job and the receivers")
            from tests.daemon_harness import sync_when_idle

            records += [sync_when_idle(http, body), sync_when_idle(http, body)]
            rank1 = next(a for a in agents() if a["role"] == "trainer" and a["rank"] == 1)
            os.kill(job.procs[1].pid, signal.SIGSTOP)
            try:
                wait_until(lambda: next(a for a in agents() if a["agent_id"] == rank1["agent_id"])
                           ["seconds_since_seen"] > silent_s, 30, "rank 1 to fall silent")
                accepted = http.post("/sync", json={k: v for k, v in body.items() if k != "wait"})
                assert accepted.status_code == 202, accepted.text
            finally:
                os.kill(job.procs[1].pid, signal.SIGCONT)
            version = accepted.json()["version"]
            wait_until(lambda: http.get(f"/versions/{version}").json()["status"] not in
                       ("requested", "snapshotting", "transferring", "verifying"), 60, "the 1-owner version")
            records.append(http.get(f"/versions/{version}").json())
            wait_until(lambda: any(a["role"] == "trainer" and a["rank"] == 1 and a["seconds_since_seen"] < 1
                                   for a in agents()), 30, "rank 1 to be back")
            records += [sync_when_idle(http, body), sync_when_idle(http, body)]
            (tmp_path / "stop").touch()
            trainers = job.collect(120)
    finally:
        (tmp_path / "stop").touch()
        (tmp_path / "rx-stop").touch()
        rx = receivers.collect(120)
        job.kill()
        daemon.stop()
    summary = [(r["status"], r["owners"], r["tensors_skipped"] > 0, r.get("reason")) for r in records]
    assert [s[:2] for s in summary] == [("committed", 2), ("committed", 2), ("committed", 1), ("committed", 2),
                                        ("committed", 2)], summary
    if sparse:
        assert summary[1][2] and summary[4][2], summary  # sparse before the change, and again after it
    served = trainers[0]["served"]
    for record in records:
        for receiver in rx:
            assert receiver["states"][record["id"]] == served[record["id"]], record["id"]


# ---- 9. a re-push is the version it names, as recorded when it committed --------------------------------------
def test_a_rollback_of_a_share_that_changed_in_memory_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    """The outside test changed one byte of actor rank 1's cached share of v1, pushed v1, and the daemon recorded
    the re-push committed with another digest than v1's. Here (2 FSDP2 owner ranks, 2 receivers) the re-push is
    refused before any byte goes out, names the rank and the version, drops the copy from the cache, and the
    receivers keep what they served."""
    from tests.daemon_harness import ROOT, free_port, sync_when_idle
    from tests.procs import start_processes
    from tests.test_fsdp_sync import transformers_receiver

    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", bucket_size_mb=0.02,
                                       transport="collective", keep_versions=3))
    receivers = start_processes([(transformers_receiver, (daemon.zmq, 5, str(tmp_path / "rx-stop"))),
                                 (transformers_receiver, (daemon.zmq, 6, str(tmp_path / "rx-stop")))])
    port = free_port()
    job = start_processes([(sparse_owner_trainer, (r, port, daemon.zmq, str(tmp_path))) for r in range(2)])
    try:
        with daemon.client() as http:
            wait_until(lambda: sorted(a["role"] for a in http.get("/receivers").json()["agents"]) ==
                       ["receiver"] * 2 + ["trainer"] * 2, 60, "the job and the receivers")
            first, second = sync_when_idle(http, {"sparse": False}), sync_when_idle(http, {"sparse": False})
            assert first["status"] == second["status"] == "committed" and first["owners"] == 2, (first, second)
            wait_until(lambda: http.get(f"/versions/{first['id']}").json()["cached"], 30, "v1 cached")
            (tmp_path / "corrupt-rank1").write_text(str(first["id"]))
            wait_until(lambda: not (tmp_path / "corrupt-rank1").exists(), 30, "the byte to change")
            pushed = http.post(f"/versions/{first['id']}/push")
            assert pushed.status_code == 202, pushed.text
            version = pushed.json()["version"]
            wait_until(lambda: http.get(f"/versions/{version}").json()["status"] in ("committed", "failed"), 60,
                       "the rollback's outcome")
            record = http.get(f"/versions/{version}").json()
            assert record["status"] == "failed", record
            assert "owner rank 1" in record["reason"] and "no longer matches" in record["reason"], record["reason"]
            wait_until(lambda: not http.get(f"/versions/{first['id']}").json()["cached"], 30, "v1 dropped")
            again = http.post(f"/versions/{first['id']}/push")
            assert again.status_code == 409, again.text
            third = sync_when_idle(http, {"sparse": False})  # the job goes on
            assert third["status"] == "committed", third
            (tmp_path / "stop").touch()
            trainers = job.collect(120)
    finally:
        (tmp_path / "stop").touch()
        (tmp_path / "rx-stop").touch()
        rx = receivers.collect(120)
        job.kill()
        daemon.stop()
    for receiver in rx:
        assert version not in receiver["states"]  # nothing of the refused rollback was applied
        assert receiver["states"][third["id"]] == trainers[0]["served"][third["id"]]


def test_the_daemon_judges_a_re_push_by_the_digest_it_recorded(tmp_path: Path) -> None:
    """The daemon's side of the same rule, whatever a trainer claims: a re-push whose bytes (the trainer's and
    the receivers' digests) are not the recorded version's does not commit."""
    daemon = start_daemon(write_config(tmp_path))
    trainer, receiver = RawAgent(daemon, "trainer"), RawAgent(daemon, "receiver")
    try:
        with daemon.client() as http:
            version = http.post("/sync", json={}).json()["version"]
            trainer.poll()
            receiver.report(version, "received", ok=True, version_digest="a" * 16)
            trainer.report(version, "done", ok=True, version_digest="a" * 16, cache_versions=[version])
            wait_until(lambda: http.get(f"/versions/{version}").json()["status"] == "committed", 10, "v1")
            receiver.poll()
            push = http.post(f"/versions/{version}/push").json()["version"]
            send = trainer.poll()
            assert send["source_version"] == version and send["expected_digest"] == "a" * 16, send
            assert version in send["keep"]
            receiver.report(push, "received", ok=True, version_digest="b" * 16)
            trainer.report(push, "done", ok=True, version_digest="b" * 16, cache_versions=[version])
            wait_until(lambda: http.get(f"/versions/{push}").json()["status"] == "failed", 10, "the re-push")
            record = http.get(f"/versions/{push}").json()
            assert "committed as " + "a" * 16 in record["reason"], record
            assert record["receivers"][0]["ok"] is False
    finally:
        trainer.close()
        receiver.close()
        daemon.stop()


# ---- 8. failed versions never evict what a repair needs -------------------------------------------------------
def refusing_then_tearing_receiver(zmq: str, stop_file: str, plan_file: str) -> dict:
    """A transformers receiver whose next applies follow ``plan_file`` (one word per version: refuse, tear, ok)."""
    from ckpt_engine.errors import ApplyRefused
    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.workers.adapters.torch_module import ModuleAdapter
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from tests.tiny_lm import tensor_bytes, tiny_llama

    model = tiny_llama(seed=9).eval()
    plan = Path(plan_file)

    class Adapter(ModuleAdapter):
        tearing = False

        def _copy(self, name, target, source) -> None:
            if self.tearing and name.endswith("layers.1.mlp.up_proj.weight"):
                self.tearing = False
                raise RuntimeError("injected: the apply failed half way")
            super()._copy(name, target, source)

    adapter = Adapter(model)
    states: dict[int, dict] = {}

    def load(payload) -> None:
        words = plan.read_text().split() if plan.exists() else []
        action = words.pop(0) if words else "ok"
        plan.write_text(" ".join(words))
        if action == "refuse":
            raise ApplyRefused(f"injected: version {payload.version} refused")
        adapter.tearing = action == "tear"
        adapter.load(payload)
        states[payload.version] = tensor_bytes(named_tensors_of(model).tensors)

    agent = RolloutAgent(load, zmq, poll_wait_s=0.2).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return {"states": states}


def test_failed_versions_never_evict_the_version_a_repair_needs(tmp_path: Path) -> None:
    """keep_versions 2: v1 commits, v2 and v3 are refused by the only receiver (it keeps v1), v4 tears it. v1
    stays cached throughout (the daemon told the trainer to keep it), a rollback to it works, and the torn
    receiver is repaired with it. (Before: v2 and v3 took both slots and v1 was gone.)"""
    from tests.daemon_harness import ROOT, TrainerLoop
    from tests.procs import start_processes
    from tests.tiny_lm import tiny_llama

    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", bucket_size_mb=0.05,
                                       transport="collective", keep_versions=2))
    plan = tmp_path / "plan"
    receiver = start_processes([(refusing_then_tearing_receiver, (daemon.zmq, str(tmp_path / "stop"), str(plan)))])
    model = tiny_llama(seed=0)
    loop = TrainerLoop(daemon.zmq, model)
    try:
        with daemon.client() as http:
            from tests.daemon_harness import sync_when_idle

            wait_until(lambda: len(http.get("/receivers").json()["agents"]) == 2, 60, "registration")
            first = sync_when_idle(http)
            assert first["status"] == "committed", first
            plan.write_text("refuse refuse tear")
            for _ in range(2):
                with torch.no_grad():
                    model.model.layers[0].mlp.up_proj.weight.add_(1.0)
                refused = sync_when_idle(http)
                assert refused["status"] == "failed" and "refused" in refused["reason"], refused
            assert http.get(f"/versions/{first['id']}").json()["cached"], "v1 was evicted by failed versions"
            assert first["id"] in http.get("/status").json()["cache_kept_for_repairs"]
            torn = sync_when_idle(http)
            assert torn["status"] == "failed" and torn["receivers"][0]["torn"], torn
            wait_until(lambda: any(v["source_version"] == first["id"] and v["status"] == "committed"
                                   for v in http.get("/versions").json()["versions"]), 60, "the repair with v1")
            wait_until(lambda: [a["state"] for a in http.get("/receivers").json()["agents"]
                                if a["role"] == "receiver"] == ["serving"], 30, "the receiver serving again")
            assert http.get(f"/versions/{first['id']}").json()["cached"]
    finally:
        (tmp_path / "stop").touch()
        loop.close()
        states = receiver.collect(120)[0]["states"]
        daemon.stop()
    repaired = max(states)
    assert states[repaired] == states[first["id"]]  # byte for byte the version it served before


# ---- smaller ones ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", ["README.md", "docs/daemon.md"])
def test_the_documented_load_example_works_for_sparse_and_whole_versions(doc: str) -> None:
    """The first example a user copies: the ``load`` of README.md (and docs/daemon.md), run as written."""
    import re

    from ckpt_engine.receive.assembly import VersionPayload
    from tests.daemon_harness import ROOT
    from tests.tiny_lm import tiny_llama

    text = (ROOT / doc).read_text()
    snippet = re.search(r"^(targets = .*?\n(?:def load.*?\n)(?:    .*\n)+)", text, re.M)
    assert snippet, f"no load example in {doc}"
    model, source = tiny_llama(seed=1), tiny_llama(seed=2)
    namespace = {"torch": torch, "model": model}
    exec(snippet.group(1), namespace)
    whole = dict(source.state_dict())
    changed = {name: t for name, t in whole.items() if "layers.0." in name}
    namespace["load"](VersionPayload(2, None, "cached", "x", changed, sparse=True))
    assert all(torch.equal(model.state_dict()[n], t) for n, t in changed.items())
    namespace["load"](VersionPayload(3, None, "cached", "x", whole))
    assert all(torch.equal(model.state_dict()[n], t) for n, t in whole.items())


def test_the_cli_can_ask_for_a_whole_version_whatever_the_deployment_says() -> None:
    from ckpt_engine.cli.main import _parser

    parser = _parser()
    assert parser.parse_args(["sync", "--no-sparse"]).sparse is False
    assert parser.parse_args(["sync", "--sparse"]).sparse is True
    assert parser.parse_args(["sync"]).sparse is None
    assert parser.parse_args(["sync", "--no-bypass-cpu"]).bypass_cpu is False


def group_member(rank: int, port: int, die: bool, results) -> None:
    from ckpt_engine.device import detect_device
    from ckpt_engine.errors import CkptEngineError
    from ckpt_engine.transport.group import SyncGroup, open_store

    store = open_store("127.0.0.1", port, timeout_s=20)
    group = SyncGroup(store, name="t", generation=1, rank=rank, world_size=3, device=detect_device("cpu"),
                      timeout_s=20, label=f"rollout worker {rank - 1}" if rank else "actor rank 0")
    group.broadcast_and_wait(torch.zeros(4), "first")
    if die:
        os.kill(os.getpid(), 9)
    try:
        for _ in range(200):
            group.broadcast_and_wait(torch.zeros(1 << 20), "bucket")
            time.sleep(0.01)
    except CkptEngineError as exc:
        results.put((rank, str(exc)))
        return
    results.put((rank, "no error"))


def test_a_collective_that_fails_because_a_peer_died_names_that_peer() -> None:
    """Found with verl: a killed rollout worker showed at the actor ranks as gloo's "Connection closed by
    peer", naming an address. The members announce who they are; a failed collective names the gone ones."""

    from ckpt_engine.transport.group import serve_store

    server = serve_store("127.0.0.1", 0)
    from tests.procs import context as procs_context

    ctx = procs_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=group_member, args=(r, server.port, r == 2, results), daemon=True) for r in range(3)]
    for proc in procs:
        proc.start()
    try:
        errors = dict(results.get(timeout=60) for _ in range(2))
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)
    assert f"rank 2 (rollout worker 1, pid {procs[2].pid} on" in errors[0] and "is gone" in errors[0], errors


@pytest.mark.parametrize(("stat", "alive"), [
    (b"421 (python) S 1 421 421 0 -1 4194560 900 0 0 0 5 2 0 0 20 0 3 0", True),
    (b"421 (python) R 1 421 421 0 -1 4194564 900 0 0 0 5 2 0 0 20 0 3 0", False),  # PF_EXITING: closing its sockets
    (b"421 (python) Z 1 421 421 0 -1 4227140 900 0 0 0 5 2 0 0 20 0 1 0", False),  # dead, not reaped
    (b"421 (a) b) (c) S 1 421 421 0 -1 4194560 900 0 0 0 5 2 0 0 20 0 3 0", True),  # ")" in its name
])
def test_a_member_is_gone_from_the_moment_it_starts_to_exit(stat: bytes, alive: bool) -> None:
    """Found under load: a peer's collective failed (its sockets closed) while the killed member was still
    exiting, not yet a zombie, so it was not named. The kernel marks a task exiting before it closes them."""
    from ckpt_engine.transport.group import stat_says_alive

    assert stat_says_alive(stat) is alive


def test_a_failed_version_names_each_receiver_s_failure_once(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path))
    trainer, receiver = RawAgent(daemon, "trainer"), RawAgent(daemon, "receiver")
    try:
        with daemon.client() as http:
            version = http.post("/sync", json={}).json()["version"]
            rank = trainer.poll()["world_size"] - 1
            why = "digest mismatch in 1 tensor(s): w"
            receiver.report(version, "received", ok=False, reason=why)
            trainer.report(version, "done", ok=False, version_digest="a" * 16, reason=f"rank {rank}: {why}",
                           receivers=[{"rank": rank, "ok": False, "reason": why}], cache_versions=[version])
            wait_until(lambda: http.get(f"/versions/{version}").json()["status"] == "failed", 10, "the verdict")
            reason = http.get(f"/versions/{version}").json()["reason"]
            assert reason.count(why) == 1, reason
    finally:
        trainer.close()
        receiver.close()
        daemon.stop()


def test_a_peer_cannot_forge_a_line_of_the_daemon_s_log(tmp_path: Path) -> None:
    """Found by the outside attack: a newline in a poll's ``unable`` made a fake log line."""
    daemon = start_daemon(write_config(tmp_path))
    try:
        rx = RawAgent(daemon, "receiver")
        rx.poll(unable="oom\n2026-11-26 07:00:01,000 ckpt_engine.daemon WARNING stopped\r")
        rx.close()
    finally:
        daemon.stop()
    lines = daemon.log_path.read_text().splitlines()
    assert not any(line.startswith("2026-11-26 07:00:01,000") for line in lines)
    assert any("oom\\n2026-11-26 07:00:01,000 ckpt_engine.daemon WARNING stopped\\r" in line for line in lines)


def test_serve_refuses_a_credentials_file_in_a_directory_others_can_write(tmp_path: Path) -> None:
    """Found by the outside attack: check-config refused it, serve did not (the file existed already)."""
    import subprocess
    import sys

    from tests.daemon_harness import ROOT

    shared = tmp_path / "shared"
    shared.mkdir()
    write_credentials(shared / "credentials.json", Credentials(operator="o" * 32, trainer="t" * 32, rollout="r" * 32))
    os.chmod(shared, 0o777)
    config = write_config(tmp_path, auth={"credentials_file": str(shared / "credentials.json")})
    result = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and str(shared) in result.stderr and "Traceback" not in result.stderr, result.stderr
