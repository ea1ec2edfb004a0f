"""The job journal: every accepted job is on disk before the broker hears it was received.

One SQLite database in WAL mode with synchronous=FULL, so a committed row survives a
power cut (the commit returns only after the WAL is fsynced). A job goes through three
states, one row per job id:

  queued    accepted and acknowledged to the broker; no result yet
  sent      its result is stored and published; the broker has not confirmed it yet
  answered  the broker acknowledged the result (PUBACK)

On start, `queued` jobs run again and `sent` results are published again from the
journal (never recomputed). A job id seen again within the dedup window is answered
from the journal instead of running twice. Answered rows older than the window are
compacted away. The file is bounded (max_bytes): when it, or the disk, is full,
`accept` raises JournalFull and the job is refused rather than accepted unkept.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

QUEUED = "queued"
SENT = "sent"
ANSWERED = "answered"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    topic TEXT NOT NULL,
    payload BLOB,
    digest TEXT,
    reply_topic TEXT NOT NULL,
    correlation BLOB,
    received REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    result BLOB,
    answered REAL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, received);
"""


class JournalFull(Exception):
    """The journal cannot keep one more job (its size bound, or the disk, is full)."""


@dataclass(frozen=True)
class Entry:
    id: str
    state: str
    topic: str
    payload: bytes | None
    digest: str | None  # sha256 of the request, to tell a repeat from a reused id
    reply_topic: str
    correlation: bytes | None
    received: float
    attempts: int
    result: bytes | None


_COLUMNS = "id, state, topic, payload, digest, reply_topic, correlation, received, attempts, result"


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def _is_full(err: sqlite3.Error) -> bool:
    return getattr(err, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(err)


class Journal:
    def __init__(self, path: Path, max_bytes: int, dedup_window_s: float) -> None:
        self.path = path
        self.dedup_window_s = dedup_window_s
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by paho's thread, the workers and the supervisor; the
        # lock serialises them (SQLite would anyway, and a lock is cheaper than a retry).
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        page = int(self._db.execute("PRAGMA page_size").fetchone()[0])
        self._db.execute(f"PRAGMA max_page_count={max(16, max_bytes // page)}")
        self._db.executescript(_SCHEMA)
        self.full_since: float | None = None  # set while new jobs find no room

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[object, ...]) -> int:
        with self._lock:
            try:
                cur = self._db.execute(sql, args)
            except sqlite3.OperationalError as err:
                if _is_full(err):
                    raise JournalFull(f"the job journal {self.path} is full: {err}") from err
                raise
            return cur.rowcount

    def lookup(self, job_id: str) -> Entry | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return Entry(*row) if row else None

    def accept(self, job_id: str, topic: str, payload: bytes, reply_topic: str, correlation: bytes | None) -> None:
        """Keep a new job; durable when this returns. JournalFull if it cannot be kept.
        Whether the last new job found room is what `full_since` reports."""
        try:
            self._write(
                # REPLACE: a row still there for this id is past the dedup window (the
                # intake checked), so the id starts afresh.
                "INSERT OR REPLACE INTO jobs (id, state, topic, payload, digest, reply_topic, correlation, received) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, QUEUED, topic, payload, digest(payload), reply_topic, correlation, time.time()),
            )
        except JournalFull:
            if self.full_since is None:
                self.full_since = time.time()
            raise
        self.full_since = None

    def replayed(self, job_id: str) -> int:
        """Count one more start that took the job up again; returns the count."""
        self._write("UPDATE jobs SET attempts = attempts + 1 WHERE id = ?", (job_id,))
        entry = self.lookup(job_id)
        return entry.attempts if entry else 0

    def store_result(self, job_id: str, reply_topic: str, correlation: bytes | None, result: bytes) -> None:
        """The result about to be published (a job refused at intake gets a row here too,
        so a redelivery of it is answered the same way)."""
        try:
            self._write(
                "INSERT INTO jobs (id, state, topic, reply_topic, correlation, received, result) "
                "VALUES (?, ?, '', ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET state = excluded.state, result = excluded.result, payload = NULL",
                (job_id, SENT, reply_topic, correlation, time.time(), result),
            )
        except JournalFull:
            # The answer still goes out; only its replay after a crash is lost.
            logger.error("journal full: the result of %s is published but not kept", job_id)

    def store_results(self, rows: list[tuple[str, str, bytes | None, bytes]]) -> None:
        """Several results (job id, reply topic, correlation, result) in one commit: a
        batch's results cost one fsync, not one each."""
        with self._lock:
            try:
                self._db.execute("BEGIN")
                self._db.executemany(
                    "INSERT INTO jobs (id, state, topic, reply_topic, correlation, received, result) "
                    "VALUES (?, ?, '', ?, ?, ?, ?) "
                    "ON CONFLICT (id) DO UPDATE SET state = excluded.state, result = excluded.result, payload = NULL",
                    [(job_id, SENT, topic, corr, time.time(), result) for job_id, topic, corr, result in rows],
                )
                self._db.execute("COMMIT")
            except sqlite3.OperationalError as err:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if not _is_full(err):
                    raise
                logger.error("journal full: %d results are published but not kept", len(rows))

    def mark_answered(self, job_id: str) -> None:
        try:
            self._write("UPDATE jobs SET state = ?, answered = ? WHERE id = ?", (ANSWERED, time.time(), job_id))
        except JournalFull:
            logger.error("journal full: could not mark %s answered", job_id)

    def pending(self) -> list[Entry]:
        """Jobs to take up again on start, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE state != ? ORDER BY received", (ANSWERED,)
            ).fetchall()
        return [Entry(*r) for r in rows]

    def compact(self, now: float | None = None) -> int:
        """Forget answered jobs older than the dedup window; returns how many."""
        cutoff = (now if now is not None else time.time()) - self.dedup_window_s
        removed = self._write("DELETE FROM jobs WHERE state = ? AND received < ?", (ANSWERED, cutoff))
        with self._lock:
            # Fold the WAL back into the database so the file does not keep growing.
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if removed:
            logger.info("journal compacted: %d answered jobs past the dedup window", removed)
        return removed

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        out = {QUEUED: 0, SENT: 0, ANSWERED: 0}
        out.update({state: int(n) for state, n in rows})
        return out
