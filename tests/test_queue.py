from __future__ import annotations

import threading
import time

import pytest

from edge.protocol.jobs import JobBase, ParsedJob
from edge.scheduler.queue import PriorityDeadlineQueue, QueueFull
from edge.scheduler.work import Reply, WorkItem


def item(job_id: str, priority: int = 5, deadline_in: float | None = None) -> WorkItem:
    now = time.monotonic()
    job = ParsedJob(job_id, "ocr", priority, None, JobBase(id=job_id))
    return WorkItem(job, Reply("r"), now, now + deadline_in if deadline_in is not None else None)


def test_priority_then_earliest_deadline_then_arrival() -> None:
    q = PriorityDeadlineQueue(10)
    for it in (
        item("late-normal", 5, 10.0),
        item("no-deadline", 5),
        item("urgent", 0),
        item("soon-normal", 5, 1.0),
        item("background", 9, 0.5),
        item("no-deadline-2", 5),
    ):
        q.put(it)
    order = [q.get(0).job.id for _ in range(6)]  # type: ignore[union-attr]
    assert order == ["urgent", "soon-normal", "late-normal", "no-deadline", "no-deadline-2", "background"]


def test_bounded() -> None:
    q = PriorityDeadlineQueue(2)
    q.put(item("a"))
    q.put(item("b"))
    with pytest.raises(QueueFull):
        q.put(item("c"))
    assert len(q) == 2


def test_get_blocks_until_put_and_close_wakes() -> None:
    q = PriorityDeadlineQueue(2)
    assert q.get(timeout=0.05) is None
    threading.Timer(0.1, lambda: q.put(item("x"))).start()
    got = q.get(timeout=5)
    assert got is not None and got.job.id == "x"
    threading.Timer(0.1, q.close).start()
    t0 = time.monotonic()
    assert q.get(timeout=5) is None
    assert time.monotonic() - t0 < 2


def test_expired() -> None:
    assert item("a", deadline_in=-0.001).expired()
    assert not item("b", deadline_in=60).expired()
    assert not item("c").expired()
