"""The network-bound bench's own wiring (bench/netns_bench.py): its namespaces and links are made and removed, and
a sharded scenario moves each receiver's share over them. Figures are the bench's, not asserted here."""

from __future__ import annotations

import subprocess

import pytest

from ckpt_engine.bench import netns_bench

pytestmark = pytest.mark.skipif(netns_bench.cannot_run() is not None, reason=str(netns_bench.cannot_run()))


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_the_cluster_links_its_namespaces_and_removes_them() -> None:
    with netns_bench.cluster(2, 100) as nodes:
        names = {ns for ns, _ in nodes}
        assert names <= _namespaces()
        ns, _ = nodes[0]
        qdisc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"], capture_output=True, text=True,
                               timeout=30).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
    assert not names & _namespaces()


def test_a_sharded_scenario_sends_each_receiver_its_share() -> None:
    """(bypass_cpu: the cached sharded path runs in the owners' scenario below)"""
    args = {"rate_mbit": 400, "mib": 1, "bucket_mib": 8, "rounds": 1, "tp": [2], "raw": False, "timeout": 30.0}
    result = netns_bench.scenario("sharded, TP=2, bypass_cpu", 2, True, args, mode="bypass_cpu")
    model = result["model_bytes"]
    for received in result["received"]:  # half the model, and its pieces' alignment padding
        assert model // 2 <= max(received) <= model // 2 * 1.01, (received, model)


def test_two_owners_each_send_their_share_on_their_own_link() -> None:
    args = {"rate_mbit": 400, "mib": 1, "bucket_mib": 1, "rounds": 1, "tp": [2], "raw": False, "timeout": 30.0}
    result = netns_bench.scenario("full, 2 receivers, 2 owners", 2, False, args, owners=2)
    model = result["model_bytes"]
    for received in result["received"]:  # every receiver the whole model, from both owners
        assert model <= max(received) <= model * 1.01, (received, model)
    assert max(result["bytes_sent"]) < 0.9 * model  # the lead sent only its share


def test_two_owners_send_each_class_their_pieces() -> None:
    args = {"rate_mbit": 400, "mib": 1, "bucket_mib": 1, "rounds": 1, "tp": [2], "raw": False, "timeout": 30.0}
    result = netns_bench.scenario("sharded, TP=2, 2 owners", 2, True, args, owners=2)
    model = result["model_bytes"]
    for received in result["received"]:  # half the model each, from both owners
        assert model // 2 <= max(received) <= model // 2 * 1.01, (received, model)


@pytest.mark.skipif(netns_bench.nixl_missing() is not None, reason=str(netns_bench.nixl_missing()))
def test_pullers_read_their_pieces_from_two_owners_on_their_own_links() -> None:
    from ckpt_engine.bench import netns_pull

    args = {"rate_mbit": 400, "mib": 1, "bucket_mib": 1, "rounds": 1, "timeout": 30.0}
    result = netns_pull.scenario("sharded, TP=2, 2 owners, pulled", 2, args, sharded=True, owners=2)
    model = result["model_bytes"]
    for received in result["received"]:  # half the model each (its pieces only), from both owners
        assert model // 2 <= max(received) <= model // 2 * 1.01, (received, model)
