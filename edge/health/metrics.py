"""The daemon's Prometheus metrics, served on `metrics.listen` (GET /metrics).

Two kinds of figure:
- what happens to jobs, counted as each result is sent (`JobMetrics.observe`, called by
  the responder): jobs by task, status and error code, latency by task and by stage,
  tokens, speculative decoding's draft tokens, time to the first token;
- what the daemon holds now, read from the same snapshot `edgectl status` shows at each
  scrape (`SnapshotCollector`): queues, jobs in hand, batch sizes, the memory ledger,
  the KV cache, the journal, the broker link, and the box's own sensors where it has
  them (NVML on a discrete GPU, a Jetson's iGPU and memory controller from sysfs, the
  kernel's thermal zones, a Jetson's power rails).

Every name starts with `edge_`; docs/operations.md (Metrics) lists them, and a test holds it to that.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge.health import sensors
from edge.protocol.results import grounding_of

logger = logging.getLogger(__name__)

# Seconds: a stage of a few hundred microseconds (decode of a small image) to a long answer.
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


class JobMetrics:
    """Counters and histograms fed by every final result."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Counter(
            "edge_jobs", "Final results sent, by task, status and error code.", ["task", "status", "code"],
            registry=registry,
        )  # fmt: skip
        self.job_seconds = Histogram(
            "edge_job_seconds", "Time from a job's arrival to its result, by task.", ["task"],
            buckets=STAGE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.stage_seconds = Histogram(
            "edge_job_stage_seconds", "Time a job spent in each stage (timings.stages), by task and stage.",
            ["task", "stage"], buckets=STAGE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "edge_tokens", "Tokens of qa jobs, by kind (prompt, completion).", ["kind"], registry=registry
        )
        self.speculative = Counter(
            "edge_speculative_tokens", "qa draft tokens of speculative decoding, by kind (drafted, accepted).",
            ["kind"], registry=registry,
        )  # fmt: skip
        self.grounding = Counter(
            "edge_qa_grounding", "qa answers by grounding verdict (grounded, flagged, abstained, unchecked).",
            ["verdict"], registry=registry,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            "edge_ttft_seconds", "Time from a qa job's arrival to its first token.",
            buckets=STAGE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.token_p50_seconds = Histogram(
            "edge_token_p50_seconds", "Each qa job's median time between tokens.",
            buckets=TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip

    def observe(self, doc: dict[str, Any]) -> None:
        """One final result document (edge/protocol/results.py)."""
        task = doc.get("task") or "unknown"
        status = str(doc.get("status"))
        code = str(doc.get("error", {}).get("code", "")) if status == "error" else ""
        self.jobs.labels(task, status, code).inc()
        timings = doc.get("timings", {})
        self.job_seconds.labels(task).observe(timings.get("total_ms", 0.0) / 1000.0)
        for stage, ms in timings.get("stages", {}).items():
            self.stage_seconds.labels(task, stage).observe(ms / 1000.0)
        output = doc.get("output")
        answer = output.get("answer") if isinstance(output, dict) else None
        text = answer if isinstance(answer, dict) else output  # a pipeline job's answer is nested
        if isinstance(text, dict) and "completion_tokens" in text:
            self.tokens.labels("prompt").inc(text.get("prompt_tokens", 0))
            self.tokens.labels("completion").inc(text["completion_tokens"])
        verdict = grounding_of(output) if status == "ok" else None
        if verdict is not None:
            self.grounding.labels(verdict).inc()
        if "drafted_tokens" in timings:
            self.speculative.labels("drafted").inc(timings["drafted_tokens"])
            self.speculative.labels("accepted").inc(timings.get("accepted_tokens", 0))
        if "ttft_ms" in timings:
            self.ttft_seconds.observe(timings["ttft_ms"] / 1000.0)
        if "token_p50_ms" in timings:
            self.token_p50_seconds.observe(timings["token_p50_ms"] / 1000.0)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class SnapshotCollector(Collector):
    """The status snapshot as metrics, read at each scrape. `sensors_root` is where the
    kernel's sysfs lives (a test gives a fake tree)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], sensors_root: Path = Path("/sys")) -> None:
        self._snapshot = snapshot
        self._sensors_root = sensors_root

    def describe(self) -> list[Metric]:
        # Nothing up front: registering must not read the snapshot (the daemon that owns
        # it is still being built then).
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._snapshot()
        except Exception:  # a scrape must never take the daemon down
            logger.exception("metrics: cannot read the daemon's snapshot")
            return
        up = _gauge("edge_up", "1 once the daemon is ready and serving, else 0; labelled with its state.", ["state"])
        up.add_metric([str(snap.get("state"))], 1.0 if snap.get("state") == "ready" else 0.0)
        yield up
        yield from self._branches(snap.get("branches", {}))
        yield from self._memory(snap.get("memory", {}), snap.get("models", []))
        yield from self._journal(snap.get("journal", {}))
        yield from self._broker(snap.get("broker", {}))
        yield from self._builds(snap.get("builds", {}))
        yield from sensors.metrics(self._sensors_root)

    @staticmethod
    def _branches(branches: dict[str, Any]) -> Iterator[Metric]:
        depth = _gauge("edge_queue_depth", "Jobs waiting in a branch's queue.", ["branch"])
        limit = _gauge("edge_queue_max", "A branch's queue limit.", ["branch"])
        running = _gauge("edge_jobs_in_hand", "Jobs a branch's worker is running now.", ["branch"])
        batches = CounterMetricFamily("edge_batches", "Batches (vision) or decode steps (text) run, by size.",
                                      labels=["branch", "size"])  # fmt: skip
        paused = CounterMetricFamily("edge_text_pauses", "Text sequences paused for more urgent jobs.")
        over = CounterMetricFamily("edge_text_over_budget", "Text jobs answered over_budget after waiting.")
        stopped = CounterMetricFamily("edge_text_stopped", "Running text jobs stopped: their HTTP request ended.")
        for name, b in branches.items():
            depth.add_metric([name], b.get("depth", 0))
            limit.add_metric([name], b.get("max", 0))
            running.add_metric([name], b.get("running", 0))
            for size, n in b.get("batch_sizes", {}).items():
                batches.add_metric([name, str(size)], n)
            if "paused" in b:
                paused.add_metric([], b["paused"])
                over.add_metric([], b["over_budget"])
                stopped.add_metric([], b.get("stopped", 0))
        yield from (depth, limit, running, batches, paused, over, stopped)

    @staticmethod
    def _memory(mem: dict[str, Any], models: list[dict[str, Any]]) -> Iterator[Metric]:
        ledger = _gauge(
            "edge_memory_ledger_bytes",
            "What the memory ledger holds, by entry: model:<name>, jobs:<class>, kv_cache (the KV pool), reserved.",
            ["entry"],
        )
        for name, m in mem.get("models", {}).items():
            ledger.add_metric([f"model:{name}"], m.get("bytes", 0))
        for job_class, n in mem.get("jobs_by_class", {}).items():
            ledger.add_metric([f"jobs:{job_class}"], n)
        kv = mem.get("kv")
        if isinstance(kv, dict):
            ledger.add_metric(["kv_cache"], kv.get("capacity_bytes", 0))
        ledger.add_metric(["reserved"], mem.get("reserved_bytes", 0))
        yield ledger
        for key, name, doc in (
            ("budget_bytes", "edge_memory_budget_bytes", "The memory budget."),
            ("used_bytes", "edge_memory_used_bytes", "What the ledger has handed out."),
            ("peak_bytes", "edge_memory_peak_bytes", "The most the ledger has handed out."),
            ("rss_bytes", "edge_process_resident_bytes", "The process's resident memory."),
            ("process_peak_bytes", "edge_process_peak_bytes", "The most the process held of what the budget covers."),
        ):
            if isinstance(mem.get(key), int | float):
                g = _gauge(name, doc)
                g.add_metric([], mem[key])
                yield g
        for key, name, doc in (
            ("evictions", "edge_memory_evictions", "Idle models evicted to make room."),
            ("refusals", "edge_memory_refusals", "Reservations the ledger refused."),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], mem.get(key, 0))
            yield c
        if isinstance(kv, dict):
            tokens = _gauge("edge_kv_tokens", "The KV cache in tokens: capacity, reserved, peak.", ["kind"])
            for kind in ("capacity", "reserved", "peak"):
                tokens.add_metric([kind], kv.get(f"{kind}_tokens", 0))
            yield tokens
        loaded = _gauge("edge_model_loaded", "1 while a model is loaded.", ["model", "branch", "backend"])
        loads = CounterMetricFamily("edge_model_loads", "Times a model was loaded.", labels=["model"])
        for m in models:
            loaded.add_metric([m["name"], m["branch"], m["backend"]], 1.0 if m.get("loaded") else 0.0)
            loads.add_metric([m["name"]], m.get("loads", 0))
        yield from (loaded, loads)

    @staticmethod
    def _journal(journal: dict[str, Any]) -> Iterator[Metric]:
        rows = _gauge("edge_journal_rows", "Journal rows by state.", ["state"])
        for state in ("queued", "sent", "answered"):
            rows.add_metric([state], journal.get(state, 0))
        yield rows
        path = journal.get("path")
        if path:
            size = _gauge("edge_journal_bytes", "The journal's size on disk (its WAL included).")
            size.add_metric([], sum(p.stat().st_size for p in _journal_files(Path(path))))
            yield size
        dup = CounterMetricFamily("edge_journal_duplicates", "Repeated job ids answered from the journal.")
        dup.add_metric([], journal.get("duplicates", 0))
        replayed = _gauge("edge_journal_replayed", "Jobs and results taken up again at this start, by kind.", ["kind"])
        for kind, n in journal.get("replayed", {}).items():
            replayed.add_metric([kind], n)
        puback = _gauge("edge_results_awaiting_puback", "Results published and not yet confirmed by the broker.")
        puback.add_metric([], journal.get("awaiting_puback", 0))
        full = _gauge("edge_journal_full", "1 while the journal (or its disk) is full.")
        full.add_metric([], 1.0 if journal.get("full") else 0.0)
        lost = _gauge(
            "edge_journal_lost_jobs",
            "Unfinished jobs held by a journal found damaged, emptied or deleted at this start "
            "(0 also where no count was kept: edgectl status says which).",
        )
        lost.add_metric([], float(journal.get("lost") or 0))
        yield from (dup, replayed, puback, full, lost)

    @staticmethod
    def _broker(broker: dict[str, Any]) -> Iterator[Metric]:
        connected = _gauge("edge_broker_connected", "1 while connected to the broker.")
        connected.add_metric([], 1.0 if broker.get("connected") else 0.0)
        connects = CounterMetricFamily("edge_broker_connects", "Connections made to the broker (reconnects included).")
        connects.add_metric([], broker.get("connects", 0))
        yield from (connected, connects)

    @staticmethod
    def _builds(builds: dict[str, Any]) -> Iterator[Metric]:
        running = _gauge(
            "edge_build_running_seconds",
            "How long the engine build in hand has run (a first start's build), by what it builds.",
            ["what"],
        )
        current = builds.get("running")
        if isinstance(current, dict):
            running.add_metric([str(current.get("what"))], current.get("seconds", 0.0))
        ended = CounterMetricFamily("edge_builds", "Engine builds run by the daemon, by how they ended.",
                                    labels=["result"])  # fmt: skip
        for result in ("built", "failed", "stopped"):
            ended.add_metric([result], builds.get(result, 0))
        yield from (running, ended)


def _journal_files(path: Path) -> list[Path]:
    files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    return [f for f in files if f.exists()]


# The listener serves scrapes, not the open internet: a few at a time, each given a few
# seconds. A client that opens many connections, or sends half a request and waits, is
# closed, so it can hold neither the process's file descriptors nor a thread for long.
MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 5.0


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # the socket's: a client that stops sending is dropped

    def log_message(self, format: str, *args: Any) -> None:  # the base's parameter name
        if logger.isEnabledFor(logging.DEBUG):  # formatted only when it is written
            logger.debug("metrics: %s", format % args)


class _BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    block_on_close = False
    # The listen backlog (socketserver's default is 5): a burst of connections past it has
    # its SYNs dropped by the kernel and retried after 1, 3, 7... s, so a client waits
    # seconds for a connection the loop would accept, or refuse and close, at once.
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)  # over the cap: closed at once, nothing held
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("metrics: a request from %s failed", client_address, exc_info=True)


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> _BoundedServer:
    """The registry at http://host:port/metrics on a thread of its own, with bounded
    connections and request time (prometheus_client's own server has neither)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsHTTPServer", (_BoundedServer,), {"address_family": family})
    server: WSGIServer = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_Handler)
    assert isinstance(server, _BoundedServer)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


class MetricsServer:
    """The registry and its HTTP endpoint. `start` binds `address`; a port already taken
    is logged and said in the status (`error`), never fatal: jobs matter more."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], sensors_root: Path = Path("/sys")) -> None:
        self.registry = CollectorRegistry()
        self.jobs = JobMetrics(self.registry)
        self.registry.register(SnapshotCollector(snapshot, sensors_root))
        self._server: Any = None
        self.address: tuple[str, int] | None = None
        self.error: str | None = None

    def start(self, address: tuple[str, int] | None) -> bool:
        self.error = None
        if address is None:
            return False
        host, port = address
        try:
            self._server = serve_metrics(host, port, self.registry)
        except (OSError, UnicodeError) as err:  # no such address here, or a name that is none
            self.error = f"cannot listen on {host}:{port}: {getattr(err, 'strerror', None) or err}"
            logger.error("metrics: %s; serving without them", self.error)
            return False
        self.address = (host, int(self._server.server_port))
        logger.info("metrics on http://%s:%d/metrics", host, self.address[1])
        return True

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def snapshot(self) -> dict[str, Any]:
        listen = f"{self.address[0]}:{self.address[1]}" if self.address else None
        return {"listen": listen, "serving": self._server is not None, "error": self.error}
