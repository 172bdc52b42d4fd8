"""Owner-sharded versions (issue 17): every trainer rank owns, caches and sends a share of each version.

The pure plan (owners, shares, layouts planned by owner), then real jobs: FSDP2 trainers of 1, 2 and 4 ranks
on gloo with a real daemon and 2 transformers receivers; the receivers get byte-identical weights in both
modes, the version digest does not depend on the rank count, and each rank's cache holds only its share;
rollback with several owners; an owner killed after a version was cached (its re-push refused, a new job's
versions work); and tensors that are views (strided, offset, transposed, expanded) sent byte-exact.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckpt_engine.errors import LayoutError, LayoutMismatchError
from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.plan.owners import Owners, owners_by_group, plan_owners, share_of, share_offsets
from ckpt_engine.plan.sparse import manifest_of, plan_sparse
from tests.daemon_harness import ROOT, free_port, start_daemon, timeouts, write_config
from tests.procs import run_processes, start_processes
from tests.test_elastic import agents_of, wait_until
from tests.test_fsdp_sync import transformers_receiver
from tests.tiny_lm import sharded_tiny_llama, tensor_bytes, tiny_llama

pytestmark = pytest.mark.multiproc


# ---- the plan ----------------------------------------------------------------------------------------------
def _layout(sizes: list[int], bucket_size: int = 1024):
    return plan_layout([TensorSpec(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)], bucket_size, 8)


def test_owners_are_balanced_by_bytes_interleaved_and_the_same_everywhere() -> None:
    layout = _layout([1000, 200, 200, 1000, 1000, 16, 1000, 500, 500])
    owners = plan_owners(layout, 3)
    assert owners == plan_owners(layout, 3) and owners.digest == plan_owners(layout, 3).digest
    held = [owners.bytes_of(layout, r) for r in range(3)]
    assert max(held) - min(held) <= layout.max_bucket_bytes  # within one bucket of each other
    assert owners.of[:3] == (0, 1, 2)  # consecutive buckets from different ranks: their sends overlap
    assert plan_owners(layout, 1).of == (0,) * len(layout.buckets)
    assert plan_owners(_layout([10]), 4).of == (0,)  # fewer buckets than ranks: some own nothing


def test_a_share_is_a_layout_of_its_own_and_knows_where_its_buckets_go() -> None:
    layout = _layout([600, 600, 600, 600, 600])
    owners = plan_owners(layout, 2)
    shares = [share_of(layout, owners, r) for r in range(2)]
    assert sorted(w for share in shares for w in share.wire) == list(range(len(layout.buckets)))
    for share in shares:
        assert [b.flat_offset for b in share.layout.buckets] == [sum(b.nbytes for b in share.layout.buckets[:i])
                                                                 for i in range(len(share.layout.buckets))]
        for local, wire in enumerate(share.wire):
            assert [s.name for s in share.layout.buckets[local].slots] == [s.name for s in layout.buckets[wire].slots]
        assert share.layout.digest != layout.digest
    assert share_of(layout, plan_owners(layout, 1), 0).layout is layout


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_share_offsets_say_where_each_bucket_sits_in_its_owners_share(ranks: int) -> None:
    layout = _layout([600, 600, 1000, 16, 600, 3000, 200])
    owners = plan_owners(layout, ranks)
    at = share_offsets(layout, owners)
    for rank in range(ranks):
        share = share_of(layout, owners, rank)
        assert [at[wire] for wire in share.wire] == [b.flat_offset for b in share.layout.buckets]


def test_owners_that_do_not_fit_a_layout_are_refused() -> None:
    layout = _layout([600, 600])
    with pytest.raises(LayoutMismatchError):
        Owners(2, (0,)).check(layout)
    with pytest.raises(LayoutError):
        Owners(2, (0, 2)).check(layout)
    with pytest.raises(LayoutError):
        plan_owners(layout, 0)


def test_a_sparse_plan_of_several_owners_never_mixes_owners_in_a_bucket() -> None:
    layout = _layout([100] * 12, bucket_size=400)
    owners = plan_owners(layout, 3)
    names = tuple(s.name for s in layout.slots)
    base = manifest_of(1, "xxh3-64", layout, list(range(12)))
    new = manifest_of(2, "xxh3-64", layout, [d + (1 if i % 2 else 0) for i, d in enumerate(range(12))])
    plan = plan_sparse(layout, new, base, bucket_size=400, alignment=8, owners=owners)
    assert plan is not None and plan.changed == names[1::2] and plan.skipped == 6
    owner_of = {slot.name: owners.of[slot.bucket] for slot in layout.slots}
    for bucket, owner in zip(plan.layout.buckets, plan.owners.of):
        assert {owner_of[s.name] for s in bucket.slots} == {owner}
    assert owners_by_group(plan.layout, 3) == plan.owners
    # receivers re-plan it from the message (groups travel with the layout) and get the same digest
    from ckpt_engine.transport.messages import LayoutMessage

    assert LayoutMessage.of(plan.layout).to_layout().digest == plan.layout.digest


# ---- real jobs ---------------------------------------------------------------------------------------------
def owner_trainer(rank: int, world: int, port: int, zmq: str, workdir: str, actions: dict[int, str],
                  on_version: Callable[[Any, int, int, str], dict] | None = None) -> dict:
    """A trainer rank (FSDP2 when ``world`` > 1) running until ``workdir/stop``: at step s it does
    ``actions[s]``: "push" (cached), "bypass", "train" (one optimizer step of the first layer).
    ``on_version(agent, rank, version, workdir)``: called on every rank after each version it served; what it
    returns joins the rank's result."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ckpt_engine.plan.tensors import named_tensors_of
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
    model = tiny_llama(seed=0)
    if world > 1:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.model.layers[0].parameters(), lr=0.5)
    agent = TrainerAgent(model, zmq, poll_wait_s=0.2).start()
    served, shares, extra = {}, {}, {}
    step = 0
    while not _stopping(workdir, world):
        step += 1
        action = actions.get(step)
        if action == "train":
            tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if action in ("push", "bypass"):
            if rank == 0:
                agent.wait_idle(60)
            version = agent.push(step, bypass_cpu=action == "bypass")
        else:
            version = agent.step(step)
        if version is not None:
            full = {n: t.full_tensor() if isinstance(t, DTensor) else t
                    for n, t in named_tensors_of(model).tensors.items()}
            served[version] = tensor_bytes(full)
            shares[version] = agent.publisher.cache.bytes_by_version()
            if on_version is not None:
                extra.update(on_version(agent, rank, version, workdir))
        time.sleep(0.01)
    agent.wait_idle(60)
    result = {"served": served, "shares": shares, "cache": agent.publisher.cache.bytes_by_version(),
              "rank": rank, **extra}
    agent.close()
    if world > 1:
        dist.destroy_process_group()
    return result


def _stopping(workdir: str, world: int) -> bool:
    """Every rank of the job stops at the same step: one that saw the stop file a step before another would
    leave that one alone in the next step's collective."""
    flag = torch.tensor([int(os.path.exists(os.path.join(workdir, "stop")))])
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _job(daemon, workdir: Path, world: int, actions: dict[int, str]):
    (workdir / "stop").unlink(missing_ok=True)
    port = free_port()
    return start_processes([(owner_trainer, (r, world, port, daemon.zmq, str(workdir), actions))
                            for r in range(world)])


def _cluster(tmp_path: Path, **config):
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", bucket_size_mb=0.02,
                                       transport="collective", **config))
    receivers = start_processes([(transformers_receiver, (daemon.zmq, 5, str(tmp_path / "rx-stop"))),
                                 (transformers_receiver, (daemon.zmq, 6, str(tmp_path / "rx-stop")))])
    return daemon, receivers


def _versions(http) -> list[dict]:
    return sorted(http.get("/versions").json()["versions"], key=lambda v: v["id"])


def test_one_two_and_four_owner_ranks_send_the_same_versions_byte_exact(tmp_path: Path) -> None:
    daemon, receivers = _cluster(tmp_path)
    digests: dict[int, list[str]] = {}
    trainers: dict[int, list[dict]] = {}
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="the receivers")
            for world in (1, 2, 4):
                workdir = tmp_path / f"world{world}"
                workdir.mkdir()
                before = len(_versions(http))
                job = _job(daemon, workdir, world, {3: "push", 6: "bypass"})
                wait_until(lambda before=before: sum(v["status"] in ("committed", "failed")
                                                     for v in _versions(http)) >= before + 2,
                           timeout_s=180, what=f"two versions from {world} rank(s)")
                (workdir / "stop").touch()
                trainers[world] = job.collect(120)
                mine = _versions(http)[before:]
                assert [(v["status"], v["mode"], v["owners"]) for v in mine] == \
                    [("committed", "cached", world), ("committed", "bypass_cpu", world)], mine
                digests[world] = [v["version_digest"] for v in mine]
                wait_until(lambda: all(a["role"] != "trainer" for a in agents_of(http)), what="the job to leave")
    finally:
        (tmp_path / "rx-stop").touch()
        rx = receivers.collect(120)
        daemon.stop()
    assert digests[1] == digests[2] == digests[4]  # the version digest does not depend on the rank count
    for world, ranks in trainers.items():
        lead = ranks[0]
        for version, expected in lead["served"].items():
            for receiver in rx:
                assert receiver["states"][version] == expected, (world, version)
        cached = min(lead["served"])  # the cached version: each rank holds only its share of it
        held = [rank["shares"][cached][cached] for rank in ranks]
        total = sum(held)
        assert all(h <= total / world + (32 << 10) for h in held), held  # about 1/world each (within a bucket)
        assert world == 1 or max(held) < 0.75 * total


def test_rollback_of_a_version_several_ranks_own(tmp_path: Path) -> None:
    daemon, receivers = _cluster(tmp_path, keep_versions=3)
    workdir = tmp_path / "job"
    workdir.mkdir()
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="the receivers")
            job = _job(daemon, workdir, 2, {3: "push", 5: "train", 7: "push"})
            wait_until(lambda: sum(v["status"] == "committed" for v in _versions(http)) >= 2, timeout_s=120,
                       what="two versions")
            first, second = _versions(http)[:2]
            assert first["cached"] and second["cached"] and first["owners"] == 2, (first, second)
            pushed = http.post(f"/versions/{first['id']}/push").json()["version"]
            wait_until(lambda: http.get(f"/versions/{pushed}").json()["status"] == "committed", timeout_s=60,
                       what="the rollback")
            (workdir / "stop").touch()
            ranks = job.collect(120)
    finally:
        (tmp_path / "rx-stop").touch()
        rx = receivers.collect(120)
        daemon.stop()
    served = ranks[0]["served"]
    assert served[first["id"]] != served[second["id"]]
    for receiver in rx:  # the rollback is the first version again, byte for byte
        assert receiver["states"][pushed] == served[first["id"]]


def test_an_owner_killed_after_caching_makes_its_versions_unpushable_and_a_new_job_works(tmp_path: Path) -> None:
    daemon, receivers = _cluster(tmp_path)  # (the killed rank is dropped once its heartbeat expires: 10 s)
    workdir = tmp_path / "job"
    workdir.mkdir()
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="the receivers")
            job = _job(daemon, workdir, 2, {3: "push"})
            wait_until(lambda: any(v["status"] == "committed" for v in _versions(http)), timeout_s=120,
                       what="the first version")
            first = _versions(http)[0]
            wait_until(lambda: http.get(f"/versions/{first['id']}").json()["cached"], what="its shares cached")
            os.kill(job.procs[1].pid, signal.SIGKILL)  # owner rank 1 and its share of the cache are gone
            wait_until(lambda: not any(a["role"] == "trainer" and a["rank"] == 1 for a in agents_of(http)),
                       timeout_s=30, what="the daemon to drop rank 1")
            assert not http.get(f"/versions/{first['id']}").json()["cached"]
            refused = http.post(f"/versions/{first['id']}/push")
            assert refused.status_code == 409 and "owner rank" in refused.json()["detail"], refused.text
            assert "1" in refused.json()["detail"].split("owner rank(s)")[1].split("of its")[0]
            job.kill()
            wait_until(lambda: all(a["role"] != "trainer" for a in agents_of(http)), timeout_s=30,
                       what="the old job to be gone")
            (workdir / "stop").unlink(missing_ok=True)
            again = _job(daemon, workdir, 2, {3: "push"})  # the trainer job is back: new versions work
            wait_until(lambda: sum(v["status"] == "committed" for v in _versions(http)) >= 2, timeout_s=120,
                       what="a version of the new job")
            latest = _versions(http)[-1]
            assert latest["status"] == "committed" and latest["owners"] == 2, latest
            (workdir / "stop").touch()
            ranks = again.collect(120)
    finally:
        (tmp_path / "rx-stop").touch()
        rx = receivers.collect(120)
        daemon.stop()
    for receiver in rx:
        assert receiver["states"][latest["id"]] == ranks[0]["served"][latest["id"]]


# ---- a failure of the job's own process group ---------------------------------------------------------------
def stalling_trainer(rank: int, port: int, zmq: str, pg_timeout_s: float, point: str, bypass: bool) -> dict:
    """A 2-rank FSDP2 job whose rank 0 stalls (SIGSTOP of its own process; the test sends SIGCONT) in the first
    version: in the middle of its gathers (``point`` "gather") or in the step agreement after it took the
    version off its queue ("agree"). Says where each rank left its loop, with what, and how long the step
    that raised had run."""
    from ckpt_engine.workers.fsdp import ShardedTensors, sharded_tensors_of
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = sharded_tiny_llama(rank, port, pg_timeout_s)
    stall = {"done": rank != 0}

    def stall_once() -> None:
        if not stall["done"]:
            stall["done"] = True
            os.kill(os.getpid(), signal.SIGSTOP)

    class StallsAtSecondBucket(ShardedTensors):
        def bucket_tensors(self, bucket, to=None):
            if bucket.index == 1 and point == "gather":
                stall_once()
            return super().bucket_tensors(bucket, to)

    class StallsAfterTakingAVersion(TrainerAgent):
        def _next_due(self):
            due = super()._next_due()
            if due is not None and point == "agree":
                stall_once()
            return due

    def source():
        named = sharded_tensors_of(model)
        return StallsAtSecondBucket(named.tensors, named.aliases)

    agent = StallsAfterTakingAVersion(source, zmq, poll_wait_s=0.2).start()
    dist.barrier()  # both registered: the version is planned for both ranks as owners
    where, requested, began = "loop", rank != 0, time.monotonic()
    try:
        for step in range(1, 10_000):
            where, began = "step", time.monotonic()
            if requested:
                agent.step(step)
            else:  # until the daemon takes a request (it refuses while receivers are not ready yet)
                requested = agent.push(step, bypass_cpu=bypass) is not None
            where = "loop"
            _stopping("/nonexistent", 2)  # a collective of the job between steps, as training has
            time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001 - where and what is the result
        return {"where": where, "error": f"{type(exc).__name__}: {exc}", "in_step_s": time.monotonic() - began}
    return {"where": "nowhere"}


@pytest.mark.parametrize(("point", "bypass", "lead_dropped"),
                         [("gather", False, False), ("gather", True, False), ("agree", False, False),
                          ("gather", False, True)])
def test_a_failure_of_the_job_group_in_a_sync_ends_the_loop_at_once_and_fails_the_version(
        tmp_path: Path, point: str, bypass: bool, lead_dropped: bool) -> None:
    """The job's own group failing in a sync (a peer stalled past its timeout) is the job's failure: step()
    raises on the rank that saw it, within the group's timeout, and the version fails saying so; instead of
    training on with ranks out of step until a later collective times out (which killed a job mid-way
    through the next sync in the fault trials), or a bypass_cpu send swallowing it, or the failed ranks'
    vote holding the exit, or a version taken before the agreement left for the heartbeat to end.
    ``lead_dropped``: the daemon gives up on the stalled rank 0 before it wakes; the reason rank 1 gave
    is kept beside "went away"."""
    pg_timeout_s = 2.0 if lead_dropped else 3.0
    heartbeat_s = 5 if lead_dropped else 30
    # (the failed version ends once the rendezvous the gone rank never comes to times out: connect_s)
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", bucket_size_mb=0.02,
                                       transport="collective", timeouts=timeouts(connect_s=8, heartbeat_s=heartbeat_s)))
    receivers = start_processes([(transformers_receiver, (daemon.zmq, 5, str(tmp_path / "rx-stop")))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 1, what="the receiver")
            port = free_port()
            job = start_processes([(stalling_trainer, (r, port, daemon.zmq, pg_timeout_s, point, bypass))
                                   for r in range(2)])
            wait_until(lambda: job.procs[1].exitcode is not None, timeout_s=90, what="rank 1 to leave its loop")

            def failed() -> bool:
                return bool(_versions(http)) and _versions(http)[-1]["status"] == "failed"

            if lead_dropped:
                wait_until(failed, timeout_s=20, what="the daemon to give up on the stalled rank 0")
            os.kill(job.procs[0].pid, signal.SIGCONT)
            lead, peer = job.collect(60)
            wait_until(failed, timeout_s=20, what="the version to fail (told by the job, not by the heartbeat timeout)")
            version = _versions(http)[-1]
    finally:
        (tmp_path / "rx-stop").touch()
        receivers.collect(120)
        daemon.stop()
    # rank 1 waited in a collective rank 0 never joined: it left from step(), within the group's timeout
    # (and the 2 s it may take to tell the daemon), not after a vote of the ranks that failed (collective_s, 30 s)
    assert peer["where"] == "step" and peer["error"].startswith("TrainerGroupError"), peer
    assert "process group" in peer["error"] and peer["in_step_s"] < pg_timeout_s + 12, peer
    # rank 0, woken, found its peer gone in the same collective: it left from step() too
    assert lead["where"] == "step" and lead["error"].startswith("TrainerGroupError"), lead
    assert "process group" in (version["reason"] or ""), version
    assert version["mode"] == ("bypass_cpu" if bypass else "cached") and version["owners"] == 2, version
    if lead_dropped:
        assert "went away" in version["reason"] and "owner rank 1: TrainerGroupError" in version["reason"], version


def unpack_failing_trainer(rank: int, port: int, zmq: str, workdir: str) -> dict:
    """A 2-rank FSDP2 job whose owner rank 0 runs out of memory unpacking its first gathered bucket (after
    the collective: the ranks are still in step); it trains on and pushes until ``workdir/stop``."""
    from ckpt_engine.workers import fsdp
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    model = sharded_tiny_llama(rank, port, 10)
    unpack, failed = fsdp._unpack, {"done": rank != 0}

    def unpack_once_out_of_memory(*args):
        if not failed["done"] and args[-1] is not None:
            failed["done"] = True
            raise torch.OutOfMemoryError("injected: no memory to unpack the gathered bucket")
        return unpack(*args)

    fsdp._unpack = unpack_once_out_of_memory
    agent = TrainerAgent(model, zmq, poll_wait_s=0.2).start()
    dist.barrier()  # both registered: versions are planned for both ranks as owners
    served: list[int] = []
    for step in range(1, 100_000):
        if _stopping(workdir, 2):
            break
        if rank == 0 and len(agent.served) < 2 and step % 20 == 0:
            agent.wait_idle(30)
            agent.push(step)
        else:
            agent.step(step)
        time.sleep(0.01)
    agent.wait_idle(30)
    served = list(agent.served)
    agent.close()
    dist.destroy_process_group()
    return {"served": served, "steps": step}


def test_a_local_failure_after_a_gather_fails_only_the_version_and_training_goes_on(tmp_path: Path) -> None:
    """Out of memory unpacking a gathered bucket is the sync's failure, not the job's: the collective is done
    and the ranks are in step, so the version fails, both ranks train on, and the next version commits."""
    daemon = start_daemon(write_config(tmp_path, ROOT / "deploy" / "engine.yaml", bucket_size_mb=0.02,
                                       transport="collective"))
    receivers = start_processes([(transformers_receiver, (daemon.zmq, 5, str(tmp_path / "rx-stop")))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 1, what="the receiver")
            port = free_port()
            job = start_processes([(unpack_failing_trainer, (r, port, daemon.zmq, str(tmp_path)))
                                   for r in range(2)])
            wait_until(lambda: [v["status"] for v in _versions(http)][:2] == ["failed", "committed"], timeout_s=120,
                       what="a failed version, then a committed one")
            (tmp_path / "stop").touch()
            lead, peer = job.collect(120)
            first = _versions(http)[0]
    finally:
        (tmp_path / "rx-stop").touch()
        receivers.collect(120)
        daemon.stop()
    assert "OutOfMemoryError" in first["reason"] and "TrainerGroupError" not in first["reason"], first
    assert len(lead["served"]) >= 1 and len(peer["served"]) >= 1, (lead, peer)


# ---- any tensor, byte-exact ---------------------------------------------------------------------------------
def views_trainer(zmq: str, workdir: str) -> dict:
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.workers.trainer_agent import TrainerAgent

    base = torch.arange(4000, dtype=torch.float32)
    matrix = torch.randn(30, 40, generator=torch.Generator().manual_seed(1))
    views = {"stepped": base[::3], "offset": base[7:777], "transposed": matrix.t(),
             "expanded": torch.randn(5, 1, generator=torch.Generator().manual_seed(2)).expand(5, 6),
             "column": matrix[:, 3], "conj": torch.randn(8, dtype=torch.complex64).conj()}
    agent = TrainerAgent(lambda: NamedTensors(dict(views)), zmq, poll_wait_s=0.2).start()
    step = 0
    while not os.path.exists(os.path.join(workdir, "stop")):
        step += 1
        agent.step(step)
        time.sleep(0.01)
    agent.wait_idle(30)
    agent.close()
    return {name: tensor_bytes({name: v.resolve_conj().contiguous()})[name] for name, v in views.items()}


def views_receiver(zmq: str, workdir: str) -> dict:
    from ckpt_engine.workers.rollout_agent import RolloutAgent

    got: dict[str, bytes] = {}

    def load(payload) -> None:
        got.update(tensor_bytes({k: v.clone() for k, v in payload.tensors.items()}))

    agent = RolloutAgent(load, zmq, poll_wait_s=0.2).start()
    while not os.path.exists(os.path.join(workdir, "stop")):
        time.sleep(0.05)
    agent.close()
    return got


@pytest.mark.parametrize("mode", ["cached", "bypass_cpu"])
def test_views_of_any_strides_and_offsets_arrive_byte_exact(tmp_path: Path, mode: str) -> None:
    daemon = start_daemon(write_config(tmp_path, transport="collective"))
    procs = start_processes([(views_trainer, (daemon.zmq, str(tmp_path))),
                             (views_receiver, (daemon.zmq, str(tmp_path)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 2, what="registration")
            record = http.post("/sync", json={"wait": True, "timeout_s": 60,
                                              "bypass_cpu": mode == "bypass_cpu"}).json()
            assert record["status"] == "committed", record
    finally:
        (tmp_path / "stop").touch()
        sent, got = procs.collect(120)
        daemon.stop()
    assert got == sent


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")
def test_tensors_without_dense_bytes_are_refused_up_front_by_name() -> None:
    from ckpt_engine.plan.tensors import specs_of

    with pytest.raises(LayoutError, match=r"'s'.*sparse"):
        specs_of({"w": torch.zeros(2), "s": torch.eye(3).to_sparse()})
    with pytest.raises(LayoutError, match=r"'q'.*quantized"):
        specs_of({"q": torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)})
    with pytest.raises(LayoutError, match=r"'m'.*meta"):
        specs_of({"m": torch.empty(4, device="meta")})


# ---- what the outside attack on issue 17 found (library level: 2 owner ranks, 1 receiver) --------------------
_T = 15.0


def _library_groups(port: int, member: int, owners: int = 2):
    """Member < owners: an owner rank (its own sync group, the owners' group); else the receiver."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.transport.group import SyncGroup, open_store, owner_part

    store = open_store("127.0.0.1", port, timeout_s=_T)

    def group(part: str, rank: int, world: int) -> SyncGroup:
        return SyncGroup(store, name="attack", generation=0, rank=rank, world_size=world,
                         device=detect_device("cpu"), timeout_s=_T, bind_host="127.0.0.1", part=part)

    if member >= owners:
        return [group(owner_part(o), 1, 2) for o in range(owners)], None
    return [group(owner_part(member), 0, 2)], group("owners/", member, owners)


def _model(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {f"t{i}": torch.randn(64, 64, generator=gen) for i in range(8)}


def library_owner(port: int, rank: int, scenario: str) -> list:
    from ckpt_engine.send.publisher import Ownership, Publisher

    (group,), owners = _library_groups(port, rank)
    publisher = Publisher(group, bucket_size=16 << 10, keep_versions=3)
    publisher.attach(group, {}, owners)
    out = []
    for version in (1, 2, 3):
        tensors, source = _model(version), None
        if version == 2 and rank == 1 and scenario == "order":  # the same tensors, another order
            tensors = dict(reversed(list(tensors.items())))
        if version == 3 and scenario == "repush":  # rank 1 no longer holds version 1
            if rank == 1:
                publisher.cache.evict(1)
            tensors, source = None, 1
        result = publisher.publish(version, tensors, ownership=Ownership(rank, 2),
                                   source_version=source).result(60)
        out.append((result.ok, result.reason))
    publisher.close()
    return out


def library_receiver(port: int) -> list:
    from ckpt_engine.receive.collective import Receiver

    groups, _ = _library_groups(port, 2)
    held: dict[str, torch.Tensor] = {}
    receiver = Receiver(groups, load=lambda payload: held.update({k: v.clone() for k, v in payload.tensors.items()}))
    out = []
    for _ in range(3):
        result = receiver.receive(begin_timeout_s=_T)
        out.append((result.ok, result.reason, {k: v.tolist() for k, v in held.items()} if result.ok else None))
    return out


def _run_library(scenario: str) -> tuple[list, list, list]:
    from ckpt_engine.transport.group import open_store
    from tests.procs import run_processes

    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    return run_processes([(library_owner, (store.port, 0, scenario)), (library_owner, (store.port, 1, scenario)),
                          (library_receiver, (store.port,))], timeout_s=180)


def test_owners_that_planned_a_version_differently_refuse_it_before_any_bucket() -> None:
    lead, other, received = _run_library("order")
    assert lead[0][0] and other[0][0] and lead[2][0] and other[2][0]
    assert not lead[1][0] and "owner rank(s) [1] planned version 2 differently" in lead[1][1]
    assert not other[1][0] and "planned version 2 differently" in other[1][1]
    ok, reason, _ = received[1]
    assert not ok and "planned version 2 differently" in reason  # told at once, nothing loaded
    assert received[2][0] and received[2][2] == {k: v.tolist() for k, v in _model(3).items()}


def test_a_repush_an_owner_cannot_serve_is_refused_naming_it_and_the_receivers_are_told() -> None:
    lead, other, received = _run_library("repush")
    assert not other[2][0] and "not in the cache" in other[2][1]
    assert not lead[2][0] and "owner rank(s) [1] could not prepare version 3" in lead[2][1]
    assert not received[2][0] and "owner rank(s) [1]" in received[2][1]


def test_shares_and_their_fill_views_are_built_once_per_layout() -> None:
    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.tensors import _FILL_VIEWS
    from ckpt_engine.send.cache import VersionCache

    layout = _layout([600] * 12)
    owners = plan_owners(layout, 2)
    assert share_of(layout, owners, 1) is share_of(_layout([600] * 12), owners, 1)  # another object, same plan
    cache = VersionCache(detect_device("cpu"), keep_versions=1)
    tensors = {f"t{i}": torch.full((600,), i, dtype=torch.uint8) for i in range(12)}
    _FILL_VIEWS.clear()
    entries = []
    for version in (1, 2, 3, 4):
        cache.snapshot(version, layout, tensors, share=share_of(layout, owners, 1), owners=owners)
        entries.append(len(_FILL_VIEWS))
    assert entries[-1] == entries[-2] <= 2 * 6  # per bucket of the share and cache buffer, reused by every version
    for version, size in ((5, 700), (6, 800), (7, 900)):  # new shapes: new buffers, the old ones freed
        bigger = _layout([size] * 12)
        cache.snapshot(version, bigger, {f"t{i}": torch.zeros(size, dtype=torch.uint8) for i in range(12)})
    alive = {buffer.data_ptr() for cached in [cache.get(v) for v in cache.versions()] for buffer in cached._buffers}
    assert {key[1] for key in _FILL_VIEWS} <= alive | {b.data_ptr() for b in cache._pool}


@pytest.mark.filterwarnings("ignore:.*(nested tensors|ComplexHalf).*:UserWarning")
def test_a_tensor_that_turns_unsendable_under_the_same_key_is_refused_by_name() -> None:
    from ckpt_engine.device import detect_device
    from ckpt_engine.errors import ConfigError
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Ownership, Publisher

    publisher = Publisher(None, device=detect_device("cpu"), bucket_size=1 << 20)
    publisher.layout_for(NamedTensors({"w": torch.eye(3)}))
    with pytest.raises(LayoutError, match=r"'w'.*sparse"):
        publisher.layout_for(NamedTensors({"w": torch.eye(3).to_sparse()}))  # same name, dtype and shape
    with pytest.raises(LayoutError, match=r"'n'.*nested"):
        publisher.layout_for(NamedTensors({"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}))
    with pytest.raises(LayoutError, match=r"'h'.*complex32"):
        publisher.layout_for(NamedTensors({"h": torch.ones(2, dtype=torch.complex32)}))
    with pytest.raises(ConfigError, match="rank -1"):
        Ownership(-1, 2)


def _pair(port: int, rank: int):
    from ckpt_engine.device import detect_device
    from ckpt_engine.transport.group import SyncGroup, open_store

    return SyncGroup(open_store("127.0.0.1", port, timeout_s=_T), name="lone", generation=0, rank=rank, world_size=2,
                     device=detect_device("cpu"), timeout_s=_T, bind_host="127.0.0.1")


def lone_owner(port: int) -> list:
    from ckpt_engine.send.publisher import Ownership, Publisher

    group = _pair(port, 0)
    publisher = Publisher(group, bucket_size=16 << 10)
    out = []
    for version, ownership in ((1, Ownership(1, 2)), (2, None)):
        result = publisher.publish(version, _model(version), ownership=ownership).result(60)
        out.append((result.ok, result.reason))
    publisher.close()
    return out


def lone_receiver(port: int) -> list:
    from ckpt_engine.receive.collective import Receiver

    receiver = Receiver(_pair(port, 1), load=lambda payload: None)
    return [(r.ok, r.reason) for r in (receiver.receive(begin_timeout_s=_T), receiver.receive(begin_timeout_s=_T))]


def test_ownership_of_several_ranks_without_an_owners_group_is_refused_and_the_receiver_told() -> None:
    from ckpt_engine.transport.group import open_store
    from tests.procs import run_processes

    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    sent, got = run_processes([(lone_owner, (store.port,)), (lone_receiver, (store.port,))], timeout_s=120)
    assert not sent[0][0] and "no owners' group" in sent[0][1] and sent[1][0]
    assert not got[0][0] and "no owners' group" in got[0][1] and got[1][0]


# ---- the release order of a failing owner's send (found by the fault trials of issue 19) ------------------------
_HELD_S = 5.0  # how long the other owner holds back its part of the vote (a loaded machine releases well within half)


def releasing_owner(port: int, rank: int) -> dict:
    """bypass_cpu; the receiver is gone, so rank 0's send fails on the wire, and rank 1 is slow to send (and so
    to take part in the owners' vote)."""
    from ckpt_engine.send.publisher import Ownership, Publisher

    def hook(index: int, buf: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            time.sleep(_HELD_S)
        return buf

    (group,), owners = _library_groups(port, rank)
    _joined(port).set(f"releasing/joined/{rank}", "1")
    publisher = Publisher(group, bucket_size=16 << 10, wire_hook=hook)
    publisher.attach(group, {}, owners)
    time.sleep(1.0)  # the receiver has left
    started = time.monotonic()
    transfer = publisher.publish(1, _model(1), mode="bypass_cpu", ownership=Ownership(rank, 2))
    released = time.monotonic() - started  # bypass_cpu: publish returns once the live tensors are released
    result = transfer.result(60)
    ended = time.monotonic() - started
    publisher.close()
    return {"released_s": released, "ended_s": ended, "ok": result.ok, "reason": result.reason}


def leaving_receiver(port: int) -> str:
    _library_groups(port, 2)
    # gone only once both owners' groups are up on their side too (leaving during their handshake fails them
    # before the send this test is about)
    _joined(port).wait([f"releasing/joined/{rank}" for rank in range(2)])
    return "joined, then left"


def _joined(port: int):
    from ckpt_engine.transport.group import open_store

    return open_store("127.0.0.1", port, timeout_s=_T)


def test_a_failing_owner_releases_its_live_tensors_before_it_waits_for_the_other_owners_vote() -> None:
    """The training loop waits on the released tensors, and the other trainer ranks wait for it in their
    gathers: a send that failed part way must release them first, not after its abort and the owners' vote
    (which waits for the slowest owner). The fault trials of issue 19 found the old order (a trainer job ended
    past its timeout)."""
    from ckpt_engine.transport.group import open_store
    from tests.procs import run_processes

    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    failing, slow, _ = run_processes([(releasing_owner, (store.port, 0)), (releasing_owner, (store.port, 1)),
                                      (leaving_receiver, (store.port,))], timeout_s=120)
    assert not failing["ok"] and not slow["ok"], (failing, slow)
    assert failing["ended_s"] >= _HELD_S - 0.5, failing  # it did wait for the slow owner's vote ...
    assert failing["released_s"] < _HELD_S / 2, failing  # ... but only after letting go of the live tensors


# ---- the lead aborting part way (found by the outside attack of issue 30) ---------------------------------------
def lead_aborting_owner(port: int, rank: int) -> list:
    """Version 1: the lead's (rank 0's) send fails at its second bucket; version 2 goes through."""
    from ckpt_engine.send.publisher import Ownership, Publisher

    sent = {"buckets": 0}

    def hook(index: int, buf: torch.Tensor) -> torch.Tensor:
        sent["buckets"] += 1
        if rank == 0 and sent["buckets"] == 2:
            raise RuntimeError("injected: the lead's device failed part way")
        return buf

    (group,), owners = _library_groups(port, rank)
    publisher = Publisher(group, bucket_size=16 << 10, wire_hook=hook)
    publisher.attach(group, {}, owners)
    out = []
    for version in (1, 2):
        started = time.monotonic()
        result = publisher.publish(version, _model(version), ownership=Ownership(rank, 2)).result(60)
        out.append((result.ok, result.reason, time.monotonic() - started))
    publisher.close()
    return out


@pytest.mark.parametrize("staging", ["device", "stream"])
def test_a_lead_aborting_part_way_ends_the_version_for_every_owner_at_once(staging: str) -> None:
    """Receivers follow the other owners' buckets after the lead's abort, so those owners reach their vote and
    hear of it now: the version fails well within the groups' timeout, and the next one goes through."""
    from ckpt_engine.transport.group import open_store
    from tests.procs import run_processes

    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    lead, other, got = run_processes([(lead_aborting_owner, (store.port, 0)), (lead_aborting_owner, (store.port, 1)),
                                      (library_receiver_of, (store.port, 2, staging))], timeout_s=180)
    assert not lead[0][0] and not other[0][0] and not got[0][0], (lead, other, got)
    assert other[0][2] < _T / 2, other  # not the group's timeout
    assert lead[1][0] and other[1][0] and got[1][0], (lead, other, got)
    assert got[1][2] == {k: v.tolist() for k, v in _model(2).items()}


def library_receiver_of(port: int, versions: int, staging: str = "device") -> list:
    from ckpt_engine.receive.collective import Receiver

    groups, _ = _library_groups(port, 2)
    held: dict[str, torch.Tensor] = {}
    receiver = Receiver(groups, load=lambda payload: held.update({k: v.clone() for k, v in payload.items()}),
                        staging=staging, streams=staging == "stream")
    out = []
    for _ in range(versions):
        result = receiver.receive(begin_timeout_s=_T)
        out.append((result.ok, result.reason, {k: v.tolist() for k, v in held.items()} if result.ok else None))
    return out


def _bypass_rank(rank: int, port: int, sharded: bool) -> str:
    """Trainer rank ``rank`` of 2 publishing a bypass_cpu version; rank 1 cannot reach its receivers."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
    from ckpt_engine.send.publisher import Ownership, Publisher, Route

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))

    def agree(vector: list[int]) -> list[int]:
        reduced = torch.tensor(vector)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return reduced.tolist()

    def route() -> Route:
        if rank == 1:
            raise SyncTimeoutError("sync group rendezvous: rank(s) [1] never joined")
        return Route(None, {}, None)  # (never used: the ranks agree not to send)

    publisher = Publisher(device=detect_device("cpu"), bucket_size=1 << 12)
    try:
        publisher.publish(1, {"w": torch.zeros(4096)}, mode="bypass_cpu", route=route, agree=agree,
                          ownership=Ownership(rank, 2), sharded=sharded)
    except CkptEngineError as exc:
        return str(exc)
    finally:
        publisher.close()
        dist.destroy_process_group()
    return "sent"


@pytest.mark.parametrize("sharded", [False, True])
def test_bypass_ranks_agree_on_their_routes_before_any_gather(sharded: bool) -> None:
    """Found by the outside attack: with a receiver gone, trainer rank 1's rendezvous failed and it went on to
    the gathers while rank 0 was still in its own (and its retry): rank 1's gather timed out, ending training.
    Now no rank gathers a bypass_cpu version unless every one reached its receivers."""
    port = free_port()
    said = run_processes([(_bypass_rank, (0, port, sharded)), (_bypass_rank, (1, port, sharded))], timeout_s=60)
    assert "another trainer rank could not reach its receivers" in said[0], said
    assert "never joined" in said[1], said
