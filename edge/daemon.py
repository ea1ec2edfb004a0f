"""The daemon: the composition root. `run` is a flat list of named start steps, each
building one subsystem that lives in its own module; nothing here decides or computes.

Threads: paho's network thread hands job messages to the intake's thread (which takes
what arrives together as one batch); one worker thread per branch runs models; the
status socket has its own; the main thread only supervises (watchdog pings, systemd
STATUS, journal compaction, shutdown), so a stuck main loop is what systemd detects.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from edge import __version__, builds
from edge.builds import BuildStopped, ChildBuilds
from edge.comms.local import LocalDeliveries
from edge.comms.message import IncomingJob
from edge.comms.mqtt import DaemonLink
from edge.config.profile import Profile
from edge.docs.embed import MODEL as EMBED_MODEL
from edge.health.metrics import MetricsServer
from edge.health.notify import Notifier, watchdog_interval_s
from edge.health.reasons import describe_failure
from edge.health.report import branches_section, memory_section, models_section
from edge.health.status import STATUS_SCHEMA_VERSION, StatusServer
from edge.intake import Intake
from edge.journal.store import Journal
from edge.memory import HostProbe, bound_heap, open_cuda
from edge.protocol.images import ImageLimits
from edge.reload import Reloader
from edge.responder import Responder
from edge.scheduler.branch import BatchRunner, BranchWorker, Worker, share_interpreter_between_branches
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.models import ModelManager
from edge.scheduler.queue import PriorityDeadlineQueue
from edge.scheduler.text_worker import TextMemory, TextWorker
from edge.scheduler.work import WorkItem
from edge.stats import JobStats
from edge.tasks.embed import EmbedTask
from edge.tasks.inspect import InspectTask, start_inspect
from edge.tasks.media import MediaLoader
from edge.tasks.ocr import OCRTask, start_ocr
from edge.tasks.pipeline import Pipeline
from edge.tasks.qa import QATask, qa_model_name, start_qa
from edge.tracing import JobTracer

if TYPE_CHECKING:
    from edge.http.server import HTTPServer

logger = logging.getLogger(__name__)

MIB = 2**20


class Daemon:
    def __init__(self, profile: Profile, profile_path: Path | None = None) -> None:
        """`profile_path`: the file the profile came from, read again on SIGHUP."""
        self.profile = profile
        self.profile_path = profile_path
        # The models as they start: a `threads: 0` of a model on the CPU made this box's
        # share for its branch (ModelsConfig.with_cpu_threads), the cores this process may use.
        self.models = profile.models.with_cpu_threads(len(os.sched_getaffinity(0)))
        self._reload = threading.Event()
        self.state = "starting"
        self.started_at = time.time()
        self.abandoned_work = False  # a worker still ran when the drain timeout ended
        self._stop = threading.Event()
        self._stalls: list[str] = []
        self.notifier = Notifier()
        self.task_errors: dict[str, str] = {}  # task -> why its model is not served
        self.queues: dict[str, PriorityDeadlineQueue] = {}
        self.workers: dict[str, Worker] = {}
        self.replayed: dict[str, int] = {"jobs": 0, "results": 0, "given_up": 0, "refused": 0}
        self.ledger = MemoryLedger(profile.memory_budget_mib * MIB, profile.memory_headroom_mib * MIB)
        self.probe: Any = HostProbe()
        self.manager = ModelManager(self.ledger, self.probe)
        limits = profile.limits
        self.media = MediaLoader(ImageLimits(limits.max_image_bytes, limits.max_image_pixels), profile.paths.media_dir)
        jcfg = profile.journal
        profile.paths.state_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(profile.paths.state_dir / "journal.sqlite3", jcfg.max_mib * MIB, jcfg.dedup_window_s)
        self.stats = JobStats()
        self.link = DaemonLink(profile, self._on_messages, on_delivered=self.journal.mark_answered)
        self.metrics = MetricsServer(self.snapshot)
        self.tracer = JobTracer.from_profile(profile.device_id, profile.tracing.otlp_endpoint)
        # Results of jobs that came in over HTTP: handed to their waiting requests.
        self.local = LocalDeliveries(on_delivered=self.journal.mark_answered)
        self.responder = Responder(
            self.link, self.journal, self.stats, profile.device_id, self.metrics.jobs.observe, self.tracer, self.local
        )
        self.intake = Intake(profile, self.queues, self.responder, self.journal)
        self.intake.stop_running = self._stop_running
        self.pipeline = Pipeline(self.responder, self.queues)
        self.builds = ChildBuilds(profile.paths.engine_dir, self.notifier, self._stop)
        self.reloader = Reloader(profile_path, lambda: self.profile, self._adopt, self.queues, self.workers,
                                 self.manager, self.metrics)  # fmt: skip
        self.status_server: StatusServer | None = None
        self.http: HTTPServer | None = None
        self.http_error: str | None = None
        self.inspect: InspectTask | None = None
        self.qa: QATask | None = None

    def _on_messages(self, msgs: list[IncomingJob]) -> list[bool]:
        return self.intake.take_many(msgs)

    def _stop_running(self, job_id: str, allowed: Callable[[WorkItem], bool], why: str) -> bool:
        return any(worker.stop_running(job_id, allowed, why) for worker in list(self.workers.values()))

    # lifecycle ---------------------------------------------------------------------

    def request_stop(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        if signum is not None:
            logger.info("signal %s: stopping", signal.Signals(signum).name)
        self._stop.set()

    def request_reload(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        # Only a flag here: the supervising loop reloads, outside the signal handler.
        self._reload.set()

    def _adopt(self, profile: Profile) -> None:
        self.profile = profile
        self.intake.profile = profile

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        steps: list[tuple[str, Callable[[], bool]]] = [
            ("directories", self._start_directories),
            ("status socket", self._start_status),
            ("metrics", self._start_metrics),
            ("memory", self._start_memory),
            ("vision branch", self._start_vision),
            ("text branch", self._start_text),
            ("journal replay", self._start_replay),
            ("workers", self._start_workers),
            ("broker", self._start_broker),
            ("http api", self._start_http),
        ]
        try:
            for name, step in steps:
                if self._stop.is_set():
                    return 0
                logger.debug("start step: %s", name)
                if not step():
                    logger.error("start step %r failed; stopping", name)
                    return 1
            self.state = "ready"
            self.notifier.ready(self._one_line_status())
            logger.info("edge %s ready on device %s", __version__, self.profile.device_id)
            self._supervise()
        finally:
            self._shutdown()
        return 0

    def _start_directories(self) -> bool:
        paths = self.profile.paths
        for directory in (paths.state_dir, paths.runtime_dir, paths.engine_dir):
            directory.mkdir(parents=True, exist_ok=True)
        return True

    def _start_status(self) -> bool:
        cfg = self.profile.status
        self.status_server = StatusServer(self.profile.status_socket, self.snapshot, cfg.socket_mode, cfg.socket_group)
        self.status_server.start()
        self.notifier.status("loading models")
        return True

    def _start_metrics(self) -> bool:
        # Never a reason not to start: a taken port is logged and shown in the status.
        self.metrics.start(self.profile.metrics.address)
        return True

    def _start_memory(self) -> bool:
        """The probe for what the budget covers on this box; what the process holds
        before any model (interpreter, libraries, the CUDA context) enters the ledger."""
        if not bound_heap():
            logger.warning("cannot fix the C heap's mmap threshold: freed job buffers may stay resident")
        on_cuda = self.profile.models.uses_cuda()
        if on_cuda:
            try:
                self.probe, _runtime = open_cuda()
            except RuntimeError as err:
                logger.error("%s", err)
                return False
            self.manager.probe = self.probe
        held = self.probe.used_bytes()
        if not self.ledger.add_model("runtime", "daemon", held, keep_alive_s=float("inf")):
            logger.error("the process alone (%d bytes) exceeds the memory budget", held)
            return False
        available = self.probe.available_bytes()
        if available is not None and self.ledger.lower_budget(held + available):
            logger.warning(
                "only %.0f MiB of the %s memory is available: the budget is %.0f MiB, not %d MiB",
                available / MIB,
                self.probe.scope,
                self.ledger.budget_bytes / MIB,
                self.profile.memory_budget_mib,
            )
        if on_cuda:
            # The allocator itself can then never take the process past the budget.
            fraction = self.probe.cap_allocator(self.ledger.budget_bytes)
            logger.info("CUDA allocator capped at %.4f of the device", fraction)
        return True

    def _start_vision(self) -> bool:
        models = self.models
        tasks: dict[str, BatchRunner] = {}
        ocr: OCRTask | None = None
        if models.ocr.enabled:
            try:
                builds.ensure_plans(self.profile, "ocr", None, self.builds)
                ocr = start_ocr(models.ocr, self.manager, self.media, self.profile.paths.engine_dir)
                tasks["ocr"] = ocr
            except Exception as err:  # one model failing must not take the others down
                logger.exception("OCR unavailable")
                self.task_errors["ocr"] = describe_failure(err)
        if models.inspect.enabled and not self._stop.is_set():
            try:
                student = builds.locate(self.profile, "inspect", self.builds)
                builds.ensure_plans(self.profile, "inspect", student, self.builds)
                engine_dir = self.profile.paths.engine_dir
                self.inspect = start_inspect(models.inspect, student, self.manager, self.media, ocr, engine_dir)
                tasks["inspect"] = self.inspect
            except BuildStopped:
                return True
            except Exception as err:
                logger.exception("inspection model unavailable")
                self.task_errors["inspect"] = describe_failure(err)
        if tasks:
            queue = PriorityDeadlineQueue(self.profile.queue.max_size)
            self.queues["vision"] = queue
            pipeline = self.pipeline
            self.workers["vision"] = BranchWorker("vision", queue, tasks, pipeline.complete, pipeline.complete_batch)
        return True

    def _start_text(self) -> bool:
        cfg = self.models.qa
        if not cfg.enabled or self._stop.is_set():
            return True
        try:
            checkpoint = builds.locate(self.profile, "qa", self.builds)
            paths = self.profile.paths
            self.qa = start_qa(
                cfg,
                checkpoint,
                self.manager,
                self.responder,
                paths.state_dir,
                paths.engine_dir,
                self.profile.device_id,
                self.media,
            )
        except BuildStopped:
            return True
        except Exception as err:
            logger.exception("text branch unavailable")
            self.task_errors["qa"] = describe_failure(err)
            return True
        engine = self.qa.engine
        wait_s = self.profile.queue.memory_wait_ms / 1000.0
        memory = TextMemory(self.ledger, qa_model_name(cfg), wait_s, engine.prefill_bytes)
        prefixes = engine.batcher.prefix_cache
        if prefixes is not None:  # its entries are bounded by the ledger too
            # What the warm-up kept was not reserved: it goes, and entries from now on are.
            prefixes.clear()
            model = qa_model_name(cfg)
            prefixes.reserve = lambda nbytes: self.ledger.reserve("prefix-cache", "qa", nbytes, model)
            prefixes.release = self.ledger.release
        offload = engine.batcher.offload
        if offload is not None and self.probe.scope != "device":
            # Paused rows held in host memory are memory the budget covers (all of it on a
            # CPU box, one pool on a Jetson); on a discrete GPU's budget they are not.
            model = qa_model_name(cfg)
            offload.reserve = lambda nbytes: self.ledger.reserve("kv-offload", "kv_offload", nbytes, model)
            offload.release_grant = self.ledger.release
        queue = PriorityDeadlineQueue(self.profile.queue.max_size)
        self.queues["text"] = queue
        answers = {"embed": EmbedTask(self.qa.retrieval).answer}
        self.workers["text"] = TextWorker(
            "text", queue, self.qa, engine.batcher, memory, self.pipeline.complete, answers
        )
        return True

    def _start_replay(self) -> bool:
        if not self.queues:
            logger.error("no branch could be started: %s", self.task_errors)
            return False
        self.replayed = self.intake.replay()
        return True

    def _start_workers(self) -> bool:
        share_interpreter_between_branches()
        for worker in self.workers.values():
            worker.start()
        return True

    def _start_broker(self) -> bool:
        self.link.start()
        return True

    def _start_http(self) -> bool:
        # Never a reason not to start (MQTT is the primary path): a listener that cannot
        # start is logged and shown in the status, as the metrics port is.
        cfg = self.profile.http
        if cfg.address is None:
            return True
        # Imported only when a listener is configured: a box without one holds no web stack.
        from edge.http.server import HTTPServer, Served

        retrieval = self.qa.retrieval if self.qa is not None else None
        served = Served(
            device_id=self.profile.device_id,
            jobs_prefix=self.profile.topic("jobs"),
            text_model=qa_model_name(self.models.qa) if self.qa is not None else None,
            embed_model=EMBED_MODEL if retrieval is not None else None,
            embed=retrieval.embed if retrieval is not None else None,
            max_prompt_chars=self.profile.limits.max_prompt_chars,
            ready=lambda: self.state == "ready",
        )
        try:
            self.http = HTTPServer(cfg, served, self.link.submit, self.local)
            self.http.start()
        except (OSError, ValueError) as err:
            logger.error("HTTP API not started: %s", err)
            self.http, self.http_error = None, str(err)
        return True

    def _supervise(self) -> None:
        # WATCHDOG=1 comes from this loop on purpose: if the loop hangs, systemd sees it.
        # It also vouches for the workers: while one is stalled (a job past the stall
        # limit, a hung kernel, a dead thread) no ping goes out, so systemd restarts us.
        interval = watchdog_interval_s()
        tick = min(interval, 1.0) if interval else 1.0
        last_ping = 0.0
        last_compact = time.monotonic()
        while not self._stop.wait(tick):
            now = time.monotonic()
            if self._reload.is_set():
                self._reload.clear()
                self.reloader()
                if self.http is not None:
                    self.http.reload_keys()
            if not self.journal.available and self.journal.retry_open():
                self.replayed = self.intake.replay()  # what the journal held, now it can be read
            if now - last_compact >= self.profile.journal.compact_interval_s:
                last_compact = now
                try:
                    self.journal.compact()
                except Exception:  # compaction is housekeeping; serving goes on
                    logger.exception("journal compaction failed")
            try:
                self.journal.record_count()
            except Exception:  # an account of the journal, never a reason to stop serving
                logger.exception("could not record the journal's count")
            try:
                self.journal.checkpoint()  # the WAL folded in here, not inside a commit
            except Exception:  # housekeeping; serving goes on
                logger.exception("journal checkpoint failed")
            stalls = [r for w in self.workers.values() if (r := w.stalled(now, self.profile.watchdog.stall_s))]
            if stalls != self._stalls:
                if stalls:
                    logger.error("not vouching to the watchdog: %s", "; ".join(stalls))
                elif self._stalls:
                    logger.warning("workers progressing again; watchdog pings resume")
                self._stalls = stalls
            if interval and not stalls and now - last_ping >= interval * 0.95:
                self.notifier.watchdog()
                last_ping = now
            self.notifier.status(self._one_line_status())

    def _shutdown(self) -> None:
        self.state = "stopping"
        self.notifier.stopping("stopping: finishing jobs in hand")
        if self.http is not None:
            # First, while the intake still takes jobs: a request arriving later would
            # find no intake to answer it and hang. A request cut off here withdraws its
            # job if still queued, as any client that goes away does; its retry runs it.
            self.http.close()
        self.intake.accepting = False
        self.link.stop_intake()
        drain = self.profile.queue.drain_timeout_s
        for worker in self.workers.values():
            if not worker.stop(drain):
                self.abandoned_work = True
                left = worker.abandon()
                logger.warning(
                    "%s branch did not finish within %.0f s; %d job(s) in hand stay journalled for the next start",
                    worker.name,
                    drain,
                    len(left),
                )
        # Queued jobs are in the journal: the next start takes them up again.
        left_queued = sum(len(queue.drain()) for queue in self.queues.values())
        if left_queued:
            logger.info("%d queued job(s) stay journalled for the next start", left_queued)
        self.link.close()
        self.journal.close()
        if self.status_server is not None:
            self.status_server.close()
        self.metrics.stop()
        self.tracer.shutdown()  # spans still batched go out
        logger.info("stopped")

    # status --------------------------------------------------------------------------

    def _one_line_status(self) -> str:
        snap = self.stats.snapshot()
        depth = sum(len(q) for q in self.queues.values())
        broker = "connected" if self.link.connected else "broker down"
        line = f"{self.state}, {broker}, queued {depth}, ok {snap['ok']}, failed {snap['failed']}"
        return f"{line}, STALLED: {'; '.join(self._stalls)}" if self._stalls else line

    def snapshot(self) -> dict[str, Any]:
        kv = self.qa.engine.batcher.kv if self.qa is not None else None
        vision = {"split_batches": self.inspect.split_batches} if self.inspect is not None else {}
        return {
            "schema_version": STATUS_SCHEMA_VERSION,
            "device": self.profile.device_id,
            "version": __version__,
            "pid": os.getpid(),
            "state": self.state,
            "uptime_s": round(time.time() - self.started_at, 3),
            "broker": {
                "host": self.profile.broker.host,
                "port": self.profile.broker.port,
                "connected": self.link.connected,
                "subscribed": self.link.subscribed,
                "since": self.link.changed_at,
                "connects": self.link.connects,
                "stream_peers": self.link.peers.online() if self.link.peers is not None else None,
                **self.link.identity.snapshot(),
            },
            "memory": memory_section(self.ledger, self.probe, kv),
            "journal": {
                "path": str(self.journal.path),
                **self.journal.counts(),
                "awaiting_puback": self.link.awaiting_puback,
                "duplicates": self.intake.duplicates,
                "replayed": dict(self.replayed),
                "full": self.journal.full_since is not None,
                "problem": self.journal.problem,
                "lost": self.journal.lost,
            },
            "models": models_section(self.manager),
            # What the loaded text model resolved to (the figures' engine_config).
            "text_engine": self.qa.engine.config() if self.qa is not None else None,
            "branches": branches_section(self.workers, self.task_errors, {"vision": vision}),
            "jobs": self.stats.snapshot(),
            "builds": self.builds.snapshot(),
            "metrics": self.metrics.snapshot(),
            "http": {
                "listen": self.profile.http.listen,
                "port": self.http.port if self.http is not None else None,
                "error": self.http_error,
            },
            "reload": self.reloader.last,
        }
