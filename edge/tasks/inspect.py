"""The `inspect` task: batches of part images through the distilled student, and each
part's label read as well when the job asks (`ocr: true`)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edge.backends import BackendOptions
from edge.config.vision import InspectModelConfig
from edge.memory import MemoryUse
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.images import Decoded
from edge.protocol.jobs import InspectJob
from edge.scheduler.ledger import Reservation
from edge.scheduler.models import ModelManager
from edge.scheduler.queue import BatchPolicy
from edge.scheduler.work import WorkItem
from edge.tasks.base import Output
from edge.tasks.media import MediaLoader
from edge.tasks.ocr import OCR_MODEL, OCRTask
from edge.timing import StageClock
from edge.vision.inspect import InspectPipeline
from edge.vision.student import weights_bytes

logger = logging.getLogger(__name__)

INSPECT_MODEL = "inspect-vit-student"


def _wants_ocr(item: WorkItem) -> bool:
    return isinstance(item.job.request, InspectJob) and item.job.request.ocr


class InspectTask:
    """Reserve the batch's buffers, decode every image (a bad one fails its own job), run
    the student once on the good ones, then OCR the jobs that asked for it. A batch the
    budget cannot hold whole, even after evicting idle models, runs in the largest parts
    that fit, one after another; only jobs that cannot fit even one at a time are
    answered over_budget."""

    name = "inspect"

    def __init__(
        self,
        manager: ModelManager,
        media: MediaLoader,
        ocr: OCRTask | None,
        policy: BatchPolicy,
        image_size: int,
        decode_threads: int = 1,
    ) -> None:
        self._manager = manager
        # A batch's images decode side by side: one at a time they cost more than the
        # student's whole forward pass on a GPU.
        self._decoders = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode") if decode_threads > 1 else None
        self._decode_threads = max(1, decode_threads)
        self._media = media
        self._ocr = ocr
        self.policy = policy
        self.image_size = image_size
        self.split_batches = 0  # batches run in parts because the budget held no more

    def run(self, items: list[WorkItem]) -> list[Output | JobError]:
        needs = {INSPECT_MODEL} | ({OCR_MODEL} if any(_wants_ocr(it) for it in items) and self._ocr else set())
        out: list[Output | JobError] = []
        start = 0
        while start < len(items):
            rest = items[start:]
            try:
                # Models first (loaded again if evicted, never evicting each other), then
                # the buffers: a model a reservation names cannot be evicted while the
                # batch runs.
                pipeline: InspectPipeline = self._manager.get(INSPECT_MODEL, keep=needs)
                if OCR_MODEL in needs:
                    self._manager.get(OCR_MODEL, keep=needs)
                res, count = self._reserve_batch(rest, needs, pipeline)
            except JobError as err:
                return out + [err for _ in rest]
            if count < len(rest):
                self.split_batches += 1
                logger.debug("batch of %d runs as %d now, the rest after: the budget holds no more", len(rest), count)
            try:
                out += self._inspect_reserved(rest[:count], pipeline)
            finally:
                self._manager.release(res, needs)
            start += count
        return out

    def batch_need(self, count: int, pipeline: InspectPipeline, ocr: bool = False) -> int:
        """What a batch of `count` reserves: every image decoded at the largest size the
        limits allow, the decoders' own buffers, the float input tensor where it is built
        on the host, on a GPU the device working memory measured at warm-up for that
        batch size, and where a job reads its label, the OCR working memory of one image
        (labels are read one at a time)."""
        host = count * self._media.max_decoded_bytes
        # Decoding takes a second buffer of the image's size while it runs, on each
        # decoding thread at once.
        host += min(count, self._decode_threads) * self._media.decode_extra_bytes
        if pipeline.host_preprocessing:
            host += pipeline.batch_bytes(count)
        if ocr and self._ocr is not None:
            host += self._ocr.working_bytes
        return self._manager.counted(MemoryUse(host=host, device=pipeline.device_bytes_for(count)))

    def _reserve_batch(
        self, items: list[WorkItem], needs: set[str], pipeline: InspectPipeline
    ) -> tuple[Reservation, int]:
        """A reservation for all of `items`, or for as many as fit once idle models are
        evicted; (reservation, how many it covers)."""
        owner = items[0].job.id

        def need(n: int) -> int:
            return self.batch_need(n, pipeline, ocr=any(_wants_ocr(it) for it in items[:n]))

        try:
            return self._manager.reserve(owner, "inspect", need(len(items)), needs, INSPECT_MODEL), len(items)
        except JobError:
            if len(items) == 1:
                raise
        # make_room has evicted what it could; take the largest part that fits now.
        free = self._manager.ledger.free_bytes()
        count = max((n for n in range(1, len(items)) if need(n) <= free), default=1)
        return self._manager.reserve(owner, "inspect", need(count), needs, INSPECT_MODEL), count

    def _decode(self, item: WorkItem) -> Decoded | JobError:
        job = item.job.request
        assert isinstance(job, InspectJob)
        t0 = time.perf_counter()
        try:
            if job.ocr and self._ocr is None:
                raise JobError(ErrorCode.UNAVAILABLE, "OCR is not loaded on this device", "ocr")
            # A job whose label is read needs every pixel; the student sees image_size.
            return self._media.load_for(job.image, None if job.ocr else self.image_size)
        except JobError as err:
            return err
        finally:
            item.stages["decode"] = (time.perf_counter() - t0) * 1000.0

    def _inspect_reserved(self, items: list[WorkItem], pipeline: InspectPipeline) -> list[Output | JobError]:
        out: list[Output | JobError] = []
        images: list[Decoded] = []
        slots: list[int] = []
        decoded = self._decoders.map(self._decode, items) if self._decoders is not None else map(self._decode, items)
        for got in decoded:
            if isinstance(got, JobError):
                out.append(got)
            else:
                images.append(got)
                slots.append(len(out))
                out.append({})
        if images:
            # Decoded images are BGR (the OCR models' order); the student was trained on RGB.
            batch = StageClock()  # each job in the batch waited on all of it
            found_all = pipeline.run([d.pixels for d in images], bgr=True, clock=batch)
            for slot, dec, found in zip(slots, images, found_all, strict=True):
                img = dec.pixels
                item = items[slot]
                job = item.job.request
                assert isinstance(job, InspectJob)
                own = StageClock()
                own.merge(batch)
                with own.stage("postprocess"):
                    doc: dict[str, Any] = found.to_dict(heatmap=job.heatmap)
                doc["image"] = {"width": dec.width, "height": dec.height}
                doc["batch_size"] = len(images)
                try:
                    if job.ocr and self._ocr is not None:
                        doc["ocr"] = self._ocr.read_text(img, own)
                    out[slot] = doc
                except JobError as err:  # this job's OCR part failed; the others stand
                    out[slot] = err
                finally:
                    item.stages.update(own.ms)
        return out


def start_inspect(
    cfg: InspectModelConfig,
    student: Path,
    manager: ModelManager,
    media: MediaLoader,
    ocr: OCRTask | None,
    engine_dir: Path | None = None,
) -> InspectTask:
    """Load the student (measured into the ledger, warmed up at its largest batch) and
    return the task. `engine_dir` holds its TensorRT plans, for that backend."""
    opts = BackendOptions(threads=cfg.threads, max_batch=cfg.max_batch, config=cfg.backend, engine_dir=engine_dir)
    keep = float("inf") if cfg.keep_alive_s is None else cfg.keep_alive_s
    backend = cfg.backend.type
    load = lambda: InspectPipeline.load(student, backend, opts)  # noqa: E731
    floor = weights_bytes(student)
    manager.register(INSPECT_MODEL, "vision", backend, load, keep, cfg.device, host_floor_bytes=floor)
    pipeline: InspectPipeline = manager.load(INSPECT_MODEL)
    policy = BatchPolicy(cfg.max_batch, cfg.max_queue_delay_ms / 1000.0, frozenset(cfg.preferred_batch_sizes))
    return InspectTask(manager, media, ocr, policy, pipeline.image_size, cfg.decode_threads)
