"""The `ocr` task: read the text on a label image."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from edge.backends import BackendOptions
from edge.config.vision import OCRModelConfig
from edge.memory import MemoryUse
from edge.protocol.errors import JobError
from edge.protocol.jobs import OCRJob
from edge.scheduler.models import ModelManager
from edge.scheduler.queue import BatchPolicy
from edge.scheduler.work import WorkItem
from edge.tasks.base import Output
from edge.tasks.media import MediaLoader
from edge.timing import StageClock
from edge.vision import ocr as ocr_bounds
from edge.vision.ocr import OCRPipeline, OCRSettings

logger = logging.getLogger(__name__)

OCR_MODEL = "pp-ocrv6-small"
# Where a box keeps what it measured of the OCR models' working memory (in engine_dir),
# one file per set of inputs (ocr-working-<key>.json): measuring takes several seconds
# of the largest work, so it runs once per box and configuration, and again whenever
# anything it depends on changes.
WORKING_PROFILE = "ocr-working-{key}.json"


class OCRTask:
    """One image at a time: an OCR job reserves the largest decoded image the limits
    allow, loads the models back first if they were evicted, and reads the lines."""

    name = "ocr"
    policy = BatchPolicy(max_batch=1, max_delay_s=0.0)

    def __init__(self, manager: ModelManager, media: MediaLoader, working_bytes: int) -> None:
        self._manager = manager
        self._media = media
        # The most one image's OCR work takes beyond the decoded image, measured at the
        # first load: every stage is bounded (see edge.vision.ocr), so this holds for any
        # image the limits let through, whatever its shape.
        self.working_bytes = working_bytes

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
        # The image, and the larger of what decoding it and reading it take beyond it
        # (one after the other).
        media = self._media
        need = self._manager.counted(
            MemoryUse(host=media.max_decoded_bytes + max(media.decode_extra_bytes, self.working_bytes))
        )
        res = self._manager.reserve(item.job.id, "ocr", need, {OCR_MODEL}, OCR_MODEL)
        try:
            clock = StageClock()
            with clock.stage("decode"):
                img = self._media.load(job.image)
            found = self.read_text(img, clock)
            return {**found, "image": {"width": int(img.shape[1]), "height": int(img.shape[0])}}
        finally:
            item.stages.update(clock.ms)
            self._manager.release(res, {OCR_MODEL})

    def read_text(self, img: np.ndarray, clock: StageClock | None = None) -> dict[str, Any]:
        """The lines on a BGR image (an inspect job's labels too); its stages to `clock`."""
        ocr: OCRPipeline = self._manager.get(OCR_MODEL)  # loaded again if it was evicted
        lines = ocr(img, clock)
        return {"lines": [line.to_dict() for line in lines], "text": "\n".join(line.text for line in lines)}


def _working_key(cfg: OCRModelConfig, settings: OCRSettings) -> dict[str, Any]:
    """What the measured working memory depends on: the model files, the settings and
    backend, the bounds each stage keeps to, and the runtimes' versions."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    files = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in OCRPipeline.model_files(settings)}
    names = ("MAX_SIDE", "LINE_BATCH", "REC_MAX_RATIO", "REC_BATCH_RATIO", "WORKING_MEASURE_VERSION")
    bounds = {k: getattr(ocr_bounds, k) for k in names}
    runtimes = {d: version(d) for d in ("onnxruntime", "onnxruntime-gpu", "opencv-python-headless", "numpy")}
    return {
        "files": files,
        "settings": [settings.det_limit_side_len, settings.use_angle_cls],
        "threads": cfg.threads,
        "backend": cfg.backend.model_dump(mode="json"),
        "device": cfg.device,
        "bounds": bounds,
        "runtimes": runtimes,
    }


def _read_working(path: Path, key: dict[str, Any]) -> int | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or not isinstance(doc.get("working_bytes"), int):
        return None
    return int(doc["working_bytes"])


def _write_working(path: Path, key: dict[str, Any], working: int) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "working_bytes": working}, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:  # measured again at the next start: slower, never wrong
        logger.warning("cannot keep the OCR working-memory profile: %s", err.strerror or err)


def start_ocr(
    cfg: OCRModelConfig, manager: ModelManager, media: MediaLoader, profile_dir: Path | None = None
) -> OCRTask:
    """Load the OCR models (measured into the ledger) and return the task. The most
    working memory one image can take is measured at the first load on this box, kept in
    profile_dir, and reserved by every job."""
    settings = OCRSettings(
        det_limit_side_len=cfg.det_limit_side_len, use_angle_cls=cfg.use_angle_cls, text_score=cfg.text_score
    )
    opts = BackendOptions(threads=cfg.threads, config=cfg.backend, engine_dir=profile_dir)
    keep = float("inf") if cfg.keep_alive_s is None else cfg.keep_alive_s
    backend = cfg.backend.type
    key = _working_key(cfg, settings)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    profile = profile_dir / WORKING_PROFILE.format(key=digest) if profile_dir is not None else None
    known = _read_working(profile, key) if profile is not None else None
    measured: list[int] = [] if known is None else [known]

    def load() -> OCRPipeline:
        # Measured once, at the first load (alone, at start): a reload during serving
        # would measure the other branch's work too.
        pipeline = OCRPipeline.load(settings, backend, opts, measure_working=not measured)
        if not measured:
            measured.append(pipeline.working_bytes)
            if profile is not None:
                _write_working(profile, key, pipeline.working_bytes)
        return pipeline

    floor = sum(f.stat().st_size for f in OCRPipeline.model_files(settings))
    manager.register(OCR_MODEL, "vision", backend, load, keep, cfg.device, host_floor_bytes=floor)
    manager.load(OCR_MODEL)
    manager.set_working(OCR_MODEL, measured[0])
    logger.info(
        "OCR working memory per image: %.1f MiB at most (%s)",
        measured[0] / 2**20,
        "measured now" if known is None else "measured at an earlier start",
    )
    return OCRTask(manager, media, measured[0])
