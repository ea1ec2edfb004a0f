"""Worker threads, one per branch: take the most urgent job, run it, hand back the outcome."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge.protocol.errors import ErrorCode, JobError
from edge.scheduler.queue import BatchPolicy, PriorityDeadlineQueue
from edge.scheduler.work import WorkItem

# Both branches are threads of one process. A thread waiting for the interpreter lock
# gets it after at most this long; Python's default (5 ms) is paid at every hand-over,
# and a camera job's path hands over several times while the text branch decodes.
GIL_SWITCH_INTERVAL_S = 0.0005


def share_interpreter_between_branches() -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    output: dict[str, Any] | None
    error: JobError | None
    started_at: float
    finished_at: float


Handler = Callable[[WorkItem], dict[str, Any]]
# One output or one error per item, in order: a bad image fails its own job, not the batch.
BatchHandler = Callable[[list[WorkItem]], list[dict[str, Any] | JobError]]
Completion = Callable[[WorkItem, Outcome], None]


@dataclass(frozen=True)
class Batching:
    task: str
    policy: BatchPolicy
    handler: BatchHandler

    def accepts(self, item: WorkItem) -> bool:
        return item.job.task == self.task


class Worker:
    """What every branch worker shares: its thread, the jobs in hand, stall detection and
    the hand-over of unfinished jobs at stop. Subclasses implement `_run`."""

    def __init__(self, name: str, queue: PriorityDeadlineQueue, complete: Completion) -> None:
        self.name = name
        self.queue = queue
        self._complete = complete
        self.batch_sizes: dict[int, int] = {}  # batch size -> batches run, for status
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"branch-{name}", daemon=True)
        self.last_progress = time.monotonic()
        self.running_since: float | None = None
        # Jobs in hand, and whether the daemon has answered them itself (stopping):
        # the worker then drops its late outcome so nothing is answered twice.
        self._hand_lock = threading.Lock()
        self._in_hand: list[WorkItem] = []
        self._abandoned = False

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> int:
        with self._hand_lock:
            return len(self._in_hand)

    def stalled(self, now: float, limit_s: float) -> str | None:
        """Why this worker looks hung (a job running past limit_s, or a dead thread), or None."""
        if not self._thread.is_alive() and not self._stop.is_set():
            return f"{self.name} worker thread died"
        since = self.running_since
        if since is not None and now - since > limit_s:
            return f"{self.name} busy with one job for {now - since:.1f} s (limit {limit_s:g} s)"
        return None

    def stop(self, timeout: float) -> bool:
        """Finish the work in hand (not the queue), then exit; True if it exited in time."""
        self._stop.set()
        self.queue.close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def abandon(self) -> list[WorkItem]:
        """The jobs in hand, handed over for the daemon to deal with; their outcomes,
        should the worker still finish them, are dropped."""
        with self._hand_lock:
            self._abandoned = True
            items, self._in_hand = self._in_hand, []
            return items

    def _take(self, items: list[WorkItem]) -> None:
        with self._hand_lock:
            self._in_hand.extend(items)

    def _deliver(self, item: WorkItem, outcome: Outcome) -> None:
        with self._hand_lock:
            if self._abandoned or not any(held is item for held in self._in_hand):
                logger.warning("dropping the late outcome of job %s: already answered at stop", item.job.id)
                return
            self._in_hand = [held for held in self._in_hand if held is not item]
        try:
            self._complete(item, outcome)
        except Exception:
            logger.exception("could not complete job %s", item.job.id)

    def _answer_now(self, item: WorkItem, error: JobError) -> None:
        """An error for a job taken from the queue but never run."""
        self._take([item])
        now = time.monotonic()
        self._deliver(item, Outcome(None, error, now, now))


class BranchWorker(Worker):
    """One job (or one dynamic batch) at a time: take the most urgent, run it, hand back."""

    def __init__(
        self,
        name: str,
        queue: PriorityDeadlineQueue,
        handler: Handler,
        complete: Completion,
        batching: Batching | None = None,
    ) -> None:
        super().__init__(name, queue, complete)
        self._handler = handler
        self._batching = batching

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last_progress = time.monotonic()
            item = self.queue.get(timeout=0.2)
            if item is None:
                continue
            batching = self._batching
            if batching is not None and item.job.task == batching.task:
                batch = self.queue.take_batch(item, batching.policy, batching.accepts)
                self._process_batch(batch, batching.handler)
            else:
                self._process(item)

    def _process_batch(self, items: list[WorkItem], handler: BatchHandler) -> None:
        self._take(items)
        started = time.monotonic()
        self.running_since = started
        live = [it for it in items if not it.expired(started)]
        results: dict[int, dict[str, Any] | JobError] = {}
        for it in items:
            if it.expired(started):
                results[id(it)] = expired_error(it, started)
        if live:
            try:
                outputs = handler(live)
                if len(outputs) != len(live):
                    raise RuntimeError(f"batch handler returned {len(outputs)} results for {len(live)} jobs")
                results.update({id(it): out for it, out in zip(live, outputs, strict=True)})
            except Exception as err:  # a model bug costs this batch, never the worker
                logger.exception("batch of %d on %s failed", len(live), self.name)
                for it in live:
                    results[id(it)] = JobError(ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
            self.batch_sizes[len(live)] = self.batch_sizes.get(len(live), 0) + 1
        finished = time.monotonic()
        self.running_since = None
        self.last_progress = finished
        for it in items:
            res = results[id(it)]
            if isinstance(res, JobError):
                self._deliver(it, Outcome(None, res, started, finished))
            else:
                self._deliver(it, Outcome(res, None, started, finished))

    def _process(self, item: WorkItem) -> None:
        self._take([item])
        started = time.monotonic()
        self.running_since = started
        output: dict[str, Any] | None = None
        error: JobError | None = None
        if item.expired(started):
            error = expired_error(item, started)
        else:
            try:
                output = self._handler(item)
            except JobError as err:
                error = err
            except Exception as err:  # a model bug must cost one job, never the worker
                logger.exception("job %s on %s failed", item.job.id, self.name)
                error = JobError(ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
        finished = time.monotonic()
        self.running_since = None
        self.last_progress = finished
        self._deliver(item, Outcome(output, error, started, finished))


def expired_error(item: WorkItem, now: float) -> JobError:
    return JobError(
        ErrorCode.EXPIRED,
        f"deadline passed after {(now - item.received_at) * 1000:.0f} ms in the queue",
        "deadline_ms",
    )
