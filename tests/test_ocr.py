"""Our OCR pipeline against rapidocr's own, on the committed sample labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge.protocol.images import ImageLimits, decode_image
from edge.vision.ocr import OCRPipeline, OCRSettings
from edge.vision.ocr_postprocess import ctc_greedy_decode, reading_order
from tests.conftest import LABELS, SAMPLES

LIMITS = ImageLimits(10**8, 10**8)


@pytest.fixture(scope="module")
def ours() -> OCRPipeline:
    return OCRPipeline.load(OCRSettings(det_limit_side_len=960, use_angle_cls=True))


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    from rapidocr import RapidOCR

    return RapidOCR(params={"Det.limit_type": "max", "Det.limit_side_len": 960, "Global.log_level": "error"})


def load(name: str) -> np.ndarray:
    return decode_image((SAMPLES / "labels" / name).read_bytes(), LIMITS, "image")


@pytest.mark.parametrize("label", LABELS, ids=[lab["name"] for lab in LABELS])
def test_reads_every_sample_label(ours: OCRPipeline, label: dict[str, object]) -> None:
    lines = ours(load(str(label["name"])))
    assert [line.text for line in lines] == label["lines"]


@pytest.mark.parametrize("label", LABELS, ids=[lab["name"] for lab in LABELS])
def test_matches_rapidocr_pipeline(ours: OCRPipeline, reference, label: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    img = load(str(label["name"]))
    mine = ours(img)
    ref = reference(img)
    assert [line.text for line in mine] == list(ref.txts)
    np.testing.assert_allclose([line.score for line in mine], ref.scores, atol=1e-4)
    np.testing.assert_allclose(np.array([line.box for line in mine]), ref.boxes, atol=1.0)


def test_matches_rapidocr_on_rotated_and_scaled_inputs(ours: OCRPipeline, reference) -> None:  # type: ignore[no-untyped-def]
    import cv2

    img = load("label_03.png")
    variants = [
        cv2.rotate(img, cv2.ROTATE_180),  # exercises the angle classifier
        cv2.resize(img, None, fx=3.0, fy=3.0),  # exercises the detector size limit
        cv2.resize(img, None, fx=0.25, fy=0.25),  # tiny input, scaled up
        img[60:110, :],  # one wide strip: vertical padding path
    ]
    for variant in variants:
        mine = ours(variant)
        ref = reference(variant)
        assert [line.text for line in mine] == list(ref.txts or ())


def test_blank_image_has_no_lines(ours: OCRPipeline) -> None:
    assert ours(np.full((200, 300, 3), 255, dtype=np.uint8)) == []


def test_ctc_decode_collapses_repeats_and_blanks() -> None:
    charset = ["<blank>", "A", "B", " "]
    steps = [1, 1, 0, 1, 2, 2, 0, 0, 3]
    probs = np.full((1, len(steps), 4), 0.01, dtype=np.float32)
    for t, c in enumerate(steps):
        probs[0, t, c] = 0.9
    ((text, score),) = ctc_greedy_decode(probs, charset)
    assert text == "AAB "
    assert score == pytest.approx(0.9)


def test_reading_order_lines_then_left_to_right() -> None:
    def box(x: float, y: float) -> np.ndarray:
        return np.array([[x, y], [x + 10, y], [x + 10, y + 5], [x, y + 5]], dtype=np.float32)

    boxes = [box(50, 102), box(0, 100), box(0, 50), box(80, 48)]
    assert reading_order(boxes) == [2, 3, 1, 0]


def test_models_come_from_the_wheel() -> None:
    from edge.vision.ocr import DET_MODEL, bundled_model_dir

    assert (bundled_model_dir() / DET_MODEL).is_file()
    assert Path(bundled_model_dir()).parts[-2] == "rapidocr"


SHAPES = [(1, 1), (4, 100_000), (100_000, 4), (60, 400_000), (31, 2001), (5000, 5000), (29, 29)]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_stage_is_bounded_whatever_the_shape(shape: tuple[int, int]) -> None:
    from edge.vision.ocr import MAX_SIDE, _vertical_padding, _within_bounds

    img, _, _ = _within_bounds(np.zeros((*shape, 3), np.uint8))
    assert max(img.shape[:2]) <= MAX_SIDE
    padded, _ = _vertical_padding(img)
    assert max(padded.shape[:2]) <= MAX_SIDE


def test_wide_lines_go_in_smaller_batches() -> None:
    from edge.vision.ocr import LINE_BATCH, REC_MAX_RATIO, _batch_ratio, _line_batches

    ratios = np.array([3.0] * 7 + [15.0, 40.0, 40.0, 30.0, 200.0])
    batches = _line_batches(ratios)
    assert sorted(i for b in batches for i in b) == list(range(len(ratios)))
    assert [len(b) for b in batches] == [LINE_BATCH, 3, 2, 1]  # narrow ones six together, as before
    for batch in batches:
        assert len(batch) <= LINE_BATCH
        assert min(max(ratios[batch]), REC_MAX_RATIO) <= _batch_ratio(len(batch))
