"""Structured job errors: every rejection names a code, a reason and, where one is to
blame, the field."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ErrorCode(str, Enum):
    """A job error's code: its value is what the protocol sends, and the member compares
    equal to it and prints as it (enum.StrEnum's behaviour, which Python 3.10 lacks)."""

    PAYLOAD_TOO_LARGE = "payload_too_large"
    BAD_JSON = "bad_json"
    INVALID_FIELD = "invalid_field"
    MISSING_FIELD = "missing_field"
    UNKNOWN_TASK = "unknown_task"
    IMAGE_INVALID = "image_invalid"
    IMAGE_TOO_LARGE = "image_too_large"
    PATH_FORBIDDEN = "path_forbidden"
    PROMPT_TOO_LONG = "prompt_too_long"
    BUSY = "busy"
    DUPLICATE = "duplicate"
    EXPIRED = "expired"
    OVER_BUDGET = "over_budget"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"
    STORAGE_FULL = "storage_full"
    INTERNAL = "internal"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


@dataclass(frozen=True)
class JobError(Exception):
    code: ErrorCode
    message: str
    field: str | None = None

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.code.value}: {self.message}{where}"

    def to_dict(self) -> dict[str, str | None]:
        return {"code": self.code.value, "message": self.message, "field": self.field}


def internal_error(err: BaseException) -> JobError:
    """What a requester is told of a fault: that it was one, and of what kind. The
    details (messages with host paths, object reprs) go to the daemon's log, which the
    caller writes with the traceback."""
    return JobError(ErrorCode.INTERNAL, f"internal error ({type(err).__name__}); the daemon's log has the details")
