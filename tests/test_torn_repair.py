"""No torn model is ever served, with real processes and the real daemon (vLLM itself: tests/engines):

- a transformers model whose apply fails part way: the adapter is torn, will not serve, reports it, and the
  daemon repairs it from the trainer's cache with the version it served last;
- an engine of two workers applied by a driver (as vLLM with tensor parallelism is): the version is applied
  only once both workers verified it, a failure in one tears the whole engine, and the repair brings both
  back to the version they served, together.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import start_daemon, train_until_stopped, write_config
from tests.models import AwkwardModel, state_bytes
from tests.procs import start_processes
from tests.test_elastic import agents_of, sync, wait_until

pytestmark = pytest.mark.multiproc
FAIL_AT = "small.500"  # a tensor in the middle of AwkwardModel


def versions_trainer(zmq: str, stop_file: str, wire_hook=None) -> dict:
    """Serves AwkwardModel, changed after every version; returns the bytes it served, by version.
    ``wire_hook``: fault injection on the bytes of each bucket as they go out (the Publisher's)."""
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = AwkwardModel(seed=1)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.2, wire_hook=wire_hook).start()
    served: dict[int, dict] = {}

    def after(step: int) -> None:
        served[agent.served[-1]] = state_bytes(model)
        model.perturb(step, fraction=0.5)

    train_until_stopped(agent, stop_file, on_version=after)
    return {"served": served}


class FailingOnce:
    """A ModuleAdapter whose copy fails at ``FAIL_AT`` while ``armed`` exists (then the file is removed)."""

    @staticmethod
    def adapter(model, armed: Path):
        from ckpt_engine.workers.adapters.torch_module import ModuleAdapter

        class Adapter(ModuleAdapter):
            def _copy(self, name, target, source) -> None:
                if name == FAIL_AT and armed.exists():
                    armed.unlink()
                    raise RuntimeError("injected: out of memory half way through the apply")
                super()._copy(name, target, source)

        return Adapter(model)


def serve_until_stopped(adapter, agent, model, stop_file: str) -> dict:
    """A rollout loop generating (under ``adapter.serving()``) until ``stop_file`` exists; what it saw."""
    served_while_torn: list[int] = []
    generated = 0
    stop = threading.Event()

    def generate() -> None:  # generation only ever runs on a whole version
        nonlocal generated
        while not stop.is_set():
            try:
                with adapter.serving(timeout_s=0.2) as version:
                    if adapter.torn is not None:
                        served_while_torn.append(version or -1)
                    generated += 1
            except Exception:  # noqa: BLE001 - TornModelError: it waits for the repair instead of generating
                pass
            time.sleep(0.005)

    loop = threading.Thread(target=generate, daemon=True)
    loop.start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    stop.set()
    loop.join(5)
    agent.close()
    return {"state": state_bytes(model), "version": adapter.version, "served_while_torn": served_while_torn,
            "generated": generated, "results": [(r.version, r.ok, r.torn, r.staging) for r in agent.results]}


def tearing_receiver(zmq: str, stop_file: str, armed: str) -> dict:
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    model = AwkwardModel(seed=7)
    adapter = FailingOnce.adapter(model, Path(armed))
    agent = RolloutAgent(adapter.load, zmq, poll_wait_s=0.2).start()
    return serve_until_stopped(adapter, agent, model, stop_file)


def test_a_torn_transformers_model_is_not_served_and_is_repaired(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, keep_versions=3, transport="collective"))
    stop, armed = tmp_path / "stop", tmp_path / "armed"
    procs = start_processes([(versions_trainer, (daemon.zmq, str(stop))),
                             (tearing_receiver, (daemon.zmq, str(stop), str(armed)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="registration")
            first = sync(http)
            assert first["status"] == "committed", first
            armed.touch()
            failed = sync(http)
            assert failed["status"] == "failed" and "injected" in failed["reason"], failed
            entry = failed["receivers"][0]
            assert entry["torn"] and entry["serving_after"] is None, entry  # never shown serving it
            repair = _wait_for_repair(http)
            assert repair["source_version"] == first["id"] and repair["status"] == "committed", repair
            receiver = next(a for a in agents_of(http) if a["role"] == "receiver")
            assert receiver["state"] == "serving" and receiver["serving"] == repair["id"]
    finally:
        stop.touch()
        trainer, rollout = procs.collect(120)
    assert rollout["served_while_torn"] == []
    assert rollout["state"] == trainer["served"][first["id"]]  # byte for byte the version it served before
    assert (failed["id"], False, True, "device") in rollout["results"]


STREAM_BUCKET_MB = 1 / 32  # 32 KiB: AwkwardModel is then 8 buckets or more, and its ``big`` is in pieces


def corrupting_trainer(zmq: str, stop_file: str, corrupt: str) -> dict:
    """versions_trainer whose wire flips one byte of a middle bucket of the next version once ``corrupt``
    exists (it is removed then: one version only)."""
    target = Path(corrupt)

    def hook(bucket: int, buf):
        if bucket == 4 and target.exists():
            target.unlink()
            buf = buf.clone()
            buf[buf.numel() // 2] ^= 0xFF
        return buf

    return versions_trainer(zmq, stop_file, wire_hook=hook)


def streaming_receiver(zmq: str, stop_file: str) -> dict:
    """A transformers-style model taking versions streamed (staging stream); generation polled throughout."""
    from ckpt_engine.workers.adapters.torch_module import ModuleAdapter
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    model = AwkwardModel(seed=7)
    adapter = ModuleAdapter(model)
    agent = RolloutAgent(adapter.load, zmq, poll_wait_s=0.2, staging="stream", streams=True).start()
    return serve_until_stopped(adapter, agent, model, stop_file)


def test_a_streamed_version_failing_in_a_middle_bucket_is_never_served_and_is_repaired(tmp_path: Path) -> None:
    """staging stream: the model takes each bucket as it verifies, so a byte flipped in a middle bucket fails
    the version after earlier buckets were applied: the model is torn, generation never runs on it, and the
    daemon repairs it from the trainer's cache (streamed again) with the version it served last."""
    daemon = start_daemon(write_config(tmp_path, keep_versions=3, transport="collective",
                                       bucket_size_mb=STREAM_BUCKET_MB))
    stop, corrupt = tmp_path / "stop", tmp_path / "corrupt"
    procs = start_processes([(corrupting_trainer, (daemon.zmq, str(stop), str(corrupt))),
                             (streaming_receiver, (daemon.zmq, str(stop)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="registration")
            committed = [sync(http) for _ in range(3)]
            assert [c["status"] for c in committed] == ["committed"] * 3, committed
            entry = committed[-1]["receivers"][0]
            assert entry["staging"]["mode"] == "stream" and entry["staging"]["pause_s"] > 0, entry
            corrupt.touch()
            failed = sync(http)
            assert failed["status"] == "failed" and "digest mismatch" in failed["reason"], failed
            entry = failed["receivers"][0]
            assert entry["torn"] and entry["serving_after"] is None, entry
            repair = _wait_for_repair(http)
            assert repair["source_version"] == committed[-1]["id"] and repair["status"] == "committed", repair
            receiver = next(a for a in agents_of(http) if a["role"] == "receiver")
            assert receiver["state"] == "serving" and receiver["serving"] == repair["id"]
            assert receiver["last_staging"]["mode"] == "stream", receiver
    finally:
        stop.touch()
        trainer, rollout = procs.collect(120)
    assert rollout["served_while_torn"] == [] and rollout["generated"] > 0
    assert rollout["state"] == trainer["served"][committed[-1]["id"]]  # byte for byte the version before
    assert (failed["id"], False, True, "stream") in rollout["results"]


def _wait_for_repair(http: httpx.Client) -> dict:
    def repaired():
        return next((v for v in http.get("/versions").json()["versions"]
                     if v["purpose"] == "repair" and v["status"] in ("committed", "failed")), None)

    wait_until(repaired, 60, "the repair")
    return repaired()


def engine(zmq: str, stop_file: str, armed: str) -> dict:
    """Two workers of one engine (each holding the whole model, as tensor-parallel vLLM workers each load the
    whole checkpoint) and the engine's driver, which applies a version to both or tears both."""
    from ckpt_engine.workers.driver import EngineDriver
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from ckpt_engine.workers.staged import StagedVersion

    class Worker:
        def __init__(self, index: int) -> None:
            self.model = AwkwardModel(seed=10 + index)
            self.adapter = FailingOnce.adapter(self.model, Path(armed) if index == 1 else Path("/nonexistent"))
            self.staged = StagedVersion(on_staged=lambda v: self.agent.report(v, "staged"), take_timeout_s=30,
                                        apply_timeout_s=60)
            self.agent = RolloutAgent(self.staged.load, zmq, poll_wait_s=0.2, engine="e0", driven=True, members=2)

    workers = [Worker(0), Worker(1)]

    class Control:  # what vLLM's update does on each worker's own thread
        paused = False
        resumes_while_torn = 0

        def pause(self) -> None:
            self.paused = True

        def apply(self, version: int) -> None:
            for worker in workers:
                payload = worker.staged.take(version, 30)
                try:
                    worker.adapter.load(payload)
                except BaseException as exc:
                    worker.staged.finish(version, exc)
                    raise
                worker.staged.finish(version)

        def abandon(self) -> None:
            pass

        def resume(self) -> None:
            if driver.torn is not None:
                self.resumes_while_torn += 1
            self.paused = False

    control = Control()
    driver = EngineDriver(control, zmq, engine="e0", poll_wait_s=0.2).start()
    for worker in workers:  # admitted by the key the daemon issued the engine's driver
        worker.agent.engine_key = driver.engine_key
        worker.agent.start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    for worker in workers:
        worker.agent.close()
    driver.close()
    return {"states": [state_bytes(w.model) for w in workers], "version": driver.version,
            "resumes_while_torn": control.resumes_while_torn}


def test_an_engine_of_two_workers_applies_together_tears_together_and_is_repaired(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, keep_versions=3, transport="auto"))
    stop, armed = tmp_path / "stop", tmp_path / "armed"
    procs = start_processes([(versions_trainer, (daemon.zmq, str(stop))),
                             (engine, (daemon.zmq, str(stop), str(armed)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 4, what="trainer, 2 workers and a driver")
            first = sync(http)
            assert first["status"] == "committed" and len(first["receivers"]) == 2, first
            armed.touch()  # worker 1 fails half way; worker 0 applied the version whole
            failed = sync(http)
            assert failed["status"] == "failed" and all(not r["ok"] for r in failed["receivers"]), failed
            repair = _wait_for_repair(http)
            assert repair["source_version"] == first["id"] and repair["status"] == "committed", repair
            assert {r["agent_id"] for r in repair["receivers"]} == {r["agent_id"] for r in failed["receivers"]}
            workers = [a for a in agents_of(http) if a["role"] == "receiver"]
            assert all(w["state"] == "serving" and w["serving"] == repair["id"] for w in workers), workers
    finally:
        stop.touch()
        trainer, rollout = procs.collect(120)
    assert rollout["resumes_while_torn"] == 0
    assert rollout["states"][0] == rollout["states"][1] == trainer["served"][first["id"]]
    assert rollout["version"] == repair["id"]


def dying_trainer(zmq: str, stop_file: str, trigger: str) -> dict:
    """versions_trainer killed (SIGKILL, by itself) as it sends bucket 4 of the next version once ``trigger``
    exists."""
    import signal

    target = Path(trigger)

    def hook(bucket: int, buf):
        if bucket == 4 and target.exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return buf

    return versions_trainer(zmq, stop_file, wire_hook=hook)


def test_a_trainer_killed_mid_stream_leaves_the_receiver_torn_in_the_history_too(tmp_path: Path) -> None:
    """Found by the outside attack on issue 27: the version's record, closed when the trainer went away, kept
    the receiver's own report but not that it was torn (/receivers said so, the history did not)."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", bucket_size_mb=STREAM_BUCKET_MB))
    stop, trigger = tmp_path / "stop", tmp_path / "trigger"
    procs = start_processes([(dying_trainer, (daemon.zmq, str(stop), str(trigger))),
                             (streaming_receiver, (daemon.zmq, str(stop)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="registration")
            first = sync(http)
            assert first["status"] == "committed", first
            trigger.touch()
            failed = sync(http)
            assert failed["status"] == "failed" and "went away" in failed["reason"], failed

            def torn_entry() -> dict | None:
                entry = http.get(f"/versions/{failed['id']}").json()["receivers"][0]
                return entry if entry.get("torn") else None

            wait_until(torn_entry, 30, "the torn receiver in the version's record")
            entry = torn_entry()
            assert entry["serving_after"] is None and entry["staging"]["mode"] == "stream", entry
            assert [a["state"] for a in agents_of(http) if a["role"] == "receiver"] == ["torn"]
    finally:
        stop.touch()
        with pytest.raises(AssertionError, match=r"\[0\] died"):  # the trainer, by its own hand; not the receiver
            procs.collect(120)
