"""The network-namespace cluster the netns benchmarks run on (:mod:`ckpt_engine.bench.netns_bench`, its pulled
rows in :mod:`ckpt_engine.bench.netns_pull`): namespaces linked through a bridge by rate-limited veths, the model
they move, and how a bench process's result comes back. Only addresses inside the namespaces made here are used
(10.213.0.0/24); every namespace is removed when it ends."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

SUBNET = "10.213.0"
MiB = 1 << 20


def cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def cluster(nodes: int, rate_mbit: int) -> Iterator[list[tuple[str, str]]]:
    """``nodes`` namespaces, each (name, address), linked through a bridge by rate-limited veths; removed on
    exit."""
    tag = uuid.uuid4().hex[:5]
    hub = f"ckb{tag}h"
    made: list[str] = []
    try:
        _sh("ip", "netns", "add", hub)
        made.append(hub)
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        out = []
        for i in range(nodes):
            ns, addr = f"ckb{tag}n{i}", f"{SUBNET}.{i + 1}"
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            a, b = f"ckb{tag}{i}a", f"ckb{tag}{i}b"
            _sh("ip", "link", "add", a, "netns", ns, "type", "veth", "peer", "name", b, "netns", hub)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", a)
            _sh("ip", "-n", ns, "link", "set", a, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", hub, "link", "set", b, "master", "br0")
            _sh("ip", "-n", hub, "link", "set", b, "up")
            for where, dev in ((ns, a), (hub, b)):  # both directions of the node's link
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                    f"{rate_mbit}mbit", "burst", "256kb", "latency", "100ms")
            out.append((ns, addr))
        yield out
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


# ---- the model ---------------------------------------------------------------------------------------------
def model_shapes(mib: int, tp_max: int) -> dict[str, tuple[int, ...]]:
    """Float32 Llama-style tensors of about ``mib`` MiB; every split dim divides by ``tp_max``."""
    hidden = 512
    layers = max(1, mib * MiB // 4 // (hidden * hidden * 16))  # q, k, v, o: 4 h²; gate, up, down: 12 h²
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (8 * tp_max * 16, hidden)}
    for layer in range(layers):
        p = f"layers.{layer}."
        for name, shape in (("q_proj", (hidden, hidden)), ("k_proj", (hidden, hidden)), ("v_proj", (hidden, hidden)),
                            ("o_proj", (hidden, hidden)), ("gate_proj", (4 * hidden, hidden)),
                            ("up_proj", (4 * hidden, hidden)), ("down_proj", (hidden, 4 * hidden))):
            shapes[p + name + ".weight"] = shape
        shapes[p + "norm.weight"] = (hidden,)
    return shapes


def llama_model(mib: int, tp_max: int) -> Any:
    import torch

    from ckpt_engine.plan.tensors import NamedTensors

    gen = torch.Generator().manual_seed(0)
    return NamedTensors({name: torch.randn(*shape, generator=gen)
                         for name, shape in model_shapes(mib, tp_max).items()})


def finish(proc: subprocess.Popen, timeout_s: float) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError("a bench process did not finish in time") from None
    if proc.returncode != 0:
        raise RuntimeError(f"a bench process failed ({proc.returncode}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def tp_spec(named: Any, rank: int, tp: int) -> dict:
    """TP rank ``rank``'s ranges: rows of column-parallel weights and the vocabulary, columns of row-parallel."""
    from ckpt_engine.plan.shards import even_split

    spec = {}
    for name, t in named.tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                          "embed.weight")):
            spec[name] = (even_split(0, t.shape[0], tp, rank),)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            spec[name] = (even_split(1, t.shape[1], tp, rank),)
    return spec


def group_at(addr: str, store: tuple[str, int], name: str, rank: int, world: int, timeout_s: float,
           part: str = "") -> Any:
    """A sync group bound to this namespace's address, its store at ``store``."""
    from ckpt_engine.device import detect_device
    from ckpt_engine.transport.group import SyncGroup, open_store

    return SyncGroup(open_store(store[0], store[1], timeout_s=timeout_s), name=name, generation=0, rank=rank,
                     world_size=world, device=detect_device("cpu"), timeout_s=timeout_s, bind_host=addr, part=part)
