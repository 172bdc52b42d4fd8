"""History store: ids monotonic across restarts, in-flight versions failed on restart, JSON columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.server.history import HistoryStore


def test_records_a_version_through_its_lifecycle(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    record = store.create(mode="cached", step=10)
    assert record.status == "requested" and record.step == 10 and record.receivers == []
    store.update(record.id, status="transferring", stages={"snapshot": 0.1})
    done = store.update(record.id, status="committed", bytes=123, buckets=2, tensors_sent=7,
                        receivers=[{"rank": 1, "ok": True, "version_digest": "ab"}], version_digest="ab", cached=True)
    assert done.status == "committed" and done.committed_at is not None and done.cached
    assert done.stages == {"snapshot": 0.1} and done.receivers[0]["rank"] == 1
    assert store.latest().id == record.id and store.latest(status="failed") is None


def test_ids_never_reused_across_restarts_and_in_flight_rows_fail(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    first = store.create(mode="cached", step=1)
    store.update(first.id, status="committed")
    second = store.create(mode="bypass_cpu", step=2)
    store.update(second.id, status="transferring")
    store.close()

    reopened = HistoryStore(path)
    assert reopened.fail_unfinished("daemon restarted") == [second.id]
    assert reopened.get(first.id).status == "committed"
    failed = reopened.get(second.id)
    assert failed.status == "failed" and failed.reason == "daemon restarted"
    assert reopened.create(mode="cached", step=3).id > second.id
    assert reopened.counts() == {"committed": 1, "failed": 1, "requested": 1}


def test_list_is_newest_first_and_filters(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    ids = [store.create(mode="cached", step=i).id for i in range(5)]
    store.update(ids[1], status="failed", reason="x")
    assert [r.id for r in store.list(limit=3)] == ids[::-1][:3]
    assert [r.id for r in store.list(status="failed")] == [ids[1]]


def test_cache_flags_follow_the_trainer(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    a, b, c = (store.create(mode="cached", step=i).id for i in range(3))
    store.set_cached({a, b})
    store.set_cached({b, c})
    assert [store.get(v).cached for v in (a, b, c)] == [False, True, True]


def test_rejects_unknown_columns_and_statuses(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    version = store.create(mode="cached", step=None).id
    with pytest.raises(ValueError, match="unknown status"):
        store.update(version, status="weird")
    with pytest.raises(ValueError, match="unknown history columns"):
        store.update(version, id=99)


def test_a_history_from_before_bytes_skipped_is_upgraded_in_place(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""CREATE TABLE versions (id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER, mode TEXT NOT NULL,
        status TEXT NOT NULL, reason TEXT, source_version INTEGER, created_at REAL NOT NULL, updated_at REAL NOT NULL,
        committed_at REAL, bytes INTEGER NOT NULL DEFAULT 0, buckets INTEGER NOT NULL DEFAULT 0,
        tensors_sent INTEGER NOT NULL DEFAULT 0, tensors_skipped INTEGER NOT NULL DEFAULT 0,
        stages TEXT NOT NULL DEFAULT '{}', receivers TEXT NOT NULL DEFAULT '[]', version_digest TEXT,
        cached INTEGER NOT NULL DEFAULT 0);
        INSERT INTO versions (step, mode, status, created_at, updated_at) VALUES (3, 'cached', 'committed', 1, 1);""")
    old.commit()
    old.close()
    store = HistoryStore(path)
    assert store.get(1).bytes_skipped == 0 and store.get(1).step == 3
    assert store.update(store.create(mode="cached", step=4).id, bytes_skipped=99).bytes_skipped == 99


def test_numbering_moves_past_versions_agents_hold_but_never_back(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    assert not store.number_after(0)  # nothing held
    assert store.number_after(7)  # an empty history: ids start after what an agent holds
    assert store.create(mode="cached", step=None).id == 8
    assert not store.number_after(3)  # already past it
    assert store.create(mode="cached", step=None).id == 9
    assert store.number_after(20) and store.create(mode="cached", step=None).id == 21
