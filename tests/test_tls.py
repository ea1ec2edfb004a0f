"""Broker TLS with client certificates and a password, through a real Mosquitto.

The test makes its own certificate authority, server and client certificates (openssl),
and a password file (mosquitto_passwd); the daemon connects with the profile's CA,
certificate, key and credentials file, serves a job, and never logs the password.
Clients without a certificate, or with the wrong password, are turned away.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from tests.conftest import Broker, edgectl, start_daemon, write_profile

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-Do-not-log"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=edge test CA",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n", encoding="utf-8")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-out", f"{name}.crt", *ext, cwd=d)  # fmt: skip


@pytest.fixture
def tls_broker(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki)
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(pki / "passwd"), "edge", PASSWORD], check=True)
    settings = (
        f"cafile {pki / 'ca.crt'}\ncertfile {pki / 'server.crt'}\nkeyfile {pki / 'server.key'}\n"
        "require_certificate true\nallow_anonymous false\n"
        f"password_file {pki / 'passwd'}\npersistence false\n"
        # Started as root, mosquitto would switch to its own user, which cannot read
        # the test's private directory; as any other user this line does nothing.
        "user root\n"
    )
    with Broker(tmp_path, settings=settings) as broker:
        yield broker.port, pki


def _connect(port: int, pki: Path, cert: bool, password: str) -> str:
    """Try a connection; returns 'ok', or why it failed."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.username_pw_set("edge", password)
    client.tls_set(
        ca_certs=str(pki / "ca.crt"),
        certfile=str(pki / "client.crt") if cert else None,
        keyfile=str(pki / "client.key") if cert else None,
        cert_reqs=ssl.CERT_REQUIRED,
    )
    outcome: list[str] = []
    done = threading.Event()

    def on_connect(c: mqtt.Client, u: object, flags: object, rc: ReasonCode, props: object) -> None:
        outcome.append("ok" if not rc.is_failure else f"refused: {rc}")
        done.set()

    def on_disconnect(c: mqtt.Client, u: object, flags: object, rc: ReasonCode, props: object) -> None:
        outcome.append(f"disconnected: {rc}")
        done.set()

    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    try:
        client.connect("127.0.0.1", port, keepalive=10)
    except (ssl.SSLError, OSError) as err:
        return f"tls failed: {err}"
    client.loop_start()
    done.wait(10)
    client.loop_stop()
    client.disconnect()
    return outcome[0] if outcome else "no answer"


def test_clients_need_a_certificate_and_the_password(tls_broker: tuple[int, Path]) -> None:
    port, pki = tls_broker
    assert _connect(port, pki, cert=True, password=PASSWORD) == "ok"
    assert _connect(port, pki, cert=True, password="wrong").startswith(("refused", "disconnected"))
    assert _connect(port, pki, cert=False, password=PASSWORD) != "ok"


def test_daemon_serves_over_tls_and_never_logs_the_password(
    tls_broker: tuple[int, Path], tmp_path: Path, ocr_engine_dir: Path
) -> None:
    port, pki = tls_broker
    (tmp_path / "password").write_text(PASSWORD + "\n", encoding="utf-8")
    broker = {
        "host": "127.0.0.1",
        "port": port,
        "username": "edge",
        "password_file": str(tmp_path / "password"),
        "tls": {
            "ca_file": str(pki / "ca.crt"),
            "cert_file": str(pki / "client.crt"),
            "key_file": str(pki / "client.key"),
        },
        "reconnect_min_s": 1,
        "reconnect_max_s": 2,
    }
    profile = write_profile(
        tmp_path,
        port,
        ocr_engine_dir,  # nothing to build: only OCR runs here
        device_id="tls",
        broker=broker,
        models={"inspect": {"enabled": False}, "qa": {"enabled": False}},
    )
    d = start_daemon(profile)
    try:
        doc = d.wait_ready()
        assert doc["broker"]["connected"]
        sent = edgectl("submit", "ocr", "--profile", str(profile), "--media-path", "labels/label_00.png", "--json")
        assert sent.returncode == 0, sent.stdout + sent.stderr
        assert json.loads(sent.stdout)["status"] == "ok"
    finally:
        d.stop()
    assert PASSWORD not in d.log.read_text()
