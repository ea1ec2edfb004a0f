"""From an MQTT message to a queued job, or to an error result naming the field."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from edge.comms.mqtt import IncomingJob
from edge.config.schema import Profile
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import JOB_MODELS, CancelJob, JobLimits, decode_payload, parse_job, recover_id
from edge.scheduler.queue import PriorityDeadlineQueue, QueueFull
from edge.scheduler.work import TASK_BRANCH, Reply, WorkItem

logger = logging.getLogger(__name__)

Rejector = Callable[[Reply, str | None, str | None, JobError, float], None]
Answerer = Callable[[Reply, str, str, dict[str, Any], float], None]


class Intake:
    def __init__(
        self, profile: Profile, queues: dict[str, PriorityDeadlineQueue], reject: Rejector, answer: Answerer
    ) -> None:
        self._profile = profile
        self._queues = queues
        self._reject = reject
        self._answer = answer
        self._limits = JobLimits(
            max_payload_bytes=profile.limits.max_payload_bytes,
            max_prompt_chars=profile.limits.max_prompt_chars,
            max_new_tokens_limit=profile.models.qa.max_new_tokens_limit,
        )

    def __call__(self, msg: IncomingJob) -> None:
        received = time.monotonic()
        topic_task = msg.topic.rsplit("/", 1)[-1]
        reply = Reply(msg.response_topic or self._profile.results_topic, msg.correlation)
        data: Any = None
        known_task = topic_task if topic_task in JOB_MODELS else None
        try:
            data = decode_payload(msg.payload, self._limits.max_payload_bytes)
            job = parse_job(data, topic_task, self._limits)
        except JobError as err:
            job_id = recover_id(data)
            logger.warning("rejected job %s on %s: %s", job_id, msg.topic, err)
            self._reject(reply, job_id, known_task, err, received)
            return
        if isinstance(job.request, CancelJob):
            self._cancel(job.id, job.request.job, reply, received)
            return
        queue = self._queues.get(TASK_BRANCH[job.task])
        if queue is None:
            unavailable = JobError(ErrorCode.UNAVAILABLE, f"task {job.task!r} is not served on this device", "task")
            logger.warning("rejected job %s: %s", job.id, unavailable)
            self._reject(reply, job.id, job.task, unavailable, received)
            return
        deadline_ms = job.deadline_ms or self._profile.queue.default_deadline_ms
        item = WorkItem(
            job=job,
            reply=reply,
            received_at=received,
            deadline_at=received + deadline_ms / 1000.0 if deadline_ms else None,
        )
        try:
            queue.put(item)
        except QueueFull as full:
            busy = JobError(ErrorCode.BUSY, str(full))
            logger.warning("rejected job %s: %s", job.id, busy)
            self._reject(reply, job.id, job.task, busy, received)
            return
        logger.debug("queued job %s (%s, priority %s)", job.id, job.task, job.priority)

    def _cancel(self, request_id: str, target: str, reply: Reply, received: float) -> None:
        """Withdraw a queued job: it is answered `cancelled` on its own reply topic, and
        the cancel request says whether it found it. A job already running finishes."""
        for queue in self._queues.values():
            item = queue.cancel(target)
            if item is not None:
                why = JobError(ErrorCode.CANCELLED, f"withdrawn while queued by cancel request {request_id!r}")
                self._reject(item.reply, item.job.id, item.job.task, why, item.received_at)
                logger.info("cancelled job %s at the request of %s", target, request_id)
                self._answer(reply, request_id, "cancel", {"job": target, "cancelled": True}, received)
                return
        self._answer(reply, request_id, "cancel", {"job": target, "cancelled": False}, received)
