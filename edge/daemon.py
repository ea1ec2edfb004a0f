"""The daemon: wires profile, models, queues, workers, MQTT and health together.

Threads: paho's network thread feeds `Intake`; one worker thread per branch runs
models; the status socket has its own; the main thread only supervises (watchdog
pings, systemd STATUS, shutdown), so a stuck main loop is what systemd detects.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from edge import __version__
from edge.backends import BackendOptions
from edge.comms.mqtt import DaemonLink
from edge.config.schema import Profile
from edge.health.notify import Notifier, watchdog_interval_s
from edge.health.status import STATUS_SCHEMA_VERSION, StatusServer
from edge.memory import RssProbe, rss_bytes
from edge.protocol import results
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.images import ImageLimits, decode_base64, decode_image, read_media_file, resolve_media_path
from edge.protocol.jobs import InspectJob, OCRJob, QAJob
from edge.scheduler.branch import Batching, BranchWorker, Outcome
from edge.scheduler.ledger import MemoryLedger, measure
from edge.scheduler.queue import BatchPolicy, PriorityDeadlineQueue
from edge.scheduler.work import Reply, WorkItem
from edge.stats import JobStats
from edge.text.qa import QAEngine, QASettings
from edge.vision.inspect import InspectPipeline
from edge.vision.ocr import OCRPipeline, OCRSettings
from engines.cache import existing_only
from engines.text_build import build_text_engine
from engines.vision_build import build_student

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    name: str
    branch: str
    backend: str
    memory_bytes: int
    load_ms: float


class Daemon:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.stats = JobStats()
        self.notifier = Notifier()
        self.state = "starting"
        self.started_at = time.time()
        self.models: list[LoadedModel] = []
        self.branch_errors: dict[str, str] = {}
        self.queues: dict[str, PriorityDeadlineQueue] = {}
        self.workers: dict[str, BranchWorker] = {}
        self._ocr: OCRPipeline | None = None
        self._inspect: InspectPipeline | None = None
        self._stalls: list[str] = []
        self.abandoned_work = False  # a worker still ran when the drain timeout ended
        self._qa: QAEngine | None = None
        self._stop = threading.Event()
        self.ledger = MemoryLedger(profile.memory_budget_mib * 2**20, profile.memory_headroom_mib * 2**20)
        self._image_limits = ImageLimits(profile.limits.max_image_bytes, profile.limits.max_image_pixels)
        from edge.intake import Intake

        self.link = DaemonLink(profile, Intake(profile, self.queues, self._reject, self._answer))
        self.status_server: StatusServer | None = None

    # lifecycle ---------------------------------------------------------------------

    def request_stop(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        if signum is not None:
            logger.info("signal %s: stopping", signal.Signals(signum).name)
        self._stop.set()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        paths = self.profile.paths
        for directory in (paths.state_dir, paths.runtime_dir, paths.engine_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.status_server = StatusServer(
            self.profile.status_socket, self.snapshot, self.profile.status.socket_mode, self.profile.status.socket_group
        )
        self.status_server.start()
        self.notifier.status("loading models")
        try:
            # What the process holds before any model (interpreter, libraries) counts too.
            if not self.ledger.add_model("runtime", "daemon", rss_bytes(), keep_alive_s=float("inf")):
                logger.error("the process alone (%d bytes) exceeds the memory budget", rss_bytes())
                return 1
            self._load_models()
            if self._stop.is_set():
                return 0
            if not self.queues:
                logger.error("no branch could be started: %s", self.branch_errors)
                return 1
            for worker in self.workers.values():
                worker.start()
            self.link.start()
            self.state = "ready"
            self.notifier.ready(self._one_line_status())
            logger.info("edge %s ready on device %s", __version__, self.profile.device_id)
            self._supervise()
        finally:
            self._shutdown()
        return 0

    def _supervise(self) -> None:
        # WATCHDOG=1 comes from this loop on purpose: if the loop hangs, systemd sees it.
        # It also vouches for the workers: while one is stalled (a job past the stall
        # limit, a hung kernel, a dead thread) no ping goes out, so systemd restarts us.
        interval = watchdog_interval_s()
        tick = min(interval, 1.0) if interval else 1.0
        last_ping = 0.0
        while not self._stop.wait(tick):
            now = time.monotonic()
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
        self.link.stop_intake()
        for worker in self.workers.values():
            drain = self.profile.queue.drain_timeout_s
            if not worker.stop(drain):
                self.abandoned_work = True
                logger.warning("%s branch did not finish its job within %.0f s", worker.name, drain)
                for item in worker.abandon():
                    why = JobError(ErrorCode.UNAVAILABLE, "daemon stopping before the job finished; resubmit")
                    self._finish(item, None, why, time.monotonic())
        # Until the journal keeps them for the next start, say so rather than drop them.
        for queue in self.queues.values():
            for item in queue.drain():
                self._finish(item, None, JobError(ErrorCode.UNAVAILABLE, "daemon stopping; resubmit"), time.monotonic())
        self.link.close()
        if self.status_server is not None:
            self.status_server.close()
        logger.info("stopped")

    # models --------------------------------------------------------------------------

    def _measure(self, name: str, branch: str, backend: str, load: Any) -> Any:
        """Load a model and enter its measured footprint in the ledger; a model the
        budget cannot hold is dropped again and its load fails with the figures."""
        t0 = time.perf_counter()
        obj, used = measure(RssProbe(), load)
        elapsed = (time.perf_counter() - t0) * 1000.0
        if not self.ledger.add_model(name, branch, used, keep_alive_s=float("inf")):
            snap = self.ledger.snapshot()
            del obj
            raise MemoryError(
                f"{name} needs {used} bytes; the ledger holds {snap['used_bytes']} of {self.ledger.capacity_bytes} "
                f"usable ({snap['budget_bytes']} budget - {snap['headroom_bytes']} headroom)"
            )
        self.models.append(LoadedModel(name, branch, backend, used, elapsed))
        logger.info("loaded %s (%s) in %.0f ms, %.1f MiB resident", name, backend, elapsed, used / 2**20)
        return obj

    def _load_models(self) -> None:
        models = self.profile.models
        if models.ocr.enabled and not self._stop.is_set():
            try:
                settings = OCRSettings(
                    det_limit_side_len=models.ocr.det_limit_side_len,
                    use_angle_cls=models.ocr.use_angle_cls,
                    text_score=models.ocr.text_score,
                )
                opts = BackendOptions(threads=models.ocr.threads)
                self._ocr = self._measure(
                    "pp-ocrv6-small",
                    "vision",
                    models.ocr.backend,
                    lambda: OCRPipeline.load(settings, models.ocr.backend, opts),
                )
            except Exception as err:  # one model failing must not take the others down
                logger.exception("OCR unavailable")
                self.branch_errors["vision"] = f"ocr: {type(err).__name__}: {err}"
        if models.inspect.enabled and not self._stop.is_set():
            try:
                student = self._student_path()
                cfg = models.inspect
                opts_i = BackendOptions(threads=cfg.threads, max_batch=cfg.max_batch)
                self._inspect = self._measure(
                    "inspect-vit-student",
                    "vision",
                    cfg.backend,
                    lambda: InspectPipeline.load(student, cfg.backend, opts_i),
                )
            except Exception as err:
                logger.exception("inspection model unavailable")
                reason = f"inspect: {type(err).__name__}: {err}"
                self.branch_errors["vision"] = "; ".join(filter(None, [self.branch_errors.get("vision"), reason]))
        if self._ocr is not None or self._inspect is not None:
            cfg = models.inspect
            policy = BatchPolicy(cfg.max_batch, cfg.max_queue_delay_ms / 1000.0, frozenset(cfg.preferred_batch_sizes))
            self._add_branch("vision", self._run_vision, Batching("inspect", policy, self._run_inspect_batch))
        if models.qa.enabled and not self._stop.is_set():
            try:
                if models.qa.threads:
                    torch.set_num_threads(models.qa.threads)
                path = self._text_engine_path()
                settings_qa = QASettings(
                    max_context_tokens=models.qa.max_context_tokens,
                    max_new_tokens=models.qa.max_new_tokens,
                    system_prompt=models.qa.system_prompt,
                )
                self._qa = self._measure(
                    f"{models.qa.source}-{models.qa.adapter}",
                    "text",
                    f"torch-cpu {models.qa.quantization}",
                    lambda: QAEngine.load(path, settings_qa),
                )
                self._add_branch("text", self._run_text)
            except Exception as err:
                logger.exception("text branch unavailable")
                self.branch_errors["text"] = f"{type(err).__name__}: {err}"

    def _text_engine_path(self) -> Path:
        qa = self.profile.models.qa
        engine_dir = self.profile.paths.engine_dir
        if self.profile.build_missing_engines:
            self.notifier.status("building the text engine (first start only)")
            return build_text_engine(engine_dir, qa.adapter, qa.quantization, progress=False)
        with existing_only():
            return build_text_engine(engine_dir, qa.adapter, qa.quantization, progress=False)

    def _student_path(self) -> Path:
        engine_dir = self.profile.paths.engine_dir
        size = self.profile.models.inspect.build_size
        if self.profile.build_missing_engines:
            self.notifier.status("building the inspection model (first start only)")
            return build_student(engine_dir, size, progress=False)
        with existing_only():
            return build_student(engine_dir, size, progress=False)

    def _add_branch(self, name: str, handler: Any, batching: Batching | None = None) -> None:
        queue = PriorityDeadlineQueue(self.profile.queue.max_size)
        self.queues[name] = queue
        self.workers[name] = BranchWorker(name, queue, handler, self._complete, batching)

    # job handlers (worker threads) ---------------------------------------------------

    def _load_image(self, job: OCRJob | InspectJob) -> Any:
        ref = job.image
        if ref.data is not None:
            raw = decode_base64(ref.data, self._image_limits, "image.data")
            return decode_image(raw, self._image_limits, "image.data")
        assert ref.path is not None
        path = resolve_media_path(self.profile.paths.media_dir, ref.path, "image.path")
        raw = read_media_file(path, self._image_limits, "image.path")
        return decode_image(raw, self._image_limits, "image.path")

    def _run_vision(self, item: WorkItem) -> dict[str, Any]:
        """OCR jobs (inspect jobs arrive in batches at _run_inspect_batch)."""
        job = item.job.request
        assert isinstance(job, OCRJob)
        if self._ocr is None:
            raise JobError(ErrorCode.UNAVAILABLE, "OCR is not loaded on this device", "task")
        img = self._load_image(job)
        return {**self._read_text(img), "image": {"width": int(img.shape[1]), "height": int(img.shape[0])}}

    def _read_text(self, img: Any) -> dict[str, Any]:
        assert self._ocr is not None
        lines = self._ocr(img)
        return {"lines": [line.to_dict() for line in lines], "text": "\n".join(line.text for line in lines)}

    def _run_inspect_batch(self, items: list[WorkItem]) -> list[dict[str, Any] | JobError]:
        """Decode every image (a bad one fails its own job), run the student once on
        the good ones, then OCR the jobs that asked for it."""
        out: list[dict[str, Any] | JobError] = []
        images: list[Any] = []
        slots: list[int] = []
        for item in items:
            job = item.job.request
            assert isinstance(job, InspectJob)
            try:
                if self._inspect is None:
                    raise JobError(ErrorCode.UNAVAILABLE, "the inspection model is not loaded on this device", "task")
                if job.ocr and self._ocr is None:
                    raise JobError(ErrorCode.UNAVAILABLE, "OCR is not loaded on this device", "ocr")
                images.append(self._load_image(job))
                slots.append(len(out))
                out.append({})
            except JobError as err:
                out.append(err)
        if images:
            assert self._inspect is not None
            # Decoded images are BGR (the OCR models' order); the student was trained on RGB.
            found_all = self._inspect.run([img[:, :, ::-1] for img in images])
            for slot, img, found in zip(slots, images, found_all, strict=True):
                job = items[slot].job.request
                assert isinstance(job, InspectJob)
                doc = found.to_dict(heatmap=job.heatmap)
                doc["image"] = {"width": int(img.shape[1]), "height": int(img.shape[0])}
                doc["batch_size"] = len(images)
                if job.ocr:
                    doc["ocr"] = self._read_text(img)
                out[slot] = doc
        return out

    def _run_text(self, item: WorkItem) -> dict[str, Any]:
        job = item.job.request
        assert isinstance(job, QAJob) and self._qa is not None
        if not job.stream:
            return self._qa.answer(job)
        seq = 0

        def publish_delta(delta: str) -> None:
            nonlocal seq
            doc = results.partial_result(job.id, "qa", self.profile.device_id, seq, delta)
            self.link.publish(item.reply.topic, results.encode(doc), item.reply.correlation)
            seq += 1

        return self._qa.answer(job, on_text=publish_delta)

    # results -------------------------------------------------------------------------

    def _complete(self, item: WorkItem, outcome: Outcome) -> None:
        self._finish(item, outcome.output, outcome.error, outcome.finished_at, outcome.started_at)

    def _finish(
        self,
        item: WorkItem,
        output: dict[str, Any] | None,
        error: JobError | None,
        finished_at: float,
        started_at: float | None = None,
    ) -> None:
        started = started_at if started_at is not None else finished_at
        timings = results.Timings(
            queued_ms=(started - item.received_at) * 1000.0,
            run_ms=(finished_at - started) * 1000.0,
            total_ms=(finished_at - item.received_at) * 1000.0,
        )
        job = item.job
        if error is None and output is not None:
            doc = results.ok_result(job.id, job.task, self.profile.device_id, output, timings)
            self.stats.record_ok(job.task, timings.total_ms)
        else:
            err = error or JobError(ErrorCode.INTERNAL, "no output")
            logger.warning("job %s failed: %s", job.id, err)
            doc = results.error_result(job.id, job.task, self.profile.device_id, err, timings)
            self.stats.record_error(job.task, err.code.value)
        self.link.publish(item.reply.topic, results.encode(doc), item.reply.correlation)

    def _answer(self, reply: Reply, job_id: str, task: str, output: dict[str, Any], received: float) -> None:
        """An ok result for a request the intake answers itself (cancel)."""
        timings = results.Timings(0.0, 0.0, (time.monotonic() - received) * 1000.0)
        doc = results.ok_result(job_id, task, self.profile.device_id, output, timings)
        self.stats.record_ok(task, timings.total_ms)
        self.link.publish(reply.topic, results.encode(doc), reply.correlation)

    def _reject(self, reply: Reply, job_id: str | None, task: str | None, error: JobError, received: float) -> None:
        now = time.monotonic()
        timings = results.Timings(0.0, 0.0, (now - received) * 1000.0)
        doc = results.error_result(job_id, task, self.profile.device_id, error, timings)
        self.stats.record_error(task, error.code.value)
        self.link.publish(reply.topic, results.encode(doc), reply.correlation)

    # status --------------------------------------------------------------------------

    def _one_line_status(self) -> str:
        snap = self.stats.snapshot()
        depth = sum(len(q) for q in self.queues.values())
        broker = "connected" if self.link.connected else "broker down"
        line = f"{self.state}, {broker}, queued {depth}, ok {snap['ok']}, failed {snap['failed']}"
        return f"{line}, STALLED: {'; '.join(self._stalls)}" if self._stalls else line

    def snapshot(self) -> dict[str, Any]:
        branches: dict[str, Any] = {}
        for name in ("vision", "text"):
            worker = self.workers.get(name)
            if worker is not None:
                branches[name] = {
                    "available": True,
                    "depth": len(worker.queue),
                    "max": worker.queue.max_size,
                    "running": 1 if worker.running_since is not None else 0,
                }
            elif name in self.branch_errors:
                branches[name] = {"available": False, "reason": self.branch_errors[name], "depth": 0, "max": 0}
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
                "since": self.link.changed_at,
                "connects": self.link.connects,
            },
            "memory": {**self.ledger.snapshot(), "rss_bytes": rss_bytes()},
            "models": [
                {
                    "name": m.name,
                    "branch": m.branch,
                    "backend": m.backend,
                    "memory_bytes": m.memory_bytes,
                    "load_ms": round(m.load_ms, 1),
                }
                for m in self.models
            ],
            "branches": branches,
            "jobs": self.stats.snapshot(),
        }
