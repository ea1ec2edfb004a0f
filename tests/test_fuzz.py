"""Thousands of random and malformed jobs against a real daemon through a real broker.

Hypothesis draws payloads from several families (raw bytes, arbitrary JSON, job-shaped
objects with wrong types, huge fields, bad base64, decompression bombs, path traversal,
unicode edge cases) and topics; every one must be answered exactly once on its own
correlation with a result or a structured error, the daemon must stay up and keep
answering good jobs, and its memory must not grow without bound.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.conftest import Broker, DaemonProc, Requester, start_daemon, write_profile

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = 5000
BATCH = 25
JOBS = "edge/fz/jobs"


def _png(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 200, 200)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _bomb() -> str:
    """A small PNG that declares 30000 x 30000 pixels (a decompression bomb)."""
    buf = io.BytesIO()
    Image.new("1", (30000, 30000)).save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode()


BOMB = _bomb()
TINY = _png(8, 8)

weird_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "\ud7ff", "\U0010ffff", "e\u0301", "\u202e", "../" * 20, "%s%n", "😀" * 50]),
    # Huge fields, drawn cheaply (a long random text would spend Hypothesis' whole budget).
    st.tuples(st.sampled_from(["x", "é", "😀", "\n"]), st.integers(5000, 20000)).map(lambda t: t[0] * t[1]),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | weird_text,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)
image_refs = st.one_of(
    st.fixed_dictionaries({"data": st.sampled_from([TINY, BOMB, "!!!", "aGVsbG8=", "", "=" * 9])}),
    st.fixed_dictionaries(
        {"path": st.sampled_from(["../../etc/passwd", "/etc/shadow", "labels/../../pyproject.toml", "nope.png", ""])}
    ),
    st.fixed_dictionaries({"data": weird_text, "path": weird_text}),
    json_values,
)
job_like = st.fixed_dictionaries(
    {"id": st.one_of(st.text(min_size=1, max_size=20), st.integers(), st.none(), st.text(min_size=129, max_size=300))},
    optional={
        "task": st.sampled_from(["ocr", "inspect", "qa", "cancel", "rm -rf", ""]) | json_values,
        "image": image_refs,
        "question": weird_text | json_values,
        "context": weird_text,
        "priority": st.integers(-5, 20) | json_values,
        "deadline_ms": st.integers(-10, 10**12) | json_values,
        "max_new_tokens": st.integers(-1, 10**6),
        "temperature": st.floats(allow_nan=True) | json_values,
        "stop": st.lists(weird_text, max_size=12),
        "heatmap": json_values,
        "job": weird_text,
        "extra": json_values,
    },
)


def _encode(value: Any) -> bytes:
    try:
        return json.dumps(value).encode()
    except (ValueError, TypeError):
        return b"{broken"


payloads = st.one_of(
    st.binary(max_size=200),
    json_values.map(_encode),
    job_like.map(_encode),
    job_like.map(lambda j: _encode(j)[: max(1, len(_encode(j)) // 2)]),  # truncated JSON
)
topics = st.sampled_from(["ocr", "inspect", "qa", "cancel", "unknown"])  # all under the subscribed jobs/+


@pytest.fixture(scope="module")
def fuzz_daemon(broker: Broker, tmp_path_factory: pytest.TempPathFactory, ocr_engine_dir: Path) -> Iterator[DaemonProc]:
    directory = tmp_path_factory.mktemp("fuzz")
    profile = write_profile(
        directory,
        broker.port,
        ocr_engine_dir,  # OCR only: malformed jobs for the other tasks still get answers
        device_id="fz",
        models={"ocr": {"threads": 1}, "inspect": {"enabled": False}, "qa": {"enabled": False}},
    )
    d = start_daemon(profile)
    d.wait_ready()
    yield d
    d.stop()


def _rss(d: DaemonProc) -> int:
    return int(json.loads(d.status().stdout)["memory"]["rss_bytes"])


def test_random_and_malformed_jobs_are_all_answered(fuzz_daemon: DaemonProc, requester: Requester) -> None:
    good = {"id": "good", "image": {"path": "labels/label_00.png"}}
    assert requester.request(f"{JOBS}/ocr", good)["status"] == "ok"
    rss_before = _rss(fuzz_daemon)
    seen: list[int] = []

    @settings(
        max_examples=EXAMPLES // BATCH,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(batch=st.lists(st.tuples(payloads, topics), min_size=BATCH, max_size=BATCH))
    def send(batch: list[tuple[bytes, str]]) -> None:
        # A burst at once, as a misbehaving client would send it; then every answer.
        corrs = [requester.send(f"{JOBS}/{topic}", payload) for payload, topic in batch]
        for corr in corrs:
            result = requester.wait(corr, timeout=60)
            assert result["status"] in ("ok", "error"), result
            if result["status"] == "error":
                assert set(result["error"]) == {"code", "message", "field"} and result["error"]["message"]
            seen.append(1)

    send()
    assert len(seen) >= EXAMPLES
    assert fuzz_daemon.proc.poll() is None, "the daemon died"
    after = requester.request(f"{JOBS}/ocr", {**good, "id": "good-after"})
    assert after["status"] == "ok" and after["output"]["text"]
    growth = _rss(fuzz_daemon) - rss_before
    assert growth < 150 * 2**20, f"resident memory grew by {growth / 2**20:.0f} MiB over {EXAMPLES} jobs"
