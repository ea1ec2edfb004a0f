"""A fleet on one shared job stream, through real daemons and a real Mosquitto: a box
that dies for good costs the requester resends of what it held, not of what the live
boxes are working through."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from edge.comms.client import JobClient, Pending
from edge.config.loader import load_profile
from tests.conftest import LABELS, Broker, DaemonProc, start_daemon, write_profile

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OCR_ONLY = {"ocr": {"threads": 1}, "inspect": {"enabled": False}, "qa": {"enabled": False}}
LABEL = f"labels/{LABELS[0]['name']}"
JOBS = 300
RESEND_AFTER_S = 15.0
# Submitted all at once, as a batch client does: without the requester's window the broker
# would split the whole burst between the boxes at once, and the half a dead box was given
# would all be resent.
KILL_AFTER = 100  # jobs submitted before the first box is killed (once it holds some)


class _Killer(threading.Thread):
    """Once armed, SIGKILLs the box, for good, the first time it holds two jobs journalled
    and unanswered: watched beside the submissions, which go on meanwhile (a box that
    answers as fast as jobs come never holds two once they stop)."""

    def __init__(self, box: DaemonProc) -> None:
        super().__init__(daemon=True)
        self.box = box
        self.armed = threading.Event()
        self.killed = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.armed.is_set() and (doc := self.box.state()) is not None and doc["journal"]["queued"] >= 2:
                self.box.stop(signal.SIGKILL)
                self.killed.set()
                return
            time.sleep(0.05)


def _wait_online(client: JobClient, boxes: set[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while set(client.online_boxes) != boxes:
        assert time.monotonic() < deadline, client.online_boxes
        time.sleep(0.05)


def test_a_box_killed_mid_burst_costs_resends_of_what_it_held_only(
    tmp_path: Path, own_broker: Broker, ocr_engine_dir: Path
) -> None:
    # A broker of its own: the killed box never returns, and its session (with its shared
    # subscription) outlives the test by broker.session_expiry_s. On the broker the test
    # process shares, it would go on taking its turn of group "plant"'s jobs, which another
    # test's boxes on that group would never see (test_shared_subscription_splits_jobs
    # lost every fourth job to it, and every fourth to the other box stopped here).
    broker = own_broker
    boxes: dict[str, DaemonProc] = {}
    for name in ("pa", "pb"):
        directory = tmp_path / name
        directory.mkdir()
        profile = write_profile(
            directory, broker.port, ocr_engine_dir, device_id=name, models=OCR_ONLY, topics={"shared_group": "plant"}
        )
        boxes[name] = start_daemon(profile)
    jobs: list[Pending] = []
    try:
        for d in boxes.values():
            d.wait_ready()
        client = JobClient(
            load_profile(boxes["pa"].profile), fleet=True, resend_after_s=RESEND_AFTER_S, max_sends=12
        ).start()
        killer = _Killer(boxes["pa"])
        try:
            _wait_online(client, {"pa", "pb"})
            killer.start()
            started = time.monotonic()
            for i in range(JOBS):  # submit waits only while a window of jobs is unanswered
                jobs.append(client.submit("ocr", {"id": f"p{i}", "image": {"path": LABEL}}))
                if i == KILL_AFTER - 1:
                    killer.armed.set()
            assert killer.killed.wait(10), "the box never held two jobs at once"
            results = [p.wait(300) for p in jobs]
            took = time.monotonic() - started
            time.sleep(2.0)  # and no second answer after
        finally:
            killer.done.set()
            client.close()
    finally:
        for d in boxes.values():
            d.stop()
    assert all(r["status"] == "ok" and r["output"]["text"] == "\n".join(LABELS[0]["lines"]) for r in results)
    twice = {p.job_id: [json.loads(c)["device"] for c in p.copies] for p in jobs if len(p.copies) != 1}
    assert not twice, twice
    # The dead box held jobs (queued there, or queued for it at the broker) and the live
    # box answered them after a resend...
    rescued = [p for p in jobs if p.sends > 1 and p.result["device"] == "pb"]
    assert rescued, "the killed box held no job: the test did not test a rescue"
    # ...and nothing else was sent twice: the live box's own queue was never resent.
    assert all(p.result["device"] == "pb" for p in jobs if p.sends > 1)
    print(f"{JOBS} jobs in {took:.0f} s: {client.resends} resends, {len(rescued)} jobs rescued")
    assert client.resends <= JOBS // 10, (client.resends, len(rescued))
