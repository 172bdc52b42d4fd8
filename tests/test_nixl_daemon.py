"""The ``nixl`` transport through the daemon (``transport: nixl``): the trainer agent offers each cached version
through the control plane, every receiver pulls it over NIXL (UCX over TCP/shared memory here), verifies and
loads it, and reports its own outcome. No sync group is formed for pullers: a receiver that joins later pulls the
newest committed version (its catch-up) while nothing else changes; a rollback pulls the cached version again.
A bypass_cpu version is pulled from the trainer's send slots."""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import pytest
import torch

from ckpt_engine.errors import CkptEngineError
from tests.daemon_harness import ROOT, start_daemon, sync_when_idle, write_config
from tests.models import AwkwardModel, load_into, state_bytes
from tests.procs import start_processes

pytestmark = pytest.mark.multiproc
if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("NIXL has no wheel for this platform", allow_module_level=True)


def trainer_proc(zmq: str, stop_file: str, folder: str | None = None) -> dict:
    """Changes its weights after every version it serves; returns the bytes each version held (also written to
    ``folder``/state-<version>, for a test that kills this process)."""
    import torch

    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = AwkwardModel(seed=1)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.2).start()
    states: dict[int, bytes] = {}  # by version
    step = 0
    while not os.path.exists(stop_file):
        step += 1
        served = agent.step(step)
        if served is not None:
            states[served] = state_bytes(model)
            if folder is not None:
                Path(folder, f"state-{served}").write_text(json.dumps({k: v.hex() for k, v in states[served].items()}))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
        time.sleep(0.01)
    agent.wait_idle(30)
    # the daemon ended the last version: a poll answered after that releases what was offered of it
    deadline = time.monotonic() + 60
    while agent.pulls.held and time.monotonic() < deadline:
        time.sleep(0.1)
    held = agent.pulls.held
    agent.close()
    return {"states": states, "held_at_end": held}


def stopping_trainer(zmq: str, stop_file: str, folder: str, stop_version: int) -> dict:
    """``trainer_proc``'s loop, whose process stops itself (SIGSTOP, heartbeats too) as it is about to report
    ``stop_version`` done (``stopped`` in ``folder``), once its reports so far (the offer) got through."""
    import signal

    import torch

    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = AwkwardModel(seed=1)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.2).start()
    report = agent.report

    def stopping(version: int, event: str, **fields) -> None:
        if version == stop_version and event == "done":
            agent.flush_reports(30)
            Path(folder, "stopped").touch()
            os.kill(os.getpid(), signal.SIGSTOP)
            # Sent from this thread under load, the stop may take effect a few ms later (seen on this machine's
            # kernel): the report waits until the test resumes the process, not only until the stop.
            while not Path(folder, "resumed").exists():
                time.sleep(0.01)
        report(version, event, **fields)

    agent.report = stopping
    step = 0
    while not os.path.exists(stop_file):
        step += 1
        if agent.step(step) is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
        time.sleep(0.01)
    agent.wait_idle(30)
    agent.close()
    return {}


def receiver_proc(zmq: str, stop_file: str, seed: int, host_id: str | None, gate: tuple[str, int] | None = None,
                  transport: str | None = None) -> dict:
    """A rollout agent; ``gate`` (folder, version): before pulling that version it says so (``pulling``) and
    waits for ``go`` in the folder, so that the test can kill or stop a process in the middle of the pull."""
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    class Gated(RolloutAgent):
        def _pull(self, assignment, settings):
            if gate is not None and assignment.version == gate[1]:
                Path(gate[0], "pulling").touch()
                _wait_for(lambda: Path(gate[0], "go").exists(), 120)
            return super()._pull(assignment, settings)

    model = AwkwardModel(seed=seed)
    agent = Gated(lambda payload: load_into(model, payload.tensors), zmq, poll_wait_s=0.2, host_id=host_id,
                  transport=transport).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    owners_known = (len(set(agent._nixl._remotes.values())), len(agent._nixl._remotes)) if agent._nixl else None
    agent.close()
    return {"state": state_bytes(model), "results": [(r.version, r.ok, r.reason) for r in agent.results],
            "owners_known": owners_known}


def _wait_for(check, timeout_s: float = 90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s}s")


def _nixl_config(tmp_path: Path) -> Path:
    """The shipped deployment with transport nixl (every receiver here is this test's own: trusted)."""
    return write_config(tmp_path, ROOT / "deploy" / "engine.yaml", transport="nixl", nixl_trust_receivers=True)


def _first_ended(client, count: int) -> list[dict]:
    """The daemon's first ``count`` versions, once each has ended."""
    def ended() -> list[dict] | None:
        done = sorted((v for v in client.get("/versions").json()["versions"] if _ended(v)), key=lambda v: v["id"])
        return done[:count] if len(done) >= count else None
    return _wait_for(ended, 240)


def _rolled_back_to(client, version: dict) -> dict:
    """Push ``version`` again (a rollback) and return the new version's record; it must commit as ``version``."""
    pushed = client.post(f"/versions/{version['id']}/push")
    assert pushed.status_code == 202, pushed.text
    again = _wait_for(lambda: _ended(client.get(f"/versions/{pushed.json()['version']}").json()))
    assert again["status"] == "committed" and again["version_digest"] == version["version_digest"], again
    return again


def _ended(record: dict) -> dict | None:
    return record if record["status"] in ("committed", "failed", "cancelled", "interrupted") else None


def test_receivers_pull_cached_versions_through_the_daemon(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop"
    daemon = start_daemon(_nixl_config(tmp_path))
    agents = start_processes([(trainer_proc, (daemon.zmq, str(stop_file))),
                              (receiver_proc, (daemon.zmq, str(stop_file), 7, None)),
                              (receiver_proc, (daemon.zmq, str(stop_file), 8, "another-host"))])
    joiner = None
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 3)
            first = sync_when_idle(client, {"step": 1})
            assert first["status"] == "committed", first
            assert [r["transport"] for r in first["receivers"]] == ["nixl", "nixl"]
            assert [r["version_digest"] for r in first["receivers"]] == [first["version_digest"]] * 2
            # bypass_cpu: no cache; the trainer keeps what it sent in its send slots, and the pullers read those
            bypass = sync_when_idle(client, {"step": 2, "bypass_cpu": True})
            assert bypass["status"] == "committed" and bypass["mode"] == "bypass_cpu" and not bypass["cached"], bypass
            assert [r["transport"] for r in bypass["receivers"]] == ["nixl", "nixl"]
            assert [r["version_digest"] for r in bypass["receivers"]] == [bypass["version_digest"]] * 2
            second = sync_when_idle(client, {"step": 3})
            assert second["status"] == "committed" and second["version_digest"] != first["version_digest"]

            # A receiver joins: it pulls the newest committed version; nobody else takes part.
            joiner = start_processes([(receiver_proc, (daemon.zmq, str(stop_file), 9, "a-third-host"))])
            caught = _wait_for(lambda: next((v for v in client.get("/versions").json()["versions"]
                                             if v["purpose"] == "catch_up" and v["status"] == "committed"), None))
            assert caught["source_version"] == second["id"] and len(caught["receivers"]) == 1
            assert caught["receivers"][0]["transport"] == "nixl"
            assert caught["version_digest"] == second["version_digest"]

            pushed = client.post(f"/versions/{first['id']}/push")  # rollback: pulled from the cache again
            assert pushed.status_code == 202, pushed.text
            again = _wait_for(lambda: _ended(client.get(f"/versions/{pushed.json()['version']}").json()))
            assert again["status"] == "committed", again
            assert again["version_digest"] == first["version_digest"] and len(again["receivers"]) == 3
    finally:
        stop_file.touch()
        results = agents.collect(120)
        joined = joiner.collect(120) if joiner is not None else []
        assert daemon.stop() == 0
    trainer, *receivers = results + joined
    first_state = trainer["states"][first["id"]]
    for rx in receivers:  # every receiver holds version 1's bytes again, exactly
        assert rx["state"] == first_state
        assert all(ok for _, ok, _ in rx["results"]), rx["results"]
        # one trainer, however often its metadata changed (found by the outside attack on issue 39: one entry
        # per version)
        assert rx["owners_known"] == (1, 1), rx["owners_known"]
    assert trainer["held_at_end"] == []  # every offer was released once its version ended



def _version(client, version: int) -> dict:
    return _wait_for(lambda: _ended(client.get(f"/versions/{version}").json()))


def test_an_owner_killed_mid_pull_fails_the_version_and_the_puller_keeps_what_it_held(tmp_path: Path) -> None:
    stop_file, gate = tmp_path / "stop", tmp_path / "gate"
    gate.mkdir()
    daemon = start_daemon(_nixl_config(tmp_path))
    trainer = start_processes([(trainer_proc, (daemon.zmq, str(stop_file), str(tmp_path)))])
    receiver = start_processes([(receiver_proc, (daemon.zmq, str(stop_file), 7, "another-host", (str(gate), 2)))])
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 2)
            first = sync_when_idle(client, {"step": 1})
            assert first["status"] == "committed" and first["id"] == 1, (first["reason"], first["receivers"])
            assert client.post("/sync", json={"step": 2}).status_code == 202
            _wait_for(lambda: Path(gate, "pulling").exists())
            trainer.procs[0].kill()  # the owner dies between its offer and the pull
            trainer.procs[0].join(30)
            Path(gate, "go").touch()
            second = _version(client, 2)
            assert second["status"] == "failed", second
    finally:
        stop_file.touch()
        [rx] = receiver.collect(120)
        trainer.kill()
        assert daemon.stop() == 0
    held = json.loads(Path(tmp_path, "state-1").read_text())
    assert rx["state"] == {k: bytes.fromhex(v) for k, v in held.items()}  # version 1, whole
    assert [(v, ok) for v, ok, _ in rx["results"]] == [(1, True), (2, False)]
    assert "pulling version 2" in rx["results"][1][2]


def test_a_puller_killed_mid_pull_costs_only_itself_and_a_joiner_pulls_the_newest(tmp_path: Path) -> None:
    stop_file, gate = tmp_path / "stop", tmp_path / "gate"
    gate.mkdir()
    daemon = start_daemon(_nixl_config(tmp_path))
    agents = start_processes([(trainer_proc, (daemon.zmq, str(stop_file), str(tmp_path))),
                              (receiver_proc, (daemon.zmq, str(stop_file), 8, "host-b"))])
    doomed = start_processes([(receiver_proc, (daemon.zmq, str(stop_file), 7, "host-a", (str(gate), 2)))])
    joiner = None
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 3)
            first = sync_when_idle(client, {"step": 1})
            assert first["status"] == "committed" and len(first["receivers"]) == 2, first
            assert client.post("/sync", json={"step": 2}).status_code == 202
            _wait_for(lambda: Path(gate, "pulling").exists())
            doomed.procs[0].kill()  # a puller dies in the middle of its pull
            # a receiver joins while version 2 is in flight: it is not in its quorum, and pulls it afterwards
            joiner = start_processes([(receiver_proc, (daemon.zmq, str(stop_file), 9, "host-c"))])
            second = _version(client, 2)
            assert second["status"] == "committed", second  # by the one that lived
            entries = {e["agent_id"]: e for e in second["receivers"]}
            assert sum(e["ok"] for e in entries.values()) == 1 and len(entries) == 2
            caught = _wait_for(lambda: next((v for v in client.get("/versions").json()["versions"]
                                             if v["purpose"] == "catch_up" and v["status"] == "committed"), None))
            assert caught["source_version"] == 2 and len(caught["receivers"]) == 1
            third = sync_when_idle(client, {"step": 3})
            assert third["status"] == "committed" and len(third["receivers"]) == 2, third
    finally:
        stop_file.touch()
        results = agents.collect(120)
        joined = joiner.collect(120) if joiner is not None else []
        doomed.kill()
        assert daemon.stop() == 0
    trainer, survivor, late = *results, *joined
    assert survivor["state"] == late["state"] == trainer["states"][third["id"]]
    assert all(ok for _, ok, _ in survivor["results"] + late["results"])
    assert trainer["held_at_end"] == []


def test_one_receiver_asks_to_pull_while_another_is_pushed(tmp_path: Path) -> None:
    """The deployment keeps transport auto; one receiver registers with transport nixl: it pulls, the other is
    pushed on the sync group, in the same versions."""
    stop_file = tmp_path / "stop"
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", nixl_trust_receivers=True))
    agents = start_processes([(trainer_proc, (daemon.zmq, str(stop_file))),
                              (receiver_proc, (daemon.zmq, str(stop_file), 7, "host-a", None, "nixl")),
                              (receiver_proc, (daemon.zmq, str(stop_file), 8, "host-b"))])
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 3)
            pulls = {a["host_id"]: a["pulls"] for a in client.get("/receivers").json()["agents"]
                     if a["role"] == "receiver"}
            assert pulls == {"host-a": True, "host-b": False}
            for step in (1, 2):
                version = sync_when_idle(client, {"step": step})
                assert version["status"] == "committed", version
                assert sorted(e["transport"] for e in version["receivers"]) == ["collective", "nixl"]
    finally:
        stop_file.touch()
        trainer, pulled, pushed = agents.collect(120)
        assert daemon.stop() == 0
    assert pulled["state"] == pushed["state"] == trainer["states"][version["id"]]


def test_a_receiver_asking_to_pull_is_refused_where_receivers_are_not_trusted(tmp_path: Path) -> None:
    from ckpt_engine.control.client import ControlReplyError
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml"))
    agent = RolloutAgent(lambda payload: None, daemon.zmq, transport="nixl", register_wait_s=10)
    try:
        with pytest.raises(ControlReplyError, match="nixl_trust_receivers"):
            agent.start()
    finally:
        agent.close()
        assert daemon.stop() == 0


# ---- several owner ranks ---------------------------------------------------------------------------------
def flip_in_share(flip_version: int, agent, rank: int, version: int, workdir: str) -> dict:
    """(``owner_trainer``'s hook) Rank 1 flips a byte of its share of ``flip_version`` once it has posted its
    digests of it for the pullers, then lets the pullers go on (``go`` in ``workdir``)."""
    if version != flip_version or rank != 1:
        return {}
    _wait_for(lambda: agent.pulls.posted(flip_version), 40)
    with agent.publisher.cache.lease(flip_version) as cached:
        slot = cached.layout.buckets[0].slots[0]
        cached.buffer[cached.layout.buckets[0].flat_offset + slot.offset] ^= 1
    Path(workdir, "go").touch()
    return {"flipped": slot.name}


def offer_fails(fail_version: int, agent, rank: int, version: int, workdir: str) -> dict:
    """(``owner_trainer``'s hook) From the version before ``fail_version`` on, rank 1 cannot offer (its NIXL
    registration fails, say): its offer of ``fail_version`` raises."""
    if rank == 1 and version == fail_version - 1:
        offer_for = agent.pulls.offer_for

        def failing(assignment, *args, **kwargs):
            if assignment.version == fail_version:
                raise CkptEngineError("registering the share failed (injected)")
            return offer_for(assignment, *args, **kwargs)

        agent.pulls.offer_for = failing
    return {}


def stall_after_posting(stall_version: int, stalling_rank: int, agent, rank: int, version: int,
                        workdir: str) -> dict:
    """(``owner_trainer``'s hook) From the version before ``stall_version`` on, rank ``stalling_rank`` stalls
    right after it posts its final digests of ``stall_version`` for the pullers (``posted`` in ``workdir``),
    until ``go``."""
    if rank != stalling_rank or version != stall_version - 1:
        return {}
    from ckpt_engine.send import pull_offer

    post = pull_offer.Board.post

    def stalling(board, digests, layout_digest, final: bool = True) -> None:
        post(board, digests, layout_digest, final)
        if board.version == stall_version and final:
            Path(workdir, "posted").touch()
            _wait_for(lambda: Path(workdir, "go").exists(), 180)

    pull_offer.Board.post = stalling
    return {}


def stall_before_reporting(stall_version: int, agent, rank: int, version: int, workdir: str) -> dict:
    """(``owner_trainer``'s hook) The lead (rank 0) stalls before it reports ``stall_version`` done to the
    daemon (``stalled`` in ``workdir``), until ``go``."""
    if rank != 0 or version != stall_version - 1:
        return {}
    report = agent.report

    def stalling(reported: int, event: str, **fields) -> None:
        if reported == stall_version and event == "done":
            Path(workdir, "stalled").touch()
            _wait_for(lambda: Path(workdir, "go").exists(), 180)
        report(reported, event, **fields)

    agent.report = stalling
    return {}


def offer_stalls(stall_version: int, agent, rank: int, version: int, workdir: str) -> dict:
    """(``owner_trainer``'s hook) From the version before ``stall_version`` on, rank 1's offer of
    ``stall_version`` stalls (``stalled`` in ``workdir``) until ``go``; what is done before a send and the
    version's report wait for it 1 s (not ``BEFORE_SEND_WAIT_S``'s 10)."""
    if rank != 1 or version != stall_version - 1:
        return {}
    from ckpt_engine.send import publisher

    publisher.BEFORE_SEND_WAIT_S = 1.0
    sys.modules[type(agent).__module__].BEFORE_SEND_WAIT_S = 1.0
    offer_for = agent.pulls.offer_for

    def stalling(assignment, *args, **kwargs):
        if assignment.version == stall_version:
            Path(workdir, "stalled").touch()
            _wait_for(lambda: Path(workdir, "go").exists(), 180)
        return offer_for(assignment, *args, **kwargs)

    agent.pulls.offer_for = stalling
    return {}


def _job(daemon, workdir: Path, flip_version: int = -1, hook=None, mode: str = "push", versions: int = 3):
    """Two FSDP2 ranks pushing (``mode``: "push" cached, "bypass") at steps 3, 7 and 9 (the first
    ``versions`` of them), training the first layer at 5."""
    from tests.daemon_harness import free_port
    from tests.test_owners import owner_trainer

    actions = {step: mode for step in (3, 7, 9)[:versions]} | {5: "train"}
    port = free_port()
    hook = hook or functools.partial(flip_in_share, flip_version)
    return start_processes([(owner_trainer, (rank, 2, port, daemon.zmq, str(workdir), actions, hook))
                            for rank in (0, 1)])


def llama_puller(zmq: str, seed: int, stop_file: str, gate: tuple[str, int]) -> dict:
    """A transformers rollout agent pulling every version; before version ``gate[1]`` it waits for ``go``."""
    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.workers.adapters.torch_module import ModuleAdapter
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from tests.tiny_lm import tensor_bytes, tiny_llama

    class Gated(RolloutAgent):
        def _pull(self, assignment, settings):
            if assignment.version == gate[1]:
                _wait_for(lambda: Path(gate[0], "go").exists(), 120)
            return super()._pull(assignment, settings)

    model = tiny_llama(seed=seed).eval()
    adapter = ModuleAdapter(model)
    agent = Gated(adapter.load, zmq, poll_wait_s=0.2).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return {"state": tensor_bytes(named_tensors_of(model).tensors),
            "results": [(r.version, r.ok, r.reason, list(r.bad_tensors)) for r in agent.results]}


def test_receivers_pull_each_bucket_from_the_trainer_rank_that_owns_it(tmp_path: Path) -> None:
    """Two FSDP2 ranks each cache and offer their half; pullers read every bucket from its owner. A byte flipped
    in rank 1's share fails that version naming the tensor; the next version and a rollback (pulled from both
    ranks' caches again) are exact."""
    workdir, stop_file = tmp_path / "job", tmp_path / "rx-stop"
    workdir.mkdir()
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", transport="nixl",
                                       nixl_trust_receivers=True, bucket_size_mb=0.02, keep_versions=3))
    pullers = start_processes([(llama_puller, (daemon.zmq, seed, str(stop_file), (str(workdir), 2)))
                               for seed in (5, 6)])
    job = None
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 2)
            job = _job(daemon, workdir, flip_version=2)
            first, flipped, third = _first_ended(client, 3)
            assert [v["status"] for v in (first, flipped, third)] == ["committed", "failed", "committed"]
            assert first["owners"] == 2 and [r["transport"] for r in first["receivers"]] == ["nixl", "nixl"]
            _rolled_back_to(client, first)
            (workdir / "stop").touch()
            ranks = job.collect(120)
    finally:
        (workdir / "stop").touch()
        stop_file.touch()
        rx = pullers.collect(120)
        assert daemon.stop() == 0
    lead, second = ranks
    for receiver in rx:
        assert receiver["state"] == lead["served"][first["id"]]  # the rollback: version 1's bytes exactly
        [(_, ok, reason, bad)] = [r for r in receiver["results"] if r[0] == flipped["id"]]
        assert not ok and bad == [second["flipped"]], (reason, bad)
        assert all(ok for version, ok, _, _ in receiver["results"] if version != flipped["id"])
    held = [rank["cache"][first["id"]] for rank in ranks]
    assert max(held) < 0.75 * sum(held), held  # each rank holds about its half of the version


def tp_puller(zmq: str, stop_file: str, rank: int) -> dict:
    """TP rank ``rank`` of 2 (tests/test_sharded_daemon.py's split) pulling its pieces: returns its local shards
    after each version it applied, and the bytes each version brought."""
    from ckpt_engine.plan.shards import local_range, split_piece_name
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from tests.test_sharded_daemon import shapes_of, tp_spec
    from tests.tiny_lm import tiny_llama

    shapes = shapes_of(tiny_llama(seed=0))
    spec = tp_spec(shapes, rank)
    local = {}
    for name, shape in shapes.items():
        slices, local_shape = spec.get(name), list(shape)
        if slices:
            local_shape[slices[0].dim] = sum(s.length for s in slices)
        local[name] = torch.zeros(local_shape)
    held: dict[int, dict] = {}

    def load(payload) -> None:
        for name, piece in payload.items():
            tensor, part = split_piece_name(name)
            where = local_range(spec, tensor, part)
            target = local[tensor] if where is None else local[tensor].narrow(where.dim, where.start, where.length)
            target.copy_(piece)
        held[payload.version] = {k: (tuple(v.shape), v.numpy().tobytes()) for k, v in local.items()}  # (no fds)

    agent = RolloutAgent(load, zmq, poll_wait_s=0.2, shard_spec=spec, transport="nixl").start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return {"held": held, "spec": spec,
            "results": [(r.version, r.ok, r.reason, r.bytes_received) for r in agent.results]}


def test_tp_pullers_read_exactly_their_pieces_from_both_owner_ranks(tmp_path: Path) -> None:
    """Two TP-rank receivers pull a sharded version that two FSDP2 ranks own: each reads only its slices (a
    row range in one read, a column range row by row) from the rank owning each tensor, verified against its
    class's digests; a rollback pulls them again from both caches."""
    from ckpt_engine.plan.shards import cut

    workdir, stop_file = tmp_path / "job", tmp_path / "rx-stop"
    workdir.mkdir()
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", transport="auto",
                                       nixl_trust_receivers=True, bucket_size_mb=0.02, keep_versions=3))
    pullers = start_processes([(tp_puller, (daemon.zmq, str(stop_file), rank)) for rank in (0, 1)])
    job = None
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 2)
            job = _job(daemon, workdir)
            versions = _first_ended(client, 3)
            assert [v["status"] for v in versions] == ["committed"] * 3, versions
            first = versions[0]
            assert first["owners"] == 2 and {r["transport"] for r in first["receivers"]} == {"nixl"}, first
            assert len({r["shard_class"] for r in first["receivers"]}) == 2
            again = _rolled_back_to(client, first)
            (workdir / "stop").touch()
            ranks = job.collect(120)
    finally:
        (workdir / "stop").touch()
        stop_file.touch()
        rx = pullers.collect(120)
        assert daemon.stop() == 0
    from tests.test_sharded_daemon import shapes_of
    from tests.tiny_lm import tiny_llama

    shapes, served = shapes_of(tiny_llama(seed=0)), ranks[0]["served"]
    full_bytes = sum(len(b) for b in served[first["id"]].values())
    for receiver in rx:
        assert all(ok for _, ok, _, _ in receiver["results"]), receiver["results"]
        assert all(0 < got < 0.75 * full_bytes for _, _, _, got in receiver["results"])  # about its half
        for version in (*(v["id"] for v in versions), again["id"]):
            source = served[first["id"] if version == again["id"] else version]
            compared = 0
            for name, (shape, raw) in receiver["held"][version].items():
                if name not in source:  # (a tied name: its tensor is compared under its own name)
                    continue
                local = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
                whole = torch.frombuffer(bytearray(source[name]), dtype=torch.float32).reshape(shapes[name])
                parts = receiver["spec"].get(name)
                expected = whole if not parts else torch.cat([cut(whole, p) for p in parts], dim=parts[0].dim)
                assert torch.equal(local, expected), (version, name)
                compared += 1
            assert compared >= len(source) - 1


def test_an_owner_rank_that_cannot_offer_fails_the_version_at_once_and_its_pullers_keep_theirs(
        tmp_path: Path) -> None:
    """Rank 1's offer of version 2 fails: the version ends when the trainer says so, not at the version's time
    limit (600 s here, far past this test's waits); its puller is recorded as never offered (no report was due
    from it, it still holds version 1), and version 3 commits to it."""
    from tests.daemon_harness import timeouts

    workdir, stop_file = tmp_path / "job", tmp_path / "rx-stop"
    workdir.mkdir()
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", transport="nixl",
                                       nixl_trust_receivers=True, bucket_size_mb=0.02,
                                       timeouts=timeouts(version_s=600)))
    pullers = start_processes([(llama_puller, (daemon.zmq, 5, str(stop_file), (str(workdir), -1)))])
    job = None
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 1)
            job = _job(daemon, workdir, hook=functools.partial(offer_fails, 2))
            first, failed, third = _first_ended(client, 3)  # (its bound: far below version_s)
            assert [v["status"] for v in (first, failed, third)] == ["committed", "failed", "committed"]
            assert "owner rank 1" in failed["reason"] and "injected" in failed["reason"], failed["reason"]
            [entry] = failed["receivers"]
            assert entry["missing_report"] is False and "never offered" in entry["reason"], entry
            (workdir / "stop").touch()
            job.collect(120)
    finally:
        (workdir / "stop").touch()
        stop_file.touch()
        [rx] = pullers.collect(120)
        assert daemon.stop() == 0
    assert [(version, ok) for version, ok, _, _ in rx["results"]] == [(first["id"], True), (third["id"], True)]


def test_an_owner_whose_offer_stalls_fails_its_version_within_the_bound_and_its_late_offer_is_never_reported(
        tmp_path: Path) -> None:
    """Outside attack, tenth session: an offer made before the send is waited for a bounded time by the send,
    and again by the version's report; one that stalls past both fails its version for its pullers (they keep
    what they hold), and when it comes at last it is neither reported nor offered twice. The next version
    commits."""
    (first, stalled, third), ranks, rx = _stalled_owner_run(
        tmp_path, functools.partial(offer_stalls, 2), "stalled", 3)
    assert [v["status"] for v in (first, stalled, third)] == ["committed", "failed", "committed"], stalled
    assert "did not finish within 1 s" in stalled["reason"], stalled["reason"]
    assert [(version, ok) for version, ok, _, _ in rx["results"]] == [(first["id"], True), (third["id"], True)]
    assert rx["state"] == ranks[0]["served"][third["id"]]


def _stalled_owner_run(tmp_path: Path, hook, stalled_file: str, versions: int) -> tuple[list[dict], list, dict]:
    """Two FSDP2 owner ranks and one puller; ``hook`` stalls an owner at version 2 (``stalled_file`` in the
    job's folder once it does) until ``go``, given once the first two versions ended. The ended versions,
    the ranks' results, the puller's."""
    workdir, stop_file = tmp_path / "job", tmp_path / "rx-stop"
    workdir.mkdir()
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", transport="nixl",
                                       nixl_trust_receivers=True, bucket_size_mb=0.02))
    pullers = start_processes([(llama_puller, (daemon.zmq, 5, str(stop_file), (str(workdir), -1)))])
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 1)
            job = _job(daemon, workdir, hook=hook, versions=versions)
            _wait_for(lambda: (workdir / stalled_file).exists(), 120)
            _first_ended(client, 2)  # (while the owner is stalled)
            (workdir / "go").touch()
            ended = _first_ended(client, versions)
            (workdir / "stop").touch()
            ranks = job.collect(180)
    finally:
        (workdir / "go").touch()
        (workdir / "stop").touch()
        stop_file.touch()
        [rx] = pullers.collect(120)
        assert daemon.stop() == 0
    return ended, ranks, rx


@pytest.mark.parametrize("stalling_rank", [1, 0])
def test_an_owner_that_stalls_after_posting_never_leaves_pullers_on_a_version_the_daemon_failed(
        tmp_path: Path, stalling_rank: int) -> None:
    """An owner rank stalls right after posting its digests of version 2. Outside attacks, 2026-11-28/29:
    rank 1 used to post before the owners' vote, and the lead before its report to the daemon, so the version
    failed (the vote, or the daemon, waited for the stalled rank) while the pullers had already loaded it. An
    owner posts only once the owners voted that every one sent its share, the lead only once the daemon has
    its report: whatever the pullers load, the daemon commits, and the history says so."""
    (first, stalled, third), ranks, rx = _stalled_owner_run(
        tmp_path, functools.partial(stall_after_posting, 2, stalling_rank), "posted", 3)
    assert [v["status"] for v in (first, stalled, third)] == ["committed"] * 3, (stalled["reason"], stalled)
    assert [(version, ok) for version, ok, _, _ in rx["results"]] == [
        (first["id"], True), (stalled["id"], True), (third["id"], True)], rx["results"]
    assert rx["state"] == ranks[0]["served"][third["id"]]


def test_a_lead_that_stalls_before_its_report_leaves_the_pullers_on_their_version(tmp_path: Path) -> None:
    """The lead stalls before it reports version 2 done (outside attack, 2026-11-29: it had posted its digests
    already, so pullers loaded a version the daemon then failed at its time limit). It posts only after its
    report: the pullers give up at the version's deadline and keep version 1, and the history agrees.
    (Two versions: a third one's push would wait for the stalled one, and the job's group with it.)"""
    (first, stalled), ranks, rx = _stalled_owner_run(
        tmp_path, functools.partial(stall_before_reporting, 2), "stalled", 2)
    assert [v["status"] for v in (first, stalled)] == ["committed", "failed"], stalled
    [entry] = stalled["receivers"]
    assert entry["ok"] is False and entry.get("serving_after") != stalled["id"], entry
    results = {version: ok for version, ok, _, _ in rx["results"]}
    assert results[first["id"]] is True and results[stalled["id"]] is False, rx["results"]
    assert rx["state"] == ranks[0]["served"][max(v for v, ok in results.items() if ok)]


def test_a_lead_the_daemon_dropped_before_its_report_tells_its_pullers_and_they_keep_theirs(tmp_path: Path) -> None:
    """Outside attack, 2026-11-29: the trainer's process stops as it is about to report version 2 done; the
    daemon drops it (silent past its heartbeat) and fails the version; then it goes on, and its report is
    refused. It used to post its digests all the same (the report was "delivered"), so its puller loaded the
    failed version. Only a report the daemon took with the version still in flight lets the pullers load."""
    import signal

    stop_file = tmp_path / "stop"
    daemon = start_daemon(_nixl_config(tmp_path))
    trainer = start_processes([(stopping_trainer, (daemon.zmq, str(stop_file), str(tmp_path), 2))])
    receivers = start_processes([(receiver_proc, (daemon.zmq, str(stop_file), 7, "another-host"))])
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 2)
            first = sync_when_idle(client, {"step": 1})
            assert client.post("/sync", json={"step": 2}).status_code == 202
            _wait_for(lambda: (tmp_path / "stopped").exists(), 120)
            failed = _wait_for(lambda: _ended(client.get("/versions/2").json()), 120)
            (tmp_path / "resumed").touch()
            os.kill(trainer.procs[0].pid, signal.SIGCONT)
            late = _wait_for(lambda: [e for e in client.get("/versions/2").json()["receivers"]
                                      if e.get("missing_report") is False], 120)  # (its outcome, if late)
    finally:
        (tmp_path / "resumed").touch()
        os.kill(trainer.procs[0].pid, signal.SIGCONT)
        stop_file.touch()
        [rx] = receivers.collect(120)
        trainer.collect(120)
        assert daemon.stop() == 0
    assert first["status"] == "committed" and failed["status"] == "failed", failed
    assert [(e["ok"], e.get("serving_after")) for e in late] == [(False, first["id"])], late
    assert [(version, ok) for version, ok, _ in rx["results"]] == [(first["id"], True), (2, False)], rx["results"]
    assert "report of version 2 was refused" in rx["results"][1][2], rx["results"]


def test_a_bypass_cpu_version_of_two_owner_ranks_is_pulled_from_their_send_slots(tmp_path: Path) -> None:
    """No cache: each FSDP2 rank keeps the buckets it sent in its send slots, and the puller reads each from its
    owner there, verified; every version byte-exact."""
    workdir, stop_file = tmp_path / "job", tmp_path / "rx-stop"
    workdir.mkdir()
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", transport="nixl",
                                       nixl_trust_receivers=True, bucket_size_mb=0.02))
    pullers = start_processes([(llama_puller, (daemon.zmq, 5, str(stop_file), (str(workdir), -1)))])
    job = None
    try:
        with daemon.client() as client:
            _wait_for(lambda: len(client.get("/receivers").json()["agents"]) == 1)
            job = _job(daemon, workdir, mode="bypass")
            versions = _first_ended(client, 3)
            assert [(v["status"], v["mode"], v["owners"], v["cached"]) for v in versions] == [
                ("committed", "bypass_cpu", 2, False)] * 3, versions
            (workdir / "stop").touch()
            ranks = job.collect(120)
    finally:
        (workdir / "stop").touch()
        stop_file.touch()
        [rx] = pullers.collect(120)
        assert daemon.stop() == 0
    assert [(v, ok) for v, ok, _, _ in rx["results"]] == [(v["id"], True) for v in versions]
    assert rx["state"] == ranks[0]["served"][versions[-1]["id"]]  # the last version's bytes, exactly
