"""Hands job messages from paho's network thread to the intake, a batch at a time.

paho calls back on its network thread, one message at a time. Journalling each there
would make a burst of camera frames wait for one fsync per frame, and keep paho from
reading the socket (and from sending PUBACKs for results) meanwhile. The network thread
only queues the message here; the pump's thread takes everything that has arrived,
lets the intake keep it with one journal commit, and acknowledges each message the
intake kept, in arrival order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from edge.comms.message import BatchIntakeCallback, IncomingJob

logger = logging.getLogger(__name__)

# The most messages one commit takes: a burst larger than this is a few commits.
MAX_BATCH = 256


@dataclass(frozen=True)
class _Delivery:
    job: IncomingJob
    mid: int | None  # None: submitted in-process, nothing to acknowledge
    qos: int


class IntakePump:
    """`ack(mid, qos)` acknowledges a message to the broker (paho's Client.ack, which
    may be called from any thread)."""

    def __init__(self, on_jobs: BatchIntakeCallback, ack: Callable[[int, int], object]) -> None:
        self._on_jobs = on_jobs
        self._ack = ack
        self._queue: queue.SimpleQueue[_Delivery | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="intake", daemon=True)
            self._thread.start()

    def put(self, job: IncomingJob, mid: int | None, qos: int) -> None:
        self._queue.put(_Delivery(job, mid, qos))

    def stop(self, timeout: float = 5.0) -> None:
        """Finish what is queued, then stop. (While the daemon stops, the intake keeps
        nothing: those messages stay unacknowledged for the next start.)"""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        running = True
        while running:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    running = False
                    break
                batch.append(nxt)
            self._take(batch)

    def _take(self, batch: list[_Delivery]) -> None:
        try:
            keep = self._on_jobs([d.job for d in batch])
        except Exception:  # never let a fault stop the intake (it answers what it can)
            logger.exception("intake failed for %d message(s)", len(batch))
            keep = [True] * len(batch)
        for delivery, kept in zip(batch, keep, strict=True):
            if kept and delivery.mid is not None:
                try:
                    self._ack(delivery.mid, delivery.qos)
                except Exception:  # the session is gone: the broker delivers it again
                    logger.warning("could not acknowledge message %d", delivery.mid, exc_info=True)
