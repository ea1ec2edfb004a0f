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
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Sequence
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


# A new job: id, topic, payload, reply topic, correlation.
NewJob = tuple[str, str, bytes, str, bytes | None]

_ACCEPT = (
    "INSERT OR REPLACE INTO jobs (id, state, topic, payload, digest, reply_topic, correlation, received) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


# sqlite3.SQLITE_FULL and the exception's sqlite_errorcode come with Python 3.11; the
# code is SQLite's own (13) and the message says it on every version.
_SQLITE_FULL = 13


def _is_full(err: sqlite3.Error) -> bool:
    return getattr(err, "sqlite_errorcode", None) == _SQLITE_FULL or "full" in str(err)


class JournalUnavailable(JournalFull):
    """The journal cannot be opened at all (a full or failing disk at start)."""


# Tasks whose answered jobs are kept for less than the dedup window, by task: an embed
# job's result is its vectors (about 2 MB for 256 texts) and cheap to compute again, so a
# client indexing in bulk would otherwise fill the journal within the day and leave every
# other job refused `storage_full`. Kept long enough for a client's retry to be answered
# from the journal.
SHORT_KEPT = {"embed": 600.0}
_META = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
# The WAL is folded back into the database by `checkpoint`, on the supervisor's own
# connection, never by a commit: SQLite's automatic checkpoint runs inside whichever commit
# passes its threshold (the intake's, the responder's) and, with synchronous=FULL, makes
# that commit wait for the database file's fsync too; a checkpoint under the shared lock
# held up every thread for as long as the WAL took to copy. After a checkpoint the WAL
# file is cut back to this size when it is next reused.
WAL_LIMIT_BYTES = 4 << 20


class Journal:
    """The job journal. Opening it never stops the daemon: a file that is not a sound
    SQLite database is set aside (renamed with a timestamp) and a new one started; a
    journal that vanished or was replaced since the last run is noticed (a marker file
    beside it carries the journal's identity); a disk too full to open it leaves the
    journal unavailable (new jobs are refused `storage_full`) until `retry_open` succeeds.
    Each of these is `problem`, reported loudly (log, `edgectl status` WARNING), with
    `lost`, the unfinished jobs known to be gone (None: unknown)."""

    def __init__(self, path: Path, max_bytes: int, dedup_window_s: float) -> None:
        self.path = path
        self.dedup_window_s = dedup_window_s
        self._max_bytes = max_bytes
        self._marker = path.with_name(path.name + ".id")
        # A second small record of how many unfinished jobs the journal holds, kept beside
        # it (record_count): what a journal found damaged, emptied or deleted had in it
        # when it can no longer say so itself.
        self._tally = path.with_name(path.name + ".count")
        self._tallied: int | None = None
        self.lost_as_of: float | None = None  # when `lost` was counted, if from the record
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by paho's thread, the workers and the supervisor; the
        # lock serialises them (SQLite would anyway, and a lock is cheaper than a retry).
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        # The checkpointer's own connection and lock (`checkpoint`): it copies the WAL into
        # the database while the others go on committing.
        self._checkpoint_lock = threading.Lock()
        self._checkpointer: sqlite3.Connection | None = None
        self.full_since: float | None = None  # set while new jobs find no room
        self.problem: str | None = None
        self.lost: int | None = None
        self.set_aside: Path | None = None
        self._open()

    @property
    def available(self) -> bool:
        return self._db is not None

    def _open(self) -> None:
        try:
            self._check_file()
            self._db = self._connect()
            self._check_identity()
        except (sqlite3.Error, OSError) as err:
            if self._db is not None:
                self._db.close()
            self._db = None
            self.full_since = self.full_since or time.time()
            problem = f"job journal unavailable ({err}): new jobs are refused until it opens"
            if problem != self.problem:  # retried every second: said once, not every time
                logger.error("%s", problem)
            self.problem = problem

    def retry_open(self) -> bool:
        """Try again to open a journal that could not be opened; True once it is open."""
        if self._db is not None:
            return True
        self._open()
        if self._db is not None:
            self.full_since = None
            if self.problem is not None and self.problem.startswith("job journal unavailable"):
                self.problem = None
            logger.warning("job journal %s is open again", self.path)
        return self._db is not None

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoint() does it, off the hot threads
            db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
            page = int(db.execute("PRAGMA page_size").fetchone()[0])
            db.execute(f"PRAGMA max_page_count={max(16, self._max_bytes // page)}")
            db.executescript(_SCHEMA + _META + ";")
        except BaseException:
            db.close()
            raise
        return db

    def _check_file(self) -> None:
        """Set aside a journal file that SQLite cannot read or whose integrity check
        fails (counting, where it can be read, the unfinished jobs it held)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        reason = None
        try:
            probe = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                verdict = probe.execute("PRAGMA quick_check").fetchone()[0]
                if verdict != "ok":
                    reason = f"integrity check: {verdict}"
            finally:
                probe.close()
        except sqlite3.DatabaseError as err:
            reason = str(err)
        if reason is None:
            return
        lost = self._count_unfinished(self.path)
        if lost is None:
            lost, self.lost_as_of = self._last_count()
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.bad-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            part = Path(f"{self.path}{suffix}")
            if part.exists():
                os.replace(part, Path(f"{aside}{suffix}"))
        self.set_aside, self.lost = aside, lost
        self.problem = (
            f"the job journal was unreadable ({reason}) and was set aside as {aside.name}; a new one was started; "
            + self._lost_words()
        )
        logger.error("%s", self.problem)

    def _lost_words(self) -> str:
        if self.lost is None:
            return "what it held is lost (no count of it was kept)"
        if self.lost_as_of is None:
            return f"{self.lost} unfinished job(s) in it are lost"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.lost_as_of))
        return f"{self.lost} unfinished job(s) in it are lost (its last count, at {when})"

    def _last_count(self, ident: str | None = None) -> tuple[int | None, float | None]:
        """The unfinished jobs the count record says the journal held, and when it
        counted them; (None, None) without a record (or one of another journal than
        `ident`, where that is known)."""
        try:
            doc = json.loads(self._tally.read_text(encoding="ascii"))
            count, at, of = int(doc["unfinished"]), float(doc["at"]), doc.get("journal")
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("the journal's count record %s cannot be read: %s", self._tally, err)
            return None, None
        if ident is not None and of != ident:
            return None, None
        return count, at

    def record_count(self) -> None:
        """Write how many unfinished jobs the journal holds to the count record, when
        that changed since the last write (called about once a second, and at a stop).
        Not fsynced: it is an account of the journal, not the journal; a power cut can
        leave it a second behind."""
        with self._lock:
            if self._db is None:
                return
            count = int(self._db.execute("SELECT COUNT(*) FROM jobs WHERE state != ?", (ANSWERED,)).fetchone()[0])
            row = self._db.execute("SELECT value FROM meta WHERE key = 'id'").fetchone()
        if count == self._tallied:
            return
        doc = {"journal": str(row[0]) if row else None, "unfinished": count, "at": time.time()}
        tmp = self._tally.with_name(self._tally.name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc) + "\n", encoding="ascii")
            os.replace(tmp, self._tally)
        except OSError as err:  # a full disk: the journal itself says so elsewhere
            logger.debug("could not write the journal's count record: %s", err)
            return
        self._tallied = count

    @staticmethod
    def _count_unfinished(path: Path) -> int | None:
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                return int(db.execute("SELECT COUNT(*) FROM jobs WHERE state != ?", (ANSWERED,)).fetchone()[0])
            finally:
                db.close()
        except sqlite3.Error:
            return None

    def _check_identity(self) -> None:
        """The journal carries an identity, and a marker beside it remembers it: a
        journal deleted, emptied or replaced since the last run is a new journal where
        the marker expects the old one, and the jobs the old one held are gone."""
        assert self._db is not None
        row = self._db.execute("SELECT value FROM meta WHERE key = 'id'").fetchone()
        try:
            expected = self._marker.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            expected = None
        if row is None:
            ident = uuid.uuid4().hex
            self._db.execute("INSERT INTO meta (key, value) VALUES ('id', ?)", (ident,))
            if expected is not None and self.problem is None:
                self.lost, self.lost_as_of = self._last_count(expected)
                self.problem = (
                    "the job journal went missing or was emptied since the last run (a new one was started): "
                    + self._lost_words()
                )
                logger.error("%s", self.problem)
        else:
            ident = str(row[0])
            if expected is not None and expected != ident and self.problem is None:
                self.lost, self.lost_as_of = self._last_count(expected)
                self.problem = "the job journal was replaced by another since the last run; " + self._lost_words()
                logger.error("%s", self.problem)
        if expected != ident:
            tmp = self._marker.with_name(self._marker.name + ".tmp")
            with open(tmp, "w", encoding="ascii") as fh:
                fh.write(ident + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._marker)

    def close(self) -> None:
        try:
            self.record_count()  # exact at a clean stop
        except sqlite3.Error as err:
            logger.warning("could not count the journal's unfinished jobs at close: %s", err)
        with self._checkpoint_lock:
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def checkpoint(self) -> tuple[int, int] | None:
        """Fold what the WAL holds into the database, on a connection of its own and
        without the journal's lock: a PASSIVE checkpoint waits for no writer and holds
        none up, so the intake and the responder commit meanwhile. The supervisor calls
        it every second. Returns (frames in the WAL, frames folded), or None where the
        journal is not open or the checkpoint could not run (a full disk: said, and
        tried again at the next call)."""
        if self._db is None:
            return None
        with self._checkpoint_lock:
            try:
                if self._checkpointer is None:
                    db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
                    db.execute("PRAGMA synchronous=FULL")
                    self._checkpointer = db
                _, frames, folded = self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as err:
                logger.warning("journal checkpoint did not run: %s", err)
                return None
        return int(frames), int(folded)

    def _write(self, sql: str, args: tuple[object, ...]) -> int:
        with self._lock:
            if self._db is None:
                raise JournalUnavailable(f"the job journal {self.path} could not be opened")
            try:
                cur = self._db.execute(sql, args)
            except sqlite3.OperationalError as err:
                if _is_full(err):
                    raise JournalFull(f"the job journal {self.path} is full: {err}") from err
                raise
            return cur.rowcount

    @staticmethod
    def _commit_many(
        db: sqlite3.Connection, sql: str, values: Sequence[tuple[object, ...]]
    ) -> sqlite3.OperationalError | None:
        """Run `sql` for every row in one transaction (one commit, one fsync); with the
        lock held. Returns the error if the journal is full (nothing written), else None."""
        try:
            db.execute("BEGIN")
            db.executemany(sql, values)
            db.execute("COMMIT")
        except sqlite3.OperationalError as err:
            if db.in_transaction:
                db.execute("ROLLBACK")
            if not _is_full(err):
                raise
            return err
        return None

    def lookup(self, job_id: str) -> Entry | None:
        with self._lock:
            if self._db is None:
                return None
            row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return Entry(*row) if row else None

    def accept(self, job_id: str, topic: str, payload: bytes, reply_topic: str, correlation: bytes | None) -> None:
        """Keep a new job; durable when this returns. JournalFull if it cannot be kept.
        Whether the last new job found room is what `full_since` reports."""
        (refused,) = self.accept_many([(job_id, topic, payload, reply_topic, correlation)])
        if refused is not None:
            raise refused

    def accept_many(self, rows: Sequence[NewJob]) -> list[JournalFull | None]:
        """Keep several new jobs (id, topic, payload, reply topic, correlation) in one
        commit, so a burst of camera frames costs one fsync, not one each; durable when
        this returns. Per row: None if kept, else why not. When the batch does not fit,
        each is tried alone, so those that fit are still kept."""
        if not rows:
            return []
        now = time.time()
        values = [(i, QUEUED, t, p, digest(p), r, c, now) for i, t, p, r, c in rows]
        try:
            with self._lock:
                if self._db is None:
                    raise JournalUnavailable(f"the job journal {self.path} could not be opened")
                # REPLACE: a row still there for an id is past the dedup window (the
                # intake checked), so the id starts afresh.
                err = self._commit_many(self._db, _ACCEPT, values)
                if err is not None and len(rows) == 1:
                    raise JournalFull(f"the job journal {self.path} is full: {err}") from err
                full = err is not None
        except JournalFull as err:
            if self.full_since is None:
                self.full_since = time.time()
            return [err] * len(rows)
        if full:
            return [self.accept_many([row])[0] for row in rows]
        self.full_since = None
        return [None] * len(rows)

    def replayed(self, job_id: str) -> int:
        """Count one more start that took the job up again; returns the count."""
        self._write("UPDATE jobs SET attempts = attempts + 1 WHERE id = ?", (job_id,))
        entry = self.lookup(job_id)
        return entry.attempts if entry else 0

    def store_result(
        self,
        job_id: str,
        reply_topic: str,
        correlation: bytes | None,
        result: bytes,
        request_digest: str | None = None,
    ) -> None:
        """The result about to be published. A request answered without being accepted
        first (a cancel) gets its row here, with its digest, so a repeat is answered the
        same way and an id reused for a different request is refused."""
        try:
            self._write(
                "INSERT INTO jobs (id, state, topic, digest, reply_topic, correlation, received, result) "
                "VALUES (?, ?, '', ?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET state = excluded.state, result = excluded.result, payload = NULL",
                (job_id, SENT, request_digest, reply_topic, correlation, time.time(), result),
            )
        except JournalFull:
            # The answer still goes out; only its replay after a crash is lost.
            logger.error("journal full: the result of %s is published but not kept", job_id)

    def store_results(self, rows: list[tuple[str, str, bytes | None, bytes]]) -> None:
        """Several results (job id, reply topic, correlation, result) in one commit: a
        batch's results cost one fsync, not one each."""
        with self._lock:
            if self._db is None:
                logger.error("journal unavailable: %d results are published but not kept", len(rows))
                return
            full = self._commit_many(
                self._db,
                "INSERT INTO jobs (id, state, topic, reply_topic, correlation, received, result) "
                "VALUES (?, ?, '', ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET state = excluded.state, result = excluded.result, payload = NULL",
                [(job_id, SENT, topic, corr, time.time(), result) for job_id, topic, corr, result in rows],
            )
            if full is not None:
                logger.error("journal full: %d results are published but not kept", len(rows))

    def mark_answered(self, job_id: str) -> None:
        """The broker has the result. Written without an fsync of its own (the next
        durable commit carries it to disk): a mark lost to a power cut only makes the
        next start send the stored result again, which a requester takes as a repeat."""
        with self._lock:
            if self._db is None:
                return
            try:
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute(
                    "UPDATE jobs SET state = ?, answered = ? WHERE id = ?", (ANSWERED, time.time(), job_id)
                )
            except sqlite3.OperationalError as err:
                if not _is_full(err):
                    raise
                logger.error("journal full: could not mark %s answered", job_id)
            finally:
                self._db.execute("PRAGMA synchronous=FULL")

    def pending(self) -> list[Entry]:
        """Jobs to take up again on start, oldest first."""
        with self._lock:
            if self._db is None:
                return []
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE state != ? ORDER BY received", (ANSWERED,)
            ).fetchall()
        return [Entry(*r) for r in rows]

    def compact(self, now: float | None = None) -> int:
        """Forget answered jobs older than the dedup window (the tasks of SHORT_KEPT: older
        than theirs); returns how many."""
        now = now if now is not None else time.time()
        cutoff = now - self.dedup_window_s
        if self._db is None:
            return 0
        removed = self._write("DELETE FROM jobs WHERE state = ? AND received < ?", (ANSWERED, cutoff))
        for task, keep_s in SHORT_KEPT.items():
            short = now - min(keep_s, self.dedup_window_s)
            removed += self._write(
                "DELETE FROM jobs WHERE state = ? AND received < ? AND topic LIKE ?",
                (ANSWERED, short, f"%/jobs/{task}"),
            )
        self.checkpoint()  # the deletions folded in too, without holding anyone up
        if removed:
            logger.info("journal compacted: %d answered jobs past the dedup window", removed)
        return removed

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = (
                []
                if self._db is None
                else self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
            )
        out = {QUEUED: 0, SENT: 0, ANSWERED: 0}
        out.update({state: int(n) for state, n in rows})
        return out
