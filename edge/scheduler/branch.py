"""One worker thread per branch: take the most urgent job, run it, hand back the outcome."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge.protocol.errors import ErrorCode, JobError
from edge.scheduler.queue import PriorityDeadlineQueue
from edge.scheduler.work import WorkItem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    output: dict[str, Any] | None
    error: JobError | None
    started_at: float
    finished_at: float


Handler = Callable[[WorkItem], dict[str, Any]]
Completion = Callable[[WorkItem, Outcome], None]


class BranchWorker:
    def __init__(self, name: str, queue: PriorityDeadlineQueue, handler: Handler, complete: Completion) -> None:
        self.name = name
        self.queue = queue
        self._handler = handler
        self._complete = complete
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"branch-{name}", daemon=True)
        self.last_progress = time.monotonic()
        self.running_since: float | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Finish the job in hand (not the queue), then exit; True if it exited in time."""
        self._stop.set()
        self.queue.close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last_progress = time.monotonic()
            item = self.queue.get(timeout=0.2)
            if item is None:
                continue
            self._process(item)

    def _process(self, item: WorkItem) -> None:
        started = time.monotonic()
        self.running_since = started
        output: dict[str, Any] | None = None
        error: JobError | None = None
        if item.expired(started):
            error = JobError(
                ErrorCode.EXPIRED,
                f"deadline passed after {(started - item.received_at) * 1000:.0f} ms in the queue",
                "deadline_ms",
            )
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
        try:
            self._complete(item, Outcome(output, error, started, finished))
        except Exception:
            logger.exception("could not complete job %s", item.job.id)
