"""Pull vs push on the network-namespace cluster of :mod:`ckpt_engine.bench.netns_bench`: the ``nixl`` transport.

    ckpt-engine bench --only netns      (its pull rows; as root, with NIXL installed)

The owner (a trainer rank) snapshots each version into its cache and offers it as the trainer agent does
(workers/pull_server.py); every receiver reads the offer's descriptor and then the buckets over NIXL (UCX over TCP
on the node's rate-limited link: ``UCX_TLS=tcp`` and the node's one veth, so that UCX's shared-memory transports,
which would cross namespaces on one machine, are not used), verifies each and reports. The offers and the
receivers' outcomes meet through files in a folder of the bench's own (the daemon's control plane carries them in
production; its cost is not what this measures). Time: from the publish to every receiver verified (snapshot,
the offer's digests and the pulls), as the push rows measure from the publish to every ack.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckpt_engine.bench.netns_cluster import MiB, cluster, finish, llama_model

_WAIT_S = 120.0


def _wait_for(path: Path, timeout_s: float = _WAIT_S) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.002)
    return path.read_bytes()


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


def run_owner(cfg: dict) -> dict:
    _use_the_link()
    from ckpt_engine.codec import encode
    from ckpt_engine.device import detect_device
    from ckpt_engine.send.publisher import Publisher, Route
    from ckpt_engine.workers.pull_server import PullServer

    folder, receivers = Path(cfg["folder"]), cfg["receivers"]
    named = llama_model(cfg["mib"], cfg["tp_max"])
    device = detect_device("cpu")
    pub = Publisher(device=device, bucket_size=cfg["bucket_mib"] * MiB, keep_versions=2)
    pulls = PullServer()
    times = []
    for version in range(1, cfg["rounds"] + 2):  # the first is a warm-up
        named.tensors[next(iter(named.tensors))].add_(1.0)
        t0 = time.perf_counter()
        result = pub.publish(version, named, route=lambda: Route(None, {}, None)).result(timeout_s=cfg["timeout_s"])
        if not result.ok:
            raise RuntimeError(f"version {version}: {result.reason}")
        pulls.release(before=version)
        offer = pulls.offer(pub.cache, version, None, device.digest_algo, cfg["timeout_s"])
        _publish_atomically(folder / f"offer-{version}", encode(offer))
        outcomes = [json.loads(_wait_for(folder / f"done-{version}-{r}")) for r in range(receivers)]
        elapsed = time.perf_counter() - t0
        if not all(o["ok"] for o in outcomes):
            raise RuntimeError(f"version {version}: {[o['reason'] for o in outcomes]}")
        if version > 1:
            times.append(elapsed)
    pulls.close()
    pub.close()
    return {"seconds": times, "raw_seconds": [], "bytes_sent": [0] * len(times),
            "model_bytes": sum(t.numel() * t.element_size() for t in named.tensors.values())}


def run_puller(cfg: dict) -> dict:
    _use_the_link()
    from ckpt_engine.codec import decode
    from ckpt_engine.device import detect_device
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.pulled import pull
    from ckpt_engine.transport.messages import PullOffer
    from ckpt_engine.transport.nixl import NixlEndpoint

    folder, rank = Path(cfg["folder"]), cfg["rank"]
    assembler = VersionAssembler(detect_device("cpu"), lambda payload: None, staging="device")
    endpoint = NixlEndpoint("receiver")
    received = []
    for version in range(1, cfg["rounds"] + 2):
        offer = decode(PullOffer, _wait_for(folder / f"offer-{version}"))
        result = pull(assembler, endpoint, offer, cfg["timeout_s"])
        _publish_atomically(folder / f"done-{version}-{rank}",
                            json.dumps({"ok": result.ok, "reason": result.reason}).encode())
        received.append(result.bytes_received)
    endpoint.close()
    return {"bytes_received": received[1:]}


def scenario(name: str, receivers: int, args: dict) -> dict:
    """``receivers`` pull every version from one owner, each on its own link."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="ckpt-netns-pull-") as folder, \
            cluster(1 + receivers, args["rate_mbit"]) as nodes:
        base = {"mib": args["mib"], "tp_max": 4, "rounds": args["rounds"], "bucket_mib": args["bucket_mib"],
                "timeout_s": args["timeout"], "folder": folder, "receivers": receivers}

        def spawn(ns: str, role: str, cfg: dict) -> subprocess.Popen:
            return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "ckpt_engine.bench.netns_pull",
                                     role, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        owner = spawn(nodes[0][0], "owner", base)
        pullers = [spawn(ns, "puller", base | {"rank": r}) for r, (ns, _) in enumerate(nodes[1:])]
        try:
            outs = [finish(p, args["timeout"] * 8) for p in pullers]
            sent = finish(owner, args["timeout"] * 8)
        finally:
            for proc in [owner, *pullers]:
                proc.kill()
    return {"name": name, "receivers": receivers, "sharded": False, "owners": 1, "mode": "cached", "pull": True,
            **sent, "received": [o["bytes_received"] for o in outs]}


def main(argv: list[str] | None = None) -> int:
    role, config = (argv if argv is not None else sys.argv[1:])[:2]
    cfg: dict[str, Any] = json.loads(config)
    print(json.dumps(run_owner(cfg) if role == "owner" else run_puller(cfg)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
