"""Parse and validate job payloads.

A payload becomes either a `ParsedJob` or a `JobError` naming the field; nothing in here
raises anything else on any input, because a crash here would take other jobs with it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.response_format import grammar_of

logger = logging.getLogger(__name__)

TASKS = ("ocr", "inspect", "qa", "embed", "cancel")
Task = Literal["ocr", "inspect", "qa", "embed", "cancel"]
MAX_ID_CHARS = 128
MAX_EMBED_INPUTS = 256  # texts an embed job carries at most

JobId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]


class _JobModel(BaseModel):
    # strict: "5" is not 5 and 1.0 is not a string; a typo'd key is an error, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ImageRef(_JobModel):
    data: str | None = Field(default=None, description="PNG or JPEG bytes, base64-encoded.")
    path: str | None = Field(default=None, description="File name relative to the device's media directory.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageRef:
        if (self.data is None) == (self.path is None):
            raise ValueError("give exactly one of 'data' (base64) or 'path'")
        return self


class JobBase(_JobModel):
    id: JobId = Field(description="Caller's job id, echoed in the result.")
    task: Task | None = Field(default=None, description="Task name; defaults to the topic's last level.")
    priority: int = Field(default=5, ge=0, le=9, description="0 is most urgent, 9 least; default 5.")
    deadline_ms: int | None = Field(
        default=None,
        ge=1,
        le=24 * 3600 * 1000,
        description="Milliseconds from receipt after which the job is answered `expired`.",
    )


class OCRJob(JobBase):
    image: ImageRef = Field(description="The image to read.")


class JsonSchemaSpec(_JobModel):
    """OpenAI's shape of a schema: `{name, schema, strict}` (an OpenAI-compatible API passes it on)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = Field(
        default=None, description="The schema's name (OpenAI's field; not used in decoding)."
    )
    description: str | None = Field(default=None, description="What the schema is for (not used in decoding).")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="The JSON schema.")
    strict: bool | None = Field(
        default=None, description="OpenAI's switch; here the schema is always enforced while decoding."
    )


class ResponseFormat(_JobModel):
    type: Literal["json_schema", "json_object", "text"] = Field(
        description="'json_schema': the answer is JSON valid against `schema`; 'json_object': any JSON object; "
        "'text': unconstrained (as without the field)."
    )
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="The JSON schema (type 'json_schema')."
    )
    json_schema: JsonSchemaSpec | None = Field(
        default=None, description="OpenAI's form of the same: `{name, schema, strict}` (type 'json_schema')."
    )


class AskSpec(_JobModel):
    question: Annotated[str, StringConstraints(min_length=1)] = Field(
        description="What the text branch is asked about the inspected part, e.g. 'Write the rework note.'"
    )
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate at most (device cap applies)."
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="Constrain the answer to JSON (as a qa job's `response_format`)."
    )


class InspectJob(JobBase):
    image: ImageRef = Field(description="The image of the part to inspect.")
    heatmap: bool = Field(
        default=False, description="Also return the per-patch defect probabilities (a 14x14 grid, row-major)."
    )
    ocr: bool = Field(default=False, description="Also read the text on the part's labels (OCR) in the same job.")
    ask: AskSpec | None = Field(
        default=None,
        description="A pipeline job: once inspected, the verdict and the label's text are handed to the text "
        "branch with this question, and the answer comes back in the same result.",
    )


class QAJob(JobBase):
    question: Annotated[str, StringConstraints(min_length=1)] = Field(description="The user's question.")
    context: str | None = Field(default=None, description="Reference text the answer should be drawn from.")
    image: ImageRef | None = Field(
        default=None,
        description="An image the question is about, as an ocr job's `image`: answered from its pixels where "
        "the box serves a vision-language model (its text model's build has an image part); refused naming "
        "this field where it does not.",
    )
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate at most (device cap applies)."
    )
    temperature: float = Field(default=0.0, ge=0.0, le=5.0, description="0 is greedy decoding (the default).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=8, description="Generation ends at any of these."
    )
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="Sampling seed, for repeatable output.")
    stream: bool = Field(
        default=False, description="Also publish partial results (status 'partial') as text is generated."
    )
    collection: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")] | None = Field(
        default=None,
        description="A document collection on the box to retrieve passages from (the profile's default if "
        "not given); they go into the prompt with their ids and the answer's citations are checked.",
    )
    top_k: int | None = Field(default=None, ge=1, le=16, description="Passages to retrieve (the profile's top_k).")
    response_format: ResponseFormat | None = Field(
        default=None,
        description="Constrain the answer, while it is decoded, to JSON valid against a schema "
        "(`{type: json_schema, schema}`) or to any JSON object (`{type: json_object}`); the result "
        "carries the parsed object as `json`.",
    )


class EmbedJob(JobBase):
    input: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        min_length=1,
        max_length=MAX_EMBED_INPUTS,
        description="Texts to embed with the box's retrieval encoder (each within the device's prompt limit).",
    )


class CancelJob(JobBase):
    job: JobId = Field(description="Id of the queued job to withdraw; it is answered `cancelled`.")


JOB_MODELS: dict[str, type[JobBase]] = {
    "ocr": OCRJob,
    "inspect": InspectJob,
    "qa": QAJob,
    "embed": EmbedJob,
    "cancel": CancelJob,
}


_TASK_NAMES: dict[str, Task] = {"ocr": "ocr", "inspect": "inspect", "qa": "qa", "embed": "embed", "cancel": "cancel"}


@dataclass(frozen=True)
class ParsedJob:
    id: str
    task: Task
    priority: int
    deadline_ms: int | None
    request: JobBase


@dataclass(frozen=True)
class JobLimits:
    max_payload_bytes: int
    max_prompt_chars: int
    max_new_tokens_limit: int


def recover_id(data: Any) -> str | None:
    """The job id, if the payload carries a usable one, so errors can still name it."""
    if isinstance(data, dict):
        job_id = data.get("id")
        if isinstance(job_id, str) and 0 < len(job_id) <= MAX_ID_CHARS:
            return job_id
    return None


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif parts:
            parts.append(f".{item}")
        else:
            parts.append(item)
    return "".join(parts)


def _validation_to_job_error(err: ValidationError) -> JobError:
    first = err.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    field = _field_path(loc) or None
    if first["type"] == "missing":
        return JobError(ErrorCode.MISSING_FIELD, "field is required", field)
    if first["type"] == "extra_forbidden":
        return JobError(ErrorCode.INVALID_FIELD, "unknown field", field)
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return JobError(ErrorCode.INVALID_FIELD, message, field)


def decode_payload(payload: bytes, max_bytes: int) -> Any:
    if len(payload) > max_bytes:
        raise JobError(ErrorCode.PAYLOAD_TOO_LARGE, f"payload is {len(payload)} bytes, limit {max_bytes}")
    try:
        data = json.loads(payload.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise JobError(ErrorCode.BAD_JSON, f"payload is not UTF-8: {err.reason}") from err
    except json.JSONDecodeError as err:
        raise JobError(ErrorCode.BAD_JSON, f"payload is not JSON: {err.msg} at {err.pos}") from err
    except RecursionError as err:
        raise JobError(ErrorCode.BAD_JSON, "payload nests too deeply") from err
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise JobError(ErrorCode.BAD_JSON, f"payload is not usable JSON: {str(err)[:120]}") from err
    if not _encodable(data):
        # A "\ud800" escape decodes to a lone surrogate, which no UTF-8 text (a result,
        # the journal, a topic) can hold.
        raise JobError(ErrorCode.BAD_JSON, "payload holds a string with an unpaired surrogate (\\uD800-\\uDFFF)")
    return data


def _encodable(data: Any) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError, RecursionError):
        return False
    return True


def parse_job(data: Any, topic_task: str | None, limits: JobLimits) -> ParsedJob:
    """Validate a decoded payload. `topic_task` is the last level of the job topic."""
    if not isinstance(data, dict):
        raise JobError(ErrorCode.INVALID_FIELD, "a job must be a JSON object", "<root>")
    payload_task = data.get("task")
    if payload_task is not None and not isinstance(payload_task, str):
        raise JobError(ErrorCode.INVALID_FIELD, "task must be a string", "task")
    task = payload_task or topic_task
    if task is None:
        raise JobError(ErrorCode.MISSING_FIELD, "no task in payload or topic", "task")
    if task not in JOB_MODELS:
        raise JobError(ErrorCode.UNKNOWN_TASK, f"unknown task {task!r}; known: {', '.join(TASKS)}", "task")
    if payload_task and topic_task and payload_task != topic_task and topic_task in JOB_MODELS:
        raise JobError(
            ErrorCode.INVALID_FIELD,
            f"task {payload_task!r} does not match topic task {topic_task!r}",
            "task",
        )
    try:
        request = JOB_MODELS[task].model_validate(data)
    except ValidationError as err:
        raise _validation_to_job_error(err) from err
    if isinstance(request, QAJob):
        _check_qa_limits(request, limits)
        grammar_of(request.response_format)
    if isinstance(request, EmbedJob):
        for i, text in enumerate(request.input):
            if len(text) > limits.max_prompt_chars:
                message = f"input {i} is {len(text)} characters, limit {limits.max_prompt_chars}"
                raise JobError(ErrorCode.PROMPT_TOO_LONG, message, f"input[{i}]")
    if isinstance(request, InspectJob) and request.ask is not None:
        _check_qa_limits(
            QAJob(id=request.id, question=request.ask.question, max_new_tokens=request.ask.max_new_tokens),
            limits,
            "ask.",
        )
        grammar_of(request.ask.response_format, "ask.")
    return ParsedJob(
        id=request.id,
        task=_TASK_NAMES[task],
        priority=request.priority,
        deadline_ms=request.deadline_ms,
        request=request,
    )


def _check_qa_limits(job: QAJob, limits: JobLimits, prefix: str = "") -> None:
    chars = len(job.question) + len(job.context or "")
    if chars > limits.max_prompt_chars:
        field = "context" if job.context and len(job.question) <= limits.max_prompt_chars else "question"
        raise JobError(
            ErrorCode.PROMPT_TOO_LONG,
            f"question and context are {chars} characters, limit {limits.max_prompt_chars}",
            prefix + field,
        )
    if job.max_new_tokens is not None and job.max_new_tokens > limits.max_new_tokens_limit:
        raise JobError(
            ErrorCode.INVALID_FIELD,
            f"max_new_tokens {job.max_new_tokens} exceeds this device's limit {limits.max_new_tokens_limit}",
            prefix + "max_new_tokens",
        )
