"""The status socket: the running daemon answers one JSON document per connection.

`edgectl status` reads it and turns it into a monitoring-plugin verdict:
0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (daemon unreachable).
"""

from __future__ import annotations

import grp
import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATUS_SCHEMA_VERSION = 1
OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
LABELS = {OK: "OK", WARNING: "WARNING", CRITICAL: "CRITICAL", UNKNOWN: "UNKNOWN"}

Snapshot = Callable[[], dict[str, Any]]


class StatusUnreachable(Exception):
    pass


def evaluate(doc: dict[str, Any]) -> tuple[int, list[str]]:
    """The check verdict for a status document, with the reasons behind it."""
    reasons: list[str] = []
    code = OK
    if doc.get("state") != "ready":
        reasons.append(f"daemon is {doc.get('state', 'in an unknown state')}")
        code = CRITICAL
    if not doc.get("broker", {}).get("connected", False):
        reasons.append("broker disconnected")
        code = max(code, WARNING)
    elif not doc["broker"].get("subscribed", True):
        # Connected and deaf: the broker has not (yet) granted the job subscriptions.
        reasons.append("job subscriptions not granted by the broker")
        code = max(code, WARNING)
    duplicate = doc.get("broker", {}).get("duplicate")
    if duplicate:
        reasons.append(str(duplicate))
        code = CRITICAL
    for branch, info in doc.get("branches", {}).items():
        if not info.get("available", False):
            reasons.append(f"{branch} branch unavailable: {info.get('reason', 'unknown')}")
            code = max(code, WARNING)
    journal = doc.get("journal", {})
    if journal.get("full", False):
        reasons.append("job journal full: new jobs are refused (storage_full)")
        code = max(code, WARNING)
    if journal.get("problem"):
        reasons.append(str(journal["problem"]))
        code = max(code, WARNING)
    metrics_error = doc.get("metrics", {}).get("error")
    if metrics_error:
        reasons.append(f"metrics not served: {metrics_error}")
        code = max(code, WARNING)
    for branch, info in doc.get("branches", {}).items():
        for task, why in (info.get("unavailable_tasks") or {}).items():
            reasons.append(f"{task} unavailable on the {branch} branch: {why}")
            code = max(code, WARNING)
    return code, reasons


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        try:
            doc = self.server.snapshot()
            body = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
        except Exception:
            logger.exception("status snapshot failed")
            body = json.dumps({"schema_version": STATUS_SCHEMA_VERSION, "state": "error"}).encode() + b"\n"
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the asker gave up waiting (a busy start); it will ask again


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        super().__init__(path, _Handler)


class StatusServer:
    def __init__(self, path: Path, snapshot: Snapshot, mode: int, group: str | None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket() or path.exists():
            # A stale socket from a crashed run; refuse only if a live daemon answers.
            try:
                query_status(path, timeout=0.5)
            except StatusUnreachable:
                path.unlink()
            else:
                raise RuntimeError(f"another daemon is answering on {path}")
        old_umask = os.umask(0o177)
        try:
            self._server = _Server(str(path), snapshot)
        finally:
            os.umask(old_umask)
        if group is not None:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        os.chmod(path, mode)
        self._thread = threading.Thread(target=self._server.serve_forever, name="status", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("status socket at %s", self.path)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def query_status(path: Path, timeout: float = 3.0) -> dict[str, Any]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError as err:
        raise StatusUnreachable(f"no daemon answers on {path}: {err.strerror or err}") from err
    try:
        doc = json.loads(b"".join(chunks))
    except ValueError as err:
        raise StatusUnreachable(f"daemon on {path} sent an unreadable status") from err
    if not isinstance(doc, dict):
        raise StatusUnreachable(f"daemon on {path} sent an unreadable status")
    return doc


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / (1 << 20):.1f} MiB"


def render_table(doc: dict[str, Any], code: int, reasons: list[str]) -> str:
    lines = [
        f"edge {doc.get('device', '?')}: {LABELS[code]}" + (f" ({'; '.join(reasons)})" if reasons else ""),
        f"  state      {doc.get('state')}   uptime {doc.get('uptime_s', 0):.0f} s   pid {doc.get('pid')}",
    ]
    broker = doc.get("broker", {})
    lines.append(
        f"  broker     {broker.get('host')}:{broker.get('port')} "
        f"{'connected' if broker.get('connected') else 'DISCONNECTED'} (connects: {broker.get('connects', 0)})"
        + ("" if broker.get("subscribed", True) or not broker.get("connected") else ", NOT SUBSCRIBED")
        + (
            f"   stream peers online: {', '.join(broker['stream_peers']) or 'none'}"
            if broker.get("stream_peers") is not None
            else ""
        )
    )
    memory = doc.get("memory", {})
    used, budget = _fmt_bytes(memory.get("used_bytes")), _fmt_bytes(memory.get("budget_bytes"))
    lines.append(
        f"  memory     ledger {used} of budget {budget} ({memory.get('scope', 'host')}; "
        f"headroom {_fmt_bytes(memory.get('headroom_bytes'))}, peak {_fmt_bytes(memory.get('peak_bytes'))}), "
        f"process peak {_fmt_bytes(memory.get('process_peak_bytes'))}"
    )
    device = ""
    if "device_bytes" in memory:
        device = f"; device {_fmt_bytes(memory['device_bytes'])} (peak {_fmt_bytes(memory.get('device_peak_bytes'))})"
    rss, rss_peak = _fmt_bytes(memory.get("rss_bytes")), _fmt_bytes(memory.get("peak_rss_bytes"))
    lines.append(f"             rss {rss} (peak {rss_peak}){device}")
    kv = memory.get("kv")
    if kv:
        lines.append(
            f"  kv cache   {kv['rows'] - kv['rows_free']}/{kv['rows']} rows held, {kv['reserved_tokens']} of "
            f"{kv['capacity_tokens']} tokens reserved ({_fmt_bytes(kv['capacity_bytes'])}, "
            f"{kv.get('kv_dtype', 'float16')})"
        )
        offload, prefixes = kv.get("offload"), kv.get("prefix_cache")
        if offload:
            lines.append(
                f"             offload to {offload['where']}: {offload['saved']} saved, {offload['restored']} "
                f"restored, {offload['recomputed']} recomputed; held {_fmt_bytes(offload['memory_bytes'])} "
                f"in memory, {_fmt_bytes(offload['disk_bytes'])} on disk"
            )
        if prefixes:
            lines.append(
                f"             prefix cache {prefixes['entries']} entries, {_fmt_bytes(prefixes['bytes'])} of "
                f"{_fmt_bytes(prefixes['capacity_bytes'])}; {prefixes['hits']} hits, {prefixes['misses']} misses"
                # Prompts left whole because the measured costs say a hit does not pay here.
                + (f", {prefixes['declined']} not split" if prefixes.get("declined") else "")
            )
    lines.append(
        "  models     name                           branch   backend                        device  counted    "
        "host       device"
    )
    for model in doc.get("models", []):
        lines.append(
            f"             {model['name']:<30} {model['branch']:<8} {model['backend']:<30} "
            f"{model.get('device', 'cpu'):<7} {_fmt_bytes(model.get('memory_bytes')):>10} "
            f"{_fmt_bytes(model.get('host_bytes')):>10} {_fmt_bytes(model.get('device_bytes')):>10}"
        )
    lines.append("  queues     branch   depth/max  running  available")
    for name, q in doc.get("branches", {}).items():
        lines.append(
            f"             {name:<8} {q.get('depth', 0):>5}/{q.get('max', 0):<4} {q.get('running', 0):>7}  "
            f"{'yes' if q.get('available') else 'no'}"
        )
    jobs = doc.get("jobs", {})
    lines.append(f"  jobs       ok {jobs.get('ok', 0)}   failed {jobs.get('failed', 0)}")
    grounding = jobs.get("qa_grounding") or {}
    if grounding:
        counts = "   ".join(f"{verdict} {grounding[verdict]}" for verdict in sorted(grounding))
        lines.append(f"  answers    {counts}")
    lines.append("  latency    task     count     p50 ms     p99 ms")
    for task, lat in sorted(jobs.get("latency", {}).items()):
        lines.append(f"             {task:<8} {lat['count']:>5} {lat['p50_ms']:>10.1f} {lat['p99_ms']:>10.1f}")
    return "\n".join(lines)
