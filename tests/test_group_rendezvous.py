"""The member rendezvous that NCCL sync groups do before building their communicator (gloo does its own),
on a real TCP store; and the NCCL error-handling override is scoped to the group's construction."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ckpt_engine.device import detect_device
from ckpt_engine.transport.group import (
    EXCHANGE_WORDS,
    MembersAbsent,
    SyncGroup,
    _nccl_failures_cleanup_only,
    await_members,
    open_store,
    store_prefix,
)
from tests.procs import context as procs_context


def _members(port: int, ranks: list[int], size: int, timeout_s: float) -> dict[int, str | None]:
    outcome: dict[int, str | None] = {}

    def member(rank: int) -> None:
        store = dist.PrefixStore(store_prefix("rdv", 0), open_store("127.0.0.1", port, timeout_s=timeout_s))
        try:
            await_members(store, rank, size)
            outcome[rank] = None
        except Exception as exc:  # noqa: BLE001 - the store's own timeout error
            outcome[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=member, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    return outcome


def test_all_members_present_returns() -> None:
    server = open_store("127.0.0.1", 0, is_master=True, timeout_s=10)
    assert _members(server.port, [0, 1, 2], 3, 10) == {0: None, 1: None, 2: None}


def test_a_missing_member_fails_everyone_within_the_store_timeout() -> None:
    server = open_store("127.0.0.1", 0, is_master=True, timeout_s=10)
    started = time.monotonic()
    outcome = _members(server.port, [0, 1], 3, 2.0)
    assert set(outcome) == {0, 1} and all(reason is not None for reason in outcome.values())
    assert time.monotonic() - started < 2.0 + 5


@pytest.mark.parametrize("before", [None, "3"])
def test_nccl_error_handling_override_is_scoped(monkeypatch, before: str | None) -> None:
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if before is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, before)
    with _nccl_failures_cleanup_only():
        assert os.environ[name] == "2"
    assert os.environ.get(name) == before


def _pair(port: int, name: str, timeout_s: float, size: int = 2) -> dict[int, SyncGroup]:
    """A gloo sync group of ``size`` members, each on a thread of its own with its own store client, by rank."""
    groups: dict[int, SyncGroup] = {}

    def member(rank: int) -> None:
        groups[rank] = SyncGroup(open_store("127.0.0.1", port, timeout_s=timeout_s), name=name, generation=0,
                                 rank=rank, world_size=size, device=detect_device("cpu"), timeout_s=timeout_s)

    joining = [threading.Thread(target=member, args=(rank,)) for rank in range(size)]
    for thread in joining:
        thread.start()
    for thread in joining:
        thread.join(timeout_s * 3)
    return groups


def test_a_receiver_waiting_for_a_version_that_will_not_come_stops_at_once() -> None:
    """Found by the chaos run of 2026-11-27 (stop_trainer): a receiver waited for a failed version's doorbell up
    to the version's time limit and missed the next version's rendezvous. It now asks, every second, whether
    the version will still come (a newer one assigned, the daemon restarted)."""
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    groups = _pair(store.port, "ring", timeout_s=20)
    asked: list[float] = []

    def abandon() -> str | None:
        asked.append(time.monotonic())
        return "superseded by version 8" if len(asked) >= 2 else None

    started = time.monotonic()
    assert groups[1].await_ring(60, abandon) == "superseded by version 8"
    assert time.monotonic() - started < 30  # (not the 60 s limit)
    groups[0].ring()  # a version that began is seen through, whatever abandon() would say
    assert groups[1].await_ring(60, abandon) is None
    for group in groups.values():
        group.close()


@pytest.mark.parametrize("lengths", [(0, 3, 1), (EXCHANGE_WORDS, 0, 2),
                                     (EXCHANGE_WORDS + 1, 0, 2 * EXCHANGE_WORDS + 7)])
def test_an_exchange_gives_every_member_every_members_values_whatever_their_lengths(lengths) -> None:
    """An exchange carries lengths and the first values in one allgather, and the rest of longer ones in a
    second that every member takes part in (they all know the lengths)."""
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    groups = _pair(store.port, "exchange", timeout_s=20, size=3)
    sent = {rank: [(-1) ** i * (i + 1) * (2**62 // (n + 1)) for i in range(n)] for rank, n in enumerate(lengths)}
    told: dict[int, list[list[int]]] = {}

    def member(rank: int) -> None:
        for round_ in range(2):  # (a second round on the same group: nothing of the first is left over)
            told[rank] = groups[rank].exchange_ints(sent[rank], f"round {round_}", round_id=("t", round_))

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert told == {rank: [sent[0], sent[1], sent[2]] for rank in range(3)}
    for group in groups.values():
        group.close()


def test_a_rank_whose_values_are_not_int64_fails_before_any_step_and_the_others_name_it_within_the_bound() -> None:
    """Found by the outside attack of the tenth session: a value past int64 found between an exchange's two
    steps left that rank's group usable and out of step, so its next exchange paired with the others' second
    step and every rank took wrong values. Every value is now converted first: the rank raises at once and its
    group is broken; the others fail within the exchange's bound, naming it."""
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    groups = _pair(store.port, "int64", timeout_s=20, size=3)
    values = {0: list(range(1025)), 1: [*range(600), 2**63, *range(424)], 2: list(range(1025))}
    failed: dict[int, Exception] = {}

    def member(rank: int) -> None:
        try:
            groups[rank].exchange_ints(values[rank], "vote", 3.0, round_id=("vote", 1))
        except Exception as exc:  # noqa: BLE001 - what each rank saw is checked below
            failed[rank] = exc

    started = time.monotonic()
    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert time.monotonic() - started < 3.0 + 15
    assert "not int64" in str(failed[1]) and groups[1].broken
    for rank in (0, 2):
        assert isinstance(failed[rank], MembersAbsent) and failed[rank].absent == (1,), failed[rank]
        assert groups[rank].broken
    for group in groups.values():
        group.close()


def test_a_rank_that_stops_between_an_exchanges_two_steps_is_named_and_the_whole_exchange_keeps_its_bound() -> None:
    """A rank that took part in the first step and never came to the second (it died or stalled there) is
    named by the others, and both steps together wait no longer than the exchange's bound."""
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=20)
    groups = _pair(store.port, "rest", timeout_s=20, size=3)
    failed: dict[int, Exception] = {}

    def member(rank: int) -> None:
        try:
            groups[rank].exchange_ints(list(range(EXCHANGE_WORDS + 9)), "vote", 4.0, round_id=("vote", 1))
        except Exception as exc:  # noqa: BLE001 - what each rank saw is checked below
            failed[rank] = exc

    def first_step_only() -> None:  # (rank 2: the first step as exchange_ints takes it, then nothing)
        head = torch.zeros(1 + EXCHANGE_WORDS, dtype=torch.int64)
        head[0] = EXCHANGE_WORDS + 9
        groups[2]._exchange_step(head, "vote", time.monotonic() + 4.0, ("vote", 1))

    started = time.monotonic()
    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    threads.append(threading.Thread(target=first_step_only))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert time.monotonic() - started < 4.0 + 15
    for rank in (0, 1):
        assert isinstance(failed[rank], MembersAbsent) and failed[rank].absent == (2,), failed[rank]
        assert "(rest)" in str(failed[rank])
    for group in groups.values():
        group.close()


def _serve_store(port_out) -> None:
    from ckpt_engine.transport.group import serve_store

    server = serve_store("127.0.0.1", 0, timeout_s=60)
    port_out.put(server.port)
    time.sleep(600)


def test_a_stalled_store_server_fails_every_store_call_within_its_bound() -> None:
    """Found by the third outside round on issue 18: a store server whose process stopped (SIGSTOP: stalled,
    not gone) blocked its clients for good, whatever timeout they gave (verl's rollout workers waited on a
    hung actor rank 0 with no end)."""
    import signal

    from ckpt_engine.errors import SyncTimeoutError
    from ckpt_engine.transport.group import wait_for_key

    ctx = procs_context()
    ports = ctx.Queue()
    server = ctx.Process(target=_serve_store, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        store = open_store("127.0.0.1", port, timeout_s=2)  # connected while the server runs
        groups = _pair(port, "up", timeout_s=10)
        os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()  # (the fourth outside round: these blocked a sender thread)
        groups[0]._note_present(("sent", 1))  # best effort: logged, not raised
        assert groups[0]._absent_from(("sent", 1)) == []  # nobody can be named
        assert time.monotonic() - started < 2 * 2 + 3
        for call in (lambda: open_store("127.0.0.1", port, timeout_s=2),
                     lambda: wait_for_key(store, "never", 2),
                     lambda: SyncGroup(store, name="stalled", generation=0, rank=1, world_size=2,
                                       device=detect_device("cpu"), timeout_s=2, connect_timeout_s=2)):
            started = time.monotonic()
            with pytest.raises(SyncTimeoutError, match=r"no answer within|could not rendezvous"):
                call()
            assert time.monotonic() - started < 2 + 2 + 2 + 3  # its timeout, the grace, and absent_members'
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.join(10)
