"""The unit file verifies cleanly, and the daemon speaks the notify protocol."""

from __future__ import annotations

import base64
import itertools
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.conftest import LABELS, REPO, Broker, Requester, start_daemon, write_profile

UNIT = REPO / "systemd" / "edged.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies_without_any_warning(tmp_path: Path) -> None:
    # verify checks that ExecStart exists; point it at this checkout's edgectl.
    edgectl = Path(sys.executable).parent / "edgectl"
    assert edgectl.exists(), "install the project (pip install -e .) first"
    text = UNIT.read_text().replace("/opt/edge/.venv/bin/edgectl", str(edgectl))
    unit = tmp_path / "edged.service"
    unit.write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr


def test_unit_contract() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "Restart=on-failure", "StateDirectory=edged", "RuntimeDirectory=edged", "WatchdogSec="):
        assert line in text
    assert "PrivateDevices=yes" not in text


class FakeNotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []

    def collect_until(self, predicate: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data))
            if predicate in data:
                return
        raise TimeoutError(f"no {predicate!r} in {self.messages}")

    def collect_while(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data))

    def count(self, key: str) -> int:
        return sum(1 for _, m in self.messages if key in m.split("\n"))


@pytest.mark.integration
def test_ready_watchdog_status_stopping(tmp_path: Path, broker: Broker, engine_dir: Path) -> None:
    notify = FakeNotifySocket(tmp_path / "notify.sock")
    profile = write_profile(tmp_path, broker.port, engine_dir, models={"qa": {"enabled": False}})
    daemon = start_daemon(profile, {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"})
    try:
        notify.collect_until("READY=1", timeout=120)
        ready_at = notify.messages[-1][0]
        ready = notify.messages[-1][1]
        assert "STATUS=" in ready
        time.sleep(2.6)
        daemon.proc.send_signal(signal.SIGTERM)
        notify.collect_until("STOPPING=1", timeout=30)
        assert daemon.proc.wait(30) == 0
    finally:
        daemon.stop()
    pings = [t for t, m in notify.messages if "WATCHDOG=1" in m.split("\n") and t > ready_at]
    # Half of WATCHDOG_USEC = 0.5 s: about five pings in 2.6 s, and never a gap near 1 s.
    assert len(pings) >= 4
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert max(gaps) < 0.9
    assert any(m.startswith("STATUS=") or "\nSTATUS=" in m for _, m in notify.messages)


def big_page_png() -> str:
    """A 2400x2400 page of 60 printed lines, base64 PNG: seconds of OCR with the
    detector at full size (a stand-in for a job that takes too long)."""
    img = np.full((2400, 2400, 3), 255, np.uint8)
    for i in range(60):
        text = f"LOT {1000 + i} SN-{i * 37 % 9999:04d}-QX{i % 10}"
        cv2.putText(img, text, (40 + (i % 2) * 1200, 40 + i * 38), cv2.FONT_HERSHEY_SIMPLEX, 1.0, (0, 0, 0), 2)
    return base64.b64encode(cv2.imencode(".png", img)[1].tobytes()).decode()


SLOW_OCR_ONLY = {
    "ocr": {"threads": 1, "det_limit_side_len": 4096},
    "inspect": {"enabled": False},
    "qa": {"enabled": False},
}


@pytest.mark.integration
def test_sigterm_waits_at_most_the_drain_timeout(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path
) -> None:
    """The job in hand past the drain timeout, and the one queued behind it, are not
    answered at stop and not lost: the journal keeps them and the next start runs them."""
    profile = write_profile(
        tmp_path, broker.port, ocr_engine_dir, device_id="dr", queue={"drain_timeout_s": 0.3},
        models=SLOW_OCR_ONLY,
    )  # fmt: skip
    daemon = start_daemon(profile)
    again = None
    try:
        daemon.wait_ready()
        corr = requester.send("edge/dr/jobs/ocr", {"id": "long", "image": {"data": big_page_png()}})
        label = f"labels/{LABELS[0]['name']}"
        queued = requester.send("edge/dr/jobs/ocr", {"id": "behind", "image": {"path": label}})
        time.sleep(1.0)  # the page is being read now
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(30) == 0
        assert time.monotonic() - t0 < 5.0
        assert not requester.answers(corr) and not requester.answers(queued)
        log = daemon.log.read_text()  # the next start writes the same log file
        again = start_daemon(profile)
        long_done = requester.wait(corr, timeout=180)
        behind = requester.wait(queued, timeout=60)
        time.sleep(0.5)
    finally:
        daemon.stop()
        if again is not None:
            again.stop()
    assert long_done["status"] == "ok" and len(long_done["output"]["lines"]) >= 30
    assert behind["status"] == "ok" and LABELS[0]["lines"][0] in behind["output"]["text"]
    assert len(requester.answers(corr)) == 1 and len(requester.answers(queued)) == 1
    assert "vision branch did not finish within 0 s; 1 job(s) in hand stay journalled" in log
    assert "1 queued job(s) stay journalled" in log


@pytest.mark.integration
def test_watchdog_pings_stop_while_a_job_is_stalled(
    tmp_path: Path, broker: Broker, requester: Requester, ocr_engine_dir: Path
) -> None:
    """A job running past watchdog.stall_s (here a large OCR page against a 0.5 s limit,
    standing in for a hung kernel) stops WATCHDOG=1 until it finishes; systemd would
    restart the daemon. Pings resume once the worker progresses again."""
    notify = FakeNotifySocket(tmp_path / "notify.sock")
    profile = write_profile(
        tmp_path,
        broker.port,
        ocr_engine_dir,  # only OCR runs: nothing to build
        device_id="wd",
        watchdog={"stall_s": 0.5},
        models=SLOW_OCR_ONLY,
    )
    daemon = start_daemon(profile, {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"})
    try:
        notify.collect_until("READY=1", timeout=120)
        corr = requester.send("edge/wd/jobs/ocr", {"id": "big", "image": {"data": big_page_png()}})
        stop = threading.Event()
        collector = threading.Thread(target=notify.collect_while, args=(stop,))
        collector.start()
        result = requester.wait(corr, timeout=180)
        done_at = time.monotonic()
        time.sleep(1.5)
        stop.set()
        collector.join()
    finally:
        daemon.stop()
    assert result["status"] == "ok" and len(result["output"]["lines"]) >= 30
    run_s = result["timings"]["run_ms"] / 1000
    assert run_s > 1.5, f"the page took only {run_s:.2f} s: too fast to show a stall"
    started = done_at - run_s
    pings = [t for t, m in notify.messages if "WATCHDOG=1" in m.split("\n")]
    # Pings every 0.2 s normally; none from the stall limit (plus a tick) to the end of the job.
    silent = [t for t in pings if started + 0.5 + 1.0 < t < done_at - 0.3]
    assert not silent, f"pinged during a stalled job at {[round(t - started, 2) for t in silent]}"
    assert any(t > done_at + 0.3 for t in pings), "pings did not resume after the job"
    assert any("STALLED: vision busy with one job" in m for _, m in notify.messages)


@pytest.mark.integration
def test_a_first_start_build_extends_the_start_timeout_and_sigterm_stops_it(tmp_path: Path, broker: Broker) -> None:
    """A first start builds the inspection model (minutes) in a child process. Meanwhile
    the daemon asks systemd for more start time (EXTEND_TIMEOUT_USEC, again before each
    extension runs out: TimeoutStartSec alone would kill the build and restart it
    forever) and says what it builds. SIGTERM ends the build and the daemon promptly,
    leaves no build process behind and nothing half-built in the engine directory (the
    next start builds again)."""
    from edge.builds import EXTEND_EVERY_S, EXTEND_S

    notify = FakeNotifySocket(tmp_path / "notify.sock")
    engines = tmp_path / "engines"
    profile = write_profile(
        tmp_path, broker.port, engines, device_id="bs",
        # The vision branch is up (OCR: nothing to build) and not yet started when the
        # stop comes during the text engine's build (import, adapter training, AWQ).
        models={"ocr": {"threads": 1}, "inspect": {"enabled": False}},
    )  # fmt: skip
    daemon = start_daemon(profile, {"NOTIFY_SOCKET": str(notify.path)})
    stop = threading.Event()
    collector = threading.Thread(target=notify.collect_while, args=(stop,))
    collector.start()
    try:
        deadline = time.monotonic() + 60
        child = None
        while child is None and time.monotonic() < deadline:
            found = subprocess.run(
                ["pgrep", "-f", f"engines.text.text_build --engine-dir {engines}"], capture_output=True, text=True
            )
            child = int(found.stdout.split()[0]) if found.stdout.strip() else None
            time.sleep(0.2)
        assert child is not None, daemon.log.read_text()
        time.sleep(EXTEND_EVERY_S + 2)  # into the build, past the second extension
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
    finally:
        stop.set()
        collector.join()
        daemon.stop()
    assert not Path(f"/proc/{child}").exists(), "the build process outlived the daemon"
    assert "stopping the engines.text.text_build build" in daemon.log.read_text()
    assert "Traceback" not in daemon.log.read_text()
    # Nothing half-built: no scratch directory left, nor a checkpoint that serves (a
    # finished step of the build, such as the import, may stay: it is complete).
    left = [p.relative_to(engines) for p in engines.rglob("*") if p.is_dir()] if engines.exists() else []
    assert not [p for p in left if any(part.startswith(".") for part in p.parts)], left
    assert not [p for p in left if "awq" in p.name], left
    extends = [(t, m) for t, m in notify.messages if "EXTEND_TIMEOUT_USEC=" in m]
    assert len(extends) >= 2, notify.messages
    assert all(f"EXTEND_TIMEOUT_USEC={int(EXTEND_S * 1e6)}" in m.split("\n") for _, m in extends)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(extends)]
    assert max(gaps) < EXTEND_S / 2  # each extension renewed well before it runs out
    assert any("STATUS=building the text engine" in m for _, m in notify.messages)
    assert not any("READY=1" in m.split("\n") for _, m in notify.messages)
