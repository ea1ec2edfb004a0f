"""A failure as the one line `edgectl status` shows for it: what went wrong, in words,
not the last line of a traceback (the log keeps the traceback)."""

from __future__ import annotations

from edge.artifacts import EngineMissing


def describe_failure(err: BaseException) -> str:
    """The reason a model or branch could not start, in one line."""
    if isinstance(err, EngineMissing):
        return str(err)  # written as a sentence already
    if isinstance(err, OSError) and err.strerror:
        what = err.strerror.lower()
        return f"{err.filename}: {what}" if err.filename is not None else what
    text = str(err).strip().splitlines()
    return text[0] if text else f"{type(err).__name__} (the log has the details)"
