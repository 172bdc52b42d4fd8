"""Version history in SQLite (WAL). Every version ever requested has a row; ids come from AUTOINCREMENT, so
they rise monotonically and are never reused, also across restarts. Rows are never deleted."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TERMINAL = ("committed", "failed", "cancelled")
STATUSES = ("requested", "snapshotting", "transferring", "verifying", *TERMINAL)

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
    cached INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS versions_status ON versions(status);
"""
_ADDED_COLUMNS = {"bytes_skipped": "INTEGER NOT NULL DEFAULT 0"}  # since the first release


@dataclass
class VersionRecord:
    id: int
    step: int | None
    mode: str
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class HistoryStore:
    """Thread-safe: one connection guarded by a lock (SQLite serialises writers anyway)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """Histories written by an older release lack newer columns; add them (rows are never rewritten)."""
        present = {row["name"] for row in self._db.execute("PRAGMA table_info(versions)")}
        for name, definition in _ADDED_COLUMNS.items():
            if name not in present:
                self._db.execute(f"ALTER TABLE versions ADD COLUMN {name} {definition}")

    def number_after(self, version: int) -> bool:
        """Make the next version id larger than ``version``; True if that moved it. Agents that outlived a
        daemon hold versions of a history this one may not have (a lost or replaced history file): a new
        version must never reuse their ids (caches, sparse bases and receivers' bookkeeping go by id)."""
        with self._lock:
            row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'versions'").fetchone()
            if version < 1 or (row is not None and row["seq"] >= version):
                return False
            if row is None:
                self._db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('versions', ?)", (version,))
            else:
                self._db.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'versions'", (version,))
            return True

    def fail_unfinished(self, reason: str) -> list[int]:
        """Mark every version that was in flight (e.g. at a crash) failed; returns their ids."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM versions WHERE status NOT IN ({','.join('?' * len(TERMINAL))})", TERMINAL
            ).fetchall()
            ids = [row["id"] for row in rows]
            now = time.time()
            self._db.executemany("UPDATE versions SET status='failed', reason=?, updated_at=? WHERE id=?",
                                 [(reason, now, i) for i in ids])
            return ids

    def create(self, *, mode: str, step: int | None, source_version: int | None = None) -> VersionRecord:
        now = time.time()
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO versions (step, mode, status, source_version, created_at, updated_at) "
                "VALUES (?, ?, 'requested', ?, ?, ?)", (step, mode, source_version, now, now))
            version = cursor.lastrowid
        record = self.get(version)
        _require(record, version)
        return record

    def update(self, version: int, **fields: Any) -> VersionRecord:
        """Set columns of a version; ``stages`` and ``receivers`` are stored as JSON."""
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"unknown status {fields['status']!r}")
        fields["updated_at"] = time.time()
        if fields.get("status") == "committed":
            fields.setdefault("committed_at", fields["updated_at"])
        for key in ("stages", "receivers"):
            if key in fields:
                fields[key] = json.dumps(fields[key])
        if "cached" in fields:
            fields["cached"] = int(bool(fields["cached"]))
        unknown = set(fields) - _COLUMNS
        if unknown:
            raise ValueError(f"unknown history columns {sorted(unknown)}")
        assignments = ", ".join(f"{key}=?" for key in fields)
        with self._lock:
            self._db.execute(f"UPDATE versions SET {assignments} WHERE id=?", (*fields.values(), version))
        record = self.get(version)
        _require(record, version)
        return record

    def set_cached(self, cached_versions: set[int]) -> None:
        """Record which versions the trainer's cache holds now."""
        with self._lock:
            self._db.execute("UPDATE versions SET cached=0 WHERE cached=1")
            self._db.executemany("UPDATE versions SET cached=1 WHERE id=?", [(v,) for v in cached_versions])

    def get(self, version: int) -> VersionRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM versions WHERE id=?", (version,)).fetchone()
        return _record(row) if row else None

    def latest(self, status: str | None = None) -> VersionRecord | None:
        rows = self.list(limit=1, status=status)
        return rows[0] if rows else None

    def list(self, *, limit: int = 50, status: str | None = None) -> list[VersionRecord]:
        """Newest first."""
        query, args = "SELECT * FROM versions", []
        if status is not None:
            query += " WHERE status=?"
            args.append(status)
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [_record(row) for row in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) AS n FROM versions GROUP BY status").fetchall()
        return {row["status"]: row["n"] for row in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()


_COLUMNS = {
    "step", "mode", "status", "reason", "source_version", "updated_at", "committed_at", "bytes", "buckets",
    "tensors_sent", "tensors_skipped", "bytes_skipped", "stages", "receivers", "version_digest", "cached",
}


def _require(record: VersionRecord | None, version: int) -> None:
    if record is None:
        raise RuntimeError(f"history lost version {version} right after writing it")


def _record(row: sqlite3.Row) -> VersionRecord:
    data = dict(row)
    data["stages"] = json.loads(data["stages"])
    data["receivers"] = json.loads(data["receivers"])
    data["cached"] = bool(data["cached"])
    return VersionRecord(**data)
