"""A class's pieces through the real send and receive path (gloo, real processes): each receiver gets exactly
its class's bytes, verified, and can put them back at their places in the full tensors; cut from the cache,
and with bypass_cpu from the live tensors (tensors larger than a bucket assembled whole first)."""

from __future__ import annotations

import torch

from ckpt_engine.device import detect_device
from ckpt_engine.plan.shards import Slice, spec_key
from ckpt_engine.plan.tensors import NamedTensors
from ckpt_engine.receive.collective import Receiver, VersionPayload
from ckpt_engine.send.class_senders import Lane
from ckpt_engine.send.publisher import Publisher, Route
from ckpt_engine.transport.group import SyncGroup, open_store
from tests.procs import run_processes

HOST = "127.0.0.1"
TIMEOUT_S = 20.0


def model(version: int, o_from: int | None = None) -> NamedTensors:
    """Weights of seed ``version``; ``o_from``: only o.weight from that seed instead."""
    gen = torch.Generator().manual_seed(version)
    tensors = {"qkv.weight": torch.randn(12, 8, generator=gen), "o.weight": torch.randn(8, 8, generator=gen),
               "emb.weight": torch.randn(20, 8, generator=gen).to(torch.bfloat16),
               "norm.weight": torch.randn(8, generator=gen), "step": torch.tensor(version)}
    if o_from is not None:
        tensors["o.weight"] = model(o_from).tensors["o.weight"]
    return NamedTensors(tensors, {"lm_head.weight": "emb.weight"})


def spec(rank: int) -> dict[str, tuple[Slice, ...]]:
    """TP rank ``rank`` of 2: rows of q (0-3 / 4-7) and its kv rows (8-9 / 10-11) of a fused qkv; columns of o."""
    return {"qkv.weight": (Slice(0, 4 * rank, 4), Slice(0, 8 + 2 * rank, 2)), "o.weight": (Slice(1, 4 * rank, 4),),
            "emb.weight": (Slice(0, 10 * rank, 10),)}


def group(port: int, rank: int) -> SyncGroup:
    return SyncGroup(open_store(HOST, port, timeout_s=TIMEOUT_S), name="shards", generation=0, rank=rank,
                     world_size=2, device=detect_device("cpu"), timeout_s=TIMEOUT_S, bind_host=HOST)


# (version, mode, the weights it sends (seed, o.weight's seed), sparse base): bypass_cpu sends version 1's weights
# again, then new ones; version 5 changes only o.weight and goes sparse against 4; version 6 is 5 in full
VERSIONS = ((1, "cached", (1, None), None), (2, "bypass_cpu", (1, None), None), (3, "bypass_cpu", (3, None), None),
            (4, "cached", (4, None), None), (5, "cached", (4, 5), 4), (6, "cached", (4, 5), None),
            (7, "cached", (4, 5), 6))  # nothing changed: no piece goes, the version still commits


def sender(port: int, rank: int) -> list:
    """The trainer's path of a sharded version: cached, then the class's pieces cut from the cache; bypass_cpu,
    cut from the live tensors (buckets of 256 bytes: qkv and emb are larger)."""
    publisher = Publisher(device=detect_device("cpu"), bucket_size=256)
    route = Route(None, {}, None, (Lane(spec_key(spec(rank)), spec(rank), group(port, 0), (1,)),))
    out = []
    for version, mode, weights, base in VERSIONS:
        result = publisher.publish(version, model(*weights), mode=mode, sharded=True, sparse_base=base,
                                   route=lambda: route).result(timeout_s=60)
        out.append((result.ok, result.reason, result.classes, result.version_digest,
                    (result.version_bytes, result.tensors, result.tensors_skipped)))
    publisher.close()
    return out


def receiver(port: int, rank: int) -> dict:
    got: dict[int, dict[str, list]] = {}

    def load(payload: VersionPayload) -> None:  # as plain lists: tensors would not outlive this process
        got[payload.version] = {name: t.float().tolist() for name, t in payload.tensors.items()}
        got[payload.version]["bytes"] = sum(t.numel() * t.element_size() for name, t in payload.tensors.items()
                                            if name not in payload.aliases)

    results = Receiver(group(port, 1), load).serve()
    return {"ok": [r.ok for r in results], "got": got}


def test_each_class_receives_exactly_its_ranges_verified() -> None:
    for rank in (0, 1):
        store = open_store(HOST, 0, is_master=True, timeout_s=10)
        sent, received = run_processes([(sender, (store.port, rank)), (receiver, (store.port, rank))],
                                       timeout_s=120)
        assert received["ok"] == [True] * len(VERSIONS)
        identities = [digest for *_, digest, _ in sent]  # of the full tensors, cached or gathered: one for one weights
        assert identities[0] == identities[1] != identities[2] and identities[2] is not None
        assert identities[4] == identities[5]
        class_digests = [classes[0]["version_digest"] for _, _, classes, _, _ in sent]
        counts = [count for *_, count in sent]  # the record's: bytes and tensors sent, tensors left out
        assert counts[4] == (8 * 8 * 4, 1, 4) and counts[6] == (0, 0, 5), counts  # o.weight only; nothing
        assert class_digests[4] == class_digests[5] == class_digests[6] != class_digests[3]  # sparse or whole
        assert set(received["got"][7]) == {"bytes"} and received["got"][7]["bytes"] == 0
        sparse = received["got"][5]
        assert set(sparse) - {"bytes"} == {f"o.weight@1:{4 * rank}:4"}  # only the piece that changed came
        whole_of = {}
        for (ok, reason, classes, _, _), (version, _, weights, base) in zip(sent, VERSIONS):
            assert ok, reason
            assert [c["ok"] for c in classes] == [True]
            full = model(*weights).tensors
            total = sum(t.numel() * t.element_size() for t in full.values())
            class_bytes = received["got"][version].pop("bytes")
            assert class_bytes < 0.6 * total  # (the norm and the step go whole to every rank)
            pieces = {**whole_of.get(base, {}),
                      **{name: torch.tensor(values) for name, values in received["got"][version].items()}}
            whole_of[version] = pieces
            full = {name: t.float() for name, t in full.items()}
            q, kv = spec(rank)["qkv.weight"]
            assert torch.equal(pieces[f"qkv.weight@0:{q.start}:4"], full["qkv.weight"][q.start:q.end])
            assert torch.equal(pieces[f"qkv.weight@0:{kv.start}:2"], full["qkv.weight"][kv.start:kv.end])
            assert torch.equal(pieces[f"o.weight@1:{4 * rank}:4"], full["o.weight"][:, 4 * rank:4 * rank + 4])
            assert torch.equal(pieces[f"emb.weight@0:{10 * rank}:10"], full["emb.weight"][10 * rank:10 * rank + 10])
            assert torch.equal(pieces[f"lm_head.weight@0:{10 * rank}:10"], pieces[f"emb.weight@0:{10 * rank}:10"])
            assert torch.equal(pieces["norm.weight"], full["norm.weight"]) and int(pieces["step"]) == weights[0]
