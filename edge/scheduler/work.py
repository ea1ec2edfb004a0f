"""The unit handed from intake to a branch worker: a plain dataclass, nothing live."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from edge.protocol.jobs import ParsedJob

TASK_BRANCH = {"ocr": "vision", "inspect": "vision", "qa": "text", "embed": "text"}


@dataclass(frozen=True)
class Reply:
    topic: str
    correlation: bytes | None = None
    # The requester's trace context (edge/tracing.py), valid or None; not journalled, so
    # a job taken up again after a restart is traced on its own.
    traceparent: str | None = None


@dataclass
class WorkItem:
    job: ParsedJob
    reply: Reply
    received_at: float = field(default_factory=time.monotonic)
    deadline_at: float | None = None
    stream: bool = False
    # Carried between admissions by the worker that owns the job (the text branch's
    # prepared or paused sequence), and since when it has waited for memory.
    progress: Any = None
    waiting_since: float | None = None
    # A pipeline job's second stage carries the first stage's task and output, to be
    # answered together as one result.
    carry: dict[str, Any] | None = None
    # What its handler measured (edge/timing.py): milliseconds by stage, and for text
    # the token latencies (ttft_ms, token_p50_ms, token_p99_ms); both go into the result.
    stages: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    # When the text branch first admitted it (its run's start, kept across pauses).
    started_at: float | None = None

    @property
    def branch(self) -> str:
        return TASK_BRANCH[self.job.task]

    def expired(self, now: float | None = None) -> bool:
        return self.deadline_at is not None and (now or time.monotonic()) >= self.deadline_at
