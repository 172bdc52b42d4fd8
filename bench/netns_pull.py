"""Pull vs push on the network-namespace cluster of :mod:`ckpt_engine.bench.netns_bench`: the ``nixl`` transport.

    ckpt-engine bench --only netns      (its pull rows; as root, with NIXL installed)

Each owner (a trainer rank, on a link of its own) snapshots its share of each version into its cache and offers
it as the trainer agent does (workers/pull_server.py: with several owners each offers its share and the lead the
descriptors; sharded, one descriptor per class, whose digests its pieces' send computed). Every receiver joins
the owners' offers as the daemon does (server/decisions/assignments.py), reads its descriptor, then its buckets
(or, sharded, exactly its pieces: row ranges out of each owner's share, column ranges from what its send kept)
over NIXL (UCX over TCP on the node's
rate-limited link: ``UCX_TLS=tcp`` and the node's one veth, so that UCX's shared-memory transports, which would
cross namespaces on one machine, are not used), verifies each and reports. The offers and the receivers'
outcomes meet through files in a folder of the bench's own (the daemon's control plane carries them in
production; its cost is not what this measures). Time: from the publish to every receiver verified (snapshot,
digests and the pulls), as the push rows measure from the publish to every ack.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckpt_engine.bench.netns_cluster import MiB, cluster, finish, group_at, llama_model, tp_spec

_WAIT_S = 120.0
# How often the bench's stand-in for the daemon's control plane (files in a folder) is looked at: its cost is
# not what the pulled rows measure, so it is looked at often (a few stat calls a millisecond: no core's worth).
_POLL_S = 0.0005


def _wait_for(path: Path, timeout_s: float = _WAIT_S) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(_POLL_S)
    return path.read_bytes()


def _wait_until(done: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never came")
        time.sleep(0.001)


def _publish_atomically(path: Path, data: bytes) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_bytes(data)
    staged.rename(path)


def _use_the_link() -> None:
    """UCX over TCP on this namespace's one link (before NIXL starts)."""
    links = [name for name in os.listdir("/sys/class/net") if name != "lo"]
    os.environ["UCX_TLS"] = "tcp"
    if links:
        os.environ["UCX_NET_DEVICES"] = links[0]


def _route(cfg: dict, store: tuple[str, int] | None, named: Any) -> tuple[Any, dict]:
    """This owner's route for versions only pullers take (no group with any receiver): with several owners
    their owners' group (one per class, sharded), and publish's options."""
    from ckpt_engine.plan.shards import spec_key
    from ckpt_engine.send.class_senders import Lane
    from ckpt_engine.send.publisher import Ownership, Route

    owner, owners, timeout = cfg["owner"], cfg["owners"], cfg["timeout_s"]

    def owners_group(name: str) -> Any:
        if store is None:  # (one owner)
            return None
        return group_at(cfg["addr"], store, name, owner, owners, timeout, part="owners/")

    ownership = {"ownership": Ownership(owner, owners), "pulled": True}
    if cfg["sharded"]:
        tp = cfg["receivers"]
        lanes = tuple(Lane(spec_key(tp_spec(named, r, tp)), tp_spec(named, r, tp), None, (), owners_group(f"g{r}"),
                           pulls=True) for r in range(tp))
        return Route(None, {}, None, lanes), {"sharded": True, **ownership}
    return Route(None, {}, owners_group("g0")), ownership


def _offering(pub: Any, pulls: Any, cfg: dict, route: Any, version: int, marks: dict[str, Any]) -> Any:
    """What offers ``version`` (as the trainer agent: called by the publisher before its send starts), noting in
    ``marks`` when it was cached, offered, or why it failed."""
    from ckpt_engine.codec import encode

    def offer() -> None:
        marks["cached"] = time.perf_counter()
        try:
            pulls.release(before=version)
            plans = None
            if cfg["sharded"]:
                with pub.cache.lease(version) as cached:
                    plans = pub.classes.wire_plans(cached, {lane.key: lane.spec for lane in route.lanes})
            offered = pulls.offer(pub.cache, version, None, pub.device.digest_algo, cfg["timeout_s"],
                                  pub.own_digests, rank=cfg["owner"], plans=plans, pieces=pub.classes.kept)
            _publish_atomically(Path(cfg["folder"]) / f"offer-{version}-{cfg['owner']}", encode(offered))
        except BaseException as exc:
            marks["failed"] = exc
            raise
        marks["offered"] = time.perf_counter()

    return offer


def run_owner(cfg: dict) -> dict:
    """An owner (a trainer rank): it caches its share of each version (every piece digested, for a sharded
    version class by class) and offers it, the lead with the descriptors."""
    _use_the_link()
    from ckpt_engine.device import detect_device
    from ckpt_engine.send.publisher import Publisher
    from ckpt_engine.transport.group import open_store
    from ckpt_engine.workers.pull_server import PullServer

    folder, receivers, owner = Path(cfg["folder"]), cfg["receivers"], cfg["owner"]
    store = None
    if cfg["owners"] > 1 and owner == 0:
        master = open_store(cfg["addr"], 0, is_master=True, timeout_s=cfg["timeout_s"])
        _publish_atomically(folder / "store", json.dumps([cfg["addr"], master.port]).encode())
        store = (cfg["addr"], master.port)
    elif cfg["owners"] > 1:
        store = tuple(json.loads(_wait_for(folder / "store")))
    named = llama_model(cfg["mib"], cfg["tp_max"])
    route, options = _route(cfg, store, named)
    device = detect_device("cpu")
    pub = Publisher(device=device, bucket_size=cfg["bucket_mib"] * MiB, keep_versions=2)
    pulls = PullServer()
    times, stages = [], []
    for version in range(1, cfg["rounds"] + 2):  # the first is a warm-up
        named.tensors[next(iter(named.tensors))].add_(1.0)
        t0, cpu0 = time.perf_counter(), time.process_time()
        marks: dict[str, Any] = {}
        offer = _offering(pub, pulls, cfg, route, version, marks)
        transfer = pub.publish(version, named, route=lambda: route, before_send=offer, **options)
        _wait_until(lambda m=marks: "offered" in m or "failed" in m, cfg["timeout_s"], f"version {version}'s offer")
        if "failed" in marks:
            raise RuntimeError(f"version {version} could not be offered: {marks['failed']!r}")
        cached_at, offered = marks["cached"], marks["offered"]
        _wait_until(lambda v=version: pulls.posted(v), cfg["timeout_s"], "the owner's digests")
        posted = time.perf_counter()
        result = transfer.result(timeout_s=cfg["timeout_s"])
        if not result.ok:
            raise RuntimeError(f"version {version}: {result.reason}")
        outcomes = [json.loads(_wait_for(folder / f"done-{version}-{r}")) for r in range(receivers)]
        ended = time.perf_counter()
        if not all(o["ok"] for o in outcomes):
            raise RuntimeError(f"version {version}: {[o['reason'] for o in outcomes]}")
        if version > 1:
            times.append(ended - t0)
            stages.append({"snapshot": cached_at - t0, "offer": offered - cached_at, "digests": posted - offered,
                           "pulls": ended - offered,
                           "owner_cpu": time.process_time() - cpu0})
    pulls.close()
    pub.close()
    return {"seconds": times, "raw_seconds": [], "bytes_sent": [0] * len(times), "stages": stages,
            "model_bytes": sum(t.numel() * t.element_size() for t in named.tensors.values())}


def run_puller(cfg: dict) -> dict:
    """A receiver: it joins the owners' offers as the daemon does (its class's descriptor, sharded) and pulls."""
    _use_the_link()
    from ckpt_engine.codec import decode
    from ckpt_engine.device import detect_device
    from ckpt_engine.plan.shards import spec_key
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.pulled import pull
    from ckpt_engine.server.decisions.assignments import joined_offer, pull_assignments
    from ckpt_engine.transport.messages import PullOffer
    from ckpt_engine.transport.nixl import NixlEndpoint

    folder, rank, owners = Path(cfg["folder"]), cfg["rank"], cfg["owners"]
    key = spec_key(tp_spec(llama_model(cfg["mib"], cfg["tp_max"]), rank, cfg["receivers"])) if cfg["sharded"] else None
    assembler = VersionAssembler(detect_device("cpu"), lambda payload: None, staging="device")
    endpoint = NixlEndpoint("receiver")
    received, cpu = [], []
    for version in range(1, cfg["rounds"] + 2):
        cpu0 = time.process_time()  # (from the previous version's end: waiting for the offer included)
        offers = {o: decode(PullOffer, _wait_for(folder / f"offer-{version}-{o}")) for o in range(owners)}
        joined = joined_offer(version, owners, offers)
        [(_, assignment)] = pull_assignments(version, "cached", None, {"me": 1}, joined,  # type: ignore[arg-type]
                                             {"me": key} if key is not None else None)
        result = pull(assembler, endpoint, assignment.offer, cfg["timeout_s"])  # type: ignore[arg-type]
        _publish_atomically(folder / f"done-{version}-{rank}",
                            json.dumps({"ok": result.ok, "reason": result.reason}).encode())
        received.append(result.bytes_received)
        cpu.append(time.process_time() - cpu0)
    endpoint.close()
    return {"bytes_received": received[1:], "cpu_s": cpu[1:]}


def scenario(name: str, receivers: int, args: dict, *, sharded: bool = False, owners: int = 1) -> dict:
    """``receivers`` pull every version from ``owners`` owners (each on its own link): whole, or each receiver
    TP rank r of ``receivers`` and its own class (sharded)."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="ckpt-netns-pull-") as folder, \
            cluster(owners + receivers, args["rate_mbit"]) as nodes:
        base = {"mib": args["mib"], "tp_max": 4, "rounds": args["rounds"], "bucket_mib": args["bucket_mib"],
                "timeout_s": args["timeout"], "folder": folder, "receivers": receivers, "owners": owners,
                "sharded": sharded}

        def spawn(ns: str, role: str, cfg: dict) -> subprocess.Popen:
            return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "ckpt_engine.bench.netns_pull",
                                     role, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        serving = [spawn(ns, "owner", base | {"owner": o, "addr": addr}) for o, (ns, addr) in enumerate(nodes[:owners])]
        pullers = [spawn(ns, "puller", base | {"rank": r}) for r, (ns, _) in enumerate(nodes[owners:])]
        try:
            outs = [finish(p, args["timeout"] * 8) for p in pullers]
            finished = [finish(p, args["timeout"] * 8) for p in serving]
            sent = finished[0]  # the lead's: until every receiver is done
        finally:
            for proc in [*serving, *pullers]:
                proc.kill()
    for stage, cpu in zip(sent["stages"], zip(*(o["cpu_s"] for o in outs), strict=True), strict=True):
        stage["puller_cpu"] = max(cpu)  # (the busiest puller's)
    return {"name": name, "receivers": receivers, "sharded": sharded, "owners": owners, "mode": "cached",
            "pull": True, **sent, "received": [o["bytes_received"] for o in outs]}


def main(argv: list[str] | None = None) -> int:
    role, config = (argv if argv is not None else sys.argv[1:])[:2]
    cfg: dict[str, Any] = json.loads(config)
    print(json.dumps(run_owner(cfg) if role == "owner" else run_puller(cfg)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
