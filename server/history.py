"""Version history in SQLite (WAL). Every version ever requested has a row; ids come from AUTOINCREMENT, so
they rise monotonically and are never reused, also across restarts. Rows are never deleted.

Storage faults are a state, not a crash: the truth about versions the daemon touches is kept in memory
first. A write that fails (disk full, I/O error) leaves the record dirty in memory, the store reports itself
degraded, and :meth:`HistoryStore.flush` writes it later, with backoff, once it can. Reads see the records in
memory over the file. A new version needs its row (its id is the row's), so while degraded :meth:`create`
raises :class:`StorageUnavailable` instead of handing out an id that a crash could hand out again.

One daemon writes a history at a time: the store holds an exclusive lock on the history file itself for its
life (``<history>.lock`` says who holds it).
"""

from __future__ import annotations

import builtins
import collections
import fcntl
import json
import logging
import math
import os
import socket
import sqlite3
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ckpt_engine.control.messages import STATUSES, TERMINAL
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.plan.modes import Mode
from ckpt_engine.retry import Backoff

log = logging.getLogger(__name__)
_CLEAN_KEPT = 1024  # clean records kept in memory besides the dirty ones
# What a write may raise: SQLite's errors, and a value SQLite cannot store (e.g. OverflowError for an integer
# past 2^63). Each is a storage fault (degraded, retried), never an exception out of the store.
_WRITE_ERRORS = (sqlite3.Error, OverflowError, ValueError, TypeError, OSError)
# How long a write waits for a lock another process holds before it fails (degraded, retried with backoff).
# Short because writes happen under the controller's lock, which agents' polls and /status wait for.
_WRITE_BUSY_S = 0.25

_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    step INTEGER,
    mode TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT,
    source_version INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    committed_at REAL,
    bytes INTEGER NOT NULL DEFAULT 0,
    buckets INTEGER NOT NULL DEFAULT 0,
    tensors_sent INTEGER NOT NULL DEFAULT 0,
    tensors_skipped INTEGER NOT NULL DEFAULT 0,
    bytes_skipped INTEGER NOT NULL DEFAULT 0,
    stages TEXT NOT NULL DEFAULT '{}',
    receivers TEXT NOT NULL DEFAULT '[]',
    version_digest TEXT,
    cached INTEGER NOT NULL DEFAULT 0,
    purpose TEXT NOT NULL DEFAULT 'sync',
    owners INTEGER NOT NULL DEFAULT 1,
    knobs TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS versions_status ON versions(status);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# columns added since the first release
_ADDED_COLUMNS = {"bytes_skipped": "INTEGER NOT NULL DEFAULT 0", "purpose": "TEXT NOT NULL DEFAULT 'sync'",
                  "owners": "INTEGER NOT NULL DEFAULT 1", "knobs": "TEXT NOT NULL DEFAULT '{}'"}
_REQUIRED_COLUMNS = {"id", "step", "mode", "status", "reason", "source_version", "created_at", "updated_at"}
_SQLITE_MAGIC = b"SQLite format 3\x00"


class HistoryError(CkptEngineError):
    """The history file cannot be used (it names ``store.history_path``)."""


class HistoryLocked(HistoryError):
    """Another daemon writes this history."""


class StorageUnavailable(CkptEngineError):
    """The history cannot be written now; what needs a new row is refused until it can."""


@dataclass
class VersionRecord:
    id: int
    step: int | None
    mode: Mode
    status: str
    reason: str | None
    source_version: int | None
    created_at: float
    updated_at: float
    committed_at: float | None
    bytes: int
    buckets: int
    tensors_sent: int
    tensors_skipped: int
    bytes_skipped: int
    stages: dict[str, float] = field(default_factory=dict)
    receivers: list[dict[str, Any]] = field(default_factory=list)
    version_digest: str | None = None
    cached: bool = False
    purpose: str = "sync"  # sync, push (rollback), catch_up (a receiver that joined), repair (a torn receiver)
    owners: int = 1  # trainer ranks that each hold and send a share of it (cached: complete while all hold theirs)
    # A framework's (verl) sync: each knob it ran with, where the value came from, and the deployment's value where
    # the framework overrode it (ckpt_engine/config/knobs.py). Empty for the daemon's own versions.
    knobs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: its deep copy of every receiver entry was half of a GET /versions. One level
        # of copies is enough: records are replaced on update, never changed in place.
        data = {name: getattr(self, name) for name in _FIELD_NAMES}
        data["stages"] = dict(self.stages)
        data["receivers"] = [dict(entry) for entry in self.receivers]
        data["knobs"] = {name: dict(entry) for name, entry in self.knobs.items()}
        return data


_FIELD_NAMES = tuple(f.name for f in fields(VersionRecord))


def _copy(record: VersionRecord) -> VersionRecord:
    """A copy the caller may change: its lists and maps too (the store's own record is replaced on update,
    never changed, and its JSON text is kept while it is the same object)."""
    return replace(record, stages=dict(record.stages), receivers=[dict(e) for e in record.receivers],
                   knobs={name: dict(entry) for name, entry in record.knobs.items()})


def _json_text(record: VersionRecord) -> str:
    """The record as JSON (UTF-8 as it is: an escaped character costs up to 12 bytes). A float that JSON cannot
    hold (NaN, infinity: none comes from the wire, an old file might hold one) is written as null, so that one
    record cannot fail every page it is on."""
    data = record.to_dict()
    try:
        return json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except ValueError:
        return json.dumps(_finite(data), separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


@dataclass
class StorageState:
    ok: bool
    error: str | None
    since: float | None
    pending_writes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class HistoryStore:
    """Thread-safe. Writes go through one connection; reads of rows not in memory use a second one, so a slow
    write never holds a read back."""

    def __init__(self, path: str | Path, *, lock_wait_s: float = 0.0) -> None:
        self.path = str(path)
        self._lock_file = _lock_history(self.path, lock_wait_s) if self.path != ":memory:" else None
        try:
            self._db = _connect(self.path)
            self.history_id = _prepare(self._db, self.path)
            self._db.execute(f"PRAGMA busy_timeout={int(_WRITE_BUSY_S * 1000)}")  # from now on: see _WRITE_BUSY_S
            self._reader = _connect(self.path, readonly=True) if self.path != ":memory:" else self._db
        except sqlite3.Error as exc:
            self._release_lock()
            raise HistoryError(f"store.history_path: {self.path}: {exc}") from exc
        self._db_lock = threading.Lock()
        self._read_lock = threading.Lock() if self._reader is not self._db else self._db_lock
        self._mem = threading.Lock()
        self._records: collections.OrderedDict[int, VersionRecord] = collections.OrderedDict()
        self._json: dict[int, tuple[VersionRecord, str]] = {}  # a record's JSON text while it is that record
        self._dirty: set[int] = set()
        self._cached_ids: set[int] | None = None  # the trainer's cache as last reported; None: as in the file
        self._cached_dirty = False
        self._problem: str | None = None
        self._problem_since: float | None = None
        self._retry = Backoff(initial_s=0.5, max_s=5.0)  # a failed write is cheap: notice storage back soon
        self._next_retry = 0.0

    # ---- state ---------------------------------------------------------------------------------------
    def storage(self) -> StorageState:
        with self._mem:
            pending = len(self._dirty) + int(self._cached_dirty)
            return StorageState(self._problem is None, self._problem, self._problem_since, pending)

    @property
    def degraded(self) -> bool:
        return self._problem is not None

    # ---- writes --------------------------------------------------------------------------------------
    def create(self, *, mode: Mode, step: int | None, source_version: int | None = None) -> VersionRecord:
        """A new version row; its id is the row's. Raises StorageUnavailable while the file cannot be written."""
        if self._problem is not None and not self.flush():  # flush retries at most once per backoff: no stall
            raise StorageUnavailable(f"the history cannot be written ({self._problem}); no new version until it can")
        now = time.time()
        try:
            with self._db_lock:
                cursor = self._db.execute(
                    "INSERT INTO versions (step, mode, status, source_version, created_at, updated_at) "
                    "VALUES (?, ?, 'requested', ?, ?, ?)", (step, mode, source_version, now, now))
                version = int(cursor.lastrowid)  # type: ignore[arg-type]
        except _WRITE_ERRORS as exc:
            self._failed(exc)
            raise StorageUnavailable(f"the history cannot be written ({self._problem}); no new version until "
                                     "it can") from exc
        record = VersionRecord(version, step, mode, "requested", None, source_version, now, now, None, 0, 0, 0, 0, 0)
        with self._mem:
            self._remember(record)
        return _copy(record)

    def number_after(self, version: int) -> bool:
        """Issue the next ids after ``version``, for an empty history taking over from a lost one whose ids
        agents still hold. False when the store cannot be written now: the ids then start at 1."""
        try:
            with self._db_lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.execute("DELETE FROM sqlite_sequence WHERE name='versions'")
                    self._db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('versions', ?)", (version,))
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
        except _WRITE_ERRORS as exc:
            self._failed(exc)
            return False
        return True

    def update(self, version: int, **fields: Any) -> VersionRecord:
        """Set fields of a version. The change is the truth at once; it reaches the file now or, when the file
        cannot be written, with the next successful :meth:`flush`."""
        _check_fields(fields)
        record = self.get(version)
        if record is None:
            raise KeyError(f"version {version} is not in the history")
        fields["updated_at"] = time.time()
        if fields.get("status") == "committed":
            fields.setdefault("committed_at", fields["updated_at"])
        with self._mem:
            current = self._records.get(version, record)
            updated = replace(current, **fields)
            self._remember(updated)
            self._dirty.add(version)
        self.flush(force=self._problem is None)
        return _copy(updated)

    def interrupt_unfinished(self, reason: str) -> list[int]:
        """Mark ``interrupted`` every version that was in flight when the daemon stopped (e.g. at a crash): its
        outcome was never recorded, and receivers may hold it. Returns their ids."""
        ids = [r.id for r in self._query(f"SELECT * FROM versions WHERE status NOT IN "
                                         f"({','.join('?' * len(TERMINAL))})", TERMINAL)]
        for version in ids:
            self.update(version, status="interrupted", reason=reason)
        return ids

    def unwritten(self) -> list[VersionRecord]:
        """Records whose latest state is only in memory (the file could not be written)."""
        with self._mem:
            return [_copy(self._records[v]) for v in sorted(self._dirty)]

    def set_cached(self, cached_versions: set[int]) -> None:
        """Record which versions the trainer's cache holds now."""
        with self._mem:
            self._cached_ids = set(cached_versions)
            self._cached_dirty = True
            for version, record in self._records.items():
                if record.cached != (version in cached_versions):  # replaced, never changed: see list_json
                    self._records[version] = replace(record, cached=not record.cached)
        self.flush(force=self._problem is None)

    def flush(self, *, force: bool = False) -> bool:
        """Write what is only in memory; True when nothing is left. Without ``force`` it waits for the backoff
        after a failure (it is called on every controller tick)."""
        if not force and time.monotonic() < self._next_retry:
            return False
        with self._mem:
            dirty = [replace(self._records[v]) for v in sorted(self._dirty)]
            cached = set(self._cached_ids) if self._cached_dirty and self._cached_ids is not None else None
        # Degraded with nothing pending: probe with a real write. An empty transaction commits even on a full
        # disk, and /health would turn healthy while /sync is still refused.
        probe = self._problem is not None and not dirty and cached is None
        try:
            with self._db_lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for record in dirty:
                        self._write(record)
                    if cached is not None:
                        self._db.execute("UPDATE versions SET cached=0 WHERE cached=1")
                        self._db.executemany("UPDATE versions SET cached=1 WHERE id=?", [(v,) for v in cached])
                    if probe:
                        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('storage_probe', ?)",
                                         (f"{time.time():.6f}",))
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:  # SQLite may have rolled back by itself (e.g. disk full)
                        self._db.execute("ROLLBACK")
                    raise
        except _WRITE_ERRORS as exc:
            self._failed(exc)
            return False
        with self._mem:
            for record in dirty:
                if self._records.get(record.id) == record:
                    self._dirty.discard(record.id)
            if cached is not None and self._cached_ids == cached:
                self._cached_dirty = False
            clean = not self._dirty and not self._cached_dirty
        if clean and self._problem is not None:
            log.warning("history storage works again; %d pending write(s) flushed",
                        len(dirty) + int(cached is not None))
            self._problem, self._problem_since = None, None
            self._retry.reset()
        return clean

    # ---- reads ---------------------------------------------------------------------------------------
    def get(self, version: int) -> VersionRecord | None:
        with self._mem:
            record = self._records.get(version)
            if record is not None:
                self._records.move_to_end(version)
                return _copy(record)
        rows = self._query("SELECT * FROM versions WHERE id=?", (version,))
        if not rows:
            return None
        with self._mem:
            record = self._records.get(version) or self._overlay(rows[0])
            self._remember(record)
            return _copy(record)

    def latest(self, status: str | None = None) -> VersionRecord | None:
        rows = self.list(limit=1, status=status)
        return rows[0] if rows else None

    def list(self, *, limit: int = 50, status: str | None = None, before: int | None = None) -> list[VersionRecord]:
        """Newest first; ``before``: only ids below it (the cursor of the next page)."""
        return [_copy(r) for r in self._select(limit, status, before)]

    def list_json(self, *, limit: int = 50, status: str | None = None, before: int | None = None
                  ) -> builtins.list[tuple[int, str]]:
        """What :meth:`list` returns, each record as (id, its JSON text). A record's text is kept while the record
        is unchanged: encoding 50 records' floats was most of a GET /versions."""
        texts = []
        for record in self._select(limit, status, before):
            with self._mem:
                kept = self._json.get(record.id)
            if kept is not None and kept[0] is record:
                texts.append((record.id, kept[1]))
                continue
            text = _json_text(record)
            with self._mem:
                if self._records.get(record.id) is record:
                    self._json[record.id] = (record, text)
            texts.append((record.id, text))
        return texts

    def _select(self, limit: int, status: str | None, before: int | None) -> builtins.list[VersionRecord]:
        """The records themselves, not copies: never change one (an update replaces it)."""
        query = "SELECT * FROM versions WHERE 1=1"
        args: builtins.list[Any] = []
        if status is not None:
            query += " AND status=?"
            args.append(status)
        if before is not None:
            query += " AND id<?"
            args.append(before)
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        # Ids first, so records already in memory are not read and parsed again: a dashboard asks every second.
        ids = [row[0] for row in self._raw(query.replace("SELECT *", "SELECT id", 1), args)]
        fetched: dict[int, VersionRecord] = {}
        for _ in range(3):  # another reader may evict a record between the two looks: read it again
            with self._mem:
                missing = [v for v in ids if v not in self._records and v not in fetched]
            if not missing:
                break
            marks = ",".join("?" * len(missing))
            fetched.update((r.id, r) for r in self._query(f"SELECT * FROM versions WHERE id IN ({marks})", missing))
        with self._mem:
            # what memory holds is taken before remembering the rest, which may evict some of it
            held = {v: self._records[v] for v in ids if v in self._records}
            for record in fetched.values():
                if record.id not in self._records:
                    self._remember(self._overlay(record))
            records = [held.get(v) or fetched[v] for v in ids if v in held or v in fetched]
            # a dirty record may have moved into (or out of) the status asked for
            if status is not None:
                records = [r for r in records if r.status == status]
                known = {r.id for r in records}
                records += [r for v, r in self._records.items() if v in self._dirty and v not in known
                            and r.status == status and (before is None or v < before)]
                records = sorted(records, key=lambda r: -r.id)[:limit]
        return records

    def counts(self) -> dict[str, int]:
        """Versions per status (the file's counts, corrected by the changes not written yet)."""
        counts = collections.Counter({status: n for status, n in
                                      self._raw("SELECT status, COUNT(*) FROM versions GROUP BY status")})
        with self._mem:
            unwritten = {v: self._records[v].status for v in self._dirty if v in self._records}
        if len(unwritten) > 500:  # storage down for long: past what one IN (...) query should carry
            rows = self._raw("SELECT id, status FROM versions")
            with self._mem:
                statuses = [self._records[i].status if i in self._records else s for i, s in rows]
            return dict(collections.Counter(statuses))
        if unwritten:
            marks = ",".join("?" * len(unwritten))
            for version, status in self._raw(f"SELECT id, status FROM versions WHERE id IN ({marks})",
                                             tuple(unwritten)):
                counts[status] -= 1
                counts[unwritten.pop(version)] += 1
            counts.update(unwritten.values())  # not in the file yet
        return {status: n for status, n in counts.items() if n > 0}

    def close(self) -> builtins.list[VersionRecord]:
        """Write what is pending and close; returns the records that could not be written (lost)."""
        self.flush(force=True)
        lost = self.unwritten()
        with self._db_lock:
            self._db.close()
        if self._reader is not self._db:
            with self._read_lock:
                self._reader.close()
        self._release_lock()
        return lost

    # ---- internals -----------------------------------------------------------------------------------
    def _remember(self, record: VersionRecord) -> None:
        self._records[record.id] = record
        self._records.move_to_end(record.id)
        clean = [v for v in self._records if v not in self._dirty]
        for version in clean[: max(0, len(clean) - _CLEAN_KEPT)]:
            del self._records[version]
            self._json.pop(version, None)

    def _overlay(self, record: VersionRecord) -> VersionRecord:
        if self._cached_ids is not None:
            record.cached = record.id in self._cached_ids
        return record

    def _write(self, record: VersionRecord) -> None:
        values = _row_values(record)
        assignments = ", ".join(f"{key}=?" for key in values)
        self._db.execute(f"UPDATE versions SET {assignments} WHERE id=?", (*values.values(), record.id))

    def _query(self, query: str, args: Any = ()) -> builtins.list[VersionRecord]:
        try:
            with self._read_lock:
                rows = self._reader.execute(query, args).fetchall()
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"the history cannot be read: {exc}") from exc
        return [_record(row) for row in rows]

    def _raw(self, query: str, args: Any = ()) -> builtins.list[tuple]:
        try:
            with self._read_lock:
                return [tuple(row) for row in self._reader.execute(query, args).fetchall()]
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"the history cannot be read: {exc}") from exc

    def _failed(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if self._problem is None:
            log.error("history storage failed (%s); keeping versions in memory until it can be written", text)
            self._problem_since = time.time()
        self._problem = text
        self._next_retry = time.monotonic() + self._retry.next_delay()

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


_COLUMNS = {
    "step", "mode", "status", "reason", "source_version", "updated_at", "committed_at", "bytes", "buckets",
    "tensors_sent", "tensors_skipped", "bytes_skipped", "stages", "receivers", "version_digest", "cached", "purpose",
    "owners", "knobs",
}


def _check_fields(fields: dict[str, Any]) -> None:
    if "status" in fields and fields["status"] not in STATUSES:
        raise ValueError(f"unknown status {fields['status']!r}")
    unknown = set(fields) - _COLUMNS
    if unknown:
        raise ValueError(f"unknown history columns {sorted(unknown)}")


def _row_values(record: VersionRecord) -> dict[str, Any]:
    values = {key: getattr(record, key) for key in sorted(_COLUMNS)}
    values["stages"] = json.dumps(values["stages"])
    values["receivers"] = json.dumps(values["receivers"])
    values["knobs"] = json.dumps(values["knobs"])
    values["cached"] = int(bool(values["cached"]))
    return values


def _record(row: sqlite3.Row) -> VersionRecord:
    data = dict(row)
    data["stages"] = json.loads(data["stages"])
    data["receivers"] = json.loads(data["receivers"])
    data["knobs"] = json.loads(data["knobs"])
    data["cached"] = bool(data["cached"])
    return VersionRecord(**data)


def _connect(path: str, *, readonly: bool = False, busy_s: float = 10.0) -> sqlite3.Connection:
    target = f"file:{path}?mode=ro" if readonly else path
    db = sqlite3.connect(target, uri=readonly, check_same_thread=False, isolation_level=None, timeout=busy_s)
    db.row_factory = sqlite3.Row
    return db


def _prepare(db: sqlite3.Connection, path: str) -> str:
    """Check that the file is a ckpt-engine history (or new), bring its schema up to date, and return its id."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if tables - {"versions", "sqlite_sequence", "meta"}:
        raise HistoryError(f"store.history_path: {path} is a SQLite database of something else (tables "
                           f"{sorted(tables)[:5]}); name a file of its own")
    if "versions" in tables:
        present = {row["name"] for row in db.execute("PRAGMA table_info(versions)")}
        missing = _REQUIRED_COLUMNS - present
        if missing:
            raise HistoryError(f"store.history_path: {path} has a 'versions' table that is not a ckpt-engine "
                               f"history (no {', '.join(sorted(missing))})")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA)
    present = {row["name"] for row in db.execute("PRAGMA table_info(versions)")}
    for name, definition in _ADDED_COLUMNS.items():  # histories of an older release lack newer columns
        if name not in present:
            db.execute(f"ALTER TABLE versions ADD COLUMN {name} {definition}")
    row = db.execute("SELECT value FROM meta WHERE key='history_id'").fetchone()
    if row is not None:
        return str(row[0])
    history_id = uuid.uuid4().hex
    db.execute("INSERT INTO meta (key, value) VALUES ('history_id', ?)", (history_id,))
    return history_id


def check_history_path(path: str) -> None:
    """Check, without creating anything, for problems ``serve`` would meet with this history path. Raises
    HistoryError naming ``store.history_path``."""
    if path == ":memory:":
        return
    target = Path(path)
    parent = next((p for p in [target.parent, *target.parent.parents] if p.exists()), Path("/"))
    if not parent.is_dir():
        raise HistoryError(f"store.history_path: {path}: {parent} is not a directory")
    if not target.exists():
        if not os.access(parent, os.W_OK | os.X_OK):
            raise HistoryError(f"store.history_path: {path}: cannot create files in {parent}")
        return
    if not target.is_file():
        raise HistoryError(f"store.history_path: {path} is not a regular file")
    for suffix in ("-wal", "-shm"):  # SQLite's own files beside it
        if Path(f"{path}{suffix}").is_dir():
            raise HistoryError(f"store.history_path: {path}{suffix} is a directory (SQLite needs that name for a file)")
    if not os.access(target, os.R_OK | os.W_OK) or not os.access(target.parent, os.W_OK | os.X_OK):
        raise HistoryError(f"store.history_path: {path}: not writable here (the file and its directory must be)")
    with open(target, "rb") as handle:
        head = handle.read(len(_SQLITE_MAGIC))
    if head and head != _SQLITE_MAGIC:
        raise HistoryError(f"store.history_path: {path} exists and is not a SQLite database")
    if head:
        try:
            db = _connect(path, readonly=True)
            try:
                tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if tables - {"versions", "sqlite_sequence", "meta"}:
                    raise HistoryError(f"store.history_path: {path} is a SQLite database of something else")
                if "versions" in tables:
                    present = {row["name"] for row in db.execute("PRAGMA table_info(versions)")}
                    if _REQUIRED_COLUMNS - present:
                        raise HistoryError(f"store.history_path: {path} has a 'versions' table that is not a "
                                           "ckpt-engine history")
            finally:
                db.close()
        except sqlite3.Error as exc:
            raise HistoryError(f"store.history_path: {path}: {exc}") from exc


def _lock_history(path: str, wait_s: float) -> Any:
    """An exclusive flock on the history file's real path for this process's life: a symlink or another name
    for the file is the same history. Raises HistoryLocked naming the holder. flock does not touch SQLite's own
    fcntl locks. The descriptor stays open until the store closes: closing any descriptor of the file would drop
    SQLite's fcntl locks. ``<history>.lock`` only says who holds the lock."""
    real = os.path.realpath(path)
    try:
        Path(real).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(real, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise HistoryError(f"store.history_path: cannot open {path}: {exc.strerror}") from exc
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise HistoryLocked(f"store.history_path: {path} is in use by another daemon ({_holder(real)}); one "
                                    "daemon writes a history at a time (store.lock_wait_s waits for it)") from None
            time.sleep(0.1)
    _say_holder(real)
    return _HistoryLock(fd)


class _HistoryLock:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def _say_holder(real: str) -> None:
    """Best effort: write who holds the history into ``<history>.lock``, never through a symlink."""
    try:
        fd = os.open(f"{real}.lock", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.warning("cannot write %s.lock (who holds the history): %s", real, exc.strerror)
        return
    with os.fdopen(fd, "w") as handle:
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")


def _holder(real: str) -> str:
    try:
        fd = os.open(f"{real}.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "another process"
    with os.fdopen(fd) as handle:
        return handle.read(200).strip() or "another process"
