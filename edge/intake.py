"""From an MQTT message to a queued job, or to an error result naming the field.

A request to the HTTP API comes in here too, as an `IncomingJob` marked local (its reply
topic is in-process): the same checks, journal, queue and answers as a broker message.

Each accepted job is written to the journal before it is queued, and the intake only
returns True (acknowledge to the broker) once the job is kept or answered. A job id
already in the journal within the dedup window is not run again: a finished one is
answered with the stored result, one still in progress is left to finish. One exception:
an HTTP job (`$local/` reply) refused for a passing reason (busy, cancelled, expired,
over budget, unavailable) runs again when its Idempotency-Key is sent again, since that
refusal says to retry: the key keeps a job's result, not a refusal of a job that never
ran (Stripe's API keeps no result for those either).

Messages that arrive together are taken together (`take_many`): the jobs among them are
journalled in one commit, so a burst of camera frames waits for one fsync, not one each.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge.comms.local import is_local
from edge.comms.local import reply_topic as local_reply_topic
from edge.comms.message import IncomingJob
from edge.config.profile import Profile
from edge.journal.store import QUEUED, SENT, Entry, Journal, JournalFull, NewJob, digest
from edge.logs import job_fields
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import (
    JOB_MODELS,
    CancelJob,
    InspectJob,
    JobLimits,
    ParsedJob,
    decode_payload,
    parse_job,
    recover_id,
)
from edge.protocol.topics import reply_topic_error
from edge.responder import Responder
from edge.scheduler.queue import PriorityDeadlineQueue, QueueFull
from edge.scheduler.work import TASK_BRANCH, Reply, WorkItem
from edge.tracing import valid_traceparent

logger = logging.getLogger(__name__)

# Refusals that say "try again": for an HTTP job they are not the key's answer (`_seen`).
RETRYABLE = frozenset(
    {ErrorCode.BUSY, ErrorCode.CANCELLED, ErrorCode.EXPIRED, ErrorCode.OVER_BUDGET, ErrorCode.UNAVAILABLE}
)


@dataclass(frozen=True)
class _Held:
    """A job checked and routed, waiting for the batch's journal commit."""

    row: NewJob
    item: WorkItem
    queue: PriorityDeadlineQueue
    notify: bool  # the requester asked to hear that it is journalled


class Intake:
    """`queues` maps a branch name to its queue; it may be filled in after the intake is
    built (the branches come up as their models load)."""

    def __init__(
        self,
        profile: Profile,
        queues: dict[str, PriorityDeadlineQueue],
        responder: Responder,
        journal: Journal,
    ) -> None:
        self.profile = profile
        self._queues = queues
        self._responder = responder
        self._reject = responder.reject
        self._answer = responder.answer
        self._journal = journal
        self.accepting = True
        self.duplicates = 0
        # Asks the workers to end a running job (the daemon sets it once they exist).
        self.stop_running: Callable[[str, Callable[[WorkItem], bool], str], bool] | None = None
        self.limits = JobLimits(
            max_payload_bytes=profile.limits.max_payload_bytes,
            max_prompt_chars=profile.limits.max_prompt_chars,
            max_new_tokens_limit=profile.models.qa.max_new_tokens_limit,
        )

    def __call__(self, msg: IncomingJob) -> bool:
        """Take one message; True once it is kept or answered (acknowledge it)."""
        return self.take_many([msg])[0]

    def take_many(self, msgs: list[IncomingJob]) -> list[bool]:
        """Take messages in arrival order; for each, True once it is kept or answered
        (acknowledge it). Every message gets exactly one result, whatever it holds: a
        fault in here is answered `internal` like any other error, never left
        unanswered. The jobs are journalled in one commit before any is queued."""
        if not self.accepting:
            return [False] * len(msgs)  # stopping: the broker delivers them again to the next start
        held: list[_Held] = []
        for msg in msgs:
            received = time.monotonic()
            try:
                taken = self._take(msg, received, held)
            except Exception:
                logger.exception("intake failed for a message on %s", msg.topic)
                self._internal(msg, received)
                continue
            if isinstance(taken, _Held):
                held.append(taken)
        self._commit(held)
        return [True] * len(msgs)

    def _internal(self, msg: IncomingJob, received: float) -> None:
        reply = Reply(self.profile.results_topic, msg.correlation, valid_traceparent(msg.traceparent))
        why = JobError(ErrorCode.INTERNAL, "the daemon could not take this message; its log has the details")
        if msg.response_topic is not None and self._reply_error(msg.response_topic, msg.local) is None:
            reply = Reply(msg.response_topic, msg.correlation, valid_traceparent(msg.traceparent))
        self._refuse(reply, None, None, why, received)

    def _commit(self, held: list[_Held]) -> None:
        """Journal the held jobs in one commit, then queue those kept. Cleared after."""
        if not held:
            return
        try:
            kept = self._journal.accept_many([h.row for h in held])
        except Exception:
            logger.exception("could not journal %d job(s)", len(held))
            why = JobError(ErrorCode.INTERNAL, "the daemon could not keep this job; its log has the details")
            for h in held:
                self._refuse(h.item.reply, h.item.job.id, h.item.job.task, why, h.item.received_at)
            held.clear()
            return
        for h, full in zip(held, kept, strict=True):
            job, reply = h.item.job, h.item.reply
            if full is not None:
                refused = JobError(ErrorCode.STORAGE_FULL, f"not accepted: {full}; free space in the state directory")
                self._refuse(reply, job.id, job.task, refused, h.item.received_at)
                continue
            try:
                h.queue.put(h.item)
            except QueueFull as busy_queue:
                busy = JobError(ErrorCode.BUSY, str(busy_queue))
                logger.warning("rejected job %s: %s", job.id, busy, extra=job_fields(job.id, job.task, busy.code.value))
                self._reject(reply, job.id, job.task, busy, h.item.received_at, journalled=True)  # kept a moment ago
                continue
            logger.debug(
                "queued job %s (%s, priority %s)", job.id, job.task, job.priority, extra=job_fields(job.id, job.task)
            )
            if h.notify:
                self._responder.accepted(reply, job.id, job.task)
        held.clear()

    def _reply_error(self, topic: str, local: bool = False) -> JobError | None:
        if local:
            # An in-process requester's `$local/` topic: no broker ever sees it.
            return None
        return reply_topic_error(topic, self.profile.topic(), self.profile.results_topic)

    def _refuse(self, reply: Reply, job_id: str | None, task: str | None, err: JobError, received: float) -> None:
        """Refused on arrival: logged and answered, nothing journalled."""
        logger.warning("rejected %s: %s", f"job {job_id}" if job_id else "a message", err)
        self._reject(reply, job_id, task, err, received, journalled=False)

    def _take(self, msg: IncomingJob, received: float, held: list[_Held]) -> bool | _Held:
        """True once answered, or the job held for the batch's commit. `held` is
        committed first where this message depends on it (the same id again, a cancel)."""
        topic_task = msg.topic.rsplit("/", 1)[-1]
        known_task = topic_task if topic_task in JOB_MODELS else None
        reply = Reply(self.profile.results_topic, msg.correlation, valid_traceparent(msg.traceparent))
        data: Any = None
        try:
            data = decode_payload(msg.payload, self.limits.max_payload_bytes)
        except JobError as err:
            self._refuse(self._reply_for(msg, reply), None, known_task, err, received)
            return True
        job_id = recover_id(data)
        if msg.response_topic is not None:
            bad_topic = self._reply_error(msg.response_topic, msg.local)
            if bad_topic is not None:
                # Answered where the requester can still see it: the device's results topic.
                self._refuse(reply, job_id, known_task, bad_topic, received)
                return True
            reply = Reply(msg.response_topic, msg.correlation, valid_traceparent(msg.traceparent))
        if msg.retained:
            why = JobError(
                ErrorCode.INVALID_FIELD,
                "retained job messages are refused (they would run again at every start): publish jobs without "
                "the retain flag, and clear this one with an empty retained message",
                "retain",
            )
            self._refuse(reply, job_id, known_task, why, received)
            return True
        if job_id is not None and any(h.row[0] == job_id for h in held):
            self._commit(held)  # the repeat is judged against the journalled first
        if self._seen(job_id, known_task, msg, reply, received):
            return True
        try:
            job = parse_job(data, topic_task, self.limits)
        except JobError as err:
            self._refuse(reply, job_id, known_task, err, received)
            return True
        if isinstance(job.request, CancelJob):
            self._commit(held)  # its target may be among them
            self._cancel(job.id, job.request.job, reply, received, digest(msg.payload), msg.local)
            return True
        try:
            queue = self.route(job)
        except JobError as unavailable:
            self._refuse(reply, job.id, job.task, unavailable, received)
            return True
        item = make_item(job, reply, received, self.profile.queue.default_deadline_ms)
        return _Held((job.id, msg.topic, msg.payload, reply.topic, reply.correlation), item, queue, msg.notify_accepted)

    def _reply_for(self, msg: IncomingJob, fallback: Reply) -> Reply:
        if msg.response_topic is not None and self._reply_error(msg.response_topic, msg.local) is None:
            return Reply(msg.response_topic, msg.correlation, valid_traceparent(msg.traceparent))
        return fallback

    def replay(self) -> dict[str, int]:
        """Take up what the journal holds unfinished, at start: results not yet confirmed
        by the broker are published again as stored; jobs without a result run again (up
        to journal.max_replays starts, so a job that brings the daemon down cannot do it
        forever). Returns the counts: jobs queued again, results sent again, jobs given
        up, jobs refused now (the profile changed: a task no longer served, say)."""
        counts = {"jobs": 0, "results": 0, "given_up": 0, "refused": 0}
        for entry in self._journal.pending():
            reply = Reply(entry.reply_topic, entry.correlation)
            if entry.state == SENT and entry.result is not None:
                self._responder.replay(reply, entry.id, entry.result)
                counts["results"] += 1
            elif entry.state == QUEUED:
                counts[self._replay_job(entry, reply)] += 1
        if any(counts.values()):
            logger.info(
                "journal: %d job(s) taken up again, %d result(s) sent again, %d given up",
                counts["jobs"],
                counts["results"],
                counts["given_up"],
            )
        return counts

    def _replay_job(self, entry: Entry, reply: Reply) -> str:
        # The job's age carries over: its deadline counts from when it first arrived.
        received = time.monotonic() - max(0.0, time.time() - entry.received)
        try:
            attempts = self._journal.replayed(entry.id)
        except JournalFull:
            attempts = entry.attempts + 1
        task = entry.topic.rsplit("/", 1)[-1]
        if attempts > self.profile.journal.max_replays:
            why = JobError(
                ErrorCode.INTERNAL,
                f"the daemon stopped {attempts - 1} times before this job finished; not running it again",
            )
            self._reject(reply, entry.id, task, why, received, journalled=True)
            return "given_up"
        try:
            # The profile's limits, or the branches served, may have changed since.
            job = parse_job(decode_payload(entry.payload or b"", self.limits.max_payload_bytes), task, self.limits)
            queue = self.route(job)
        except JobError as err:
            self._reject(reply, entry.id, task, err, received, journalled=True)
            return "refused"
        queue.put(make_item(job, reply, received, self.profile.queue.default_deadline_ms), force=True)
        return "jobs"

    def route(self, job: ParsedJob) -> PriorityDeadlineQueue:
        """The queue of the branch that runs the job; JobError `unavailable` if a branch
        it needs is not served here."""
        queue = self._queues.get(TASK_BRANCH[job.task])
        if queue is None:
            raise JobError(ErrorCode.UNAVAILABLE, f"task {job.task!r} is not served on this device", "task")
        if isinstance(job.request, InspectJob) and job.request.ask is not None and "text" not in self._queues:
            raise JobError(ErrorCode.UNAVAILABLE, "the text branch is not served on this device", "ask")
        return queue

    def _seen(self, job_id: str | None, task: str | None, msg: IncomingJob, reply: Reply, received: float) -> bool:
        """Whether this id is already in the journal (within the dedup window). Then it
        is not run again: a repeat of a finished job gets the stored result, unless it is
        the broker redelivering the very message (its DUP flag, same reply and
        correlation), whose result went out already; a repeat of one in progress gets its
        one result when done if it is a redelivery (same reply and correlation), else a
        `duplicate` error saying so; an id reused for a different request is refused,
        since answering it with another job's result would be wrong."""
        if job_id is None:
            return False
        entry = self._journal.lookup(job_id)
        if entry is None or entry.received < time.time() - self._journal.dedup_window_s:
            return False
        same_reply = (entry.reply_topic, entry.correlation) == (reply.topic, reply.correlation)
        if msg.local and same_reply and entry.digest == digest(msg.payload) and _retryable(entry):
            # The client was told to come back (429, 503, 504) or went away (cancelled):
            # its retry runs the job afresh; the journal row is replaced on accept.
            logger.info("job %s sent again after a refusal that said to retry: it runs again", job_id)
            return False
        self.duplicates += 1
        if entry.digest is not None and entry.digest != digest(msg.payload):
            reused = JobError(
                ErrorCode.INVALID_FIELD, "this id belongs to another job within the dedup window; use a new id", "id"
            )
            logger.warning("rejected job %s: %s", job_id, reused)
            self._reject(reply, job_id, task, reused, received)
        elif entry.state != QUEUED and entry.result is not None and msg.redelivered and same_reply:
            # Our PUBACK for it was lost (the connection dropped: a SIGSTOP past the
            # keepalive, a network cut) and the job finished meanwhile. Its result was
            # published to this reply already (or is replayed from the journal until the
            # broker has it): a second copy would be a duplicate the requester never asked for.
            logger.info("job %s redelivered by the broker after it was answered: not answered twice", job_id)
        elif entry.state != QUEUED and entry.result is not None:
            logger.info("job %s seen again within the dedup window: answering from the journal", job_id)
            self._responder.resend(reply, entry.result)
        elif not same_reply:
            pending = JobError(
                ErrorCode.DUPLICATE, "this job is already in progress; its result goes to the first request's reply"
            )
            self._reject(reply, job_id, task, pending, received)
        else:
            logger.info("job %s delivered again while in progress: it is answered once, when done", job_id)
            if msg.notify_accepted and task is not None:
                self._responder.accepted(reply, job_id, task)  # a resend to the box that holds it
        return True

    def _cancel(
        self, request_id: str, target: str, reply: Reply, received: float, request_digest: str, local: bool
    ) -> None:
        """Withdraw a queued job: it is answered `cancelled` on its own reply topic, and
        the cancel request says whether it found it. A job already running finishes, but
        for an in-process (HTTP) cancel, whose client has gone: that one is stopped.
        Each side withdraws only its own: an in-process (HTTP) cancel only the job whose
        reply is that id's `$local/` topic, a broker's cancel never an HTTP job, so an
        id that happens to be the same on the two paths cannot withdraw the other's job."""
        owner = local_reply_topic(target)

        def allowed(item: WorkItem) -> bool:
            return item.reply.topic == owner if local else not is_local(item.reply.topic)

        for queue in self._queues.values():
            item = queue.cancel(target, allowed)
            if item is not None:
                why = JobError(ErrorCode.CANCELLED, f"withdrawn while queued by cancel request {request_id!r}")
                self._reject(item.reply, item.job.id, item.job.task, why, item.received_at, journalled=True)
                logger.info("cancelled job %s at the request of %s", target, request_id)
                output = {"job": target, "cancelled": True}
                self._answer(reply, request_id, "cancel", output, received, request_digest)
                return
        found: dict[str, Any] = {"job": target, "cancelled": False}
        if local and self.stop_running is not None:
            # An HTTP request ended (its client gone, or timed out): its job, if running, stops at
            # its next step (answered `cancelled`); a broker's cancel leaves a running job to
            # finish, as the protocol says.
            reason = f"stopped while running by cancel request {request_id!r}: its HTTP request ended"
            found["stopping"] = self.stop_running(target, allowed, reason)
        self._answer(reply, request_id, "cancel", found, received, request_digest)


def _retryable(entry: Entry) -> bool:
    """Whether an HTTP job's stored result is a refusal that told its client to retry."""
    if entry.state == QUEUED or entry.result is None or not is_local(entry.reply_topic):
        return False
    try:
        doc = json.loads(entry.result)
        return doc.get("status") == "error" and ErrorCode(doc["error"]["code"]) in RETRYABLE
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def make_item(job: ParsedJob, reply: Reply, received: float, default_deadline_ms: int | None) -> WorkItem:
    deadline_ms = job.deadline_ms or default_deadline_ms
    return WorkItem(
        job=job,
        reply=reply,
        received_at=received,
        deadline_at=received + deadline_ms / 1000.0 if deadline_ms else None,
    )
