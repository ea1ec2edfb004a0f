"""A bounded queue ordered by priority, then earliest deadline, then arrival."""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
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


@dataclass(frozen=True)
class BatchPolicy:
    """Dynamic batching for one task: at most `max_batch` items, the first waiting at
    most `max_delay_s` for company, sooner once a `preferred` size is reached."""

    max_batch: int
    max_delay_s: float
    preferred: frozenset[int] = frozenset()


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

    def set_max_size(self, max_size: int) -> None:
        """A new limit (a reload): jobs already queued past it stay, new ones wait for room."""
        with self._cond:
            self._max = max_size

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def put(self, item: WorkItem, force: bool = False) -> None:
        """Queue an item; QueueFull at the size limit unless `force` (jobs taken up again
        from the journal at start were accepted once already and are never refused)."""
        with self._cond:
            if len(self._heap) >= self._max and not force:
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

    def take_batch(self, first: WorkItem, policy: BatchPolicy, matches: Callable[[WorkItem], bool]) -> list[WorkItem]:
        """Grow a batch around `first` (already taken) with queued items that `matches`
        accepts, most urgent first, Triton-style: dispatch when the batch is full, when
        it has reached a preferred size and nothing more is waiting, or when the first
        item has waited `max_delay_s` since it arrived. Other items keep their places."""
        batch = [first]
        give_up_at = first.received_at + policy.max_delay_s
        with self._cond:
            while len(batch) < policy.max_batch:
                picked = self._pop_matching(matches, policy.max_batch - len(batch))
                batch.extend(picked)
                if len(batch) >= policy.max_batch or self._closed:
                    break
                if len(batch) in policy.preferred:
                    break  # below max_batch, so nothing that matches is left waiting

                remaining = give_up_at - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        return batch

    def take_matching(self, matches: Callable[[WorkItem], bool], limit: int) -> list[WorkItem]:
        """Up to `limit` queued jobs that `matches` takes, most urgent first, out of the queue."""
        with self._cond:
            return self._pop_matching(matches, limit)

    def _pop_matching(self, matches: Callable[[WorkItem], bool], limit: int) -> list[WorkItem]:
        if not self._heap or limit <= 0:
            return []
        ordered = sorted(self._heap)
        taken = [e for e in ordered if matches(e.item)][:limit]
        if taken:
            keep = {id(e) for e in taken}
            self._heap = [e for e in ordered if id(e) not in keep]  # sorted: still a heap
        return [e.item for e in taken]

    def cancel(self, job_id: str, allowed: Callable[[WorkItem], bool] | None = None) -> WorkItem | None:
        """Take a queued job out by id (None if it is not queued here, or `allowed`
        says no to it: the requester may withdraw only its own)."""
        with self._cond:
            for i, entry in enumerate(self._heap):
                if entry.item.job.id == job_id and (allowed is None or allowed(entry.item)):
                    self._heap.pop(i)
                    heapq.heapify(self._heap)
                    return entry.item
            return None

    def drain(self) -> list[WorkItem]:
        with self._cond:
            items = [e.item for e in sorted(self._heap)]
            self._heap.clear()
            return items

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
