"""History store: ids monotonic across restarts, in-flight versions interrupted on restart, JSON columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_engine.server.history import HistoryError, HistoryLocked, HistoryStore, check_history_path


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
    assert reopened.interrupt_unfinished("daemon restarted") == [second.id]
    assert reopened.get(first.id).status == "committed"
    failed = reopened.get(second.id)
    assert failed.status == "interrupted" and failed.reason == "daemon restarted"
    assert reopened.create(mode="cached", step=3).id > second.id
    assert reopened.counts() == {"committed": 1, "interrupted": 1, "requested": 1}


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


def test_a_history_keeps_its_id_and_only_one_daemon_writes_it(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    history_id = store.history_id
    with pytest.raises(HistoryLocked, match=r"in use by another daemon .*pid"):
        HistoryStore(path)  # a second writer is refused, naming the first
    store.close()
    again = HistoryStore(path)
    assert again.history_id == history_id and HistoryStore(tmp_path / "other.sqlite3").history_id != history_id


def test_a_second_store_waits_for_the_lock_when_asked(tmp_path: Path) -> None:
    import threading

    path = tmp_path / "h.sqlite3"
    first = HistoryStore(path)
    threading.Timer(0.5, first.close).start()
    second = HistoryStore(path, lock_wait_s=10)  # gets it once the first lets go
    assert second.create(mode="cached", step=1).id == 1


@pytest.mark.parametrize("make", ["text", "other_sqlite", "foreign_versions", "directory_parent"])
def test_a_history_path_that_cannot_be_used_is_named(tmp_path: Path, make: str) -> None:
    import sqlite3

    path = tmp_path / "h.sqlite3"
    if make == "text":
        path.write_text("not a database at all, just text that is long enough")
    elif make in ("other_sqlite", "foreign_versions"):
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE versions (x)" if make == "foreign_versions" else "CREATE TABLE invoices (x)")
        db.commit()
        db.close()
    else:
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "h.sqlite3"
    with pytest.raises(HistoryError, match=r"store.history_path"):
        check_history_path(str(path))
    with pytest.raises(HistoryError, match=r"store.history_path"):
        HistoryStore(path)


def test_a_write_that_fails_stays_in_memory_and_reaches_the_file_later(tmp_path: Path) -> None:
    """A real storage fault: a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes every write fail with
    EFBIG, as a full disk would. Reads go on, the truth stays in memory, new versions are refused, and once the
    limit is lifted every pending write reaches the file."""
    import subprocess
    import sys

    script = f"""
import resource, signal, sqlite3
from ckpt_engine.server.history import HistoryError, HistoryLocked, HistoryStore, check_history_path, StorageUnavailable
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = HistoryStore({str(tmp_path / "h.sqlite3")!r})
first = store.create(mode="cached", step=1)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
record = store.update(first.id, status="committed", version_digest="ab")
assert record.status == "committed" and store.get(first.id).status == "committed", "truth kept in memory"
state = store.storage()
assert not state.ok and state.pending_writes == 1 and state.error, state
print(state.error)
try:
    store.create(mode="cached", step=2)
    raise SystemExit("a new version was created while the file could not be written")
except StorageUnavailable:
    pass
assert [r.status for r in store.list()] == ["committed"]
assert store.counts() == {{"committed": 1}}, store.counts()  # the unwritten change counts, not the file's row
assert store.get(first.id).to_dict() == {{**store.get(first.id).__dict__}}
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
assert store.flush(force=True) and store.storage().ok
db = sqlite3.connect({str(tmp_path / "h.sqlite3")!r})
assert db.execute("SELECT status, version_digest FROM versions").fetchall() == [("committed", "ab")]
print("OK")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip().endswith("OK"), result.stdout + result.stderr


def test_a_full_disk_with_nothing_pending_stays_degraded_until_a_real_write_works(tmp_path: Path) -> None:
    """Trust round 3, item 5: a refused create leaves nothing pending; an empty commit succeeds even on a full
    disk, so health is decided by a real write (a probe), not by an empty transaction."""
    import subprocess
    import sys

    script = f"""
import resource, signal
from ckpt_engine.server.history import HistoryStore, StorageUnavailable
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = HistoryStore({str(tmp_path / "h.sqlite3")!r})
store.create(mode="cached", step=1)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
try:
    store.create(mode="cached", step=2)
    raise SystemExit("created on a full disk")
except StorageUnavailable:
    pass
assert store.degraded and store.storage().pending_writes == 0
for _ in range(3):
    assert not store.flush(force=True), "an empty commit must not count as storage back"
    assert store.degraded and not store.storage().ok
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
assert store.flush(force=True) and not store.degraded and store.storage().ok
assert store.create(mode="cached", step=3).id == 2
print("OK")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip().endswith("OK"), result.stdout + result.stderr


def test_list_pages_with_a_cursor(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    ids = [store.create(mode="cached", step=i).id for i in range(7)]
    first = store.list(limit=3)
    second = store.list(limit=3, before=first[-1].id)
    third = store.list(limit=3, before=second[-1].id)
    assert [r.id for r in first + second + third] == ids[::-1]


def test_a_page_keeps_every_row_when_reading_it_evicts_records_from_memory(tmp_path: Path) -> None:
    """Found by the outside attack on issue 26: a page whose in-memory records were evicted while the rest of
    it was read from the file lost them (49 rows of 50, and no cursor to the older ones)."""
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    for step in range(2100):
        store.create(mode="cached", step=step)
    store.close()
    store = HistoryStore(path)  # nothing in memory
    store.list(limit=1000)
    store.list(limit=1000, before=1101)  # memory now holds 1100..101, 101 the oldest
    assert [r.id for r in store.list(limit=50, before=126)] == list(range(125, 75, -1))
    assert len(store.list(limit=1000, before=600)) == 599
    assert len(store.list(limit=1000, before=1101)) == 1000
    store.close()


def test_a_records_json_text_follows_every_change(tmp_path: Path) -> None:
    """GET /versions sends the JSON text the store keeps per record: an update, a flip of the cache flag, a
    record read back from the file and a filtered page each give what :meth:`list` gives."""
    store = HistoryStore(tmp_path / "h.sqlite3")
    ids = [store.create(mode="cached", step=i).id for i in range(4)]

    def same() -> None:
        for query in ({}, {"status": "committed"}, {"limit": 2, "before": ids[-1]}):
            as_text = [(i, json.loads(text)) for i, text in store.list_json(**query)]
            assert as_text == [(r.id, r.to_dict()) for r in store.list(**query)], query

    same()
    store.update(ids[0], status="committed", stages={"fill": 0.25}, receivers=[{"rank": 1, "ok": True}])
    same()
    store.set_cached({ids[0]})
    same()
    store.set_cached(set())
    same()
    store.close()
    store = HistoryStore(tmp_path / "h.sqlite3")  # (same() reads the reopened store: records from the file)
    same()
    store.update(ids[1], status="failed", reason="x")
    same()


def test_a_returned_record_is_the_callers_to_change(tmp_path: Path) -> None:
    """Found by the outside attack on issue 38: the copies shared their lists and maps with the store's record,
    so an edit changed the store in memory only, and GET /versions' kept text disagreed with it."""
    store = HistoryStore(tmp_path / "h.sqlite3")
    version = store.create(mode="cached", step=1).id
    store.update(version, stages={"fill": 0.5}, receivers=[{"rank": 1, "ok": True}])
    store.list_json()
    got = store.get(version)
    got.stages["fill"] = 99.0
    got.receivers[0]["ok"] = False
    store.list()[0].stages["snapshot"] = 1.0
    assert store.get(version).stages == {"fill": 0.5} and store.get(version).receivers == [{"rank": 1, "ok": True}]
    assert json.loads(store.list_json()[0][1])["stages"] == {"fill": 0.5}


def test_a_float_json_cannot_hold_is_null_and_text_stays_utf8(tmp_path: Path) -> None:
    """Found by the outside attack on issue 38: one record with NaN failed every page it was on (HTTP and now
    ZMQ); and escaped non-ASCII text took up to 12 bytes a character in the kept text."""
    store = HistoryStore(tmp_path / "h.sqlite3")
    version = store.create(mode="cached", step=1).id
    store.update(version, stages={"fill": float("nan"), "ack": float("inf"), "load": 0.25}, reason="über 😀")
    [(_, text)] = store.list_json()
    page = json.loads(text)
    assert page["stages"] == {"fill": None, "ack": None, "load": 0.25}
    assert "über 😀" in text and "\\u" not in text
