"""Result documents, the one shape every answer takes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from edge.protocol.errors import JobError

RESULT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Timings:
    queued_ms: float
    run_ms: float
    total_ms: float
    # Milliseconds by stage, "queued" first (edge/timing.py), and the text branch's token
    # latencies (ttft_ms, token_p50_ms, token_p99_ms) where the job decoded, and its
    # speculative decoding's draft tokens (drafted_tokens, accepted_tokens) where that ran.
    stages: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "queued_ms": round(self.queued_ms, 3),
            "run_ms": round(self.run_ms, 3),
            "total_ms": round(self.total_ms, 3),
            "stages": {"queued": round(self.queued_ms, 3), **{k: round(v, 3) for k, v in self.stages.items()}},
            **{k: round(v, 3) for k, v in self.latency.items()},
        }


def ok_result(job_id: str, task: str, device_id: str, output: dict[str, Any], timings: Timings) -> dict[str, Any]:
    return {
        "v": RESULT_SCHEMA_VERSION,
        "id": job_id,
        "task": task,
        "device": device_id,
        "status": "ok",
        "output": output,
        "timings": timings.to_dict(),
    }


def error_result(
    job_id: str | None, task: str | None, device_id: str, error: JobError, timings: Timings
) -> dict[str, Any]:
    return {
        "v": RESULT_SCHEMA_VERSION,
        "id": job_id,
        "task": task,
        "device": device_id,
        "status": "error",
        "error": error.to_dict(),
        "timings": timings.to_dict(),
    }


def encode(result: dict[str, Any]) -> bytes:
    return json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def accepted_notice(job_id: str, task: str, device_id: str) -> dict[str, Any]:
    """A box's word that it has journalled a job (sent to requesters that ask for it):
    the job is this box's to answer from now on, across its restarts; its result follows."""
    return {"v": RESULT_SCHEMA_VERSION, "id": job_id, "task": task, "device": device_id, "status": "accepted"}


def partial_result(job_id: str, task: str, device_id: str, seq: int, delta: str) -> dict[str, Any]:
    """A streamed piece of a job's output; the job's final result still follows."""
    return {
        "v": RESULT_SCHEMA_VERSION,
        "id": job_id,
        "task": task,
        "device": device_id,
        "status": "partial",
        "seq": seq,
        "delta": delta,
    }


def grounding_of(output: Any) -> str | None:
    """A qa output's grounding verdict (edge/tasks/grounding.py), a pipeline job's nested
    answer's included; None for outputs that have none."""
    if not isinstance(output, dict):
        return None
    inner = output.get("answer")
    found = inner.get("grounding") if isinstance(inner, dict) else output.get("grounding")
    return found if isinstance(found, str) else None
