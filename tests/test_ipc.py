"""Same-host path between real processes: a colocated receiver maps the sender's shared slots while a
remote-style receiver gets the same version over the gloo collective; faults on either side."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
import torch

from ckpt_engine.device import detect_device
from ckpt_engine.plan.modes import mode_of
from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.collective import Receiver
from ckpt_engine.receive.colocated import BucketNotice, IpcReceiver
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.transport.group import open_store
from ckpt_engine.transport.same_host import FramedSocket, IpcHub, abstract_address, host_identity
from tests.models import BUCKET_SIZE, AwkwardModel, load_into, state_bytes
from tests.procs import context as procs_context
from tests.procs import run_processes, shm_files, start_processes
from tests.test_sync_multiproc import _sync_group

pytestmark = pytest.mark.multiproc
CPU = detect_device("cpu")


def mixed_sender(port: int, hub: str, versions: int) -> dict:
    model = AwkwardModel(seed=1)
    publisher = Publisher(_sync_group(port, 0, 2), bucket_size=BUCKET_SIZE, ipc_hub_name=hub)
    publisher.attach(publisher.sender.group, ipc_peers={"colocated": 2})
    results, states = [], []
    for version in range(1, versions + 1):
        model.perturb(version)
        result = publisher.publish(version, named_tensors_of(model), mode=mode_of(version % 2 == 0)).result(60)
        results.append((result.ok, result.reason, sorted(result.committed_ranks), result.version_digest))
        states.append(state_bytes(model))
    shm = shm_files()
    publisher.close()
    return {"results": results, "states": states, "shm": shm}


def collective_receiver(port: int) -> dict:
    model = AwkwardModel(seed=7)
    out = []
    rx = Receiver(_sync_group(port, 1, 2), lambda p: (load_into(model, p.tensors), out.append(state_bytes(model))))
    results = rx.serve()
    return {"ok": [r.ok for r in results], "states": out, "digests": [r.version_digest for r in results]}


def colocated_receiver(hub: str, slow_bucket: int | None = None, marker: str | None = None) -> dict:
    model = AwkwardModel(seed=8)
    out = []
    rx = IpcReceiver(hub, "colocated", 2, lambda p: (load_into(model, p.tensors), out.append(state_bytes(model))),
                     device=CPU, timeout_s=20)
    if slow_bucket is not None:  # fault injection: stall inside the version so the parent can kill -9 us
        original = rx.assembler.check_bucket

        def stall(incoming, bucket, expected):
            if bucket.index == slow_bucket:
                Path(marker).touch()
                time.sleep(60)
            return original(incoming, bucket, expected)

        rx.assembler.check_bucket = stall  # type: ignore[method-assign]
    results, shm = [], set()
    while (result := rx.receive(begin_timeout_s=60)) is not None:
        results.append(result)
        shm |= shm_files()
    return {"ok": [r.ok for r in results], "states": out, "digests": [r.version_digest for r in results], "shm": shm}


def test_colocated_and_collective_receivers_get_identical_versions() -> None:
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    sender, remote, local = run_processes([(mixed_sender, (store.port, hub, 3)), (collective_receiver, (store.port,)),
                                           (colocated_receiver, (hub,))], timeout_s=120)
    assert [r[0] for r in sender["results"]] == [True] * 3, sender["results"]
    assert all(r[2] == [1, 2] for r in sender["results"])  # both receivers committed every version
    assert remote["ok"] == local["ok"] == [True] * 3
    assert remote["states"] == local["states"] == sender["states"]  # byte-identical, cached and bypass_cpu
    assert remote["digests"] == local["digests"] == [r[3] for r in sender["results"]]
    assert sender["shm"] == local["shm"] == set()  # memfd slots never appear in /dev/shm


def old_minimal_sender(hub_name: str) -> dict:
    """An older sender speaking the IPC protocol by hand, without any optional field."""
    from ckpt_engine.codec import encode
    from ckpt_engine.plan.hashing import bucket_digests, version_digest
    from ckpt_engine.plan.layout import plan_layout
    from ckpt_engine.plan.tensors import fill_bucket, specs_of
    from ckpt_engine.transport.messages import LayoutMessage, VersionHeader, VersionTrailer

    tensors = {"a": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.bfloat16)}
    layout = plan_layout(specs_of(tensors), bucket_size=64)
    hub = IpcHub(hub_name, CPU)
    slots = hub.ensure_slots(layout.max_bucket_bytes)
    peers, _ = hub.peers({"colocated": 1}, 30)
    chan: FramedSocket = peers[0].channel
    chan.send({"type": "map", "slots": [s.describe() for s in hub.slots]}, [s.fd for s in hub.slots])
    assert chan.recv(10)[0]["type"] == "mapped"
    header = VersionHeader(version=1, mode="cached", digest_algo="xxh3-64", layout_digest=layout.digest,
                           layout=LayoutMessage.of(layout))
    chan.send({"type": "begin", "header": encode(header)})
    digests = []
    for bucket in layout.buckets:
        fill_bucket(slots[bucket.index % 2], bucket.slots, tensors, bucket.nbytes)
        values = bucket_digests(bucket, slots[bucket.index % 2][: bucket.nbytes], "xxh3-64", layout.digest).tolist()
        digests += values
        chan.send({"type": "bucket", "seq": bucket.index, "slot": bucket.index % 2, "index": bucket.index,
                   "digests": values})
        while chan.recv(10)[0]["type"] != "release":
            pass
    chan.send({"type": "end", "trailer": encode(VersionTrailer(
        version=1, version_digest=version_digest("xxh3-64", layout.digest, digests)))})
    ack = chan.recv(10)[0]
    hub.close()
    return {"ack": ack["ack"], "buckets": len(layout.buckets)}


def minimal_receiver(hub: str) -> dict:
    got = {}
    rx = IpcReceiver(hub, "colocated", 1, lambda p: got.update({k: v.clone() for k, v in p.tensors.items()}),
                     device=CPU, timeout_s=20)
    result = rx.receive(30)
    return {"ok": result.ok, "a": got["a"].tolist(), "b": got["b"].float().tolist()}


def test_an_older_sender_without_optional_fields_still_works() -> None:
    assert BucketNotice.model_validate({"seq": 0, "slot": 0, "index": 0, "digests": []}).names is None
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    sender, receiver = run_processes([(old_minimal_sender, (hub,)), (minimal_receiver, (hub,))], timeout_s=60)
    assert sender["buckets"] == 2 and sender["ack"]["ok"]
    assert receiver == {"ok": True, "a": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "b": [[1.0] * 3] * 2}


def test_kill9_of_the_colocated_receiver_mid_version(tmp_path: Path) -> None:
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "stalled"
    ctx = procs_context()
    victim = ctx.Process(target=colocated_receiver, args=(hub, 1, str(marker)), daemon=True)
    victim.start()
    others = start_processes([(mixed_sender, (store.port, hub, 1)), (collective_receiver, (store.port,))])
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the colocated receiver never reached the stall point"
    assert shm_files(victim.pid) == set()  # what it maps mid-version: nothing that could outlive it in /dev/shm
    started = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    sender, remote = others.collect(90)
    victim.join(10)
    ok, reason, committed, _ = sender["results"][0]
    assert not ok and "rank 2" in reason and "dropped" in reason  # only the dead receiver failed
    assert committed == [1] and remote["ok"] == [True]  # the remote receiver still got the whole version
    assert time.monotonic() - started < 30
    assert sender["shm"] == set()


def stalling_sender(hub: str, marker: str) -> None:
    model = AwkwardModel(seed=1)
    publisher = Publisher(device=CPU, bucket_size=BUCKET_SIZE, ipc_hub_name=hub, timeout_s=30)
    publisher.attach(None, ipc_peers={"colocated": 1})

    def stall(k: int, buf: torch.Tensor) -> torch.Tensor:
        if k == 2:
            Path(marker).touch()
            time.sleep(60)
        return buf

    publisher.sender.wire_hook = stall
    publisher.publish(1, named_tensors_of(model)).result(120)


def lone_colocated_receiver(hub: str) -> dict:
    rx = IpcReceiver(hub, "colocated", 1, lambda p: None, device=CPU, timeout_s=30)
    started = time.monotonic()
    result = rx.receive(60)
    return {"result": None if result is None else (result.ok, result.reason), "elapsed": time.monotonic() - started}


def test_kill9_of_the_sender_mid_version_releases_the_receiver(tmp_path: Path) -> None:
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "stalled"
    ctx = procs_context()
    victim = ctx.Process(target=stalling_sender, args=(hub, str(marker)), daemon=True)
    victim.start()
    receiver = start_processes([(lone_colocated_receiver, (hub,))])
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()
    assert shm_files(victim.pid) == set()  # the sender mid-version: its segments are memfds, no /dev/shm file
    os.kill(victim.pid, signal.SIGKILL)
    (rx,) = receiver.collect(60)
    victim.join(10)
    ok, reason = rx["result"]
    assert not ok and "PeerGone" in reason  # told by the dead socket, not after its 30 s timeout
    assert rx["elapsed"] < 25


def test_host_identity_is_stable_in_one_process() -> None:
    assert host_identity() == host_identity() and ":" in host_identity()


def hub_only_sender(hub: str) -> dict:
    publisher = Publisher(device=CPU, bucket_size=BUCKET_SIZE, ipc_hub_name=hub, timeout_s=3)
    publisher.attach(None, ipc_peers={"colocated": 2})
    started = time.monotonic()
    result = publisher.publish(1, named_tensors_of(AwkwardModel(seed=1)), mode="bypass_cpu").result(60)
    return {"ok": result.ok, "reason": result.reason, "elapsed": time.monotonic() - started}


def test_a_receiver_that_stops_releasing_is_timed_out_and_dropped(tmp_path: Path) -> None:
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    ctx = procs_context()
    stalled = ctx.Process(target=colocated_receiver, args=(hub, 0, str(tmp_path / "stalled")), daemon=True)
    stalled.start()
    try:
        (sender,) = run_processes([(hub_only_sender, (hub,))], timeout_s=60)
    finally:
        stalled.kill()
        stalled.join(10)
    assert not sender["ok"] and "dropped" in sender["reason"] and "release" in sender["reason"]
    assert sender["elapsed"] < 30  # bounded by the timeout (3 s, a few times), not by the stalled receiver


def two_version_sender(hub: str) -> list:
    publisher = Publisher(device=CPU, bucket_size=BUCKET_SIZE, ipc_hub_name=hub, timeout_s=20)
    publisher.attach(None, ipc_peers={"colocated": 1})
    model = AwkwardModel(seed=1)
    out = []
    for version in (1, 2, 3):
        publisher.attach(None, ipc_peers={"colocated": 1})  # as the trainer agent does for every version
        out.append(publisher.publish(version, named_tensors_of(model)).result(60).ok)
    publisher.close()
    return out


def reconnecting_receiver(hub: str) -> list:
    results = []
    for _ in range(2):  # a fresh receiver object (e.g. after a restart) knows no layout yet
        rx = IpcReceiver(hub, "colocated", 1, lambda p: None, device=CPU, timeout_s=20)
        results.append(rx.receive(30).ok)
        rx.close()
    rx = IpcReceiver(hub, "colocated", 1, lambda p: None, device=CPU, timeout_s=20)
    results.append(rx.receive(30).ok)
    return results


def test_a_reconnected_colocated_receiver_is_sent_the_layout_again() -> None:
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    sender, receiver = run_processes([(two_version_sender, (hub,)), (reconnecting_receiver, (hub,))], timeout_s=90)
    assert sender == [True, True, True] and receiver == [True, True, True]


def _connect(hub_name: str, agent_id: str) -> FramedSocket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(abstract_address(hub_name))
    channel = FramedSocket(sock)
    channel.send({"type": "hello", "agent_id": agent_id})
    return channel


def test_a_reconnect_during_a_version_keeps_what_the_old_connection_already_sent() -> None:
    # Found by CI: a receiver acked, closed and said hello again before the sender read the ack; the hub
    # closed the old socket under the sender, which failed the version the receiver had applied.
    hub_name = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    hub = IpcHub(hub_name, CPU)
    try:
        first = _connect(hub_name, "colocated")
        (old,), missing = hub.peers({"colocated": 1}, 10)
        assert not missing
        first.send({"type": "ack", "ack": {"version": 1}})
        first.close()
        second = _connect(hub_name, "colocated")
        deadline = time.monotonic() + 10
        while hub.peers({"colocated": 1}, 0)[0][0] is old and time.monotonic() < deadline:
            time.sleep(0.01)
        (new,), _ = hub.peers({"colocated": 1}, 0)
        assert new is not old
        assert old.channel.recv(5)[0] == {"type": "ack", "ack": {"version": 1}}
        hub.release([old, new])
        assert old.channel.sock.fileno() == -1 and new.channel.sock.fileno() != -1
        second.close()
    finally:
        hub.close()


def test_a_receiver_asked_to_abandon_stops_waiting_within_its_begin_timeout() -> None:
    hub_name = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    hub = IpcHub(hub_name, CPU)
    rx = IpcReceiver(hub_name, "colocated", 1, lambda p: None, device=CPU, timeout_s=20)
    try:
        calls = []
        started = time.monotonic()
        quiet = rx.receive(2.0, abandon=lambda: calls.append(1) and None)  # never says why: times out
        waited = time.monotonic() - started
        assert not quiet.ok and "within the timeout" in quiet.reason and len(calls) > 5
        assert waited < 3.5  # the begin timeout once, not once per phase of the wait
        gone = rx.receive(20.0, abandon=lambda: "its daemon is gone")
        assert not gone.ok and "its daemon is gone" in gone.reason and time.monotonic() - started < 5
    finally:
        rx.close()
        hub.close()


# the sender drops a peer that stops releasing after about half of this; the healthy peer waits all of it for
# its next bucket: on a loaded machine too, seconds of margin
PEER_TIMEOUT_S = 10.0


def two_peer_sender(hub: str) -> dict:
    publisher = Publisher(device=CPU, bucket_size=BUCKET_SIZE, ipc_hub_name=hub, timeout_s=PEER_TIMEOUT_S)
    publisher.attach(None, ipc_peers={"healthy": 1, "silent": 2})
    started = time.monotonic()
    result = publisher.publish(1, named_tensors_of(AwkwardModel(seed=1)), mode="bypass_cpu").result(60)
    return {"acks": {a.rank: (a.ok, a.reason) for a in result.receivers}, "elapsed": time.monotonic() - started,
            "buckets": result.buckets}


def healthy_colocated(hub: str) -> dict:
    rx = IpcReceiver(hub, "healthy", 1, lambda p: None, device=CPU, timeout_s=PEER_TIMEOUT_S)
    result = rx.receive(30)
    return {"ok": result.ok, "reason": result.reason}


def silent_colocated(hub: str, stop_file: str) -> dict:
    """Maps the slots and takes the version's start, then stops reading inside the first bucket (an engine
    that hung) until the test ends."""
    rx = IpcReceiver(hub, "silent", 2, lambda p: None, device=CPU, timeout_s=PEER_TIMEOUT_S)

    def hang(incoming, bucket, expected):
        while not os.path.exists(stop_file):
            time.sleep(0.05)
        raise RuntimeError("test over")

    rx.assembler.check_bucket = hang  # type: ignore[method-assign]
    try:
        rx.receive(begin_timeout_s=30)
    except RuntimeError:
        pass
    rx.close()
    return {}


def test_a_silent_colocated_receiver_fails_only_itself(tmp_path: Path) -> None:
    """The sender drops a peer that stopped releasing slots well before the healthy peers' own wait for the
    next bucket runs out (both use the same timeout), so they finish the version."""
    hub, stop = f"ckpt-test-{uuid.uuid4().hex[:8]}", tmp_path / "stop"
    silent = start_processes([(silent_colocated, (hub, str(stop)))])
    try:
        healthy, sender = start_processes([(healthy_colocated, (hub,)), (two_peer_sender, (hub,))]).collect(90)
    finally:
        stop.touch()
        silent.collect(30)
    assert sender["buckets"] > 2  # slots get reused, so releases are waited for
    assert healthy["ok"], healthy
    assert sender["acks"][1][0] and not sender["acks"][2][0] and "release" in sender["acks"][2][1]
    # about half the timeout for the silent one, not a timeout per peer (twice the timeout)
    assert sender["elapsed"] < 1.5 * PEER_TIMEOUT_S


def growing_sender(hub: str) -> dict:
    model = AwkwardModel(seed=1)
    publisher = Publisher(device=CPU, bucket_size=1 << 22, ipc_hub_name=hub, timeout_s=30)
    publisher.attach(None, ipc_peers={"colocated": 1})
    grown = torch.zeros(1 << 18)  # 1 MiB: the one bucket, and so the slots, grow when it joins
    out: dict = {"ok": [], "sizes": {}, "hub": {}, "mapped": {}}
    for version in range(1, 7):
        named = named_tensors_of(model)
        if version > 3:
            named.tensors["grown"] = grown
        result = publisher.publish(version, named, mode=mode_of(version % 2 == 0)).result(60)
        out["ok"].append(result.ok)
        slots = publisher.hub.slots  # type: ignore[union-attr]
        out["sizes"][version] = [s.nbytes for s in slots]
        out["hub"][version] = {str(os.fstat(s.fd).st_ino) for s in slots if s.fd is not None}
        out["mapped"][version] = _slot_inodes()
    publisher.close()
    return out


def _slot_inodes() -> set[str]:
    """The inodes of the memfd segments this process maps (the hub's slots and the cache's shareable segments; one
    per segment, however many views of it exist)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[4] for line in maps if "memfd:ckpt-engine-slot" in line}


def counting_receiver(hub: str) -> dict:
    names: list[list[str]] = []
    rx = IpcReceiver(hub, "colocated", 1, lambda p: names.append(sorted(p.tensors)), device=CPU, timeout_s=20)
    results = []
    while (result := rx.receive(begin_timeout_s=30)) is not None:
        results.append(result.ok)
    return {"ok": results, "names": names}


def test_slots_replaced_by_larger_ones_are_unmapped_by_the_sender() -> None:
    """Regression (GPU run of 2026-11-27: a replaced CUDA slot stayed allocated): the views a fill keeps into a
    slot must not outlive the slot, or the sender keeps every slot it ever had."""
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    sender, receiver = run_processes([(growing_sender, (hub,)), (counting_receiver, (hub,))], timeout_s=120)
    assert sender["ok"] == [True] * 6 and receiver["ok"] == [True] * 6
    assert all("grown" in names for names in receiver["names"][3:])
    assert sender["sizes"][6][0] > sender["sizes"][3][0]  # the slots grew
    old, new = sender["hub"][3], sender["hub"][6]
    assert len(old) == len(new) == 2 and not old & new
    assert old <= sender["mapped"][3] and new <= sender["mapped"][6]
    assert not old & sender["mapped"][6], sender  # the old slots are no longer mapped


def route_changing_sender(port: int, hub: str) -> list:
    """The owners_change chaos trial's sequence: a layout over the same-host path, another layout over the
    sync group (another route: e.g. two owners), then the first layout over the same-host path again."""
    group = _sync_group(port, 0, 2)
    publisher = Publisher(device=CPU, bucket_size=BUCKET_SIZE, ipc_hub_name=hub, timeout_s=20)
    model = AwkwardModel(seed=1)
    whole = named_tensors_of(model)
    part = dict(list(whole.tensors.items())[:2])
    out = []
    for version, route, named in ((1, "ipc", whole), (2, "group", part), (3, "ipc", whole)):
        if route == "ipc":
            publisher.attach(None, ipc_peers={"colocated": 1})
        else:
            publisher.attach(group)
        result = publisher.publish(version, named).result(60)
        out.append((result.ok, result.reason))
    publisher.close()
    group.close()
    return out


def both_ways_receiver(port: int, hub: str) -> list:
    """One assembler for both paths, as a rollout agent has (it knows the newest layout it was sent)."""
    from ckpt_engine.receive.assembly import VersionAssembler

    assembler = VersionAssembler(CPU, lambda p: None)
    collective = Receiver(_sync_group(port, 1, 2), lambda p: None, assembler=assembler)  # (the sender waits)
    ipc = IpcReceiver(hub, "colocated", 1, lambda p: None, device=CPU, timeout_s=20, assembler=assembler)
    out = []
    for receiver in (ipc, collective, ipc):
        result = receiver.receive(60)
        out.append((result.ok, result.reason) if result is not None else None)
    ipc.close()
    return out


def test_a_receiver_sent_another_layout_by_another_route_is_sent_the_layout_again() -> None:
    # Found by the chaos run (owners_change): the hub remembered the layout a colocated receiver was sent
    # before it got versions over the sync group; back on the same-host path it was sent only the digest.
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    sender, receiver = run_processes([(route_changing_sender, (store.port, hub)),
                                      (both_ways_receiver, (store.port, hub))], timeout_s=120)
    assert [ok for ok, _ in sender] == [True, True, True], sender
    assert [r and r[0] for r in receiver] == [True, True, True], receiver


def plain_and_sharded_sender(hub: str, steps: list) -> list:
    """One publisher sending one colocated receiver plain versions and sharded ones (the class of whole
    tensors, or a TP rank's class), as the trainer agent routes them."""
    from ckpt_engine.plan.shards import spec_key
    from ckpt_engine.send.class_senders import Lane
    from ckpt_engine.send.publisher import Route
    from tests.test_shard_delivery import model, spec

    peers = {"colocated": 1}
    publisher = Publisher(device=CPU, bucket_size=256, ipc_hub_name=hub, timeout_s=20)
    out = []
    for version, step in enumerate(steps, start=1):
        if step == "plain":
            route = Route(None, dict(peers), None)
        else:
            key, shard = ("whole", {}) if step == "whole" else (spec_key(spec(step)), spec(step))
            route = Route(None, {}, None, (Lane(key, shard, None, (1,), ipc_peers=dict(peers)),))
        result = publisher.publish(version, model(1), sharded=step != "plain", route=lambda r=route: r).result(60)
        out.append((result.ok, result.reason))
    publisher.close()
    return out


def steady_receiver(hub: str, versions: int) -> list:
    rx = IpcReceiver(hub, "colocated", 1, lambda p: None, device=CPU, timeout_s=20)
    out = []
    for _ in range(versions):
        result = rx.receive(60)
        out.append(None if result is None else (result.ok, result.reason))
    rx.close()
    return out


@pytest.mark.parametrize("steps", [["whole", "plain", "whole", "plain"], ["plain", 0, "plain", 0]])
def test_a_receiver_moving_between_plain_and_sharded_versions_is_sent_the_layout_it_lacks(steps: list) -> None:
    # Found by the outside attack of 2026-11-28: the plain sender and the class senders each remembered what
    # the receiver was sent last, and each sent only the digest of a layout the other had since replaced.
    hub = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    sender, receiver = run_processes([(plain_and_sharded_sender, (hub, steps)), (steady_receiver, (hub, len(steps)))],
                                     timeout_s=150)
    assert [ok for ok, _ in sender] == [True] * len(steps), sender
    assert [r and r[0] for r in receiver] == [True] * len(steps), receiver
