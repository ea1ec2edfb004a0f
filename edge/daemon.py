"""The daemon: wires profile, models, queues, workers, MQTT and health together.

Threads: paho's network thread feeds `Intake`; one worker thread per branch runs
models; the status socket has its own; the main thread only supervises (watchdog
pings, systemd STATUS, shutdown), so a stuck main loop is what systemd detects.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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
from edge.intake import Intake, make_item
from edge.journal.store import QUEUED, SENT, Entry, Journal, JournalFull
from edge.memory import RssProbe, peak_rss_bytes, rss_bytes
from edge.protocol import results
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.images import ImageLimits, decode_base64, decode_image, read_media_file, resolve_media_path
from edge.protocol.jobs import InspectJob, JobLimits, OCRJob, ParsedJob, QAJob, decode_payload, parse_job
from edge.scheduler.branch import Batching, BranchWorker, Outcome, Worker, share_interpreter_between_branches
from edge.scheduler.ledger import MemoryLedger, Reservation
from edge.scheduler.models import ModelManager
from edge.scheduler.queue import BatchPolicy, PriorityDeadlineQueue
from edge.scheduler.text_worker import TextMemory, TextWorker
from edge.scheduler.work import Reply, WorkItem
from edge.stats import JobStats
from edge.text.continuous import Sequence
from edge.text.qa import QAEngine, QASettings
from edge.vision.inspect import InspectPipeline
from edge.vision.ocr import OCRPipeline, OCRSettings
from engines.cache import EngineMissing, existing_only
from engines.text_build import build_text_engine
from engines.vision_build import build_student

logger = logging.getLogger(__name__)

TEXT_KV_POOL = "text-kv"
OCR_MODEL = "pp-ocrv6-small"
INSPECT_MODEL = "inspect-vit-student"


class BuildStopped(Exception):
    """A first-start build ended by a stop request."""


def _wants_ocr(item: WorkItem) -> bool:
    return isinstance(item.job.request, InspectJob) and item.job.request.ocr


class Daemon:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.stats = JobStats()
        self.notifier = Notifier()
        self.state = "starting"
        self.started_at = time.time()
        self._image_size = 0  # the student's input side, known once it loads
        self.branch_errors: dict[str, str] = {}
        self.queues: dict[str, PriorityDeadlineQueue] = {}
        self.workers: dict[str, Worker] = {}
        self._served: set[str] = set()  # tasks whose model loaded at start
        self._stalls: list[str] = []
        self.abandoned_work = False  # a worker still ran when the drain timeout ended
        self.split_batches = 0  # vision batches run in parts because the budget held no more
        self._qa: QAEngine | None = None
        self._stop = threading.Event()
        self.ledger = MemoryLedger(profile.memory_budget_mib * 2**20, profile.memory_headroom_mib * 2**20)
        self.manager = ModelManager(self.ledger, RssProbe())
        self._image_limits = ImageLimits(profile.limits.max_image_bytes, profile.limits.max_image_pixels)
        profile.paths.state_dir.mkdir(parents=True, exist_ok=True)
        jcfg = profile.journal
        self.journal = Journal(profile.paths.state_dir / "journal.sqlite3", jcfg.max_mib * 2**20, jcfg.dedup_window_s)
        self.replayed = {"jobs": 0, "results": 0, "given_up": 0}
        self.intake = Intake(profile, self.queues, self._reject, self._answer, self.journal, self._resend)
        self.link = DaemonLink(profile, self.intake, on_delivered=self.journal.mark_answered)
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
            self._replay()
            share_interpreter_between_branches()
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
        last_compact = time.monotonic()
        while not self._stop.wait(tick):
            now = time.monotonic()
            if now - last_compact >= self.profile.journal.compact_interval_s:
                last_compact = now
                try:
                    self.journal.compact()
                except Exception:  # compaction is housekeeping; serving goes on
                    logger.exception("journal compaction failed")
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
        self.intake.accepting = False
        self.link.stop_intake()
        for worker in self.workers.values():
            drain = self.profile.queue.drain_timeout_s
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
        logger.info("stopped")

    def _replay(self) -> None:
        """Take up what the journal holds unfinished: results not yet confirmed by the
        broker are published again as stored; jobs without a result run again (up to
        journal.max_replays starts, so a job that brings the daemon down cannot do it
        forever)."""
        entries = self.journal.pending()
        if not entries:
            return
        limits = self.intake.limits
        for entry in entries:
            reply = Reply(entry.reply_topic, entry.correlation)
            if entry.state == SENT and entry.result is not None:
                self.link.publish(reply.topic, entry.result, reply.correlation, entry.id)
                self.replayed["results"] += 1
            elif entry.state == QUEUED:
                self._replay_job(entry, reply, limits)
        logger.info(
            "journal: %d job(s) taken up again, %d result(s) sent again, %d given up",
            self.replayed["jobs"],
            self.replayed["results"],
            self.replayed["given_up"],
        )

    def _replay_job(self, entry: Entry, reply: Reply, limits: JobLimits) -> None:
        # The job's age carries over: its deadline counts from when it first arrived.
        received = time.monotonic() - max(0.0, time.time() - entry.received)
        try:
            attempts = self.journal.replayed(entry.id)
        except JournalFull:
            attempts = entry.attempts + 1
        task = entry.topic.rsplit("/", 1)[-1]
        if attempts > self.profile.journal.max_replays:
            self.replayed["given_up"] += 1
            why = JobError(
                ErrorCode.INTERNAL,
                f"the daemon stopped {attempts - 1} times before this job finished; not running it again",
            )
            self._reject(reply, entry.id, task, why, received)
            return
        try:
            # The profile's limits, or the branches served, may have changed since.
            job = parse_job(decode_payload(entry.payload or b"", limits.max_payload_bytes), task, limits)
            queue = self.intake.route(job)
        except JobError as err:
            self._reject(reply, entry.id, task, err, received)
            return
        queue.put(make_item(job, reply, received, self.profile.queue.default_deadline_ms), force=True)
        self.replayed["jobs"] += 1

    # models --------------------------------------------------------------------------

    def _load(self, name: str, branch: str, backend: str, load: Any, keep_alive_s: float | None = None) -> Any:
        """Load a model through the manager: its measured footprint enters the ledger; a
        model the budget cannot hold fails its load with the figures."""
        keep = float("inf") if keep_alive_s is None else keep_alive_s
        self.manager.register(name, branch, backend, load, keep)
        return self.manager.load(name)

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
                self._load(
                    OCR_MODEL,
                    "vision",
                    models.ocr.backend,
                    lambda: OCRPipeline.load(settings, models.ocr.backend, opts),
                    models.ocr.keep_alive_s,
                )
                self._served.add("ocr")
            except Exception as err:  # one model failing must not take the others down
                logger.exception("OCR unavailable")
                self.branch_errors["vision"] = f"ocr: {type(err).__name__}: {err}"
        if models.inspect.enabled and not self._stop.is_set():
            try:
                student = self._student_path()
                cfg = models.inspect
                opts_i = BackendOptions(threads=cfg.threads, max_batch=cfg.max_batch)
                pipeline: InspectPipeline = self._load(
                    INSPECT_MODEL,
                    "vision",
                    cfg.backend,
                    lambda: InspectPipeline.load(student, cfg.backend, opts_i),
                    cfg.keep_alive_s,
                )
                self._image_size = pipeline.image_size
                del pipeline  # the manager holds it (and may evict it)
                self._served.add("inspect")
            except BuildStopped:
                return
            except Exception as err:
                logger.exception("inspection model unavailable")
                reason = f"inspect: {type(err).__name__}: {err}"
                self.branch_errors["vision"] = "; ".join(filter(None, [self.branch_errors.get("vision"), reason]))
        if self._served & {"ocr", "inspect"}:
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
                    max_sequences=models.qa.max_sequences,
                )
                name = f"{models.qa.source}-{models.qa.adapter}"
                qa = self._load(
                    name, "text", f"torch-cpu {models.qa.quantization}", lambda: QAEngine.load(path, settings_qa)
                )
                self._qa = qa
                # The KV cache was allocated (and zeroed, so resident) inside the measured
                # load; jobs reserve their KV from it.
                self.ledger.add_pool(TEXT_KV_POOL, name, qa.kv_cache_bytes)
                queue = PriorityDeadlineQueue(self.profile.queue.max_size)
                memory = TextMemory(self.ledger, name, TEXT_KV_POOL, self.profile.queue.memory_wait_ms / 1000.0)
                self.queues["text"] = queue
                self.workers["text"] = TextWorker(
                    "text", queue, qa.batcher, self._prepare_text, qa.output, qa.kv_tokens, memory, self._complete
                )
            except BuildStopped:
                return
            except Exception as err:
                logger.exception("text branch unavailable")
                self.branch_errors["text"] = f"{type(err).__name__}: {err}"

    def _text_engine_path(self) -> Path:
        qa = self.profile.models.qa

        def cached() -> Path:
            with existing_only():
                return build_text_engine(self.profile.paths.engine_dir, qa.adapter, qa.quantization, progress=False)

        args = ["--adapter", qa.adapter, "--quantization", qa.quantization]
        return self._engine(cached, "the text engine", "engines.text_build", args)

    def _student_path(self) -> Path:
        size = self.profile.models.inspect.build_size

        def cached() -> Path:
            with existing_only():
                return build_student(self.profile.paths.engine_dir, size, progress=False)

        return self._engine(cached, "the inspection model", "engines.vision_build", ["--size", size])

    def _engine(self, cached: Callable[[], Path], what: str, module: str, args: list[str]) -> Path:
        """A built engine from the cache; if it is missing and the profile allows, built
        first (in a child process, see _build_in_child)."""
        try:
            path: Path = cached()
            return path
        except EngineMissing:
            if not self.profile.build_missing_engines:
                raise
        self.notifier.status(f"building {what} (first start only)")
        self._build_in_child(module, args)
        path = cached()
        return path

    def _build_in_child(self, module: str, args: list[str]) -> None:
        """Run a build (a no-op when its result is cached) in a child process: a first
        build takes minutes, and a stop request must end it, which a build running in
        this process could not be made to do. Builds write to a scratch directory and
        rename it when done, so a stopped one leaves nothing half-built."""
        cmd = [sys.executable, "-m", module, "--engine-dir", str(self.profile.paths.engine_dir), "--no-progress", *args]
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)  # its log lines go to stderr, as ours do
        while child.poll() is None:
            if self._stop.wait(0.2):
                logger.info("stopping the %s build (pid %d)", module, child.pid)
                child.terminate()
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                raise BuildStopped(module)
        if child.returncode != 0:
            raise RuntimeError(f"{module} exited with {child.returncode}; its log is above")

    def _add_branch(self, name: str, handler: Any, batching: Batching) -> None:
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

    def _reserve(self, owner: str, task: str, nbytes: int, needs: set[str], model: str) -> Reservation:
        """A job's own buffers, all or nothing, before it runs. The vision branch runs one
        batch at a time and the text branch draws on its own pool, so waiting cannot cure
        a refusal here; evicting idle models (not those the job `needs`) can. If that is
        not enough it is answered over_budget at once, with the figures. `model` (loaded
        by the caller) counts as in use while the reservation is held: nothing evicts it."""
        res = self.ledger.reserve(owner, task, nbytes, model=model)
        if res is None and self.manager.make_room(nbytes, keep=needs):
            res = self.ledger.reserve(owner, task, nbytes, model=model)
        if res is None:
            snap = self.ledger.snapshot()
            raise JobError(
                ErrorCode.OVER_BUDGET,
                f"needs {nbytes} bytes; the ledger holds {snap['used_bytes']} of {self.ledger.capacity_bytes} "
                f"usable ({snap['budget_bytes']} budget - {snap['headroom_bytes']} headroom)",
            )
        return res

    def _release(self, res: Reservation, used: set[str]) -> None:
        """Give a job's buffers back; the models it used count as used now, so their
        keep-alive (before they may be evicted) starts from here."""
        self.ledger.release(res)
        self.ledger.touch(*used)

    def _image_bytes(self) -> int:
        """The most a decoded image can take (the decoder refuses more pixels), BGR uint8."""
        return self.profile.limits.max_image_pixels * 3

    def _run_vision(self, item: WorkItem) -> dict[str, Any]:
        """OCR jobs (inspect jobs arrive in batches at _run_inspect_batch)."""
        job = item.job.request
        assert isinstance(job, OCRJob)
        if "ocr" not in self._served:
            raise JobError(ErrorCode.UNAVAILABLE, "OCR is not loaded on this device", "task")
        self.manager.get(OCR_MODEL)  # loaded again if it was evicted
        res = self._reserve(item.job.id, "ocr", self._image_bytes(), {OCR_MODEL}, OCR_MODEL)
        try:
            img = self._load_image(job)
            return {**self._read_text(img), "image": {"width": int(img.shape[1]), "height": int(img.shape[0])}}
        finally:
            self._release(res, {OCR_MODEL})

    def _read_text(self, img: Any) -> dict[str, Any]:
        ocr: OCRPipeline = self.manager.get(OCR_MODEL)  # loaded again if it was evicted
        lines = ocr(img)
        return {"lines": [line.to_dict() for line in lines], "text": "\n".join(line.text for line in lines)}

    def _run_inspect_batch(self, items: list[WorkItem]) -> list[dict[str, Any] | JobError]:
        """Reserve the batch's buffers, decode every image (a bad one fails its own job),
        run the student once on the good ones, then OCR the jobs that asked for it. A
        batch the budget cannot hold whole, even after evicting idle models, runs in the
        largest parts that fit, one after another; only jobs that cannot fit even one at
        a time are answered over_budget."""
        if "inspect" not in self._served:
            missing = JobError(ErrorCode.UNAVAILABLE, "the inspection model is not loaded on this device", "task")
            return [missing for _ in items]
        needs = {INSPECT_MODEL} | ({OCR_MODEL} if any(_wants_ocr(it) for it in items) else set())
        out: list[dict[str, Any] | JobError] = []
        start = 0
        while start < len(items):
            rest = items[start:]
            try:
                # Models first (loaded again if evicted, never evicting each other), then
                # the buffers: a model a reservation names cannot be evicted while the
                # batch runs.
                pipeline: InspectPipeline = self.manager.get(INSPECT_MODEL, keep=needs)
                if OCR_MODEL in needs:
                    self.manager.get(OCR_MODEL, keep=needs)
                res, count = self._reserve_batch(rest, needs)
            except JobError as err:
                return out + [err for _ in rest]
            if count < len(rest):
                self.split_batches += 1
                logger.debug("batch of %d runs as %d now, the rest after: the budget holds no more", len(rest), count)
            try:
                out += self._inspect_reserved(rest[:count], pipeline)
            finally:
                self._release(res, needs)
            start += count
        return out

    def _batch_need(self, count: int) -> int:
        return count * self._image_bytes() + InspectPipeline.batch_bytes_at(self._image_size, count)

    def _reserve_batch(self, items: list[WorkItem], needs: set[str]) -> tuple[Reservation, int]:
        """A reservation for all of `items`, or for as many as fit once idle models are
        evicted; (reservation, how many it covers)."""
        owner = items[0].job.id
        try:
            return self._reserve(owner, "inspect", self._batch_need(len(items)), needs, INSPECT_MODEL), len(items)
        except JobError:
            if len(items) == 1:
                raise
        # make_room has evicted what it could; take the largest part that fits now.
        free = self.ledger.free_bytes()
        count = max((n for n in range(1, len(items)) if self._batch_need(n) <= free), default=1)
        return self._reserve(owner, "inspect", self._batch_need(count), needs, INSPECT_MODEL), count

    def _inspect_reserved(self, items: list[WorkItem], pipeline: InspectPipeline) -> list[dict[str, Any] | JobError]:
        out: list[dict[str, Any] | JobError] = []
        images: list[Any] = []
        slots: list[int] = []
        for item in items:
            job = item.job.request
            assert isinstance(job, InspectJob)
            try:
                if job.ocr and "ocr" not in self._served:
                    raise JobError(ErrorCode.UNAVAILABLE, "OCR is not loaded on this device", "ocr")
                images.append(self._load_image(job))
                slots.append(len(out))
                out.append({})
            except JobError as err:
                out.append(err)
        if images:
            # Decoded images are BGR (the OCR models' order); the student was trained on RGB.
            found_all = pipeline.run([img[:, :, ::-1] for img in images])
            for slot, img, found in zip(slots, images, found_all, strict=True):
                job = items[slot].job.request
                assert isinstance(job, InspectJob)
                doc = found.to_dict(heatmap=job.heatmap)
                doc["image"] = {"width": int(img.shape[1]), "height": int(img.shape[0])}
                doc["batch_size"] = len(images)
                try:
                    if job.ocr:
                        doc["ocr"] = self._read_text(img)
                    out[slot] = doc
                except JobError as err:  # this job's OCR part failed; the others stand
                    out[slot] = err
        return out

    def _prepare_text(self, item: WorkItem) -> Sequence:
        job = item.job.request
        assert isinstance(job, QAJob) and self._qa is not None
        if not job.stream:
            return self._qa.prepare(job, item)
        seq = 0

        def publish_delta(delta: str) -> None:
            nonlocal seq
            doc = results.partial_result(job.id, "qa", self.profile.device_id, seq, delta)
            self.link.publish(item.reply.topic, results.encode(doc), item.reply.correlation)
            seq += 1

        return self._qa.prepare(job, item, on_text=publish_delta)

    # results -------------------------------------------------------------------------

    def _complete(self, item: WorkItem, outcome: Outcome) -> None:
        job = item.job.request
        if isinstance(job, InspectJob) and job.ask is not None and outcome.output is not None:
            self._ask_text(item, job, outcome.output)
            return
        output = outcome.output
        if item.carry is not None and output is not None:
            output = {**item.carry["output"], "answer": output}
        self._finish(item, output, outcome.error, outcome.finished_at, outcome.started_at)

    def _ask_text(self, item: WorkItem, job: InspectJob, inspected: dict[str, Any]) -> None:
        """A pipeline job's second stage: the verdict and the label's text become the
        context of a question on the text branch, queued at the job's priority; the one
        result comes when the answer does."""
        assert job.ask is not None
        ocr = inspected.get("ocr", {}).get("text") if job.ocr else None
        context = (
            f"Inspection result: {inspected['class']} (confidence {inspected['score']:.2f}), "
            f"defect score {inspected['defect_score']:.2f}."
            + (f" Label text: {' / '.join(ocr.splitlines())}." if ocr else "")
        )
        question = QAJob(id=job.id, question=job.ask.question, context=context, max_new_tokens=job.ask.max_new_tokens)
        stage = WorkItem(
            job=ParsedJob(job.id, "qa", job.priority, None, question),
            reply=item.reply,
            received_at=item.received_at,
            carry={"task": "inspect", "output": inspected},
        )
        queue = self.queues.get("text")
        if queue is None:  # the intake refuses these; the text branch may have gone since
            why = JobError(ErrorCode.UNAVAILABLE, "the text branch is not served on this device", "ask")
            self._finish(item, None, why, time.monotonic())
            return
        queue.put(stage, force=True)  # accepted once already: never refused for queue size

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
        task = item.carry["task"] if item.carry is not None else job.task
        if error is None and output is not None:
            doc = results.ok_result(job.id, task, self.profile.device_id, output, timings)
            self.stats.record_ok(task, timings.total_ms)
        else:
            err = error or JobError(ErrorCode.INTERNAL, "no output")
            logger.warning("job %s failed: %s", job.id, err)
            doc = results.error_result(job.id, task, self.profile.device_id, err, timings)
            self.stats.record_error(task, err.code.value)
        self._send(item.reply, job.id, results.encode(doc))

    def _answer(self, reply: Reply, job_id: str, task: str, output: dict[str, Any], received: float) -> None:
        """An ok result for a request the intake answers itself (cancel)."""
        timings = results.Timings(0.0, 0.0, (time.monotonic() - received) * 1000.0)
        doc = results.ok_result(job_id, task, self.profile.device_id, output, timings)
        self.stats.record_ok(task, timings.total_ms)
        self._send(reply, job_id, results.encode(doc))

    def _reject(
        self, reply: Reply, job_id: str | None, task: str | None, error: JobError, received: float, keep: bool = True
    ) -> None:
        """An error result for a job refused before it ran. `keep=False` leaves the
        journal alone: the refusal concerns another request that holds this id."""
        now = time.monotonic()
        timings = results.Timings(0.0, 0.0, (now - received) * 1000.0)
        doc = results.error_result(job_id, task, self.profile.device_id, error, timings)
        self.stats.record_error(task, error.code.value)
        if keep:
            self._send(reply, job_id, results.encode(doc))
        else:
            self.link.publish(reply.topic, results.encode(doc), reply.correlation)

    def _send(self, reply: Reply, job_id: str | None, payload: bytes) -> None:
        """Publish a final result. With an id it is stored in the journal first, so a
        crash before the broker's PUBACK sends the same bytes again at the next start,
        and the PUBACK marks the job answered."""
        if job_id is None:
            self.link.publish(reply.topic, payload, reply.correlation)
            return
        self.journal.store_result(job_id, reply.topic, reply.correlation, payload)
        self.link.publish(reply.topic, payload, reply.correlation, job_id)

    def _resend(self, reply: Reply, job_id: str, payload: bytes) -> None:
        """A finished job's stored result, for a repeat of its id within the dedup window."""
        self.link.publish(reply.topic, payload, reply.correlation)

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
                    "running": worker.running,
                    "batch_sizes": {str(k): v for k, v in sorted(worker.batch_sizes.items())},
                }
                if name == "vision":
                    branches[name]["split_batches"] = self.split_batches
                if isinstance(worker, TextWorker):
                    branches[name]["paused"] = worker.paused
                    branches[name]["over_budget"] = worker.over_budget
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
            "memory": {**self.ledger.snapshot(), "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes()},
            "journal": {
                "path": str(self.journal.path),
                **self.journal.counts(),
                "awaiting_puback": self.link.awaiting_puback,
                "duplicates": self.intake.duplicates,
                "replayed": dict(self.replayed),
                "full": self.journal.full_since is not None,
            },
            "models": [
                {
                    "name": m.name,
                    "branch": m.branch,
                    "backend": m.backend,
                    "memory_bytes": m.memory_bytes,
                    "load_ms": round(m.load_ms, 1),
                    "loaded": m.obj is not None,
                    "loads": m.loads,
                    "keep_alive_s": None if m.keep_alive_s == float("inf") else m.keep_alive_s,
                }
                for m in self.manager.models()
            ],
            "branches": branches,
            "jobs": self.stats.snapshot(),
        }
