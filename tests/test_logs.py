"""Log formats (edge/logs.py): journald entries with a job's structured fields, given a
fake journal sink in place of journald's socket (the seam systemd-python provides),
JSON lines, and the choice `auto` makes under systemd and elsewhere."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge import logs
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import OCRJob, ParsedJob
from edge.scheduler.branch import Outcome
from edge.scheduler.work import Reply, WorkItem
from systemd import journal
from tests import fakes


class Sink:
    """What journald would have been sent: one dict of fields per entry."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def __call__(self, MESSAGE: str, **fields: Any) -> None:
        self.entries.append({"MESSAGE": MESSAGE, **fields})


@pytest.fixture
def sink() -> Iterator[Sink]:
    found = Sink()
    handler = logs.handler_for("journal", sender=found)
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    yield found
    root.removeHandler(handler)
    root.setLevel(level)


def test_a_failed_job_is_logged_to_the_journal_with_its_fields(sink: Sink, tmp_path: Path) -> None:
    responder, _link, _journal = fakes.responder(tmp_path)
    job = OCRJob.model_validate({"id": "cam3-000172", "image": {"path": "x.png"}})
    item = WorkItem(ParsedJob(job.id, "ocr", 5, None, job), Reply("r"))
    error = JobError(ErrorCode.IMAGE_INVALID, "cannot decode image", "image.path")
    now = time.monotonic()
    responder.finish(item, Outcome(None, error, now, now))
    (entry,) = [e for e in sink.entries if e.get("JOB_ID") == "cam3-000172"]
    assert entry["TASK"] == "ocr" and entry["ERROR_CODE"] == "image_invalid"
    assert entry["MESSAGE"] == "job cam3-000172 failed: image_invalid: cannot decode image (field image.path)"
    assert entry["PRIORITY"] == "4" and entry["LOGGER"] == "edge.responder"  # warning
    assert entry["SYSLOG_IDENTIFIER"] == "edged"


def test_a_line_without_a_job_carries_no_job_fields(sink: Sink) -> None:
    logging.getLogger("edge.test").info("loaded %s", "ocr", extra=logs.job_fields(None, model="ocr"))
    (entry,) = sink.entries
    assert entry["MESSAGE"] == "loaded ocr" and entry["MODEL"] == "ocr"
    assert not {"JOB_ID", "TASK", "ERROR_CODE"} & set(entry)


def test_json_lines_carry_the_same_fields(capsys: pytest.CaptureFixture[str]) -> None:
    handler = logs.handler_for("json")
    log = logging.getLogger("edge.test.json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("job %s failed", "q1", extra=logs.job_fields("q1", "qa", "over_budget"))
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("boom")
    finally:
        log.removeHandler(handler)
        log.propagate = True
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["message"] == "job q1 failed" and first["level"] == "warning" and first["logger"] == "edge.test.json"
    assert (first["job_id"], first["task"], first["error_code"]) == ("q1", "qa", "over_budget")
    assert first["time"].endswith("Z") and "model" not in first
    assert second["level"] == "error" and "ValueError: bad" in second["exception"]


def test_auto_is_the_journal_under_systemd_and_plain_lines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    assert isinstance(logs.handler_for("auto"), journal.JournalHandler)
    monkeypatch.delenv("JOURNAL_STREAM")
    plain = logs.handler_for("auto")
    assert isinstance(plain, logging.StreamHandler) and not isinstance(plain, journal.JournalHandler)
    assert isinstance(logs.handler_for("text"), logging.StreamHandler)


def test_setup_replaces_the_handler_and_level() -> None:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    try:
        logs.setup("warning", "json")
        logs.setup("debug", "text")
        assert len(root.handlers) == 1 and root.level == logging.DEBUG
        assert not isinstance(root.handlers[0].formatter, logs.JsonFormatter)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)
