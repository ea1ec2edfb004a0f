"""The OCR pipeline: detection, optional 0/180 classification, recognition.

The three PP-OCR models ship as ONNX inside the `rapidocr` wheel; they run here through
the project's backend seam, and every step around them (resizing, DB boxes, cropping,
CTC decoding) is the project's own, so the same code drives TensorRT or CUDA sessions.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

from edge.backends import BackendOptions, InferenceSession, ModelSource, get_backend
from edge.vision.ocr_postprocess import (
    DBParams,
    crop_quad,
    ctc_greedy_decode,
    db_boxes,
    normalize_line,
    reading_order,
)

logger = logging.getLogger(__name__)

DET_MODEL = "PP-OCRv6_det_small.onnx"
REC_MODEL = "PP-OCRv6_rec_small.onnx"
CLS_MODEL = "ch_ppocr_mobile_v2.0_cls_mobile.onnx"

# Whole-image bounds before detection: tiny images are scaled up to be seen at all,
# huge ones scaled down so the detector's input stays bounded.
MIN_SIDE = 30
MAX_SIDE = 2000
# Very wide strips (a single line) get black bands above and below so the detector
# sees a roughly square-ish field, as it was trained.
PAD_WIDTH_HEIGHT_RATIO = 8
PAD_MIN_HEIGHT = 30

REC_SHAPE = (3, 48, 320)
CLS_SHAPE = (3, 48, 192)
LINE_BATCH = 6
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


def _scale_to_multiple_of_32(img: np.ndarray, ratio: float) -> np.ndarray | None:
    h, w = img.shape[:2]
    new_h = int(round(int(h * ratio) / 32) * 32)
    new_w = int(round(int(w * ratio) / 32) * 32)
    if new_h <= 0 or new_w <= 0:
        return None
    return cv2.resize(img, (new_w, new_h))


def _within_bounds(img: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Scale into [MIN_SIDE, MAX_SIDE]; returns the image and the factors back to source."""
    h, w = img.shape[:2]
    ratio_h = ratio_w = 1.0
    if max(h, w) > MAX_SIDE:
        scaled = _scale_to_multiple_of_32(img, MAX_SIDE / max(h, w))
        if scaled is not None:
            img = scaled
            ratio_h, ratio_w = h / img.shape[0], w / img.shape[1]
    h2, w2 = img.shape[:2]
    if min(h2, w2) < MIN_SIDE:
        scaled = _scale_to_multiple_of_32(img, MIN_SIDE / min(h2, w2))
        if scaled is not None:
            img = scaled
            ratio_h, ratio_w = h2 / img.shape[0], w2 / img.shape[1]
    return img, ratio_h, ratio_w


def _vertical_padding(img: np.ndarray) -> tuple[np.ndarray, int]:
    h, w = img.shape[:2]
    if h > PAD_MIN_HEIGHT and w / h <= PAD_WIDTH_HEIGHT_RATIO:
        return img, 0
    target = max(int(w / PAD_WIDTH_HEIGHT_RATIO), PAD_MIN_HEIGHT) * 2
    pad = int(abs(target - h) / 2)
    return cv2.copyMakeBorder(img, pad, pad, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0)), pad


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
    ) -> OCRPipeline:
        det_file, rec_file, *cls_file = cls.model_files(settings, model_dir)
        engine = get_backend(backend)
        opts = options or BackendOptions()
        det = engine.load(ModelSource("OCR detection", onnx=det_file), opts)
        rec = engine.load(ModelSource("OCR recognition", onnx=rec_file), opts)
        angle = engine.load(ModelSource("OCR angle", onnx=cls_file[0]), opts) if cls_file else None
        pipeline = cls(det, rec, angle, settings)
        pipeline.warm_up()
        return pipeline

    def warm_up(self) -> None:
        """Run every model once on a synthetic line, so memory measured after loading
        includes the backends' workspaces and the first job is not the slow one."""
        img = np.full((96, 320, 3), 255, dtype=np.uint8)
        cv2.putText(img, "SN-0000", (10, 60), cv2.FONT_HERSHEY_SIMPLEX, 1.5, (0, 0, 0), 3)
        self(img)

    def __call__(self, img_bgr: np.ndarray) -> list[OCRLine]:
        src_h, src_w = img_bgr.shape[:2]
        img, ratio_h, ratio_w = _within_bounds(img_bgr)
        img, pad_top = _vertical_padding(img)
        boxes = self._detect(img)
        if not boxes:
            return []
        crops = [crop_quad(img, box) for box in boxes]
        if self._cls is not None:
            crops = self._orient(crops)
        texts = self._recognise(crops)
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

    def _detect(self, img: np.ndarray) -> list[np.ndarray]:
        h, w = img.shape[:2]
        limit = self._settings.det_limit_side_len
        ratio = limit / max(h, w) if max(h, w) > limit else 1.0
        resized = _scale_to_multiple_of_32(img, ratio)
        if resized is None:
            return []
        tensor = ((resized.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None]
        (prob,) = self._det.run({self._det.input_names[0]: tensor.astype(np.float32)})[:1]
        boxes, _scores = db_boxes(prob[0, 0], (h, w), self._settings.db)
        return [boxes[i] for i in reading_order(boxes)]

    def _orient(self, crops: list[np.ndarray]) -> list[np.ndarray]:
        assert self._cls is not None
        order = np.argsort([c.shape[1] / float(c.shape[0]) for c in crops])
        out = list(crops)
        for start in range(0, len(crops), LINE_BATCH):
            idx = order[start : start + LINE_BATCH]
            batch = np.stack([normalize_line(crops[i], CLS_SHAPE, 0.0) for i in idx])
            probs = self._cls.run({self._cls.input_names[0]: batch})[0]
            for i, p in zip(idx, probs, strict=True):
                label = int(p.argmax())
                if label == 1 and p[label] > CLS_FLIP_THRESHOLD:
                    out[i] = cv2.rotate(crops[i], cv2.ROTATE_180)
        return out

    def _recognise(self, crops: list[np.ndarray]) -> list[tuple[str, float]]:
        # Similar widths share a batch so little of each batch is padding.
        ratios = [c.shape[1] / float(c.shape[0]) for c in crops]
        order = np.argsort(np.array(ratios))
        results: list[tuple[str, float]] = [("", 0.0)] * len(crops)
        _, height, width = REC_SHAPE
        for start in range(0, len(crops), LINE_BATCH):
            idx = order[start : start + LINE_BATCH]
            max_ratio = max([width / height, *(ratios[i] for i in idx)])
            batch = np.stack([normalize_line(crops[i], REC_SHAPE, max_ratio) for i in idx])
            probs = self._rec.run({self._rec.input_names[0]: batch})[0]
            for i, decoded in zip(idx, ctc_greedy_decode(probs, self._charset), strict=True):
                results[int(i)] = decoded
        return results
