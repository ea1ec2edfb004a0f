"""docs/protocol.md: its examples match the schemas, the parser and the running daemon."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from edge.protocol.errors import JobError
from edge.protocol.jobs import JobLimits, parse_job
from tests.conftest import LABELS, REPO, SAMPLES, Broker, DaemonProc, Requester

DOC = REPO / "docs" / "protocol.md"
SCHEMAS = REPO / "docs" / "schemas"
LIMITS = JobLimits(max_payload_bytes=1 << 20, max_prompt_chars=8000, max_new_tokens_limit=512)
_EXAMPLE = re.compile(r"<!-- example: (job|result|partial|notice) ([\w-]+) -->\s*```json\n(.*?)```", re.S)


def examples() -> dict[tuple[str, str], Any]:
    found = {(kind, name): json.loads(body) for kind, name, body in _EXAMPLE.findall(DOC.read_text())}
    assert len(found) >= 8
    return found


def schema(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / name).read_text()))


EXAMPLES = examples()
JOB_EXAMPLES = {name: body for (kind, name), body in EXAMPLES.items() if kind == "job"}


def test_every_job_example_has_its_result() -> None:
    assert {n for k, n in EXAMPLES if k == "result"} == set(JOB_EXAMPLES)


@pytest.mark.parametrize("key", sorted(EXAMPLES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_examples_match_schema(key: tuple[str, str]) -> None:
    kind, _ = key
    validator = schema("job.schema.json" if kind == "job" else "result.schema.json")
    body = EXAMPLES[key]
    if kind == "job" and key[1].startswith("bad-type"):
        assert not validator.is_valid(body)
    else:
        validator.validate(body)


@pytest.mark.parametrize("name", sorted(JOB_EXAMPLES))
def test_parser_agrees_with_documented_result(name: str) -> None:
    expected = EXAMPLES[("result", name)]
    job = JOB_EXAMPLES[name]
    if expected["status"] == "ok":
        parsed = parse_job(job, job.get("task"), LIMITS)
        assert parsed.id == expected["id"]
    elif expected["error"]["code"] in {"invalid_field", "missing_field"}:
        with pytest.raises(JobError) as err:
            parse_job(job, job.get("task"), LIMITS)
        assert err.value.code.value == expected["error"]["code"]
        assert err.value.field == expected["error"]["field"]


CASES: list[tuple[dict[str, Any], bool]] = [
    ({"id": "a", "image": {"data": "aGk="}}, True),
    ({"id": "a", "question": "q", "stop": ["\n"], "seed": 3}, True),
    ({"id": "a", "image": {"data": "x", "path": "y"}}, False),
    ({"id": "a", "image": {"path": "y"}, "question": "q"}, True),  # a question about an image
    ({"id": "a", "image": {"path": "y"}, "question": "q", "heatmap": True}, False),
    ({"id": "a", "image": {"path": "y", "data": "aGk="}, "question": "q"}, False),
    ({"id": "a", "image": "y.png", "question": "q"}, False),
    ({"id": "a", "question": "q", "top_p": 0}, False),
    ({"id": "a", "question": "q", "priority": 10}, False),
    ({"id": "", "question": "q"}, False),
    ({"id": "a", "question": "q", "extra": 1}, False),
    ({"id": "a", "input": ["a pump", "a dressing"]}, True),
    ({"id": "a", "input": []}, False),
    ({"id": "a", "input": [""]}, False),
    ({"id": "a", "input": "a pump"}, False),
    ({"id": "a", "input": ["x"] * 257}, False),
]


@pytest.mark.parametrize(("job", "valid"), CASES)
def test_schema_and_parser_agree(job: dict[str, Any], valid: bool) -> None:
    assert schema("job.schema.json").is_valid(job) == valid
    task = "qa" if "question" in job else "ocr" if "image" in job else "embed" if "input" in job else "qa"
    try:
        parse_job(job, task, LIMITS)
        parsed = True
    except JobError:
        parsed = False
    assert parsed == valid


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(JOB_EXAMPLES))
def test_examples_against_the_daemon(name: str, daemon: DaemonProc, requester: Requester) -> None:
    job = JOB_EXAMPLES[name]
    expected = EXAMPLES[("result", name)]
    result = requester.request(f"edge/t1/jobs/{job['task']}", job, timeout=120)
    schema("result.schema.json").validate(result)
    assert (result["id"], result["task"], result["status"]) == (expected["id"], expected["task"], expected["status"])
    if expected["status"] == "error":
        assert result["error"]["code"] == expected["error"]["code"]
        assert result["error"]["field"] == expected["error"]["field"]
    elif job["task"] == "inspect":
        # The test build is smoke-sized: its verdict may differ, the shape and the label may not.
        out = result["output"]
        assert set(out) == set(expected["output"])
        assert set(out["probabilities"]) == set(expected["output"]["probabilities"])
        assert out["ocr"]["text"] == expected["output"]["ocr"]["text"]
    elif job["task"] == "embed":
        # The example shows each vector's first four numbers: the encoder's, as served.
        out, shown = result["output"], expected["output"]
        assert (out["model"], out["dimensions"]) == (shown["model"], shown["dimensions"])
        assert [len(v) for v in out["embeddings"]] == [out["dimensions"]] * len(job["input"])
        for got, first in zip(out["embeddings"], shown["embeddings"], strict=True):
            assert got[: len(first)] == pytest.approx(first, abs=1e-4)
    elif job["task"] == "ocr":
        assert result["output"]["text"] == expected["output"]["text"]
        assert result["output"]["lines"][0]["box"] == expected["output"]["lines"][0]["box"]
        assert result["output"]["image"] == expected["output"]["image"]


def _sample_client(broker: Broker, *args: str) -> tuple[int, dict[str, Any]]:
    res = subprocess.run(
        [sys.executable, str(SAMPLES / "send_job.py"), "--port", str(broker.port), "--device", "t1", *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.stdout, res.stderr
    return res.returncode, json.loads(res.stdout)


@pytest.mark.integration
def test_the_sample_client_sends_an_image_and_prints_its_result(daemon: DaemonProc, broker: Broker) -> None:
    """samples/send_job.py, as a camera host would start from it: the image as base64, its
    own response topic and correlation data; the result printed, exit status 0 on ok."""
    label = LABELS[0]
    code, result = _sample_client(broker, "--task", "ocr", "--image", str(SAMPLES / "labels" / label["name"]))
    assert code == 0 and result["status"] == "ok", result
    assert result["output"]["text"].split("\n") == label["lines"]
    part = SAMPLES / "parts" / "part_01_scratch.png"
    code, result = _sample_client(broker, "--image", str(part), "--read-labels", "--heatmap", "--id", "sample-1")
    assert code == 0 and result["id"] == "sample-1" and result["task"] == "inspect", result
    heatmap = result["output"]["heatmap"]
    assert [len(row) for row in heatmap] == [14] * 14 and "ocr" in result["output"]
    schema("result.schema.json").validate(result)
    # Sent again with its id: the same request (reply topic and correlation follow from the
    # id), answered from the journal with the stored result.
    code, again = _sample_client(broker, "--image", str(part), "--read-labels", "--heatmap", "--id", "sample-1")
    assert code == 0 and again == result


@pytest.mark.integration
def test_the_sample_client_prints_the_error_of_a_job_the_box_refuses(
    daemon: DaemonProc, broker: Broker, tmp_path: Path
) -> None:
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_bytes(b"these are not pixels")
    code, result = _sample_client(broker, "--image", str(not_an_image))
    assert code == 1 and result["status"] == "error", result
    assert result["error"]["field"].startswith("image"), result


def test_doc_exists() -> None:
    assert Path(DOC).is_file()
