"""A bounded queue ordered by priority, then earliest deadline, then arrival."""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from dataclasses import dataclass, field

from edge.scheduler.work import WorkItem


@dataclass(order=True)
class _Entry:
    priority: int
    deadline: float
    seq: int
    item: WorkItem = field(compare=False)


class QueueFull(Exception):
    pass


class PriorityDeadlineQueue:
    def __init__(self, max_size: int) -> None:
        self._heap: list[_Entry] = []
        self._max = max_size
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    @property
    def max_size(self) -> int:
        return self._max

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def put(self, item: WorkItem) -> None:
        with self._cond:
            if len(self._heap) >= self._max:
                raise QueueFull(f"queue holds {len(self._heap)} jobs, limit {self._max}")
            deadline = item.deadline_at if item.deadline_at is not None else math.inf
            heapq.heappush(self._heap, _Entry(item.job.priority, deadline, next(self._seq), item))
            self._cond.notify()

    def get(self, timeout: float | None = None) -> WorkItem | None:
        """The most urgent item, or None on timeout or once closed and empty."""
        with self._cond:
            if not self._heap and not self._closed:
                self._cond.wait(timeout)
            if not self._heap:
                return None
            return heapq.heappop(self._heap).item

    def drain(self) -> list[WorkItem]:
        with self._cond:
            items = [e.item for e in sorted(self._heap)]
            self._heap.clear()
            return items

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
