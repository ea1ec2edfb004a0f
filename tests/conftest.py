"""Shared fixtures: a real Mosquitto on a free loopback port (bench/common.py starts it), daemons as
real processes."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two test processes on a small box (scripts/test.sh): one torch thread each, so their
# thread pools do not spin against each other (the daemons they start set their own).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import fcntl
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import yaml
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

# The broker and the repository root are bench/common.py's (the demo and the benchmarks
# start the same broker); the tests import them from here.
from bench.common import REPO as REPO
from bench.common import Broker as Broker
from bench.common import free_port as free_port

SAMPLES = REPO / "samples"
LABELS = json.loads((SAMPLES / "labels" / "labels.json").read_text(encoding="utf-8"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """File order for two test processes taking whole files (scripts/test.sh): the file
    marked `runs_first` (the longest, which builds the session's engines) first, the
    files that need no engines next, so that the other process has work while the first
    builds; then the rest, each group in its own order."""

    first = {item.path for item in items if item.get_closest_marker("runs_first")}
    built = {item.path for item in items if "engine_dir" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: 0 if item.path in first else 2 if item.path in built else 1)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    with Broker(tmp_path_factory.mktemp("broker")) as b:
        yield b


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker a test may stop and restart without disturbing the others."""
    with Broker(tmp_path) as b:
        yield b


def _shared_engines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's engine directory. EDGE_TEST_ENGINE_DIR reuses a developer's engine
    cache (builds are keyed by their inputs, so a cached engine is the same engine); CI
    builds afresh, once for all the test processes (pytest-xdist workers share the run's
    base directory): the first builds under the lock, the others find the builds cached."""
    reuse = os.environ.get("EDGE_TEST_ENGINE_DIR")
    base = tmp_path_factory.getbasetemp()
    path = Path(reuse) if reuse else (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "engines"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def embed_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's engine directory with the retrieval encoder built in it."""
    from engines.retrieval.embed_build import build_embedder

    path = _shared_engines(tmp_path_factory)
    # A lock of its own: the encoder builds in seconds, and need not wait for the others.
    with (path / ".tests-embed.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build_embedder(path)
    return path


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory: pytest.TempPathFactory, embed_engine_dir: Path) -> Path:
    """Engines built once per test session (the build itself is tested elsewhere)."""
    from engines.text.text_build import build_text_engine
    from engines.vision.vision_build import build_student

    path = _shared_engines(tmp_path_factory)
    with (path / ".tests.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # The default pipeline: import, clinic QLoRA adapter merged in, AWQ INT4.
        build_text_engine(path, "clinic", "awq-int4", progress=False)
        # The inspection student at smoke size: the serving path, not accuracy, is tested with it.
        build_student(path, "quick", progress=False)
    return path


@pytest.fixture(scope="session")
def ocr_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine directory of daemons that serve OCR only (nothing to build): the OCR
    working-memory profile is measured by the first of them and kept for the others."""
    return tmp_path_factory.mktemp("ocr-engines")


def write_profile(directory: Path, port: int, engine_dir: Path, device_id: str = "t1", **overrides: Any) -> Path:
    profile: dict[str, Any] = {
        "device_id": device_id,
        "log_level": "info",
        "broker": {"host": "127.0.0.1", "port": port, "reconnect_min_s": 1, "reconnect_max_s": 2},
        "models": {
            "ocr": {"threads": 1},
            "inspect": {"build_size": "quick", "threads": 1, "max_queue_delay_ms": 50},
            "qa": {"max_new_tokens": 24, "max_context_tokens": 512},
        },
        # A port of its own: tests run daemons side by side.
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        "paths": {
            "state_dir": str(directory / "state"),
            "runtime_dir": str(directory / "run"),
            "engine_dir": str(engine_dir),
            "media_dir": str(SAMPLES),
        },
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(profile.get(key), dict):
            profile[key] = {**profile[key], **value}
        else:
            profile[key] = value
    path = directory / f"{device_id}.yaml"
    path.write_text(yaml.safe_dump(profile), encoding="utf-8")
    return path


def edgectl(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


@dataclass
class DaemonProc:
    profile: Path
    socket: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def status(self) -> subprocess.CompletedProcess[str]:
        """`edgectl status --json`, the command itself (its exit code and output)."""
        return edgectl("status", "--socket", str(self.socket), "--json")

    def state(self) -> dict[str, Any] | None:
        """The status document with its check, as `edgectl status --json` prints it, read
        from the socket in this process (None while nothing answers there): for waiting on
        a daemon, where a process per poll would take the CPU the daemon is starting on."""
        from edge.health.status import LABELS, StatusUnreachable, evaluate, query_status

        try:
            doc = query_status(self.socket)
        except StatusUnreachable:
            return None
        code, reasons = evaluate(doc)
        doc["check"] = {"code": code, "status": LABELS[code], "reasons": reasons}
        return doc

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            doc = self.state()
            # Not CRITICAL; subscribed, not only connected: a job published between the
            # CONNACK and the SUBACK is not the daemon's (dropped, or the shared stream's
            # other boxes').
            if (
                doc is not None
                and doc["check"]["code"] in (0, 1)
                and doc.get("state") == "ready"
                and doc["broker"]["connected"]
                and doc["broker"]["subscribed"]
            ):
                return doc
            time.sleep(0.2)
        raise TimeoutError(f"daemon not ready:\n{self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(profile: Path, env_extra: dict[str, str] | None = None) -> DaemonProc:
    data = yaml.safe_load(profile.read_text())
    sock = Path(data["paths"]["runtime_dir"]) / "status.sock"
    log = profile.with_suffix(".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    fh = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.cli", "serve", "--profile", str(profile)],
        stdout=fh,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
    )
    return DaemonProc(profile, sock, proc, log)


@pytest.fixture(scope="session")
def daemon(broker: Broker, engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One daemon with both branches, shared by the request/response tests."""
    directory = tmp_path_factory.mktemp("daemon")
    # The sample leaflets as collection "leaflets", for the jobs that retrieve (docs/protocol.md's among them).
    from edge.docs.embed import Embedder, locate
    from edge.docs.ingest import add
    from edge.docs.store import DocStore

    add(DocStore(directory / "state" / "docs"), "leaflets", [SAMPLES / "leaflets"], Embedder.load(locate(engine_dir)))
    # Its text model on the CPU kernel the shipped profile serves.
    qa = {"max_new_tokens": 24, "max_context_tokens": 512, "cpu_kernel": shipped_cpu_kernel()}
    d = start_daemon(write_profile(directory, broker.port, engine_dir, models={"qa": qa}))
    d.wait_ready()
    yield d
    d.stop()


def shipped_cpu_kernel() -> str:
    """models.qa.cpu_kernel as profiles/cpu-dev.yaml sets it."""
    doc = yaml.safe_load((REPO / "profiles" / "cpu-dev.yaml").read_text(encoding="utf-8"))
    return str(doc["models"]["qa"].get("cpu_kernel", "exact"))


@dataclass
class Requester:
    """A test-side MQTT v5 client: sends jobs with correlation, collects replies."""

    port: int
    reply_topic: str = field(default_factory=lambda: f"test/replies/{uuid.uuid4().hex}")
    persistent: bool = False  # a session the broker keeps (and its replies) across a reconnect
    replies: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    partials: dict[bytes, list[dict[str, Any]]] = field(default_factory=dict)
    raw: list[tuple[str, bytes, bytes | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"req-{uuid.uuid4().hex[:12]}", protocol=mqtt.MQTTv5
        )
        self._client.on_message = self._on_message
        self._client.reconnect_delay_set(1, 2)
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *a: subscribed.set()
        if self.persistent:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 600
            self._client.connect("127.0.0.1", self.port, clean_start=False, properties=props)
        else:
            self._client.connect("127.0.0.1", self.port)
        self._client.loop_start()
        self._client.subscribe([(self.reply_topic, SubscribeOptions(qos=1))])
        if not subscribed.wait(10):
            raise TimeoutError("subscribe timed out")

    def subscribe(self, topic: str) -> None:
        done = threading.Event()
        self._client.on_subscribe = lambda *a: done.set()
        self._client.subscribe([(topic, SubscribeOptions(qos=1))])
        if not done.wait(10):
            raise TimeoutError("subscribe timed out")

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        corr = getattr(msg.properties, "CorrelationData", None)
        with self._cond:
            self.raw.append((msg.topic, bytes(msg.payload), bytes(corr) if corr is not None else None))
            if corr is not None and msg.topic == self.reply_topic:
                doc = json.loads(msg.payload)
                if doc.get("status") == "partial":
                    self.partials.setdefault(bytes(corr), []).append(doc)
                else:
                    self.replies[bytes(corr)] = doc
            self._cond.notify_all()

    def send(
        self,
        topic: str,
        payload: bytes | dict[str, Any],
        response: bool = True,
        wait: bool = True,
        user: dict[str, str] | None = None,
    ) -> bytes:
        """Publish one request at QoS 1 (waiting for the broker's PUBACK unless not `wait`:
        paho then keeps it queued through a broker outage); `user`: MQTT v5 user properties."""
        corr = uuid.uuid4().bytes
        props = None
        if response or user:
            props = Properties(PacketTypes.PUBLISH)
        if response:
            assert props is not None
            props.ResponseTopic = self.reply_topic
            props.CorrelationData = corr
        if user:
            assert props is not None
            props.UserProperty = list(user.items())
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        info = self._client.publish(topic, body, qos=1, properties=props)
        if wait:
            info.wait_for_publish(10)
        return corr

    def answers(self, corr: bytes) -> list[bytes]:
        """Every reply payload that arrived for one request, duplicates included."""
        with self._cond:
            return [p for t, p, c in self.raw if c == corr and t == self.reply_topic]

    def wait(self, corr: bytes, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while corr not in self.replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no reply")
                self._cond.wait(left)
            return self.replies[corr]

    def wait_partial(self, corr: bytes, timeout: float = 60.0) -> dict[str, Any]:
        """The first streamed piece of one request: proof that its job is running."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.partials.get(corr):
                if corr in self.replies:
                    raise AssertionError(f"answered before any piece was streamed: {self.replies[corr]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no streamed piece")
                self._cond.wait(left)
            return self.partials[corr][0]

    def wait_topic(self, topic: str, timeout: float = 30.0) -> list[bytes]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(t == topic for t, _, _ in self.raw):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"nothing on {topic}")
                self._cond.wait(left)
            return [p for t, p, _ in self.raw if t == topic]

    def request(self, topic: str, payload: bytes | dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        return self.wait(self.send(topic, payload), timeout)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@pytest.fixture
def requester(broker: Broker) -> Iterator[Requester]:
    r = Requester(broker.port)
    yield r
    r.close()
