"""The job journal on its own: states, durability across reopening, dedup window,
compaction and the size bound (a real SQLite file, filled for real)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from edge.journal.store import ANSWERED, QUEUED, SENT, SHORT_KEPT, WAL_LIMIT_BYTES, Journal, JournalFull


def test_a_job_goes_queued_sent_answered(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite3", 2**20, 60.0)
    j.accept("a", "edge/t1/jobs/ocr", b'{"id": "a"}', "replies", b"corr")
    entry = j.lookup("a")
    assert entry is not None and entry.state == QUEUED and entry.payload == b'{"id": "a"}'
    assert entry.correlation == b"corr" and entry.reply_topic == "replies"
    j.store_result("a", "replies", b"corr", b"result-a")
    entry = j.lookup("a")
    assert entry is not None and entry.state == SENT and entry.result == b"result-a"
    assert entry.payload is None  # the request is not needed once its result is kept
    j.mark_answered("a")
    entry = j.lookup("a")
    assert entry is not None and entry.state == ANSWERED
    assert j.counts() == {QUEUED: 0, SENT: 0, ANSWERED: 1}


def test_unfinished_jobs_survive_reopening_in_arrival_order(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    j = Journal(path, 2**20, 60.0)
    for name in ("first", "second", "third"):
        j.accept(name, "edge/t1/jobs/ocr", name.encode(), "r", None)
        time.sleep(0.01)
    j.store_result("second", "r", None, b"done")
    j.store_result("third", "r", None, b"done")
    j.mark_answered("third")
    j.close()  # what a restart sees: only what reached the file
    again = Journal(path, 2**20, 60.0)
    pending = again.pending()
    assert [(e.id, e.state) for e in pending] == [("first", QUEUED), ("second", SENT)]
    assert again.replayed("first") == 1 and again.replayed("first") == 2


def test_wal_mode_and_full_sync(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    Journal(path, 2**20, 60.0).accept("a", "t", b"x", "r", None)
    db = sqlite3.connect(str(path))
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_commits_never_checkpoint_and_the_checkpoint_holds_no_one_up(tmp_path: Path) -> None:
    """A commit never folds the WAL into the database (SQLite's automatic checkpoint would
    run inside the intake's or the responder's commit); the supervisor's checkpoint does,
    on its own connection, while another thread holds the journal's lock (a commit in
    progress), and the WAL file is cut back to its limit when next reused."""
    path = tmp_path / "j.sqlite3"
    j = Journal(path, 64 * 2**20, 60.0)
    assert j._db is not None and j._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    payload = b"x" * 8192  # a camera frame's worth of base64, near enough
    for batch in range(60):
        j.accept_many([(f"job-{batch}-{i}", "edge/t1/jobs/inspect", payload, "r", None) for i in range(20)])
    wal = path.with_name(path.name + "-wal")
    assert wal.stat().st_size > 2 * WAL_LIMIT_BYTES  # nothing folded it in along the way
    taken = threading.Event()
    release = threading.Event()

    def commit_in_progress() -> None:
        with j._lock:
            taken.set()
            release.wait(10)

    holder = threading.Thread(target=commit_in_progress)
    holder.start()
    try:
        assert taken.wait(5)
        folded = j.checkpoint()
        assert folded is not None and folded[0] > 0 and folded[1] == folded[0]  # every frame, lock or not
    finally:
        release.set()
        holder.join()
    j.accept("after", "edge/t1/jobs/inspect", payload, "r", None)  # the WAL is reused from its start
    assert wal.stat().st_size <= WAL_LIMIT_BYTES
    assert len(j.pending()) == 60 * 20 + 1
    j.close()
    assert len(Journal(path, 64 * 2**20, 60.0).pending()) == 60 * 20 + 1


def test_compaction_forgets_only_answered_jobs_past_the_window(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite3", 2**20, 100.0)
    for name in ("old-answered", "old-queued", "new-answered"):
        j.accept(name, "t", b"x", "r", None)
    for name in ("old-answered", "new-answered"):
        j.store_result(name, "r", None, b"ok")
        j.mark_answered(name)
    assert j.compact(now=time.time() + 50) == 0  # all within the window
    # Pretend time moved on past the window for the first two.
    with sqlite3.connect(str(j.path)) as db:
        db.execute("UPDATE jobs SET received = received - 1000 WHERE id LIKE 'old-%'")
    assert j.compact() == 1
    assert j.lookup("old-answered") is None
    assert j.lookup("old-queued") is not None  # never answered: kept whatever its age
    assert j.lookup("new-answered") is not None


def test_answered_embed_jobs_are_forgotten_sooner_than_the_dedup_window(tmp_path: Path) -> None:
    """An embed job's result (its vectors) is kept for a retry's while, not the whole
    window: a bulk indexing client cannot fill the journal for the other jobs."""
    j = Journal(tmp_path / "j.sqlite3", 2**20, 86400.0)
    for name, topic in (("e-old", "edge/t1/jobs/embed"), ("e-new", "edge/t1/jobs/embed"), ("q-old", "edge/t1/jobs/qa")):
        j.accept(name, topic, b"x", "r", None)
        j.store_result(name, "r", None, b"ok")
        j.mark_answered(name)
    j.accept("e-queued", "edge/t1/jobs/embed", b"x", "r", None)
    with sqlite3.connect(str(j.path)) as db:
        db.execute(
            "UPDATE jobs SET received = received - ? WHERE id LIKE '%-old' OR id = 'e-queued'",
            (SHORT_KEPT["embed"] + 1,),
        )
    assert j.compact() == 1
    assert j.lookup("e-old") is None
    assert j.lookup("e-new") is not None and j.lookup("q-old") is not None  # within their windows
    assert j.lookup("e-queued") is not None  # never answered: kept


def test_a_full_journal_refuses_then_recovers_when_space_is_freed(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite3", 256 * 1024, 60.0)
    payload = b"p" * 20_000
    accepted = 0
    with pytest.raises(JournalFull, match="full"):
        for i in range(100):
            j.accept(f"job-{i}", "t", payload, "r", None)
            accepted += 1
    assert 3 <= accepted < 20
    assert j.full_since is not None
    assert j.lookup(f"job-{accepted}") is None  # refused means not kept, not half-kept
    # Answering jobs drops their payloads; the space is reused.
    for i in range(accepted):
        j.store_result(f"job-{i}", "r", None, b"ok")
    j.accept("after", "t", payload, "r", None)
    assert j.full_since is None
    assert all(j.lookup(f"job-{i}") is not None for i in range(accepted))


def test_a_batch_of_results_is_kept_in_one_commit(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite3", 2**20, 60.0)
    for name in ("a", "b"):
        j.accept(name, "t", name.encode(), "r", None)
    j.store_results([("a", "r", b"ca", b"result-a"), ("b", "r", None, b"result-b"), ("refused", "r", None, b"err")])
    got = {e.id: (e.state, e.result) for e in j.pending()}
    assert got == {"a": (SENT, b"result-a"), "b": (SENT, b"result-b"), "refused": (SENT, b"err")}
    entry = j.lookup("a")
    assert entry is not None and entry.payload is None  # the request is not needed once its result is kept


def _statements(j: Journal) -> list[str]:
    """Every statement the journal's connection runs from now on."""
    seen: list[str] = []
    assert j._db is not None
    j._db.set_trace_callback(seen.append)
    return seen


def test_jobs_taken_together_are_kept_in_one_commit(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite3", 2**20, 60.0)
    seen = _statements(j)
    rows = [(f"j{i}", "edge/t1/jobs/ocr", f"p{i}".encode(), "r", None) for i in range(5)]
    assert j.accept_many(rows) == [None] * 5
    assert sum(s == "COMMIT" for s in seen) == 1
    j.close()  # what a restart sees: the commit reached the file
    again = Journal(tmp_path / "j.sqlite3", 2**20, 60.0)
    want = [(f"j{i}", QUEUED, f"p{i}".encode()) for i in range(5)]
    assert [(e.id, e.state, e.payload) for e in again.pending()] == want


def test_a_batch_that_does_not_fit_keeps_those_that_do(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite3", 256 * 1024, 60.0)
    rows = [(f"job-{i}", "t", b"p" * 20_000, "r", None) for i in range(30)]
    refused = j.accept_many(rows)
    kept = [i for i, why in enumerate(refused) if why is None]
    assert 3 <= len(kept) < 20 and kept == list(range(len(kept)))  # the first ones, in order
    assert all(isinstance(why, JournalFull) for why in refused[len(kept) :])
    assert all(j.lookup(f"job-{i}") is not None for i in kept)
    assert j.lookup(f"job-{len(kept)}") is None and j.full_since is not None


def test_an_answered_mark_waits_for_the_next_durable_commit(tmp_path: Path) -> None:
    """Marks come once per result from paho's thread: they skip the fsync (a lost mark
    only sends a stored result again); every commit of a job or result still has it."""
    j = Journal(tmp_path / "j.sqlite3", 2**20, 60.0)
    j.accept("a", "t", b"x", "r", None)
    j.store_result("a", "r", None, b"ok")
    seen = _statements(j)
    j.mark_answered("a")
    update = next(i for i, s in enumerate(seen) if s.startswith("UPDATE jobs SET state"))
    assert seen[update - 1] == "PRAGMA synchronous=NORMAL" and seen[update + 1] == "PRAGMA synchronous=FULL"
    assert j._db is not None and j._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL again
    entry = j.lookup("a")
    assert entry is not None and entry.state == ANSWERED


def test_a_batch_finds_a_journal_that_cannot_be_opened_refused_row_by_row(tmp_path: Path) -> None:
    from edge.journal.store import JournalUnavailable

    j = Journal(tmp_path / "j.sqlite3", 2**20, 60.0)
    j.close()  # as a journal that could not be opened
    refused = j.accept_many([(f"j{i}", "t", b"x", "r", None) for i in range(3)])
    assert len(refused) == 3 and all(isinstance(why, JournalUnavailable) for why in refused)
    assert j.full_since is not None
