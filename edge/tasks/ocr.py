"""The `ocr` task: read the text on a label image."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from edge.backends import BackendOptions
from edge.config.schema import OCRModelConfig
from edge.memory import MemoryUse
from edge.protocol.errors import JobError
from edge.protocol.jobs import OCRJob
from edge.scheduler.models import ModelManager
from edge.scheduler.queue import BatchPolicy
from edge.scheduler.work import WorkItem
from edge.tasks.base import Output
from edge.tasks.media import MediaLoader
from edge.vision.ocr import OCRPipeline, OCRSettings

logger = logging.getLogger(__name__)

OCR_MODEL = "pp-ocrv6-small"


class OCRTask:
    """One image at a time: an OCR job reserves the largest decoded image the limits
    allow, loads the models back first if they were evicted, and reads the lines."""

    name = "ocr"
    policy = BatchPolicy(max_batch=1, max_delay_s=0.0)

    def __init__(self, manager: ModelManager, media: MediaLoader) -> None:
        self._manager = manager
        self._media = media

    def run(self, items: list[WorkItem]) -> list[Output | JobError]:
        out: list[Output | JobError] = []
        for item in items:
            try:
                out.append(self._one(item))
            except JobError as err:
                out.append(err)
        return out

    def _one(self, item: WorkItem) -> Output:
        job = item.job.request
        assert isinstance(job, OCRJob)
        self._manager.get(OCR_MODEL)  # loaded again if it was evicted
        need = self._manager.counted(MemoryUse(host=self._media.max_decoded_bytes))
        res = self._manager.reserve(item.job.id, "ocr", need, {OCR_MODEL}, OCR_MODEL)
        try:
            img = self._media.load(job.image)
            return {**self.read_text(img), "image": {"width": int(img.shape[1]), "height": int(img.shape[0])}}
        finally:
            self._manager.release(res, {OCR_MODEL})

    def read_text(self, img: np.ndarray) -> dict[str, Any]:
        """The lines on a BGR image (an inspect job's labels too)."""
        ocr: OCRPipeline = self._manager.get(OCR_MODEL)  # loaded again if it was evicted
        lines = ocr(img)
        return {"lines": [line.to_dict() for line in lines], "text": "\n".join(line.text for line in lines)}


def start_ocr(cfg: OCRModelConfig, manager: ModelManager, media: MediaLoader) -> OCRTask:
    """Load the OCR models (measured into the ledger) and return the task."""
    settings = OCRSettings(
        det_limit_side_len=cfg.det_limit_side_len, use_angle_cls=cfg.use_angle_cls, text_score=cfg.text_score
    )
    opts = BackendOptions(threads=cfg.threads, config=cfg.backend)
    keep = float("inf") if cfg.keep_alive_s is None else cfg.keep_alive_s
    backend = cfg.backend.type
    load = lambda: OCRPipeline.load(settings, backend, opts)  # noqa: E731
    floor = sum(f.stat().st_size for f in OCRPipeline.model_files(settings))
    manager.register(OCR_MODEL, "vision", backend, load, keep, cfg.device, host_floor_bytes=floor)
    manager.load(OCR_MODEL)
    return OCRTask(manager, media)
