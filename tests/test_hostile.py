"""Hostile input and faults, through the daemon as a real process and a real Mosquitto:
one bad message never bricks the box, costs another job, or goes unanswered; a damaged
journal never stops a start."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.conftest import LABELS, Broker, DaemonProc, Requester, start_daemon, write_profile

pytestmark = pytest.mark.integration

OCR_ONLY = {"ocr": {"threads": 1}, "inspect": {"enabled": False}, "qa": {"enabled": False}}
LABEL = f"labels/{LABELS[0]['name']}"


def publish_raw(
    requester: Requester, topic: str, payload: bytes, response_topic: str | None, retain: bool = False
) -> bytes:
    """A job with any Response Topic (or none) and fresh Correlation Data."""
    corr = uuid.uuid4().bytes
    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = corr
    if response_topic is not None:
        props.ResponseTopic = response_topic
    requester._client.publish(topic, payload, qos=1, properties=props, retain=retain).wait_for_publish(10)
    return corr


def wait_raw(requester: Requester, corr: bytes, topic: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [json.loads(p) for t, p, c in list(requester.raw) if c == corr and t == topic]
        if got:
            time.sleep(0.3)  # and nothing more after it
            return [json.loads(p) for t, p, c in list(requester.raw) if c == corr and t == topic]
        time.sleep(0.05)
    raise TimeoutError(f"nothing for this job on {topic}")


@pytest.fixture(scope="module")
def ocr_box(broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    directory = tmp_path_factory.mktemp("hostile")
    d = start_daemon(write_profile(directory, broker.port, directory / "engines", device_id="hz", models=OCR_ONLY))
    d.wait_ready()
    yield d
    d.stop()


@pytest.mark.parametrize(
    "topic",
    ["", "replies/+/x", "replies/#", "$SYS/x", "edge/hz/available", "edge/hz/jobs/ocr", "edge/other/jobs/ocr"],
)
def test_a_response_topic_results_cannot_go_to_is_refused_at_intake(
    ocr_box: DaemonProc, requester: Requester, topic: str
) -> None:
    requester.subscribe("#")  # everything: the refusal, and anything that should not be there
    job = json.dumps({"id": f"t-{uuid.uuid4().hex[:6]}", "image": {"path": LABEL}}).encode()
    corr = publish_raw(requester, "edge/hz/jobs/ocr", job, topic)
    (refusal,) = wait_raw(requester, corr, "edge/hz/results")
    assert refusal["status"] == "error" and refusal["error"]["code"] == "invalid_field"
    assert refusal["error"]["field"] == "response_topic"
    # Nothing was published anywhere else for it (but the job itself), and the box serves on.
    assert sorted(t for t, _, c in requester.raw if c == corr) == ["edge/hz/jobs/ocr", "edge/hz/results"]
    good = requester.request("edge/hz/jobs/ocr", {"id": f"g-{uuid.uuid4().hex[:6]}", "image": {"path": LABEL}})
    assert good["status"] == "ok"


def test_payloads_the_parser_chokes_on_get_exactly_one_answer(ocr_box: DaemonProc, requester: Requester) -> None:
    payloads = [
        b'{"id": "big", "image": {"path": "x.png"}, "priority": ' + b"9" * 5000 + b"}",
        b'{"id": "sur\\ud800", "image": {"path": "x.png"}}',
        b'{"id": "ok-id", "image": {"path": "x.png"}, "deadline_ms": 1' + b"0" * 400 + b"}",
    ]
    for body in payloads:
        corr = publish_raw(requester, "edge/hz/jobs/ocr", body, requester.reply_topic)
        (answer,) = wait_raw(requester, corr, requester.reply_topic)
        assert answer["status"] == "error" and answer["error"]["code"] in {"bad_json", "invalid_field"}
    assert ocr_box.proc.poll() is None


def test_a_rejected_id_does_not_claim_the_id_and_bad_input_does_not_fill_the_journal(
    tmp_path: Path, broker: Broker
) -> None:
    profile = write_profile(
        tmp_path, broker.port, tmp_path / "engines", device_id="rj", models=OCR_ONLY, journal={"max_mib": 1}
    )
    daemon = start_daemon(profile)
    first, second = Requester(broker.port), Requester(broker.port)
    try:
        daemon.wait_ready()
        # Thousands of invalid jobs with unique ids, each answered with an error...
        pad = "x" * 300
        corrs = [
            first.send("edge/rj/jobs/ocr", {"id": f"bad-{i}", "image": {"path": LABEL}, "pad": pad}, wait=False)
            for i in range(3000)
        ]
        answers = [first.wait(c, 120) for c in corrs]
        assert all(a["status"] == "error" and a["error"]["field"] == "pad" for a in answers)
        # ...leave the journal as it was: a good job is accepted, not refused storage_full,
        # and an id an invalid job used belongs to nobody.
        ok = second.request("edge/rj/jobs/ocr", {"id": "bad-7", "image": {"path": LABEL}})
        assert ok["status"] == "ok", ok
        # A cancel request's id is kept with its request: reused for another target, it is
        # refused, not answered with the first cancel's result.
        c1 = second.request("edge/rj/jobs/cancel", {"id": "cx", "job": "nothing-1"})
        assert c1["status"] == "ok" and c1["output"] == {"job": "nothing-1", "cancelled": False}
        c2 = second.request("edge/rj/jobs/cancel", {"id": "cx", "job": "nothing-2"})
        assert c2["status"] == "error" and c2["error"]["code"] == "invalid_field" and c2["error"]["field"] == "id"
        counts = json.loads(daemon.status().stdout)["journal"]
        assert counts["queued"] + counts["sent"] + counts["answered"] <= 3  # the good job and the cancel
    finally:
        first.close()
        second.close()
        daemon.stop()


def test_a_retained_job_is_refused_and_never_run(tmp_path: Path, broker: Broker, requester: Requester) -> None:
    topic = "edge/rt/jobs/ocr"
    body = json.dumps({"id": "kept", "image": {"path": LABEL}}).encode()
    publish_raw(requester, topic, body, requester.reply_topic, retain=True)
    profile = write_profile(tmp_path, broker.port, tmp_path / "engines", device_id="rt", models=OCR_ONLY)
    daemon = start_daemon(profile)
    try:
        daemon.wait_ready()
        deadline = time.monotonic() + 30
        while not any(json.loads(p).get("id") == "kept" for t, p, _ in requester.raw if t == requester.reply_topic):
            assert time.monotonic() < deadline, "the retained job got no answer"
            time.sleep(0.1)
        docs = [json.loads(p) for t, p, _ in requester.raw if t == requester.reply_topic]
        mine = [d for d in docs if d.get("id") == "kept"]
        assert len(mine) == 1 and mine[0]["status"] == "error" and mine[0]["error"]["field"] == "retain"
        assert json.loads(daemon.status().stdout)["jobs"]["ok"] == 0
    finally:
        requester._client.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)  # clear it
        daemon.stop()


def _journal_profile(tmp_path: Path, broker: Broker, device_id: str) -> Path:
    return write_profile(tmp_path, broker.port, tmp_path / "engines", device_id=device_id, models=OCR_ONLY)


def _status(d: DaemonProc) -> tuple[int, dict[str, Any]]:
    res = d.status()
    return res.returncode, json.loads(res.stdout)


def test_an_undeliverable_stored_result_never_blocks_a_start(tmp_path: Path, broker: Broker) -> None:
    profile = _journal_profile(tmp_path, broker, "ud")
    d = start_daemon(profile)
    d.wait_ready()
    d.stop()
    # An older journal holding a result for a topic no broker accepts.
    db = sqlite3.connect(str(tmp_path / "state" / "journal.sqlite3"))
    db.execute(
        "INSERT INTO jobs (id, state, topic, reply_topic, received, result) VALUES ('old', 'sent', '', 'r/#', ?, ?)",
        (time.time(), b'{"id": "old"}'),
    )
    db.commit()
    db.close()
    again = start_daemon(profile)
    try:
        again.wait_ready()
        _, doc = _status(again)
        assert doc["journal"]["replayed"]["results"] == 1 and doc["journal"]["sent"] == 0
    finally:
        again.stop()


def test_a_damaged_journal_is_set_aside_and_said_loudly(tmp_path: Path, broker: Broker, requester: Requester) -> None:
    """Each damage in turn, a start after each: not a database (set aside, a new one
    started), emptied, deleted. Every start serves, says WARNING with the reason, and
    journals jobs in the new journal; a start after a sound stop says nothing."""
    profile = _journal_profile(tmp_path, broker, "jd")
    journal = tmp_path / "state" / "journal.sqlite3"
    d = start_daemon(profile)
    d.wait_ready()
    assert _status(d)[0] == 0
    for damage in ("garbage", "truncated", "deleted"):
        assert (
            requester.request("edge/jd/jobs/ocr", {"id": f"before-{damage}", "image": {"path": LABEL}})["status"]
            == "ok"
        )
        d.stop()
        for extra in ("-wal", "-shm"):
            Path(f"{journal}{extra}").unlink(missing_ok=True)
        if damage == "garbage":
            journal.write_bytes(os.urandom(8192))
        elif damage == "truncated":
            journal.write_bytes(b"")
        else:
            journal.unlink()
        d = start_daemon(profile)
        d.wait_ready()
        code, doc = _status(d)
        assert code == 1 and doc["journal"]["problem"], (damage, doc["journal"])
        assert doc["check"]["status"] == "WARNING" and doc["journal"]["problem"] in doc["check"]["reasons"]
        if damage == "garbage":
            assert "set aside" in doc["journal"]["problem"]
            assert len(list(journal.parent.glob("journal.sqlite3.bad-*"))) == 1
        else:
            assert "missing or was emptied" in doc["journal"]["problem"], doc["journal"]["problem"]
        assert doc["journal"]["problem"] in d.log.read_text()
        # It serves: jobs are journalled in the new journal.
        assert (
            requester.request("edge/jd/jobs/ocr", {"id": f"after-{damage}", "image": {"path": LABEL}})["status"] == "ok"
        )
        assert _status(d)[1]["journal"]["answered"] >= 1
    d.stop()
    d = start_daemon(profile)
    try:
        d.wait_ready()
        assert _status(d)[0] == 0  # a sound journal after a clean stop: nothing to say
    finally:
        d.stop()


def test_a_full_disk_at_start_refuses_jobs_until_space_returns(
    tmp_path: Path, broker: Broker, requester: Requester
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(state)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.decode().strip()}")
    try:
        filler = state / "filler"
        with open(filler, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 4096)
                    fh.flush()
            except OSError:
                pass
        profile = _journal_profile(tmp_path, broker, "fd")
        d = start_daemon(profile)
        try:
            d.wait_ready()
            code, doc = _status(d)
            assert code == 1 and doc["journal"]["full"] and doc["journal"]["problem"]
            refused = requester.request("edge/fd/jobs/ocr", {"id": "f1", "image": {"path": LABEL}})
            assert refused["status"] == "error" and refused["error"]["code"] == "storage_full"
            filler.unlink()
            deadline = time.monotonic() + 30
            while _status(d)[1]["journal"]["full"]:
                assert time.monotonic() < deadline, "the journal never opened once space was free"
                time.sleep(0.5)
            assert requester.request("edge/fd/jobs/ocr", {"id": "f2", "image": {"path": LABEL}})["status"] == "ok"
        finally:
            d.stop()
    finally:
        subprocess.run(["umount", str(state)], capture_output=True)


def test_a_task_whose_model_cannot_load_is_a_warning(tmp_path: Path, broker: Broker, engine_dir: Path) -> None:
    from engines.vision_build import build_student

    built = build_student(engine_dir, "quick", progress=False)
    broken = tmp_path / "student"
    shutil.copytree(built, broken)
    (broken / "student.onnx").write_bytes(b"not a model")
    models = {"ocr": {"threads": 1}, "inspect": {"engine": str(broken), "threads": 1}, "qa": {"enabled": False}}
    d = start_daemon(write_profile(tmp_path, broker.port, tmp_path / "engines", device_id="mw", models=models))
    try:
        d.wait_ready()
        code, doc = _status(d)
        assert code == 1 and doc["check"]["status"] == "WARNING"
        assert "inspect" in doc["branches"]["vision"]["unavailable_tasks"]
        assert any(r.startswith("inspect unavailable") for r in doc["check"]["reasons"])
    finally:
        d.stop()


def test_a_damaged_build_is_never_built_over(tmp_path: Path, broker: Broker, engine_dir: Path) -> None:
    from engines.vision_build import build_student

    built = build_student(engine_dir, "quick", progress=False)
    engines = tmp_path / "engines"
    copy = engines / built.name
    shutil.copytree(built, copy)
    (copy / "manifest.json").write_text('{"kind": "vision-stu')  # damaged after it was published
    models = {"ocr": {"enabled": False}, "inspect": {"build_size": "quick", "threads": 1}, "qa": {"enabled": False}}
    d = start_daemon(write_profile(tmp_path, broker.port, engines, device_id="db", models=models))
    try:
        deadline = time.monotonic() + 60
        while d.proc.poll() is None and time.monotonic() < deadline:
            if "not building over it" in d.log.read_text():
                break
            time.sleep(0.2)
        assert "not building over it" in d.log.read_text()
    finally:
        d.stop()
    assert (copy / "student.onnx").exists() and (copy / "manifest.json").read_text() == '{"kind": "vision-stu'


def test_errors_tell_nothing_of_the_host(ocr_box: DaemonProc, requester: Requester) -> None:
    outside_existing = requester.request(
        "edge/hz/jobs/ocr", {"id": "p1", "image": {"path": "../../../../etc/hostname"}}
    )
    outside_missing = requester.request("edge/hz/jobs/ocr", {"id": "p2", "image": {"path": "../../../../etc/no-such"}})
    a, b = outside_existing["error"], outside_missing["error"]
    assert a["code"] == b["code"] == "path_forbidden"
    assert a["message"].replace("hostname", "X") == b["message"].replace("no-such", "X")
    junk = requester.request("edge/hz/jobs/ocr", {"id": "p3", "image": {"data": "aGVsbG8gd29ybGQ="}})
    assert junk["error"]["code"] == "image_invalid" and "0x" not in junk["error"]["message"]
    assert "/" not in junk["error"]["message"]
