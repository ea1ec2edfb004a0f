"""Geometry around the PP-OCR models: DB box extraction, ordering, cropping, CTC decoding.

The detector outputs a per-pixel text probability map (Differentiable Binarization);
boxes come from thresholding it, scoring each connected region, and growing the region
back out by the shrink ratio the model was trained with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np
import pyclipper

LINE_Y_TOLERANCE_PX = 10


@dataclass(frozen=True)
class DBParams:
    thresh: float = 0.3
    box_thresh: float = 0.5
    max_candidates: int = 1000
    unclip_ratio: float = 1.6
    min_size: int = 3
    dilate: bool = True


def _min_area_quad(points: np.ndarray) -> tuple[np.ndarray, float]:
    """The minimum-area rectangle around points, corners ordered tl, tr, br, bl."""
    rect = cv2.minAreaRect(points)
    corners = sorted(cv2.boxPoints(rect).tolist(), key=lambda p: p[0])
    left = sorted(corners[:2], key=lambda p: p[1])
    right = sorted(corners[2:], key=lambda p: p[1])
    quad = np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)
    return quad, float(min(rect[1]))


def _region_score(prob: np.ndarray, quad: np.ndarray) -> float:
    """Mean probability inside the quad (the 'fast' score: the quad, not the contour)."""
    h, w = prob.shape
    xs, ys = quad[:, 0], quad[:, 1]
    x0 = int(np.clip(np.floor(xs.min()), 0, w - 1))
    x1 = int(np.clip(np.ceil(xs.max()), 0, w - 1))
    y0 = int(np.clip(np.floor(ys.min()), 0, h - 1))
    y1 = int(np.clip(np.ceil(ys.max()), 0, h - 1))
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=np.uint8)
    shifted = (quad - np.array([x0, y0], dtype=np.float32)).astype(np.int32)
    cv2.fillPoly(mask, [shifted.reshape(-1, 2)], 1)
    return float(cv2.mean(prob[y0 : y1 + 1, x0 : x1 + 1], mask)[0])


def _polygon_area_perimeter(quad: np.ndarray) -> tuple[float, float]:
    x, y = quad[:, 0].astype(np.float64), quad[:, 1].astype(np.float64)
    area = 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))
    perimeter = float(np.sum(np.hypot(np.roll(x, -1) - x, np.roll(y, -1) - y)))
    return area, perimeter


def _unclip(quad: np.ndarray, ratio: float) -> np.ndarray:
    area, perimeter = _polygon_area_perimeter(quad)
    distance = area * ratio / perimeter
    offset = pyclipper.PyclipperOffset()
    offset.AddPath(quad.tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    grown = offset.Execute(distance)
    return np.array(grown, dtype=np.float32).reshape(-1, 1, 2)


def _order_clockwise(quad: np.ndarray) -> np.ndarray:
    by_x = quad[np.argsort(quad[:, 0]), :]
    left = by_x[:2][np.argsort(by_x[:2, 1])]
    right = by_x[2:][np.argsort(by_x[2:, 1])]
    return np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)


def db_boxes(prob_map: np.ndarray, src_hw: tuple[int, int], params: DBParams) -> tuple[list[np.ndarray], list[float]]:
    """Boxes (4x2 float32, in source pixel coordinates) and scores from a DB map [H, W]."""
    src_h, src_w = src_hw
    height, width = prob_map.shape
    bitmap: np.ndarray = (prob_map > params.thresh).astype(np.uint8)
    if params.dilate:
        bitmap = np.asarray(cv2.dilate(bitmap, np.ones((2, 2), dtype=np.uint8)))
    contours, _ = cv2.findContours(bitmap * 255, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    boxes: list[np.ndarray] = []
    scores: list[float] = []
    for contour in contours[: params.max_candidates]:
        quad, short_side = _min_area_quad(contour)
        if short_side < params.min_size:
            continue
        score = _region_score(prob_map, quad)
        if score < params.box_thresh:
            continue
        grown, short_side = _min_area_quad(_unclip(quad, params.unclip_ratio))
        if short_side < params.min_size + 2:
            continue
        grown[:, 0] = np.clip(np.round(grown[:, 0] / width * src_w), 0, src_w)
        grown[:, 1] = np.clip(np.round(grown[:, 1] / height * src_h), 0, src_h)
        box = _order_clockwise(grown.astype(np.int32).astype(np.float32))
        box[:, 0] = np.clip(box[:, 0], 0, src_w - 1).astype(np.int32)
        box[:, 1] = np.clip(box[:, 1], 0, src_h - 1).astype(np.int32)
        if int(np.linalg.norm(box[0] - box[1])) <= 3 or int(np.linalg.norm(box[0] - box[3])) <= 3:
            continue
        boxes.append(box)
        scores.append(score)
    return boxes, scores


def reading_order(boxes: list[np.ndarray]) -> list[int]:
    """Indices in reading order: top to bottom by line, then left to right."""
    if not boxes:
        return []
    tops = np.array([b[0, 1] for b in boxes])
    lefts = np.array([b[0, 0] for b in boxes])
    by_y = np.argsort(tops, kind="stable")
    line_ids = np.concatenate([[0], np.cumsum(np.diff(tops[by_y]) >= LINE_Y_TOLERANCE_PX)])
    within = np.lexsort((lefts[by_y], line_ids))
    return [int(i) for i in by_y[within]]


def quad_size(quad: np.ndarray) -> tuple[int, int]:
    """(width, height) of the upright rectangle a quad is warped to."""
    width = int(max(np.linalg.norm(quad[0] - quad[1]), np.linalg.norm(quad[2] - quad[3])))
    height = int(max(np.linalg.norm(quad[0] - quad[3]), np.linalg.norm(quad[1] - quad[2])))
    return width, height


def line_ratio(quad: np.ndarray) -> float:
    """Width over height of the line crop_quad makes from a quad (tall ones are turned)."""
    width, height = quad_size(quad)
    if height >= 1.5 * width:
        width, height = height, width
    return width / float(max(1, height))


def crop_quad(img: np.ndarray, quad: np.ndarray) -> np.ndarray:
    """Warp a (possibly rotated) text quad to an upright rectangle."""
    width, height = quad_size(quad)
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    matrix = cv2.getPerspectiveTransform(quad.astype(np.float32), target)
    crop = cv2.warpPerspective(img, matrix, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC)
    if crop.shape[0] >= 1.5 * crop.shape[1]:
        # Tall crops are vertical text lines; the recogniser reads horizontal ones.
        crop = np.rot90(crop)
    return crop


def normalize_line(img: np.ndarray, shape_chw: tuple[int, int, int], max_wh_ratio: float) -> np.ndarray:
    """Resize a line crop to the model height, keep its aspect, right-pad to the batch width."""
    channels, height, base_width = shape_chw
    width = int(height * max_wh_ratio) if max_wh_ratio > 0 else base_width
    ratio = img.shape[1] / float(img.shape[0])
    resized_w = min(width, math.ceil(height * ratio))
    resized = cv2.resize(img, (resized_w, height)).astype(np.float32)
    resized = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    out = np.zeros((channels, height, width), dtype=np.float32)
    out[:, :, :resized_w] = resized
    return out


def ctc_greedy_decode(probs: np.ndarray, charset: list[str]) -> list[tuple[str, float]]:
    """Collapse repeats and drop blanks (index 0); score is the mean kept-step probability."""
    best = probs.argmax(axis=2)
    best_p = probs.max(axis=2)
    out: list[tuple[str, float]] = []
    for idx, prob in zip(best, best_p, strict=True):
        keep = np.ones(len(idx), dtype=bool)
        keep[1:] = idx[1:] != idx[:-1]
        keep &= idx != 0
        chars = [charset[i] for i in idx[keep]]
        confidences = np.round(prob[keep].astype(np.float64), 5)
        score = float(np.round(confidences.mean(), 5)) if confidences.size else 0.0
        out.append(("".join(chars), score))
    return out
