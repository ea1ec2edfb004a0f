"""Job spans (edge/tracing.py) through the responder, collected by the OpenTelemetry
SDK's in-memory exporter: a requester's traceparent continued, one span per stage in
order inside the job's, the job span's traceparent on the result."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, format_span_id, format_trace_id

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import OCRJob, ParsedJob
from edge.responder import Responder
from edge.scheduler.branch import Outcome
from edge.scheduler.work import Reply, WorkItem
from edge.tracing import JobTracer, valid_traceparent
from tests import fakes

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _responder(tmp_path: Path) -> tuple[Responder, fakes.FakeLink, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    base, link, journal = fakes.responder(tmp_path)
    tracer = JobTracer("t", exporter, batch=False)
    return Responder(link, journal, base.stats, "t", tracer=tracer), link, exporter


def _times(span: ReadableSpan) -> tuple[int, int]:
    assert span.start_time is not None and span.end_time is not None
    return span.start_time, span.end_time


def _attr(span: ReadableSpan, key: str) -> object:
    assert span.attributes is not None
    return span.attributes[key]


def _item(job_id: str, traceparent: str | None) -> WorkItem:
    job = OCRJob.model_validate({"id": job_id, "image": {"path": "x.png"}})
    return WorkItem(ParsedJob(job_id, "ocr", 5, None, job), Reply("r", b"c", traceparent), time.monotonic() - 0.05)


def test_a_requesters_trace_continues_into_the_job_and_its_stages(tmp_path: Path) -> None:
    responder, link, exporter = _responder(tmp_path)
    item = _item("j1", PARENT)
    item.stages.update({"decode": 4.0, "preprocess": 6.0, "model": 20.0, "postprocess": 5.0})
    now = time.monotonic()
    responder.finish(item, Outcome({"text": "SN-1"}, None, now - 0.035, now))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    job = spans["edge.job ocr"]
    assert format_trace_id(job.context.trace_id) == PARENT.split("-")[1]
    assert job.parent is not None and format_span_id(job.parent.span_id) == PARENT.split("-")[2]
    assert _attr(job, "edge.job.id") == "j1" and _attr(job, "edge.status") == "ok"
    stages = [s for s in exporter.get_finished_spans() if s.name.startswith("edge.stage")]
    assert [s.name for s in stages] == [
        f"edge.stage {n}" for n in ("queued", "decode", "preprocess", "model", "postprocess")
    ]
    assert all(s.parent is not None and s.parent.span_id == job.context.span_id for s in stages)
    for span in stages:  # laid end to end from the job's arrival, each as long as its stage
        ms = link.sent[0].doc["timings"]["stages"][_attr(span, "edge.stage")]
        start, end = _times(span)
        assert (end - start) / 1e6 == pytest.approx(ms, abs=0.01)
    job_start, job_end = _times(job)
    assert _times(stages[0])[0] == job_start
    assert all(_times(a)[1] == _times(b)[0] for a, b in itertools.pairwise(stages))
    assert _times(stages[-1])[1] <= job_end
    assert (job_end - job_start) / 1e6 >= 50  # it arrived 50 ms before its result
    # The result carries the job span's context, in the requester's trace.
    doc = link.sent[0].doc
    assert doc["traceparent"] == f"00-{PARENT.split('-')[1]}-{format_span_id(job.context.span_id)}-01"


def test_a_job_without_a_traceparent_starts_a_trace_and_an_error_is_marked(tmp_path: Path) -> None:
    responder, link, exporter = _responder(tmp_path)
    item = _item("j2", None)
    now = time.monotonic()
    responder.finish(item, Outcome(None, JobError(ErrorCode.IMAGE_INVALID, "bad", "image.path"), now, now))
    (job,) = [s for s in exporter.get_finished_spans() if s.name == "edge.job ocr"]
    assert job.parent is None and job.status.status_code == StatusCode.ERROR
    assert _attr(job, "edge.error.code") == "image_invalid"
    assert link.sent[0].doc["traceparent"].split("-")[1] == format_trace_id(job.context.trace_id)


def test_a_refused_job_is_traced_too(tmp_path: Path) -> None:
    responder, link, exporter = _responder(tmp_path)
    error = JobError(ErrorCode.INVALID_FIELD, "no", "image")
    responder.reject(Reply("r", b"c", PARENT), "j3", "ocr", error, time.monotonic())
    (job,) = exporter.get_finished_spans()[-1:]
    assert job.name == "edge.job ocr" and format_trace_id(job.context.trace_id) == PARENT.split("-")[1]
    assert json.loads(link.sent[0].payload)["traceparent"].startswith(f"00-{PARENT.split('-')[1]}-")


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (PARENT, True),
        (PARENT.upper(), False),  # W3C's hex is lower case
        (PARENT[:3] + PARENT[3:].replace("a", "A", 1), False),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),  # all-zero trace id
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),  # all-zero span id
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),  # version ff is invalid
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", False),
        ("garbage", False),
        (None, False),
    ],
)
def test_only_w3c_traceparents_are_continued(value: str | None, valid: bool) -> None:
    assert (valid_traceparent(value) is not None) == valid
