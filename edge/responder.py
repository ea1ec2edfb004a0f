"""The one path every result takes: journalled, published, counted.

A final result of a journalled job is stored in the journal before it is published, so a
crash before the broker's PUBACK sends the same bytes again at the next start (and the
PUBACK marks the job answered). A job refused on arrival was never journalled, and its
refusal is not journalled either: bad input must not fill the journal that good jobs
need (a redelivery of it is simply refused again, the same way), nor claim its id for
the dedup window. Partial results (streamed pieces) are published only: the final result
that follows is the one that counts. A result whose topic cannot be published to at all
(only an old journal can hold one: intake refuses such topics) is marked answered and
logged, so it never blocks anything. Results for `$local/` reply topics (jobs that came
in over HTTP) go to the in-process delivery target instead of the broker, after the
same journalling, counting and tracing. Every final result is counted in the job
statistics, by task and error code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from edge.comms.local import is_local
from edge.comms.message import Publisher
from edge.journal.store import Journal
from edge.logs import job_fields
from edge.protocol import results
from edge.protocol.errors import ErrorCode, JobError
from edge.scheduler.branch import Outcome
from edge.scheduler.work import Reply, WorkItem
from edge.stats import JobStats
from edge.tracing import JobTracer

logger = logging.getLogger(__name__)


class Responder:
    def __init__(
        self,
        link: Publisher,
        journal: Journal,
        stats: JobStats,
        device_id: str,
        observe: Callable[[dict[str, Any]], None] | None = None,
        tracer: JobTracer | None = None,
        local: Publisher | None = None,
    ) -> None:
        """`observe`: given every final result document (the metrics count it);
        `tracer`: makes each job's spans, and the result carries the job span's
        traceparent; `local`: where results for `$local/` topics go (edge/comms/local.py)."""
        self._mqtt = link
        self._local = local
        self._journal = journal
        self.stats = stats
        self._device_id = device_id
        self._observe = observe
        self._tracer = tracer

    def _via(self, topic: str) -> Publisher:
        return self._local if self._local is not None and is_local(topic) else self._mqtt

    def _counted(self, doc: dict[str, Any], reply: Reply, received: float) -> bytes:
        if self._tracer is not None:
            try:
                doc["traceparent"] = self._tracer.record(doc, received, reply.traceparent)
            except Exception:  # tracing must never keep a result from being sent
                logger.exception("could not trace the result of %s", doc.get("id"))
        if self._observe is not None:
            try:
                self._observe(doc)
            except Exception:  # counting a result must never keep it from being sent
                logger.exception("could not count the result of %s", doc.get("id"))
        return results.encode(doc)

    # jobs that ran ----------------------------------------------------------------------

    def finish(self, item: WorkItem, outcome: Outcome) -> None:
        """The final result of a job a worker ran (a pipeline job's second stage carries
        the first stage's task and output, answered together)."""
        self.finish_batch([(item, outcome)])

    def finish_batch(self, pairs: list[tuple[WorkItem, Outcome]]) -> None:
        """The final results of a batch: journalled in one commit, then published."""
        docs = [(item, self._document(item, outcome)) for item, outcome in pairs]
        self._journal.store_results([(i.job.id, i.reply.topic, i.reply.correlation, d) for i, d in docs])
        for item, payload in docs:
            self._publish_kept(item.reply, item.job.id, payload)

    def _document(self, item: WorkItem, outcome: Outcome) -> bytes:
        started = outcome.started_at
        timings = results.Timings(
            queued_ms=(started - item.received_at) * 1000.0,
            run_ms=(outcome.finished_at - started) * 1000.0,
            total_ms=(outcome.finished_at - item.received_at) * 1000.0,
            stages=item.stages,
            latency=item.latency,
        )
        job = item.job
        task = item.carry["task"] if item.carry is not None else job.task
        output = outcome.output
        if item.carry is not None and output is not None:
            output = {**item.carry["output"], "answer": output}
        if outcome.error is None and output is not None:
            doc = results.ok_result(job.id, task, self._device_id, output, timings)
            self.stats.record_ok(task, timings.total_ms)
            verdict = results.grounding_of(output)
            if verdict is not None:
                self.stats.record_grounding(verdict)
        else:
            err = outcome.error or JobError(ErrorCode.INTERNAL, "no output")
            logger.warning("job %s failed: %s", job.id, err, extra=job_fields(job.id, task, err.code.value))
            doc = results.error_result(job.id, task, self._device_id, err, timings)
            self.stats.record_error(task, err.code.value)
        return self._counted(doc, item.reply, item.received_at)

    def partial(self, item: WorkItem, seq: int, delta: str) -> None:
        """A streamed piece of a job's output; its final result still follows."""
        doc = results.partial_result(item.job.id, item.job.task, self._device_id, seq, delta)
        self._via(item.reply.topic).publish(item.reply.topic, results.encode(doc), item.reply.correlation)

    # jobs answered without running ----------------------------------------------------

    def answer(
        self, reply: Reply, job_id: str, task: str, output: dict[str, Any], received: float, request_digest: str
    ) -> None:
        """An ok result for a request the intake answers itself (cancel): kept with the
        request's digest, so a repeat gets it again and an id reused for another request
        is told so."""
        timings = results.Timings(0.0, 0.0, (time.monotonic() - received) * 1000.0)
        doc = results.ok_result(job_id, task, self._device_id, output, timings)
        self.stats.record_ok(task, timings.total_ms)
        payload = self._counted(doc, reply, received)
        self._journal.store_result(job_id, reply.topic, reply.correlation, payload, request_digest)
        self._publish_kept(reply, job_id, payload)

    def reject(
        self,
        reply: Reply,
        job_id: str | None,
        task: str | None,
        error: JobError,
        received: float,
        journalled: bool = False,
    ) -> None:
        """An error result for a job refused before it ran. `journalled`: the job is in
        the journal (taken up at start, or withdrawn while queued) and its row gets the
        result; else (refused on arrival) the refusal is published only."""
        timings = results.Timings(0.0, 0.0, (time.monotonic() - received) * 1000.0)
        doc = results.error_result(job_id, task, self._device_id, error, timings)
        self.stats.record_error(task, error.code.value)
        payload = self._counted(doc, reply, received)
        if journalled and job_id is not None:
            self._send(reply, job_id, payload)
        else:
            self._via(reply.topic).publish(reply.topic, payload, reply.correlation)

    def accepted(self, reply: Reply, job_id: str, task: str) -> None:
        """Tell a requester that asked that the job is journalled here: this box answers
        it, so a requester with a fleet need not send it to another box while this one is
        online. Published only (a lost notice costs one resend, which is answered once)."""
        doc = results.accepted_notice(job_id, task, self._device_id)
        self._via(reply.topic).publish(reply.topic, results.encode(doc), reply.correlation)

    def resend(self, reply: Reply, payload: bytes) -> None:
        """A finished job's stored result, for a repeat of its id within the dedup window."""
        self._via(reply.topic).publish(reply.topic, payload, reply.correlation)

    def replay(self, reply: Reply, job_id: str, payload: bytes) -> None:
        """A result stored but not confirmed by the broker before the last stop: sent
        again as stored, and marked answered on its PUBACK."""
        self._publish_kept(reply, job_id, payload)

    def _send(self, reply: Reply, job_id: str, payload: bytes) -> None:
        self._journal.store_result(job_id, reply.topic, reply.correlation, payload)
        self._publish_kept(reply, job_id, payload)

    def _publish_kept(self, reply: Reply, job_id: str, payload: bytes) -> None:
        if not self._via(reply.topic).publish(reply.topic, payload, reply.correlation, job_id):
            logger.error(
                "the result of %s can never be delivered (topic refused); marking it answered",
                job_id,
                extra=job_fields(job_id),
            )
            self._journal.mark_answered(job_id)
