"""Job errors as HTTP answers: a status for each code, and OpenAI's error object
{"error": {"message", "type", "param", "code"}} so OpenAI clients raise the right kind."""

from __future__ import annotations

from typing import Any

from edge.protocol.errors import ErrorCode, JobError

STATUS: dict[ErrorCode, int] = {
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.BAD_JSON: 400,
    ErrorCode.INVALID_FIELD: 400,
    ErrorCode.MISSING_FIELD: 400,
    ErrorCode.UNKNOWN_TASK: 400,
    ErrorCode.IMAGE_INVALID: 400,
    ErrorCode.IMAGE_TOO_LARGE: 413,
    ErrorCode.PATH_FORBIDDEN: 403,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.BUSY: 429,
    ErrorCode.DUPLICATE: 409,
    ErrorCode.EXPIRED: 504,
    ErrorCode.OVER_BUDGET: 503,
    ErrorCode.CANCELLED: 409,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.STORAGE_FULL: 507,
    ErrorCode.INTERNAL: 500,
}

# The job's field names where the API calls them otherwise: a chat's question and context
# come from its messages, a completion's question from its prompt.
PARAM: dict[str, str] = {"max_new_tokens": "max_tokens", "question": "messages", "context": "messages", "id": "id"}
COMPLETION_PARAM: dict[str, str] = {**PARAM, "question": "prompt", "context": "prompt"}


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def from_job_error(err: JobError | dict[str, Any], chat: bool = True) -> tuple[int, dict[str, Any]]:
    """The status and body for a job error (or a result's `error` object), its field
    named as the chat (`chat`) or the completion endpoint calls it."""
    if isinstance(err, JobError):
        code, message, field = err.code, err.message, err.field
    else:
        try:
            code = ErrorCode(err.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        message, field = str(err.get("message", "")), err.get("field")
    status = STATUS.get(code, 500)
    names = PARAM if chat else COMPLETION_PARAM
    param = names.get(field, field) if isinstance(field, str) else None
    return status, body(status, message, code.value, param)
