"""The OCR pipeline: detection, optional 0/180 classification, recognition.

The three PP-OCR models ship as ONNX inside the `rapidocr` wheel; they run here through
the project's backend seam, and every step around them (resizing, DB boxes, cropping,
CTC decoding) is the project's own, so the same code drives TensorRT or CUDA sessions.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import cv2
import numpy as np

from edge.backends import BackendOptions, InferenceSession, ModelSource, get_backend
from edge.memory import host_working_bytes
from edge.timing import StageClock
from edge.vision.ocr_postprocess import (
    DBParams,
    crop_quad,
    ctc_greedy_decode,
    db_boxes,
    line_ratio,
    normalize_line,
    reading_order,
)

logger = logging.getLogger(__name__)

DET_MODEL = "PP-OCRv6_det_small.onnx"
REC_MODEL = "PP-OCRv6_rec_small.onnx"
CLS_MODEL = "ch_ppocr_mobile_v2.0_cls_mobile.onnx"

# Whole-image bounds before detection: tiny images are scaled up to be seen at all,
# huge ones scaled down, and no side ever passes MAX_SIDE, padding included: whatever
# the image's shape, each stage's working memory has a bound, measured at warm-up.
MIN_SIDE = 30
MAX_SIDE = 2000
# Very wide strips (a single line) get black bands above and below so the detector
# sees a roughly square-ish field, as it was trained.
PAD_WIDTH_HEIGHT_RATIO = 8
PAD_MIN_HEIGHT = 30

REC_SHAPE = (3, 48, 320)
CLS_SHAPE = (3, 48, 192)
LINE_BATCH = 6
# The widest line the recogniser is fed, as width over height: a longer one is squeezed
# to it (a line across the whole bounded image at its smallest height).
REC_MAX_RATIO = 64
# A recognition batch's lines together, in the same units: wide lines go in smaller
# batches, so a batch's working memory has a bound (measured for every batch size).
REC_BATCH_RATIO = LINE_BATCH * 16
# Which way _largest_work measures: a box's kept measurement is redone when it changes.
WORKING_MEASURE_VERSION = 3
CLS_FLIP_THRESHOLD = 0.9


class OCRModelsNotFound(FileNotFoundError):
    pass


def bundled_model_dir() -> Path:
    """Where the rapidocr wheel keeps its ONNX models, found without importing it."""
    spec = importlib.util.find_spec("rapidocr")
    if spec is None or not spec.submodule_search_locations:
        raise OCRModelsNotFound("the rapidocr package (which carries the OCR models) is not installed")
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    for name in (DET_MODEL, REC_MODEL, CLS_MODEL):
        if not (models / name).is_file():
            raise OCRModelsNotFound(f"OCR model {name} missing from {models}")
    return models


def _plan(model: Path) -> dict[str, str]:
    """What the TensorRT plan built from an OCR model serves (engines/trt_build.py)."""
    return {"task": "ocr", "file": model.name}


@dataclass(frozen=True)
class OCRLine:
    text: str
    score: float
    box: list[list[int]]

    def to_dict(self) -> dict[str, object]:
        return {"text": self.text, "score": round(self.score, 5), "box": self.box}


@dataclass(frozen=True)
class OCRSettings:
    det_limit_side_len: int = 960
    use_angle_cls: bool = True
    text_score: float = 0.5
    db: DBParams = field(default_factory=DBParams)


def _scale_to_multiple_of_32(img: np.ndarray, ratio: float) -> np.ndarray:
    """Scaled by `ratio`, each side rounded to a multiple of 32 and at least 32."""
    h, w = img.shape[:2]
    new_h = max(32, int(round(int(h * ratio) / 32) * 32))
    new_w = max(32, int(round(int(w * ratio) / 32) * 32))
    return cv2.resize(img, (new_w, new_h))


def _within_bounds(img: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Scale into [MIN_SIDE, MAX_SIDE]; returns the image and the factors back to source.
    An image too elongated for both bounds keeps the long side within MAX_SIDE and its
    short side as large as that allows."""
    h, w = img.shape[:2]
    if max(h, w) > MAX_SIDE:
        img = _scale_to_multiple_of_32(img, MAX_SIDE / max(h, w))
    h2, w2 = img.shape[:2]
    if min(h2, w2) < MIN_SIDE:
        # Up only as far as the long side stays within bounds (32-multiples round down).
        ratio = min(MIN_SIDE / min(h2, w2), (MAX_SIDE - 16) / max(h2, w2))
        if ratio > 1.0:
            img = _scale_to_multiple_of_32(img, ratio)
    return img, h / img.shape[0], w / img.shape[1]


def _vertical_padding(img: np.ndarray) -> tuple[np.ndarray, int]:
    h, w = img.shape[:2]
    if h > PAD_MIN_HEIGHT and w / h <= PAD_WIDTH_HEIGHT_RATIO:
        return img, 0
    target = min(max(int(w / PAD_WIDTH_HEIGHT_RATIO), PAD_MIN_HEIGHT) * 2, MAX_SIDE)
    pad = int(max(0, target - h) / 2)
    return cv2.copyMakeBorder(img, pad, pad, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0)), pad


def _batch_ratio(n: int) -> float:
    """The widest a batch of n lines may be fed (width over height)."""
    return min(REC_MAX_RATIO, REC_BATCH_RATIO / n)


def _line_batches(ratios: np.ndarray) -> list[list[int]]:
    """Lines in order of width, cut into batches of at most LINE_BATCH whose widest line
    stays within what a batch of that size may be fed."""
    base = REC_SHAPE[2] / REC_SHAPE[1]
    batches: list[list[int]] = []
    current: list[int] = []
    for i in np.argsort(ratios):
        widest = max(base, min(float(ratios[i]), REC_MAX_RATIO))
        if current and (len(current) == LINE_BATCH or widest > _batch_ratio(len(current) + 1)):
            batches.append(current)
            current = []
        current.append(int(i))
    return [*batches, current] if current else batches


class OCRPipeline:
    """Thread-compatible, not thread-safe: one worker thread drives one pipeline."""

    def __init__(
        self,
        det: InferenceSession,
        rec: InferenceSession,
        cls: InferenceSession | None,
        settings: OCRSettings,
    ) -> None:
        self._det = det
        self._rec = rec
        self._cls = cls if settings.use_angle_cls else None
        self._settings = settings
        chars = rec.metadata().get("character")
        if not chars:
            raise ValueError("recognition model carries no character list")
        # CTC index 0 is the blank; the models also emit a trailing space class.
        self._charset = ["<blank>", *chars.splitlines(), " "]
        self.working_bytes = 0  # measured at warm-up: the most one image's work takes

    @property
    def device_floor_bytes(self) -> int:
        """What the models' runtimes say they hold on the device (0 where they say nothing)."""
        return sum(int(getattr(s, "device_bytes", 0)) for s in (self._det, self._rec, self._cls) if s is not None)

    @staticmethod
    def model_files(settings: OCRSettings, model_dir: Path | None = None) -> list[Path]:
        """The model files a pipeline with these settings loads: detection, recognition
        and, with the angle classifier on, angle."""
        models = model_dir or bundled_model_dir()
        names = [DET_MODEL, REC_MODEL] + ([CLS_MODEL] if settings.use_angle_cls else [])
        return [models / name for name in names]

    @classmethod
    def load(
        cls,
        settings: OCRSettings,
        backend: str = "onnxruntime",
        options: BackendOptions | None = None,
        model_dir: Path | None = None,
        measure_working: bool = True,
    ) -> OCRPipeline:
        det_file, rec_file, *cls_file = cls.model_files(settings, model_dir)
        engine = get_backend(backend)
        opts = options or BackendOptions()
        det = engine.load(ModelSource("OCR detection", onnx=det_file, plan=_plan(det_file)), opts)
        rec = engine.load(ModelSource("OCR recognition", onnx=rec_file, plan=_plan(rec_file)), opts)
        angle = (
            engine.load(ModelSource("OCR angle", onnx=cls_file[0], plan=_plan(cls_file[0])), opts) if cls_file else None
        )
        pipeline = cls(det, rec, angle, settings)
        pipeline.warm_up(measure_working)
        return pipeline

    def warm_up(self, measure: bool = True) -> None:
        """Run every model once on a synthetic line, so memory measured after loading
        includes the backends' workspaces and the first job is not the slow one; then,
        if asked, measure the most working memory one image can take (working_bytes)."""
        img = np.full((96, 320, 3), 255, dtype=np.uint8)
        cv2.putText(img, "SN-0000", (10, 60), cv2.FONT_HERSHEY_SIMPLEX, 1.5, (0, 0, 0), 3)
        self(img)
        if measure:
            self.working_bytes = self._largest_work()

    def _largest_work(self) -> int:
        """Bytes the largest work an image can cause takes beyond the decoded image:
        detection on the largest bounded image (measured) with that image and its padded
        copy, or after it (its buffers gone), that image and a batch's crops (each at
        most the image) held while the recognition batch of each size runs at the widest
        it may be (measured)."""
        img, _, _ = _within_bounds(np.full((MAX_SIDE, MAX_SIDE, 3), 255, dtype=np.uint8))
        img, _ = _vertical_padding(img)
        # Each shape runs once before it is measured: a runtime plans its memory at the
        # first run of a shape and holds more on the runs after (onnxruntime's memory
        # pattern), which is what jobs see.
        self._detect(img, StageClock())
        detect = host_working_bytes(partial(self._detect, img, StageClock()))
        crops = LINE_BATCH * MAX_SIDE * MAX_SIDE * 3
        height = REC_SHAPE[1]
        read = 0
        for n in range(1, LINE_BATCH + 1):
            line = np.full((height, int(height * _batch_ratio(n)), 3), 255, dtype=np.uint8)
            self._read_batch([line] * n, StageClock())
            read = max(read, host_working_bytes(partial(self._read_batch, [line] * n, StageClock())))
        # While detection runs, the bounded image and its padded copy may both be held
        # (each at most the largest bounded image); while lines are read, that image and
        # a batch's crops.
        canvas = MAX_SIDE * MAX_SIDE * 3
        return max(2 * canvas + detect, canvas + crops + read)

    def __call__(self, img_bgr: np.ndarray, clock: StageClock | None = None) -> list[OCRLine]:
        """The lines on a BGR image; where its time goes (preprocess: bounds, resizing,
        crops and their normalisation; model: the detector, orientation and recognizer
        sessions; postprocess: boxes, text decoding, lines) is added to `clock`."""
        clock = clock or StageClock()
        src_h, src_w = img_bgr.shape[:2]
        with clock.stage("preprocess"):
            img, ratio_h, ratio_w = _within_bounds(img_bgr)
            img, pad_top = _vertical_padding(img)
        boxes = self._detect(img, clock)
        if not boxes:
            return []
        texts = self._read_lines(img, boxes, clock)
        with clock.stage("postprocess"):
            return self._lines(boxes, texts, pad_top, (ratio_h, ratio_w), (src_h, src_w))

    def _lines(
        self,
        boxes: list[np.ndarray],
        texts: list[tuple[str, float]],
        pad_top: int,
        ratios: tuple[float, float],
        size: tuple[int, int],
    ) -> list[OCRLine]:
        (ratio_h, ratio_w), (src_h, src_w) = ratios, size
        lines: list[OCRLine] = []
        for box, (text, score) in zip(boxes, texts, strict=True):
            if not text.strip() or score < self._settings.text_score:
                continue
            src = box.copy()
            src[:, 1] -= pad_top
            src[:, 0] *= ratio_w
            src[:, 1] *= ratio_h
            src = np.maximum(src, 0)
            src[:, 0] = np.minimum(src[:, 0], src_w)
            src[:, 1] = np.minimum(src[:, 1], src_h)
            lines.append(OCRLine(text=text, score=score, box=src.astype(int).tolist()))
        return lines

    def _detect(self, img: np.ndarray, clock: StageClock) -> list[np.ndarray]:
        h, w = img.shape[:2]
        limit = self._settings.det_limit_side_len
        ratio = limit / max(h, w) if max(h, w) > limit else 1.0
        with clock.stage("preprocess"):
            resized = _scale_to_multiple_of_32(img, ratio)
            tensor = ((resized.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None]
        (prob,) = self._det.run_staged({self._det.input_names[0]: tensor.astype(np.float32)}, clock)[:1]
        with clock.stage("postprocess"):
            boxes, _scores = db_boxes(prob[0, 0], (h, w), self._settings.db)
            return [boxes[i] for i in reading_order(boxes)]

    def _read_lines(self, img: np.ndarray, boxes: list[np.ndarray], clock: StageClock) -> list[tuple[str, float]]:
        """Crop, orient and recognise the lines a batch at a time, similar widths together
        (little of each batch is padding): at most one batch of crops is held at once."""
        ratios = np.array([line_ratio(box) for box in boxes])
        results: list[tuple[str, float]] = [("", 0.0)] * len(boxes)
        for idx in _line_batches(ratios):
            with clock.stage("preprocess"):
                crops = [crop_quad(img, boxes[i]) for i in idx]
            for i, decoded in zip(idx, self._read_batch(crops, clock), strict=True):
                results[i] = decoded
        return results

    def _read_batch(self, crops: list[np.ndarray], clock: StageClock) -> list[tuple[str, float]]:
        if self._cls is not None:
            with clock.stage("preprocess"):
                batch = np.stack([normalize_line(crop, CLS_SHAPE, 0.0) for crop in crops])
            probs = self._cls.run_staged({self._cls.input_names[0]: batch}, clock)[0]
            for i, p in enumerate(probs):
                label = int(p.argmax())
                if label == 1 and p[label] > CLS_FLIP_THRESHOLD:
                    crops[i] = cv2.rotate(crops[i], cv2.ROTATE_180)
        _, height, width = REC_SHAPE
        with clock.stage("preprocess"):
            widest = max([width / height, *(crop.shape[1] / float(crop.shape[0]) for crop in crops)])
            batch = np.stack([normalize_line(crop, REC_SHAPE, min(widest, REC_MAX_RATIO)) for crop in crops])
        probs = self._rec.run_staged({self._rec.input_names[0]: batch}, clock)[0]
        with clock.stage("postprocess"):
            return ctc_greedy_decode(probs, self._charset)
