"""Staging (receive/staging.py): where a receiver holds a version, chosen per version, and streamed receive.

The choice is a pure rule (table tests); the bytes are checked with real processes on a real gloo group: one
sender, and a receiver per staging (device, host, stream, and auto under a budget that cannot hold the
version and one that can), each taking every odd tensor byte-exact: strided views, fp8, bool, complex,
0-dim, empty, tied names, and a tensor three buckets long sent in pieces.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.plan.tensors import NamedTensors
from ckpt_engine.receive.staging import Held, StagingNeeds, choose_staging
from ckpt_engine.transport.group import open_store
from tests.procs import run_processes
from tests.test_sync_multiproc import HOST, _sync_group

BUCKET = 16 << 10
MiB = 1 << 20
NEEDS = StagingNeeds(version=100 * MiB, buckets=2 * 8 * MiB, assembly=0)


@pytest.mark.parametrize(("policy", "free_device", "free_host", "streams", "held", "mode"), [
    ("device", 0, 0, True, Held(), "device"),  # an explicit policy is followed (allocation may then fail)
    ("host", 0, 0, False, Held(), "host"),
    ("stream", 0, 0, True, Held(), "stream"),
    ("stream", 10**12, 10**12, False, Held(), "host"),  # a load that takes whole versions only never streams
    ("auto", 400 * MiB, 0, True, Held(), "device"),  # the version fits half the device's free memory
    ("auto", 150 * MiB, 0, True, Held(device=100 * MiB), "device"),  # its own staging counts as free
    ("auto", 150 * MiB, 400 * MiB, True, Held(), "host"),  # not the device's half, the host's
    ("auto", 150 * MiB, 150 * MiB, True, Held(), "stream"),  # neither: streamed through two buckets
    ("auto", 20 * MiB, 400 * MiB, True, Held(), "stream"),  # host staging still needs two device buckets
    ("auto", 150 * MiB, 150 * MiB, False, Held(), "host"),  # cannot stream: host is the last resort
])
def test_the_staging_of_a_version(policy, free_device, free_host, streams, held, mode) -> None:
    choice = choose_staging(policy, NEEDS, free_device=free_device, free_host=free_host, share=0.5, held=held,
                            streams=streams)
    assert choice.mode == mode and choice.why


def test_what_each_staging_needs_is_bounded_by_the_bucket_for_stream() -> None:
    specs = [TensorSpec("big", "float32", (3 * BUCKET // 4 + 5,)), TensorSpec("small", "float16", (100,))]
    needs = StagingNeeds.of(plan_layout(specs, BUCKET))
    assert needs.buckets == 2 * BUCKET and needs.assembly == (3 * BUCKET // 4 + 5) * 4
    assert needs.version >= needs.assembly


def odd_tensors(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    base = torch.randn(3000, generator=gen)
    matrix = torch.randn(30, 40, generator=gen)
    tied = torch.randn(12, 8, generator=gen)
    return {
        "stepped": base[::3], "offset": base[7:777], "transposed": matrix.t(), "column": matrix[:, 3],
        "fp8_e4m3": torch.randn(77, generator=gen).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(33, 3, generator=gen).to(torch.float8_e5m2),
        "bool": torch.rand(101, generator=gen) > 0.5,
        "complex": torch.randn(9, 2, dtype=torch.complex64, generator=gen),
        "scalar": torch.tensor(float(version)), "empty": torch.empty(0, 5),
        "bf16": torch.randn(65, generator=gen).bfloat16(),
        "int64": torch.arange(17, dtype=torch.int64) * version,
        "embed": tied, "lm_head": tied,  # one tensor under two names
        "long": torch.randn(3 * BUCKET // 4 + 123, generator=gen),  # three buckets and a bit: sent in pieces
    }


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    return {name: (str(t.dtype), tuple(t.shape),
                   hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
            for name, t in tensors.items()}


def sender(port: int, world: int) -> list[dict]:
    from ckpt_engine.send.publisher import Publisher

    publisher = Publisher(_sync_group(port, 0, world), bucket_size=BUCKET)
    sent = []
    for version in (1, 2):
        tensors = odd_tensors(version)
        layout = publisher.layout_for(NamedTensors(tensors))
        result = publisher.publish(version, NamedTensors(tensors)).result(timeout_s=60)
        sent.append({"ok": result.ok, "reason": result.reason, "fingerprint": fingerprint(tensors),
                     "chunked": any(slot.chunked for slot in layout.slots), "buckets": len(layout.buckets)})
    publisher.close()
    return sent


def receiver(port: int, rank: int, world: int, staging: str, budget: int | None) -> list[dict]:
    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.collective import Receiver

    got: list[dict] = []

    def load(payload) -> None:  # copies out, as an engine does (a streamed view is valid only for its step)
        copies = {name: tensor.clone() for name, tensor in payload.items()}
        got.append({"tensors": fingerprint(copies), "streamed": payload.streamed})

    assembler = VersionAssembler(detect_device("cpu"), load, staging=staging, budget=budget, streams=True)
    rx = Receiver(_sync_group(port, rank, world), load, assembler=assembler)
    out = []
    for _ in range(2):
        result = rx.receive(60)
        out.append({"ok": result.ok, "reason": result.reason, "staging": result.staging, "why": result.staging_why,
                    **got[-1]} if result.ok else {"ok": False, "reason": result.reason})
    if rx.receive(60) is not None:
        raise RuntimeError("expected the sender to close the group")
    return out


RECEIVERS = [("device", None, "device"), ("host", None, "host"), ("stream", None, "stream"),
             ("auto", 64 << 10, "stream"),  # a budget of 64 KiB: half of it holds neither the version nor a host copy
             ("auto", 1 << 30, "device")]


def test_odd_tensors_arrive_byte_exact_in_every_staging() -> None:
    store = open_store(HOST, 0, is_master=True, timeout_s=30)
    world = 1 + len(RECEIVERS)
    jobs = [(sender, (store.port, world))] + [(receiver, (store.port, 1 + i, world, staging, budget))
                                              for i, (staging, budget, _) in enumerate(RECEIVERS)]
    sent, *received = run_processes(jobs, timeout_s=240)
    assert all(s["ok"] for s in sent), sent
    assert sent[0]["chunked"] and sent[0]["buckets"] >= 5
    for (staging, budget, expected), versions in zip(RECEIVERS, received):
        for version, got in zip(sent, versions):
            assert got["ok"], (staging, got)
            assert got["staging"] == expected and got["streamed"] == (expected == "stream"), (staging, budget, got)
            assert got["tensors"] == version["fingerprint"], staging


def plain_sender(port: int, chunked: bool = False) -> bool:
    from ckpt_engine.send.publisher import Publisher

    publisher = Publisher(_sync_group(port, 0, 2), bucket_size=BUCKET)
    oks = [publisher.publish(v, NamedTensors(plain_model(v, chunked))).result(timeout_s=60).ok for v in (1, 2, 3)]
    publisher.close()
    return all(oks)


def plain_model(version: int, chunked: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    tensors = {f"w{i}": torch.randn(BUCKET // 4 // 3, generator=gen) for i in range(30)}  # ten buckets
    if chunked:  # in the middle: four buckets in pieces
        tensors = {**dict(list(tensors.items())[:15]), "long": torch.randn(BUCKET + 5, generator=gen),
                   **dict(list(tensors.items())[15:])}
    return tensors


def counting_receiver(port: int, chunked: bool = False) -> dict:
    """A load as engines write it (a for loop, so it holds its last tensor while it asks for the next)."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.collective import Receiver

    own = {name: torch.empty_like(t) for name, t in plain_model(0, chunked).items()}
    in_use: list[int] = []

    def load(payload) -> None:
        for name, tensor in payload.items():
            own[name].copy_(tensor)
            in_use.append(len(assembler.buffers.pool))

    assembler = VersionAssembler(detect_device("cpu"), load, staging="stream", streams=True)
    rx = Receiver(_sync_group(port, 1, 2), load, assembler=assembler)
    results = [rx.receive(60) for _ in range(3)]
    rx.receive(60)
    return {"ok": [r.ok for r in results], "pool": max(in_use), "bytes": [b.numel() for b, _ in assembler.buffers.pool],
            "same": fingerprint(own) == fingerprint(plain_model(3, chunked))}


@pytest.mark.parametrize("chunked", [False, True])
def test_a_streamed_version_lands_in_two_bucket_buffers_reused_across_buckets_and_versions(chunked: bool) -> None:
    """Two bucket buffers whatever the model's size (and, for a tensor sent in pieces, one of its size to put
    it together), reused from bucket to bucket and version to version: not one per bucket."""
    store = open_store(HOST, 0, is_master=True, timeout_s=30)
    sent, got = run_processes([(plain_sender, (store.port, chunked)), (counting_receiver, (store.port, chunked))],
                              timeout_s=120)
    assert sent and got["ok"] == [True] * 3 and got["same"], got
    buckets = [size for size in got["bytes"] if size <= BUCKET]
    # two in use; a third only while the transport has not yet let go of a bucket it finished receiving
    # (gloo's work objects release their tensors from its own thread)
    assert len(buckets) <= 3 and got["pool"] <= 3 + chunked, got
    assert chunked == any(size >= (BUCKET + 5) * 4 for size in got["bytes"]), got


# ---- a receiver of an older release (it speaks protocol 1) facing a chunked version ------------------------------
def chunked_then_plain(version: int) -> dict[str, torch.Tensor]:
    tensors = plain_model(version)
    if version == 2:
        tensors["long"] = torch.randn(3 * BUCKET // 4)  # three buckets: sent in pieces
    return tensors


def older_sender(port: int | None, hub: str | None) -> list[tuple[bool, str | None]]:
    from ckpt_engine.device import detect_device
    from ckpt_engine.send.publisher import Publisher

    if hub is None:
        publisher = Publisher(_sync_group(port, 0, 2, timeout_s=5), bucket_size=BUCKET)
    else:
        publisher = Publisher(device=detect_device("cpu"), bucket_size=BUCKET, ipc_hub_name=hub, timeout_s=20)
        publisher.attach(None, ipc_peers={"old": 1})
    out = []
    for version in (1, 2):
        result = publisher.publish(version, NamedTensors(chunked_then_plain(version))).result(timeout_s=60)
        out.append((result.ok, result.reason))
    publisher.close()
    return out


def older_receiver(port: int | None, hub: str | None) -> list[tuple[bool, str | None]]:
    """This release's receiver made to speak protocol 1 only, as the releases before chunked tensors did."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.receive import colocated
    from ckpt_engine.receive.collective import Receiver
    from ckpt_engine.transport import framing

    framing.SUPPORTED_PROTOS = (1,)
    colocated.IPC_PROTO = 1
    if hub is None:
        rx = Receiver(_sync_group(port, 1, 2, timeout_s=5), lambda payload: None)
    else:
        rx = colocated.IpcReceiver(hub, "old", 1, lambda payload: None, device=detect_device("cpu"), timeout_s=20)
    return [(r.ok, r.reason) for r in (rx.receive(30), rx.receive(30))]


@pytest.mark.parametrize("transport", ["collective", "ipc"])
def test_a_receiver_that_speaks_protocol_1_takes_plain_versions_and_refuses_a_chunked_one_clearly(transport) -> None:
    import uuid

    store = open_store(HOST, 0, is_master=True, timeout_s=30)
    port, hub = (store.port, None) if transport == "collective" else (None, f"ckpt-test-{uuid.uuid4().hex[:8]}")
    sent, got = run_processes([(older_sender, (port, hub)), (older_receiver, (port, hub))], timeout_s=120)
    assert sent[0][0] and got[0][0], (sent, got)  # a version without pieces is protocol 1, as before
    assert not got[1][0] and not sent[1][0], (sent, got)
    if transport == "collective":
        assert "protocol 2 is not supported" in got[1][1], got
    else:
        assert "sent in pieces" in got[1][1] and "upgrade ckpt-engine" in got[1][1], got


# ---- the deployment's staging reaches every receiver; what each used is in the history -----------------------------
def budget_receiver(zmq: str, stop_file: str, streams: bool) -> list:
    import os
    import time

    from ckpt_engine.workers.adapters.torch_module import ModuleAdapter
    from ckpt_engine.workers.rollout_agent import RolloutAgent
    from tests.models import AwkwardModel

    adapter = ModuleAdapter(AwkwardModel(seed=7))
    agent = RolloutAgent(adapter.load, zmq, poll_wait_s=0.2, streams=streams).start()
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    agent.close()
    return [(r.version, r.ok, r.staging) for r in agent.results]


def test_auto_staging_under_the_deployment_s_budget_streams_where_the_load_can(tmp_path) -> None:
    """staging auto with a budget half of which holds no version: the receiver whose load streams is streamed,
    the one whose load takes whole versions falls back to host staging; the history says which and why."""
    from tests.daemon_harness import start_daemon, write_config
    from tests.procs import start_processes
    from tests.test_elastic import agents_of, sync, wait_until
    from tests.test_torn_repair import versions_trainer

    daemon = start_daemon(write_config(tmp_path, staging="auto", staging_budget_mb=0.05, transport="collective"))
    stop = tmp_path / "stop"
    procs = start_processes([(versions_trainer, (daemon.zmq, str(stop))),
                             (budget_receiver, (daemon.zmq, str(stop), True)),
                             (budget_receiver, (daemon.zmq, str(stop), False))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 3, what="registration")
            record = sync(http)
            assert record["status"] == "committed", record
            modes = sorted(entry["staging"]["mode"] for entry in record["receivers"])
            assert modes == ["host", "stream"], record["receivers"]
            why = {entry["staging"]["mode"]: entry["staging"]["why"] for entry in record["receivers"]}
            assert "whole versions only" in why["host"] and "neither" in why["stream"], why
            listed = [a["last_staging"]["mode"] for a in agents_of(http) if a["role"] == "receiver"]
            assert sorted(listed) == ["host", "stream"]
    finally:
        stop.touch()
        _, streamed, whole = procs.collect(120)
    assert streamed[-1][1:] == (True, "stream") and whole[-1][1:] == (True, "host")


# ---- what the outside attack on issue 27 found ------------------------------------------------------------------
def ipc_sender(hub: str) -> list[bool]:
    from ckpt_engine.device import detect_device
    from ckpt_engine.send.publisher import Publisher

    publisher = Publisher(device=detect_device("cpu"), bucket_size=BUCKET, ipc_hub_name=hub, timeout_s=20,
                          keep_versions=2)
    publisher.attach(None, ipc_peers={"streamed": 1})
    oks = [publisher.publish(v, NamedTensors(plain_model(v, chunked=v % 2 == 1))).result(timeout_s=60).ok
           for v in (1, 2, 3)]
    publisher.close()
    return oks


def ipc_streamed_receiver(hub: str) -> list:
    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.colocated import IpcReceiver

    own = {name: torch.empty_like(t) for name, t in plain_model(0, True).items()}
    got: list = []

    def load(payload) -> None:
        for name, tensor in payload.items():
            own[name].copy_(tensor)

    device = detect_device("cpu")
    rx = IpcReceiver(hub, "streamed", 1, load, device=device, timeout_s=20,
                     assembler=VersionAssembler(device, load, staging="stream", streams=True))
    for version in (1, 2, 3):
        result = rx.receive(30)
        expected = plain_model(version, chunked=version % 2 == 1)
        same = all(torch.equal(own[name], tensor) for name, tensor in expected.items())
        got.append((result.ok, result.reason, result.staging, result.staging_why, same))
    rx.close()
    return got


def test_a_same_host_receiver_streams_from_the_sender_s_buffer() -> None:
    """Found by the outside attack on issue 27: a streamed load on the same host read the next bucket's notice
    early (the streamed prefetch ran on a version the sender's buffer holds) and lost step with the sender."""
    import uuid

    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    sent, got = run_processes([(ipc_sender, (hub,)), (ipc_streamed_receiver, (hub,))], timeout_s=120)
    assert sent == [True] * 3, (sent, got)
    for ok, reason, staging, why, same in got:
        assert ok and same, (reason, got)
        assert staging == "shared" and "streamed into the load" in why, why


def growing_sender(port: int) -> bool:
    from ckpt_engine.send.publisher import Publisher

    publisher = Publisher(_sync_group(port, 0, 2), bucket_size=BUCKET)
    oks = [publisher.publish(v, NamedTensors(growing_model(v))).result(timeout_s=60).ok for v in (1, 2, 3)]
    publisher.close()
    return all(oks)


def growing_model(version: int) -> dict[str, torch.Tensor]:
    """Chunked tensors of 2.5, 4.5 and 6.5 buckets, smallest first, between small ones."""
    gen = torch.Generator().manual_seed(version)
    out: dict[str, torch.Tensor] = {}
    for i, buckets in enumerate((2.5, 4.5, 6.5)):
        out[f"small{i}"] = torch.randn(100, generator=gen)
        out[f"chunked{i}"] = torch.randn(int(buckets * BUCKET) // 4, generator=gen)
    return out


def pool_receiver(port: int) -> dict:
    from ckpt_engine.receive.collective import Receiver

    own = {name: torch.empty_like(t) for name, t in growing_model(0).items()}
    peak: list[int] = []

    def load(payload) -> None:
        for name, tensor in payload.items():
            own[name].copy_(tensor)
            peak.append(sum(b.numel() for b, _ in rx.assembler.buffers.pool))

    rx = Receiver(_sync_group(port, 1, 2), load, staging="stream", streams=True)
    oks = [rx.receive(60).ok for _ in range(3)]
    rx.receive(60)
    return {"ok": oks, "peak": max(peak), "after": [b.numel() for b, _ in rx.assembler.buffers.pool],
            "same": fingerprint(own) == fingerprint(growing_model(3))}


def test_a_stream_of_growing_chunked_tensors_holds_the_largest_not_their_sum() -> None:
    """Found by the outside attack on issue 27: each assembly buffer too small for the next chunked tensor stayed
    in the pool (memory the sum of them), and the largest was dropped between versions (allocated again)."""
    store = open_store(HOST, 0, is_master=True, timeout_s=30)
    sent, got = run_processes([(growing_sender, (store.port,)), (pool_receiver, (store.port,))], timeout_s=120)
    assert sent and got["ok"] == [True] * 3 and got["same"], got
    largest = int(6.5 * BUCKET)
    # two assembly buffers at most at once (the load holds the previous tensor while the next is put together)
    assert got["peak"] <= 3 * BUCKET + largest + int(4.5 * BUCKET), got
    assert max(got["after"]) == largest and sorted(got["after"])[:-1] == [BUCKET] * (len(got["after"]) - 1), got
