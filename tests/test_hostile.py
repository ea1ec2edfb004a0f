"""Hostile input and faults, through the daemon as a real process and a real Mosquitto:
one bad message never bricks the box, costs another job, or goes unanswered; a damaged
journal never stops a start."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.conftest import LABELS, REPO, SAMPLES, Broker, DaemonProc, Requester, start_daemon, write_profile

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
def ocr_box(broker: Broker, tmp_path_factory: pytest.TempPathFactory, ocr_engine_dir: Path) -> Iterator[DaemonProc]:
    directory = tmp_path_factory.mktemp("hostile")
    d = start_daemon(write_profile(directory, broker.port, ocr_engine_dir, device_id="hz", models=OCR_ONLY))
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
    tmp_path: Path, broker: Broker, ocr_engine_dir: Path
) -> None:
    profile = write_profile(
        tmp_path, broker.port, ocr_engine_dir, device_id="rj", models=OCR_ONLY, journal={"max_mib": 1}
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


def test_a_retained_job_is_refused_and_never_run(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path
) -> None:
    topic = "edge/rt/jobs/ocr"
    body = json.dumps({"id": "kept", "image": {"path": LABEL}}).encode()
    publish_raw(requester, topic, body, requester.reply_topic, retain=True)
    profile = write_profile(tmp_path, broker.port, ocr_engine_dir, device_id="rt", models=OCR_ONLY)
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


def test_a_retained_job_is_refused_once_not_at_every_restart(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path
) -> None:
    # The broker hands a topic's retained message to every new subscription; the daemon
    # subscribes again at every connect. Refused once, it must not be refused again (a
    # new copy each time) at each restart that finds its session at the broker.
    topic = "edge/rr/jobs/ocr"
    body = json.dumps({"id": "kept-once", "image": {"path": LABEL}}).encode()
    publish_raw(requester, topic, body, requester.reply_topic, retain=True)
    profile = write_profile(tmp_path, broker.port, ocr_engine_dir, device_id="rr", models=OCR_ONLY)

    def refusals() -> list[dict[str, Any]]:
        docs = [json.loads(p) for t, p, _ in list(requester.raw) if t == requester.reply_topic]
        return [d for d in docs if d.get("id") == "kept-once"]

    try:
        for start in range(3):
            daemon = start_daemon(profile)
            try:
                daemon.wait_ready()
                if start == 0:
                    deadline = time.monotonic() + 30
                    while not refusals():
                        assert time.monotonic() < deadline, "the retained job got no answer"
                        time.sleep(0.1)
                # A job sent now is answered after anything the subscription brought.
                ok = requester.request(topic, {"id": f"after-{start}", "image": {"path": LABEL}})
                assert ok["status"] == "ok"
                time.sleep(1.0)
            finally:
                daemon.stop()
        (refusal,) = refusals()
        assert refusal["status"] == "error" and refusal["error"]["field"] == "retain"
    finally:
        requester._client.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)  # clear it


def _journal_profile(tmp_path: Path, broker: Broker, device_id: str, engines: Path) -> Path:
    return write_profile(tmp_path, broker.port, engines, device_id=device_id, models=OCR_ONLY)


def _status(d: DaemonProc) -> tuple[int, dict[str, Any]]:
    res = d.status()
    return res.returncode, json.loads(res.stdout)


def test_an_undeliverable_stored_result_never_blocks_a_start(
    tmp_path: Path, broker: Broker, ocr_engine_dir: Path
) -> None:
    profile = _journal_profile(tmp_path, broker, "ud", ocr_engine_dir)
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


def test_a_damaged_journal_is_set_aside_and_said_loudly(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path
) -> None:
    """Each damage in turn, a start after each: not a database (set aside, a new one
    started), emptied, deleted. Every start serves, says WARNING with the reason, and
    journals jobs in the new journal; a start after a sound stop says nothing."""
    profile = _journal_profile(tmp_path, broker, "jd", ocr_engine_dir)
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


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_lost_journal_is_reported_with_the_jobs_it_held(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path, damage: str
) -> None:
    """A journal that cannot say what it held any more (garbage, or gone) is reported with
    the count a small record beside it kept: in the log, the status and the metrics."""
    profile = _journal_profile(tmp_path, broker, f"jl{damage[0]}", ocr_engine_dir)
    journal = tmp_path / "state" / "journal.sqlite3"
    d = start_daemon(profile)
    d.wait_ready()
    topic = f"edge/jl{damage[0]}/jobs/ocr"
    corrs = [requester.send(topic, {"id": f"q{i}", "image": {"path": LABEL}}) for i in range(40)]
    requester.wait(corrs[0], 60)
    d.stop()  # SIGTERM: the jobs still queued stay journalled for the next start
    db = sqlite3.connect(str(journal))
    held = int(db.execute("SELECT COUNT(*) FROM jobs WHERE state != 'answered'").fetchone()[0])
    db.close()
    assert held > 0, "every job finished before the stop: nothing to lose"
    for extra in ("-wal", "-shm"):
        Path(f"{journal}{extra}").unlink(missing_ok=True)
    if damage == "garbage":
        journal.write_bytes(os.urandom(8192))
    else:
        journal.unlink()
    d = start_daemon(profile)
    try:
        d.wait_ready()
        code, doc = _status(d)
        assert code == 1 and doc["journal"]["lost"] == held, doc["journal"]
        assert f"{held} unfinished job(s) in it are lost" in doc["journal"]["problem"]
        assert doc["journal"]["problem"] in d.log.read_text()
        port = yaml.safe_load(profile.read_text())["metrics"]["listen"].rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert f"edge_journal_lost_jobs {float(held)}" in metrics
    finally:
        d.stop()


def test_a_full_disk_at_start_refuses_jobs_until_space_returns(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path
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
        profile = _journal_profile(tmp_path, broker, "fd", ocr_engine_dir)
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


def test_a_task_whose_model_cannot_load_is_a_warning(
    tmp_path: Path, broker: Broker, engine_dir: Path, ocr_engine_dir: Path
) -> None:
    from engines.vision.vision_build import build_student

    built = build_student(engine_dir, "quick", progress=False)
    broken = tmp_path / "student"
    shutil.copytree(built, broken)
    (broken / "student.onnx").write_bytes(b"not a model")
    models = {"ocr": {"threads": 1}, "inspect": {"engine": str(broken), "threads": 1}, "qa": {"enabled": False}}
    d = start_daemon(write_profile(tmp_path, broker.port, ocr_engine_dir, device_id="mw", models=models))
    try:
        d.wait_ready()
        code, doc = _status(d)
        assert code == 1 and doc["check"]["status"] == "WARNING"
        assert "inspect" in doc["branches"]["vision"]["unavailable_tasks"]
        assert any(r.startswith("inspect unavailable") for r in doc["check"]["reasons"])
    finally:
        d.stop()


def test_an_unreadable_engine_directory_is_one_clear_reason(broker: Broker) -> None:
    # Not a traceback's last line ("PermissionError: [Errno 13] ..."), and no build tried
    # into a directory the box cannot read. Root reads everything: as root the daemon
    # runs as nobody, in a directory of its own outside pytest's (which only root may enter).
    base = Path(tempfile.mkdtemp(prefix="edge-unreadable-", dir="/tmp"))
    base.chmod(0o755)
    state, run, engines = base / "state", base / "run", base / "engines"
    for directory in (state, run, engines):
        directory.mkdir()
    as_root = os.geteuid() == 0
    engines.chmod(0o700 if as_root else 0o000)
    if as_root:
        for directory in (state, run):
            os.chown(directory, 65534, 65534)
    paths = {"state_dir": str(state), "runtime_dir": str(run), "engine_dir": str(engines), "media_dir": str(SAMPLES)}
    # OCR serves (it only keeps its working-memory figure there), so the daemon starts.
    models = {"ocr": {"threads": 1}, "inspect": {"build_size": "quick", "threads": 1}, "qa": {"enabled": False}}
    profile = write_profile(base, broker.port, engines, device_id="ur", models=models, paths=paths)
    profile.chmod(0o644)
    log = profile.with_suffix(".log")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_root else []
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*as_nobody, sys.executable, "-m", "edge.cli", "serve", "--profile", str(profile)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    d = DaemonProc(profile, run / "status.sock", proc, log)
    try:
        d.wait_ready()
        code, doc = _status(d)
        why = doc["branches"]["vision"]["unavailable_tasks"]["inspect"]
        assert why == f"the engine directory {engines} cannot be read (permission denied): check its permissions"
        assert code == 1 and f"inspect unavailable on the vision branch: {why}" in doc["check"]["reasons"]
        assert "building" not in log.read_text()
    finally:
        d.stop()
        engines.chmod(0o700)
        shutil.rmtree(base, ignore_errors=True)


def test_a_damaged_build_is_never_built_over(tmp_path: Path, broker: Broker, engine_dir: Path) -> None:
    from engines.vision.vision_build import build_student

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


# Images within the pixel limit (here 9 MP) of every extreme shape: a strip a few pixels
# high and one a few pixels wide, a line 100 px high, and the largest square.
PIXELS = 9_000_000
EXTREME = [(25, 360_000), (360_000, 25), (9, 999_000), (100, 90_000), (3_000, 3_000)]


def test_an_image_of_any_shape_stays_within_what_its_job_reserved(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path
) -> None:
    import cv2
    import numpy as np

    media = tmp_path / "media"
    media.mkdir()
    for h, w in EXTREME:
        img = np.full((h, w, 3), 255, np.uint8)
        for x in range(0, max(h, w) - 400, 900):  # text along the long side
            at = (x, h // 2 + 8) if w >= h else (2, x + 30)
            cv2.putText(img, "SN-1234", at, cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
        assert cv2.imwrite(str(media / f"{h}x{w}.png"), img)
    shutil.copy(Path(__file__).parent.parent / "samples" / LABEL, media / "label.png")
    paths = {"media_dir": str(media), "state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run")}
    limits = {"max_image_pixels": PIXELS}
    profile = write_profile(
        tmp_path, broker.port, ocr_engine_dir, device_id="shape", models=OCR_ONLY, paths=paths, limits=limits
    )
    d = start_daemon(profile)
    try:
        d.wait_ready()
        before = _status(d)[1]["memory"]
        for h, w in EXTREME:
            job = {"id": f"x{h}x{w}", "image": {"path": f"{h}x{w}.png"}}
            doc = requester.request("edge/shape/jobs/ocr", job, 120)
            assert doc["status"] == "ok", doc  # read (or found empty), never a crash or `internal`
            assert doc["output"]["image"] == {"width": w, "height": h}
        label = requester.request("edge/shape/jobs/ocr", {"id": "label", "image": {"path": "label.png"}})
        assert [line["text"] for line in label["output"]["lines"]] == LABELS[0]["lines"]
        after = _status(d)[1]["memory"]
    finally:
        d.stop()
    # What the jobs made the process take beyond what it held is within what the ledger
    # had them reserve (its peak above its idle figure), with 16 MiB for the MQTT client
    # and Python objects; a start's own peak (the worst case measured) may stand above.
    reserved = after["peak_bytes"] - before["used_bytes"]
    assert reserved > 0 and after["reserved_bytes"] == 0
    bound = max(before["peak_rss_bytes"], before["rss_bytes"] + reserved + 16 * 2**20)
    assert after["peak_rss_bytes"] <= bound, (after["peak_rss_bytes"], before, reserved)


def _twin(tmp_path: Path, broker: Broker, engines: Path, name: str, client_id: str | None = None) -> DaemonProc:
    directory = tmp_path / name
    directory.mkdir()
    broker_cfg: dict[str, Any] = {"host": "127.0.0.1", "port": broker.port, "reconnect_min_s": 1, "reconnect_max_s": 1}
    if client_id is not None:
        broker_cfg["client_id"] = client_id
    profile = write_profile(directory, broker.port, engines, device_id="twin", models=OCR_ONLY, broker=broker_cfg)
    return start_daemon(profile)


def _critical(d: DaemonProc, words: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert d.proc.poll() is None, d.log.read_text()
        res = d.status()
        if res.returncode == 2 and words in res.stdout:
            return json.loads(res.stdout)  # type: ignore[no-any-return]
        time.sleep(0.3)
    raise TimeoutError(f"no CRITICAL saying {words!r}:\n{d.status().stdout}\n{d.log.read_text()[-3000:]}")


def test_two_boxes_with_one_client_id_are_critical_and_back_off(
    tmp_path: Path, broker: Broker, ocr_engine_dir: Path
) -> None:
    # Reconnecting after 1 s, two daemons with one client id take each other's session
    # about once a second. Both must notice, say CRITICAL, and wait longer and longer.
    a, b = _twin(tmp_path, broker, ocr_engine_dir, "a"), _twin(tmp_path, broker, ocr_engine_dir, "b")
    try:
        docs = [_critical(d, "session takeovers", 60) for d in (a, b)]
        assert all("another client uses client id 'edge-twin'" in doc["broker"]["duplicate"] for doc in docs)
        before = sum(doc["broker"]["takeovers"] for doc in docs)
        time.sleep(8)
        after = [json.loads(d.status().stdout)["broker"] for d in (a, b)]
        # Backed off (15 s, then 30 s ...): at most one more takeover each in 8 s, where
        # reconnecting every second would have made eight.
        assert sum(x["takeovers"] for x in after) - before <= 2, after
        assert all(x["backoff_s"] >= 15 and x["duplicate"] for x in after)
    finally:
        a.stop()
        b.stop()


def test_two_boxes_with_one_device_id_and_two_client_ids_are_critical(
    tmp_path: Path, broker: Broker, ocr_engine_dir: Path
) -> None:
    # No takeovers here: both hold sessions and both would take every job. The second
    # box's availability notice carries its own instance nonce; both see the other's.
    a = _twin(tmp_path, broker, ocr_engine_dir, "a", client_id="twin-a")
    try:
        a.wait_ready()
        assert a.status().returncode == 0
        b = _twin(tmp_path, broker, ocr_engine_dir, "b", client_id="twin-b")
        try:
            doc = _critical(a, "announces itself as device 'twin'", 60)
            assert doc["broker"]["foreign_notices"] >= 1 and doc["broker"]["takeovers"] == 0
        finally:
            b.stop()
    finally:
        a.stop()


def test_a_box_that_dies_for_good_loses_no_job_of_a_resending_requester(
    tmp_path: Path, broker: Broker, ocr_engine_dir: Path, ocr_box: DaemonProc
) -> None:
    # Two boxes on one shared job stream; one is killed mid-burst and never comes back.
    # The jobs it had taken stay in its session at the broker (Mosquitto keeps them
    # there): only the requester's resend, same id, to the box still online, gets them
    # answered. Every job is answered, each with one answer (copies byte for byte).
    import signal

    from edge.comms.client import JobClient
    from edge.config.loader import load_profile

    boxes: dict[str, DaemonProc] = {}
    for name in ("fa", "fb"):
        directory = tmp_path / name
        directory.mkdir()
        engines, stream = ocr_engine_dir, {"shared_group": "line"}
        profile = write_profile(directory, broker.port, engines, device_id=name, models=OCR_ONLY, topics=stream)
        boxes[name] = start_daemon(profile)
    try:
        for d in boxes.values():
            d.wait_ready()
        client = JobClient(load_profile(boxes["fa"].profile), fleet=True, resend_after_s=4.0, max_sends=12).start()
        try:
            deadline = time.monotonic() + 10
            while set(client.online_boxes) != {"fa", "fb"} and time.monotonic() < deadline:
                time.sleep(0.05)
            # Another box is online on the broker (ocr_box), not on this stream: never a resend target.
            assert sorted(client.online_boxes) == ["fa", "fb"]
            jobs = [client.submit("ocr", {"id": f"f{i}", "image": {"path": LABEL}}) for i in range(40)]
            deadline = time.monotonic() + 60
            while not any(p.answered.is_set() and p.result["device"] == "fa" for p in jobs):
                assert time.monotonic() < deadline, "the first box answered nothing"
                time.sleep(0.02)
            boxes["fa"].stop(signal.SIGKILL)
            results = [p.wait(180) for p in jobs]
            time.sleep(1.0)  # and no second, different answer after
        finally:
            client.close()
    finally:
        for d in boxes.values():
            d.stop()
    assert all(r["status"] == "ok" and r["output"]["text"] == "\n".join(LABELS[0]["lines"]) for r in results)
    twice = {p.job_id: [json.loads(c) for c in set(p.copies)] for p in jobs if len(set(p.copies)) > 1}
    assert not twice, twice
    rescued = [p for p in jobs if p.sends > 1 and p.result["device"] == "fb"]
    assert rescued and client.resends >= len(rescued)  # jobs the dead box held, answered by the live one
    assert "fa" not in client.online_boxes  # its will said it went offline
