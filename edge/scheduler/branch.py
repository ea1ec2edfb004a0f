"""Worker threads, one per branch: take the most urgent job, run it, hand back the outcome."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from edge.logs import job_fields
from edge.protocol.errors import ErrorCode, JobError, internal_error
from edge.scheduler.queue import BatchPolicy, PriorityDeadlineQueue
from edge.scheduler.work import WorkItem

# Both branches, the intake and paho are threads of one process. A thread waiting for
# the interpreter lock gets it after at most this long; at Python's default (5 ms) a
# camera job's path, which hands over several times, waited that long at each hand-over
# while the text branch decoded.
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


# One output or one error per item, in order: a bad image fails its own job, not the batch.
BatchHandler = Callable[[list[WorkItem]], list[dict[str, Any] | JobError]]
Completion = Callable[[WorkItem, Outcome], None]
# A batch's outcomes handed over together (one journal commit for all their results).
BatchCompletion = Callable[[list[tuple[WorkItem, Outcome]]], None]


class BatchRunner(Protocol):
    """What a batch worker runs: a task with its batching policy (edge/tasks/base.py)."""

    name: str
    policy: BatchPolicy

    def run(self, items: list[WorkItem]) -> list[dict[str, Any] | JobError]: ...


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

    def stop_running(self, job_id: str, allowed: Callable[[WorkItem], bool], why: str) -> bool:
        """Ask that job `job_id`, if it is running here and `allowed`, be ended with a
        `cancelled` error (`why`) as soon as it can; True if this worker takes such
        requests. A vision batch is short and runs to its end: False."""
        return False

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
        if self._thread.ident is None:
            return True  # never started (a stop during the start steps)
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
            logger.exception("could not complete job %s", item.job.id, extra=job_fields(item.job.id, item.job.task))

    def _answer_now(self, item: WorkItem, error: JobError) -> None:
        """An error for a job taken from the queue but never run."""
        self._take([item])
        now = time.monotonic()
        self._deliver(item, Outcome(None, error, now, now))


class BranchWorker(Worker):
    """One batch at a time: take the most urgent job, gather the queued jobs of the same
    task that its policy allows (dynamic batching), run them, hand back the outcomes."""

    def __init__(
        self,
        name: str,
        queue: PriorityDeadlineQueue,
        tasks: dict[str, BatchRunner],
        complete: Completion,
        complete_batch: BatchCompletion | None = None,
    ) -> None:
        super().__init__(name, queue, complete)
        self._tasks = tasks
        self._complete_batch = complete_batch

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last_progress = time.monotonic()
            item = self.queue.get(timeout=0.2)
            if item is None:
                continue
            task = self._tasks.get(item.job.task)
            if task is None:
                # Intake routes only tasks this branch serves; a job taken up from the
                # journal after the profile changed may not be one of them.
                why = JobError(ErrorCode.UNAVAILABLE, f"task {item.job.task!r} is not served on this device", "task")
                self._answer_now(item, why)
                continue
            batch = self.queue.take_batch(item, task.policy, same_task(task.name))
            self._process_batch(batch, task.run)

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
                    results[id(it)] = internal_error(err)
            self.batch_sizes[len(live)] = self.batch_sizes.get(len(live), 0) + 1
        finished = time.monotonic()
        self.running_since = None
        self.last_progress = finished
        pairs = []
        for it in items:
            res = results[id(it)]
            if isinstance(res, JobError):
                pairs.append((it, Outcome(None, res, started, finished)))
            else:
                pairs.append((it, Outcome(res, None, started, finished)))
        self._deliver_batch(pairs)

    def _deliver_batch(self, pairs: list[tuple[WorkItem, Outcome]]) -> None:
        if self._complete_batch is None:
            for item, outcome in pairs:
                self._deliver(item, outcome)
            return
        with self._hand_lock:
            if self._abandoned:
                logger.warning("dropping the late outcomes of %d job(s): already answered at stop", len(pairs))
                return
            held = {id(it) for it in self._in_hand}
            pairs = [(it, out) for it, out in pairs if id(it) in held]
            done = {id(it) for it, _ in pairs}
            self._in_hand = [it for it in self._in_hand if id(it) not in done]
        try:
            self._complete_batch(pairs)
        except Exception:
            logger.exception("could not complete a batch of %d job(s)", len(pairs))


def same_task(name: str) -> Callable[[WorkItem], bool]:
    return lambda item: item.job.task == name


def expired_error(item: WorkItem, now: float) -> JobError:
    return JobError(
        ErrorCode.EXPIRED,
        f"deadline passed after {(now - item.received_at) * 1000:.0f} ms in the queue",
        "deadline_ms",
    )
