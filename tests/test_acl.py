"""docs/mosquitto-acl.example in a real Mosquitto: each box is confined to its own topics."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import LABELS, REPO, SAMPLES, Broker, edgectl, start_daemon, write_profile

pytestmark = pytest.mark.integration

USERS = {"press-1": "pw-1", "press-2": "pw-2", "line-3": "pw-3"}
OCR_ONLY = {"ocr": {"threads": 1}, "inspect": {"enabled": False}, "qa": {"enabled": False}}


@pytest.fixture
def acl_broker(tmp_path: Path) -> Iterator[int]:
    shutil.copy(REPO / "docs" / "mosquitto-acl.example", tmp_path / "acl")
    for i, (user, pw) in enumerate(USERS.items()):
        args = ["mosquitto_passwd", "-b", str(tmp_path / "passwd"), user, pw]
        subprocess.run(args[:1] + (["-c"] if i == 0 else []) + args[1:], check=True)
    settings = (
        f"allow_anonymous false\npassword_file {tmp_path / 'passwd'}\n"
        f"acl_file {tmp_path / 'acl'}\npersistence false\nuser root\n"
    )
    with Broker(tmp_path, settings=settings) as broker:
        yield broker.port


class Peer:
    """A connected client that records (topic, payload) of what it is delivered."""

    def __init__(self, port: int, user: str) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv5)
        self.client.username_pw_set(user, USERS[user])
        self.got: list[tuple[str, str]] = []
        ready = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: ready.set()
        self.client.on_message = lambda c, u, m: self.got.append((m.topic, m.payload.decode()))
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert ready.wait(5)

    def subscribe(self, *topics: str) -> None:
        for topic in topics:
            self.client.subscribe(topic, qos=1)  # a refused grant or a filtered delivery: both count as denied
        time.sleep(0.2)

    def publish(self, topic: str, tag: str) -> None:
        self.client.publish(topic, tag.encode(), qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_boxes_and_requesters_are_confined(acl_broker: int) -> None:
    """Whatever a client subscribes to or publishes, only what the ACL allows is delivered."""
    press1, press2, line3 = (Peer(acl_broker, u) for u in USERS)
    try:
        # The second of each pair is not its own: its jobs, and its availability notices.
        own, other = "edge/press-1/available", "edge/press-2/available"
        press1.subscribe("edge/press-1/jobs/#", "edge/press-2/jobs/#", own, other)
        press2.subscribe("edge/press-2/jobs/#")
        line3.subscribe("replies/line-3/#", "replies/line-4/#", "edge/press-1/jobs/#")
        line3.publish("edge/press-1/jobs/ocr", "job-for-1")
        line3.publish("edge/press-2/jobs/ocr", "job-for-2")
        press1.publish("edge/press-2/jobs/ocr", "injected-by-1")  # boxes do not send jobs
        press1.publish("replies/line-3/r1", "answer-to-3")
        press1.publish("replies/line-4/r2", "answer-to-4")
        press1.publish("edge/press-2/available", "spoofed")  # cannot speak for another box
        press2.publish("edge/press-2/available", "two-online")  # press-1 cannot hear it
        press1.publish("edge/press-1/available", "one-online")  # it hears its own (a twin's)
        line3.subscribe("edge/+/available")
        press1.publish("edge/press-2/available", "spoofed-again")
        time.sleep(0.5)
        assert press1.got == [("edge/press-1/jobs/ocr", "job-for-1"), ("edge/press-1/available", "one-online")]
        assert press2.got == [("edge/press-2/jobs/ocr", "job-for-2")]
        assert line3.got == [("replies/line-3/r1", "answer-to-3")]
    finally:
        for p in (press1, press2, line3):
            p.close()


def test_a_box_and_edgectl_submit_work_under_the_acl(acl_broker: int, ocr_engine_dir: Path, tmp_path: Path) -> None:
    """The daemon logged in as press-1 and `edgectl submit` as the requesting system
    line-3, each with its own user: the job reaches the box, and its result comes back on a
    reply topic under replies/line-3/, the only replies that user may read."""
    box = write_profile(
        tmp_path, acl_broker, ocr_engine_dir, device_id="press-1", models=OCR_ONLY,
        broker={"username": "press-1", "password": USERS["press-1"]},
    )  # fmt: skip
    requester = write_profile(
        tmp_path, acl_broker, ocr_engine_dir, device_id="line-3",
        broker={"username": "line-3", "password": USERS["line-3"]},
    )  # fmt: skip
    daemon = start_daemon(box)
    try:
        daemon.wait_ready()
        label = LABELS[0]
        res = edgectl(
            "submit", "ocr", "--profile", str(requester), "--device", "press-1", "--json",
            "--image", str(SAMPLES / "labels" / label["name"]), "--timeout", "60",
        )  # fmt: skip
        assert res.returncode == 0, res.stdout + res.stderr
        result = json.loads(res.stdout)
        assert result["status"] == "ok" and result["output"]["text"].split("\n") == label["lines"]
    finally:
        daemon.stop()
