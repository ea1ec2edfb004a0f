from __future__ import annotations

import json
from typing import Any

import pytest

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import EmbedJob, JobLimits, OCRJob, QAJob, decode_payload, parse_job, recover_id

LIMITS = JobLimits(max_payload_bytes=4096, max_prompt_chars=200, max_new_tokens_limit=64)


def parse(data: Any, topic_task: str | None = None) -> Any:
    return parse_job(data, topic_task, LIMITS)


def test_valid_ocr_qa_and_embed_jobs() -> None:
    job = parse({"id": "a1", "image": {"path": "labels/label_00.png"}}, "ocr")
    assert job.task == "ocr" and isinstance(job.request, OCRJob) and job.priority == 5
    qa = parse({"id": "q", "task": "qa", "question": "Why?", "priority": 0, "deadline_ms": 500, "stop": ["\n"]})
    assert isinstance(qa.request, QAJob) and qa.priority == 0 and qa.deadline_ms == 500
    embed = parse({"id": "e", "input": ["a pump", "a dressing"], "priority": 2}, "embed")
    assert (
        embed.task == "embed"
        and isinstance(embed.request, EmbedJob)
        and embed.request.input == ["a pump", "a dressing"]
    )


@pytest.mark.parametrize(
    ("data", "topic", "code", "field"),
    [
        ([1, 2], "ocr", ErrorCode.INVALID_FIELD, "<root>"),
        ({"image": {"path": "x.png"}}, "ocr", ErrorCode.MISSING_FIELD, "id"),
        ({"id": 7, "image": {"path": "x.png"}}, "ocr", ErrorCode.INVALID_FIELD, "id"),
        ({"id": "", "image": {"path": "x.png"}}, "ocr", ErrorCode.INVALID_FIELD, "id"),
        ({"id": "x" * 129, "image": {"path": "x.png"}}, "ocr", ErrorCode.INVALID_FIELD, "id"),
        ({"id": "a", "task": "translate"}, "translate", ErrorCode.UNKNOWN_TASK, "task"),
        ({"id": "a"}, None, ErrorCode.MISSING_FIELD, "task"),
        ({"id": "a", "task": 3}, "ocr", ErrorCode.INVALID_FIELD, "task"),
        ({"id": "a", "task": "qa", "question": "q"}, "ocr", ErrorCode.INVALID_FIELD, "task"),
        ({"id": "a"}, "ocr", ErrorCode.MISSING_FIELD, "image"),
        ({"id": "a", "image": {}}, "ocr", ErrorCode.INVALID_FIELD, "image"),
        ({"id": "a", "image": {"data": "x", "path": "y"}}, "ocr", ErrorCode.INVALID_FIELD, "image"),
        ({"id": "a", "image": {"data": 5}}, "ocr", ErrorCode.INVALID_FIELD, "image.data"),
        ({"id": "a", "image": {"path": "x"}, "priority": "5"}, "ocr", ErrorCode.INVALID_FIELD, "priority"),
        ({"id": "a", "image": {"path": "x"}, "priority": 10}, "ocr", ErrorCode.INVALID_FIELD, "priority"),
        ({"id": "a", "image": {"path": "x"}, "deadline_ms": 0}, "ocr", ErrorCode.INVALID_FIELD, "deadline_ms"),
        ({"id": "a", "image": {"path": "x"}, "colour": 1}, "ocr", ErrorCode.INVALID_FIELD, "colour"),
        ({"id": "a", "question": ""}, "qa", ErrorCode.INVALID_FIELD, "question"),
        ({"id": "a", "question": "q", "temperature": -1}, "qa", ErrorCode.INVALID_FIELD, "temperature"),
        ({"id": "a", "question": "q", "top_p": 0}, "qa", ErrorCode.INVALID_FIELD, "top_p"),
        ({"id": "a", "question": "q", "stop": ["x"] * 9}, "qa", ErrorCode.INVALID_FIELD, "stop"),
        ({"id": "a", "question": "q", "stop": [""]}, "qa", ErrorCode.INVALID_FIELD, "stop[0]"),
        ({"id": "a", "question": "q" * 201}, "qa", ErrorCode.PROMPT_TOO_LONG, "question"),
        ({"id": "a", "question": "q", "context": "c" * 300}, "qa", ErrorCode.PROMPT_TOO_LONG, "context"),
        ({"id": "a", "question": "q", "max_new_tokens": 65}, "qa", ErrorCode.INVALID_FIELD, "max_new_tokens"),
        ({"id": "a"}, "embed", ErrorCode.MISSING_FIELD, "input"),
        ({"id": "a", "input": []}, "embed", ErrorCode.INVALID_FIELD, "input"),
        ({"id": "a", "input": "a pump"}, "embed", ErrorCode.INVALID_FIELD, "input"),
        ({"id": "a", "input": ["ok", ""]}, "embed", ErrorCode.INVALID_FIELD, "input[1]"),
        ({"id": "a", "input": ["x"] * 257}, "embed", ErrorCode.INVALID_FIELD, "input"),
        ({"id": "a", "input": ["ok", "p" * 201]}, "embed", ErrorCode.PROMPT_TOO_LONG, "input[1]"),
    ],
)
def test_bad_jobs_name_code_and_field(data: Any, topic: str | None, code: ErrorCode, field: str) -> None:
    with pytest.raises(JobError) as err:
        parse(data, topic)
    assert err.value.code == code
    assert err.value.field == field
    assert err.value.message


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"{not json", ErrorCode.BAD_JSON),
        (b"\xff\xfe\x00", ErrorCode.BAD_JSON),
        (b"[" * 100_000 + b"]" * 100_000, ErrorCode.PAYLOAD_TOO_LARGE),
        (json.dumps({"id": "a", "pad": "x" * 5000}).encode(), ErrorCode.PAYLOAD_TOO_LARGE),
    ],
)
def test_undecodable_payloads(payload: bytes, code: ErrorCode) -> None:
    with pytest.raises(JobError) as err:
        decode_payload(payload, LIMITS.max_payload_bytes)
    assert err.value.code == code


def test_deeply_nested_json_is_an_error_not_a_crash() -> None:
    with pytest.raises(JobError) as err:
        decode_payload(b"[" * 3000 + b"]" * 3000, 1 << 20)
    assert err.value.code == ErrorCode.BAD_JSON


def test_recover_id_only_when_usable() -> None:
    assert recover_id({"id": "abc"}) == "abc"
    assert recover_id({"id": 5}) is None
    assert recover_id({"id": "x" * 500}) is None
    assert recover_id("nope") is None
