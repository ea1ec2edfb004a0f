"""Where the daemon's log goes, and the job fields its lines carry.

`log_format` in the profile:
- `auto` (the default): the systemd journal when running under systemd (JOURNAL_STREAM
  set) and systemd-python is there, else `text`;
- `journal`: journald entries through systemd-python's JournalHandler, with structured
  fields a collector can filter on (`journalctl JOB_ID=cam3-000172`, `TASK=qa`,
  `ERROR_CODE=over_budget`, `MODEL=...`) beside journald's own (PRIORITY, CODE_FILE...);
- `json`: one JSON object per line on stderr (time, level, logger, message and the same
  fields in lower case), for collectors other than journald;
- `text`: plain lines on stderr, timestamped unless journald timestamps them.

A log call names a job's fields with `extra=job_fields(...)`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

# The structured fields a job's lines may carry, as journald names them.
JOB_FIELDS = ("JOB_ID", "TASK", "ERROR_CODE", "MODEL")

LogFormat = Literal["auto", "text", "json", "journal"]


def job_fields(
    job_id: str | None, task: str | None = None, error_code: str | None = None, model: str | None = None
) -> dict[str, str]:
    """`extra=` for a log call about one job: only the fields that are known."""
    values = (job_id, task, error_code, model)
    return {name: str(value) for name, value in zip(JOB_FIELDS, values, strict=True) if value is not None}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in JOB_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                doc[name.lower()] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def _journal_handler(sender: Callable[..., None] | None) -> logging.Handler | None:
    try:
        from systemd import journal
    except ImportError:
        return None
    replaced = {} if sender is None else {"sender_function": sender}
    handler: logging.Handler = journal.JournalHandler(SYSLOG_IDENTIFIER="edged", **replaced)
    return handler


def handler_for(fmt: LogFormat, sender: Callable[..., None] | None = None) -> logging.Handler:
    """The handler `fmt` asks for. `sender`: journald's send function, replaced in a test."""
    if fmt in ("auto", "journal"):
        under_systemd = "JOURNAL_STREAM" in os.environ
        handler = _journal_handler(sender) if fmt == "journal" or under_systemd else None
        if handler is not None:
            handler.setFormatter(logging.Formatter("%(message)s"))
            return handler
        if fmt == "journal":
            logging.getLogger(__name__).warning("log_format journal: systemd-python is not installed; plain lines")
    stream = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        stream.setFormatter(JsonFormatter())
    else:
        # Under systemd, journald timestamps every line; a terminal wants its own.
        text = "%(levelname)s %(name)s: %(message)s"
        stream.setFormatter(logging.Formatter(text if "JOURNAL_STREAM" in os.environ else "%(asctime)s " + text))
    return stream


def setup(level: str, fmt: LogFormat = "auto") -> None:
    """The root logger at `level`, its one handler as `fmt` asks; called again (a
    reload), it replaces both."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler_for(fmt))
    root.setLevel(getattr(logging, level.upper()))
