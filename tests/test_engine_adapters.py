"""The SGLang adapter against a fake server that mirrors sglang 0.5.23 (tests/fakes/fake_sglang.py: its
request models, replies, weight-update sessions, and its update group joined with torch's own helper the
way SGLang joins it), really receiving the tensors over that group (gloo standing in for NCCL). vLLM is
tested for real in tests/engines (scripts/test-engines.sh)."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from ckpt_engine.device import detect_device
from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.collective import VersionPayload
from ckpt_engine.receive.payload import StreamFailed
from ckpt_engine.workers.adapters.push_group import PushGroup, PushSettings
from ckpt_engine.workers.adapters.sglang import EngineUpdateError, SGLangAdapter
from tests.daemon_harness import ROOT, free_port
from tests.tiny_lm import tiny_llama

pytestmark = pytest.mark.multiproc


@contextlib.contextmanager
def fake_server(module: str, *flags: str, port: int | None = None) -> Iterator[str]:
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *flags], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/_fake/state", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(f"{module} did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def payload(version: int = 7) -> VersionPayload:
    model = tiny_llama(seed=3)
    named = named_tensors_of(model)
    tensors = dict(named.tensors)
    for alias, canonical in named.aliases.items():
        tensors[alias] = tensors[canonical]  # as the receiver hands them over: one object under both names
    return VersionPayload(version=version, step=70, mode="cached", version_digest="x", tensors=tensors)


def sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())).hexdigest()


def push_settings(chunk_bytes: int = 64 << 10) -> PushSettings:
    return PushSettings("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=30, chunk_bytes=chunk_bytes)


def cpu_group(settings: PushSettings) -> PushGroup:
    return PushGroup(settings, detect_device("cpu", "gloo"))


def test_sglang_update_flow_in_order_with_version_label() -> None:
    version = payload()
    with fake_server("tests.fakes.fake_sglang") as url:
        settings = push_settings()
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()  # the store keys SGLang's group waits on are the ones our push group writes
        adapter.load(version)
        assert adapter.weight_version() == "7"
        state = httpx.get(f"{url}/_fake/state").json()
        adapter.close()
    calls = [c["call"] for c in state["calls"]]
    # a group of the same name left by an earlier run is destroyed first (SGLang refuses a second one)
    assert calls[:4] == ["destroy_weights_update_group", "init_weights_update_group", "pause_generation",
                         "begin_weight_update"]
    assert calls[-2:] == ["end_weight_update", "continue_generation"]
    assert state["calls"][2]["mode"] == "retract"  # in_place would make every flush fail
    updates = [c for c in state["calls"] if c["call"] == "update_weights_from_distributed"]
    assert len(updates) > 1 and len(calls) == len(updates) + 6
    # the label and the flush with the last batch only: SGLang applies weight_version after every request
    assert [u["weight_version"] for u in updates] == [None] * (len(updates) - 1) + ["7"]
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
    assert "lm_head.weight" not in state["checksums"]  # the tied alias is pushed once, under its first name
    expected = {name: sha(t) for name, t in version.tensors.items() if name != "lm_head.weight"}
    assert state["checksums"] == expected and state["weight_version"] == "7" and state["paused"] is None


def test_sglang_failing_part_way_stays_paused_until_a_whole_version() -> None:
    """The second batch fails after the first was applied: SGLang holds a mix, so generation is not continued
    and the load is torn; the next whole version (the daemon's repair) applies and generation continues."""
    with fake_server("tests.fakes.fake_sglang", "--fail-second-update") as url:
        settings = push_settings()
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()
        with pytest.raises(EngineUpdateError, match="injected failure"):
            adapter.load(payload(8))
        state = httpx.get(f"{url}/_fake/state").json()
        assert state["paused"] == "retract" and not state["session"] and state["weight_version"] == "default"
        assert adapter.torn is not None and adapter.version is None
        adapter.load(payload(9))  # the repair
        state = httpx.get(f"{url}/_fake/state").json()
        adapter.close()
    assert state["paused"] is None and state["weight_version"] == "9" and adapter.torn is None
    assert [c["call"] for c in state["calls"]].count("pause_generation") == 1  # it never ran on the mix


def streamed(version: int, fail_after: int | None = None) -> VersionPayload:
    """The payload a streamed receive hands ``load`` (receive/streamed.py): (name, tensor) pairs as buckets
    verify, an alias right after its tensor; ``fail_after`` items, the stream raises as a bucket that did not
    verify makes it."""
    whole = payload(version)

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for index, item in enumerate(whole.tensors.items()):
            if fail_after is not None and index == fail_after:
                raise StreamFailed(f"version {version}: digest mismatch in {item[0]} (bucket 3)")
            yield item

    return VersionPayload(version=version, step=70, mode="cached", version_digest=None, tensors={},
                          stream=items())


def test_sglang_takes_a_streamed_version_batch_by_batch_with_the_label_after_the_end() -> None:
    with fake_server("tests.fakes.fake_sglang") as url:
        settings = push_settings()
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()
        adapter.load(streamed(7))
        state = httpx.get(f"{url}/_fake/state").json()
        adapter.close()
    updates = [c for c in state["calls"] if c["call"] == "update_weights_from_distributed"]
    assert len(updates) > 1 and [u["weight_version"] for u in updates] == [None] * (len(updates) - 1) + ["7"]
    expected = {name: sha(t) for name, t in payload(7).tensors.items() if name != "lm_head.weight"}
    assert state["checksums"] == expected and state["paused"] is None and state["weight_version"] == "7"


@pytest.mark.parametrize("fail_after, torn", [(1, False), (10, True)])
def test_sglang_a_stream_failing_part_way_refuses_or_stays_paused(fail_after: int, torn: bool) -> None:
    """A bucket fails to verify: before any batch was pushed SGLang is unchanged and generation continues
    (refused); after one was, SGLang holds a mix and stays paused (torn) until a whole version applies; the
    update group stays (our side failed, not the push)."""
    from ckpt_engine.errors import ApplyRefused

    with fake_server("tests.fakes.fake_sglang") as url:
        settings = push_settings(chunk_bytes=16 << 10)
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()
        with pytest.raises(ApplyRefused if not torn else StreamFailed, match="digest mismatch"):
            adapter.load(streamed(8, fail_after))
        state = httpx.get(f"{url}/_fake/state").json()
        assert (state["paused"] == "retract") == torn and (adapter.torn is not None) == torn
        assert state["weight_version"] == "default" and adapter._stale is None
        adapter.load(streamed(9))
        state = httpx.get(f"{url}/_fake/state").json()
        adapter.close()
    assert state["paused"] is None and state["weight_version"] == "9" and adapter.torn is None


def test_sglang_refusing_before_any_weight_changes_nothing() -> None:
    from ckpt_engine.errors import ApplyRefused

    with fake_server("tests.fakes.fake_sglang") as url:
        settings = push_settings()
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()
        httpx.post(f"{url}/begin_weight_update", json={})  # someone else holds a session: begin is refused
        with pytest.raises(ApplyRefused, match="session is already open"):
            adapter.load(payload(5))
        state = httpx.get(f"{url}/_fake/state").json()
        adapter.close()
    assert state["paused"] is None and adapter.torn is None and state["weight_version"] == "default"
    assert state["session"]  # the other client's session is not ours to close


def test_sglang_adapter_restarted_joins_again() -> None:
    """Our side restarts while SGLang keeps the update group of the old run: the new adapter destroys it and
    joins anew, instead of failing every version (found by the outside attack on issue 14)."""
    with fake_server("tests.fakes.fake_sglang") as url:
        first_settings = push_settings()
        first = SGLangAdapter(url, first_settings, group=cpu_group(first_settings))
        first.connect()
        first.load(payload(3))
        first.group.close()  # the old process is gone; SGLang still holds its group
        settings = push_settings()
        second = SGLangAdapter(url, settings, group=cpu_group(settings))
        second.connect()
        second.load(payload(4))
        state = httpx.get(f"{url}/_fake/state").json()
        second.close()
    assert state["weight_version"] == "4" and state["paused"] is None
    assert [c["call"] for c in state["calls"]].count("destroy_weights_update_group") == 2


def test_sglang_restarted_is_refused_then_joined_again() -> None:
    """SGLang restarts: the next version fails before any weight lands (refused, nothing changed, not torn) and
    the one after joins a new group and applies; a sparse version onto the restarted server's own weights
    would be a mix, so that one makes the engine torn until a whole version."""
    from ckpt_engine.errors import ApplyRefused, TornModelError

    port = free_port()
    settings = push_settings()
    with fake_server("tests.fakes.fake_sglang", port=port) as url:
        adapter = SGLangAdapter(url, settings, group=cpu_group(settings))
        adapter.connect()
        adapter.load(payload(3))
    with fake_server("tests.fakes.fake_sglang", port=port):  # the same server, restarted
        sparse = payload(4)
        sparse.sparse = True
        with pytest.raises(TornModelError, match="not 3"):
            adapter.load(sparse)
        assert adapter.torn is not None
        adapter.load(payload(5))  # whole: joins a new group, applies, continues generation
        state = httpx.get(f"{url}/_fake/state").json()
        assert state["weight_version"] == "5" and state["paused"] is None and adapter.torn is None
    with fake_server("tests.fakes.fake_sglang", port=port):  # restarted again, now with a whole version
        adapter.load(payload(6))
        state = httpx.get(f"{url}/_fake/state").json()
    with pytest.raises(ApplyRefused, match="unreachable"):  # the server is down: nothing changed
        adapter.load(payload(7))
    adapter.close()
    assert state["weight_version"] == "6" and adapter.version == 6


def test_the_push_group_uses_the_store_keys_sglang_s_group_waits_on() -> None:
    """Byte-exact with torch's own helper, as SGLang calls it: g/g//<device>//<key>."""
    from ckpt_engine.workers.adapters.push_group import torch_group_prefix

    assert (torch_group_prefix("weight_update_group", "cuda") + "/0"
            == "weight_update_group/weight_update_group//cuda//0")
