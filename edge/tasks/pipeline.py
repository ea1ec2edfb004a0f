"""Pipeline jobs: an `inspect` job with `ask` is answered once, with the inspection and
the text branch's answer about the part together.

Every outcome of a worker passes through `Pipeline.complete`: a finished first stage of
a pipeline job goes on to the text branch as a question whose context is the verdict and
the label's text; everything else goes to the responder as the job's final result.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import InspectJob, ParsedJob, QAJob
from edge.responder import Responder
from edge.scheduler.branch import Outcome
from edge.scheduler.queue import PriorityDeadlineQueue
from edge.scheduler.work import WorkItem

logger = logging.getLogger(__name__)


def context_of(inspected: dict[str, Any], with_labels: bool) -> str:
    """What the text branch is told about the part."""
    ocr = inspected.get("ocr", {}).get("text") if with_labels else None
    return (
        f"Inspection result: {inspected['class']} (confidence {inspected['score']:.2f}), "
        f"defect score {inspected['defect_score']:.2f}."
        + (f" Label text: {' / '.join(ocr.splitlines())}." if ocr else "")
    )


class Pipeline:
    def __init__(self, responder: Responder, queues: dict[str, PriorityDeadlineQueue]) -> None:
        self._responder = responder
        self._queues = queues

    def complete(self, item: WorkItem, outcome: Outcome) -> None:
        self.complete_batch([(item, outcome)])

    def complete_batch(self, pairs: list[tuple[WorkItem, Outcome]]) -> None:
        """A batch's outcomes: first stages of pipeline jobs go on; the rest are answered
        together (one journal commit)."""
        final = []
        for item, outcome in pairs:
            job = item.job.request
            if (
                isinstance(job, InspectJob)
                and job.ask is not None
                and outcome.output is not None
                and item.carry is None
            ):
                self._ask_text(item, job, outcome.output)
            else:
                final.append((item, outcome))
        if final:
            self._responder.finish_batch(final)

    def _ask_text(self, item: WorkItem, job: InspectJob, inspected: dict[str, Any]) -> None:
        """Queued on the text branch at the job's priority; the one result comes when the
        answer does."""
        assert job.ask is not None
        question = QAJob(
            id=job.id,
            question=job.ask.question,
            context=context_of(inspected, job.ocr),
            # Seen by a vision-language model with the verdict and the label's text
            # (QATask.prepare drops it for a model without an image part).
            image=job.image,
            max_new_tokens=job.ask.max_new_tokens,
            response_format=job.ask.response_format,
        )
        stage = WorkItem(
            job=ParsedJob(job.id, "qa", job.priority, None, question),
            reply=item.reply,
            received_at=item.received_at,
            carry={"task": "inspect", "output": inspected},
            # The inspection's stages, named apart from the answer's own.
            stages={f"inspect.{name}": ms for name, ms in item.stages.items()},
        )
        queue = self._queues.get("text")
        if queue is None:  # the intake refuses these; the text branch may have gone since
            why = JobError(ErrorCode.UNAVAILABLE, "the text branch is not served on this device", "ask")
            now = time.monotonic()
            self._responder.finish(item, Outcome(None, why, now, now))
            return
        queue.put(stage, force=True)  # accepted once already: never refused for queue size
