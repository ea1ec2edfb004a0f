"""Results for requesters inside this process (an HTTP request waiting on its job).

A job that came in over HTTP has a reply topic under `$local/`: a topic no MQTT client
may name as its Response Topic (intake refuses `$` topics from the broker), so the two
paths can never answer each other's jobs. The responder hands results for such topics
here instead of to the broker; everything before that (journal, counting, tracing) is
the same. A final result handed over is the HTTP path's PUBACK: the job is marked
answered, whether or not anyone still waits (a client that went away can fetch it again
with its idempotency key, from the journal).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from edge.comms.message import DeliveredCallback

logger = logging.getLogger(__name__)

LOCAL_PREFIX = "$local/"

Inbox = Callable[[bytes], None]


def is_local(topic: str) -> bool:
    return topic.startswith(LOCAL_PREFIX)


def reply_topic(job_id: str) -> str:
    """The `$local/` topic an in-process job is answered on: one per job id, so the
    intake can tell whose job it is (only this topic's requester may withdraw it)."""
    return LOCAL_PREFIX + job_id


class LocalDeliveries:
    """A Publisher for `$local/` topics: each payload goes to every inbox open on its
    topic (a retry waiting beside the first request gets the one result too)."""

    def __init__(self, on_delivered: DeliveredCallback | None = None) -> None:
        self._on_delivered = on_delivered
        self._lock = threading.Lock()
        self._inboxes: dict[str, list[Inbox]] = {}

    def open(self, topic: str, inbox: Inbox) -> None:
        with self._lock:
            self._inboxes.setdefault(topic, []).append(inbox)

    def close(self, topic: str, inbox: Inbox) -> int:
        """Stop handing results to `inbox`; returns how many still wait on the topic
        (requests sharing one job: it is theirs until the last of them leaves)."""
        with self._lock:
            boxes = self._inboxes.get(topic, [])
            if inbox in boxes:
                boxes.remove(inbox)
            if not boxes:
                self._inboxes.pop(topic, None)
            return len(boxes)

    def waiting(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._inboxes.values())

    def publish(self, topic: str, payload: bytes, correlation: bytes | None, job_id: str | None = None) -> bool:
        with self._lock:
            boxes = list(self._inboxes.get(topic, ()))
        for inbox in boxes:
            try:
                inbox(payload)
            except Exception:  # one waiter's fault must not keep the result from the others
                logger.exception("could not hand a result to a waiter on %s", topic)
        if job_id is not None and self._on_delivered is not None:
            self._on_delivered(job_id)
        return True
