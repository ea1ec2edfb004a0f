"""Which Response Topics results may go to (edge/protocol/topics.py), and payloads the JSON
layer accepts but nothing downstream could carry."""

from __future__ import annotations

import pytest

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import decode_payload
from edge.protocol.topics import MAX_TOPIC_BYTES, reply_topic_error

NS, RESULTS = "edge/box1", "edge/box1/results"


@pytest.mark.parametrize(
    ("topic", "why"),
    [
        ("", "empty"),
        ("a/+/b", "wildcard"),
        ("a/#", "wildcard"),
        ("$SYS/broker", "'$'"),
        ("a\x00b", "NUL"),
        ("x" * (MAX_TOPIC_BYTES + 1), "bytes"),
        ("a/\ud800", "UTF-8"),
        ("edge/box1/available", "own topics"),
        ("edge/box1/jobs/ocr", "own topics"),
        ("edge/box1", "own topics"),
        ("edge/box2/jobs/qa", "job topic"),
        ("plant/jobs/anything", "job topic"),
    ],
)
def test_topics_results_cannot_go_to(topic: str, why: str) -> None:
    err = reply_topic_error(topic, NS, RESULTS)
    assert err is not None and err.field == "response_topic" and err.code == ErrorCode.INVALID_FIELD
    assert why in err.message


@pytest.mark.parametrize("topic", ["replies/line-3/x", RESULTS, f"{RESULTS}/cam3", "edge/box2/results", "é/ü"])
def test_topics_results_may_go_to(topic: str) -> None:
    assert reply_topic_error(topic, NS, RESULTS) is None


@pytest.mark.parametrize(
    "payload",
    [b'{"id": 1' + b"2" * 5000 + b"}", b'{"id": "a\\udc80"}', b'{"id": "x", "q": ["\\ud83d"]}'],
)
def test_payloads_nothing_could_carry_are_bad_json(payload: bytes) -> None:
    with pytest.raises(JobError) as err:
        decode_payload(payload, 1 << 20)
    assert err.value.code == ErrorCode.BAD_JSON


def test_a_surrogate_pair_escape_is_an_ordinary_character() -> None:
    assert decode_payload(b'{"id": "\\ud83d\\ude00"}', 1024) == {"id": "\U0001f600"}
