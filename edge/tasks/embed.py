"""The `embed` task: texts to vectors with the box's retrieval encoder (edge/docs/embed.py).

A job of the text branch's queue like a question (its priority, deadline, journal entry and
metrics), answered in one call between decode steps: the encoder is small beside the
language model, and sharing the queue keeps one order of work and one memory budget. The
HTTP API's /v1/embeddings submits these jobs.
"""

from __future__ import annotations

import time

import numpy as np

from edge.docs.embed import MODEL
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import EmbedJob
from edge.scheduler.work import WorkItem
from edge.tasks.base import Output
from edge.tasks.retrieval import Retrieval


class EmbedTask:
    def __init__(self, retrieval: Retrieval | None) -> None:
        self._retrieval = retrieval

    def answer(self, item: WorkItem) -> Output:
        """The job's vectors, in its texts' order: `{model, dimensions, embeddings}`; the
        encoder's time is the job's `embed` stage."""
        job = item.job.request
        assert isinstance(job, EmbedJob)
        if self._retrieval is None:
            raise JobError(ErrorCode.UNAVAILABLE, "no retrieval encoder is set up on this box", "task")
        t0 = time.perf_counter()
        vectors = np.asarray(self._retrieval.embed(list(job.input)), dtype=np.float32)
        item.stages["embed"] = (time.perf_counter() - t0) * 1000.0
        return {
            "model": MODEL,
            "dimensions": int(vectors.shape[1]),
            "embeddings": [[float(x) for x in row] for row in vectors],
        }
