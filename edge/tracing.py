"""OpenTelemetry traces of jobs: one span per job, a child span per stage.

A requester may send a W3C `traceparent` as an MQTT v5 user property; the job's span
then continues that trace, and the result carries the job span's own `traceparent` for
the requester to continue in turn. The spans are made as the result is sent, from the
job's recorded times (arrival, then `timings.stages` one after another): no span is held
open while the job runs, and a job refused on arrival gets its span too.

Spans go where `tracing` in the profile says: nowhere (the default: traceparents are
still continued and echoed), or an OTLP/HTTP collector (`tracing.otlp_endpoint`, which
needs the opentelemetry-exporter-otlp-proto-http package). Tests give an in-memory
exporter instead. A traceparent that is not W3C's format is ignored, as the W3C
recommendation says: the job runs, in a trace of its own.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanContext, Status, StatusCode, format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

TRACEPARENT = re.compile(r"^[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
_PROPAGATOR = TraceContextTextMapPropagator()


def valid_traceparent(value: str | None) -> str | None:
    """`value` if it is a W3C traceparent (version 00's form), else None. W3C's form is
    lower-case hex: an upper-case one is not W3C's, and is ignored like any other."""
    if value is None:
        return None
    value = value.strip()
    return value if TRACEPARENT.match(value) and not value.startswith("ff") else None


def traceparent_of(context: SpanContext) -> str:
    return f"00-{format_trace_id(context.trace_id)}-{format_span_id(context.span_id)}-{int(context.trace_flags):02x}"


class JobTracer:
    """Spans for finished jobs. `exporter`: where they go (None: spans are made for their
    ids, so traceparents continue, and dropped)."""

    def __init__(self, device_id: str, exporter: SpanExporter | None = None, batch: bool = True) -> None:
        resource = Resource.create({"service.name": "edged", "service.instance.id": device_id})
        self._provider = TracerProvider(resource=resource)
        if exporter is not None:
            processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
            self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("edge")

    @classmethod
    def from_profile(cls, device_id: str, otlp_endpoint: str | None) -> JobTracer:
        if otlp_endpoint is None:
            return cls(device_id)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        except ImportError:
            logger.error(
                "tracing.otlp_endpoint is set but opentelemetry-exporter-otlp-proto-http is not installed: "
                "spans are not exported (traceparents are still continued)"
            )
            return cls(device_id)
        logger.info("traces exported to %s", otlp_endpoint)
        return cls(device_id, OTLPSpanExporter(endpoint=otlp_endpoint))

    def record(self, doc: dict[str, Any], received_at: float, traceparent: str | None) -> str:
        """The spans of one final result `doc` (received_at on the monotonic clock);
        returns the job span's traceparent."""
        now_ns = time.time_ns()
        mono = time.monotonic()
        timings = doc.get("timings", {})
        end_ns = now_ns
        start_ns = now_ns - int(max(0.0, mono - received_at) * 1e9)
        parent = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        task = doc.get("task") or "unknown"
        span = self._tracer.start_span(f"edge.job {task}", context=parent, start_time=start_ns)
        span.set_attribute("edge.job.id", str(doc.get("id")))
        span.set_attribute("edge.task", task)
        span.set_attribute("edge.status", str(doc.get("status")))
        error = doc.get("error")
        if isinstance(error, dict):
            span.set_attribute("edge.error.code", str(error.get("code")))
            span.set_status(Status(StatusCode.ERROR, str(error.get("message"))))
        try:
            ctx = trace.set_span_in_context(span)
            at = start_ns
            for name, ms in timings.get("stages", {}).items():
                length = int(ms * 1e6)
                child = self._tracer.start_span(f"edge.stage {name}", context=ctx, start_time=at)
                child.set_attribute("edge.stage", name)
                child.end(end_time=min(at + length, end_ns))
                at += length
        finally:
            span.end(end_time=end_ns)
        return traceparent_of(span.get_span_context())

    def shutdown(self) -> None:
        self._provider.shutdown()
