"""Synthetic factory images for the inspection model: parts with printed labels, with or
without a defect, reproducible from a seed.

Each image is a 224x224 view of a part surface (brushed metal or moulded plastic, with
its own colour, grain and lighting) carrying a printed label with a serial number. The
classes are a clean part and four defects drawn on top: a scratch (a thin bright or
dark stroke), a dent (a shaded crater), a stain (a translucent blot) and missing print
(a label whose text is partly not printed). Every image comes with the defect's pixel
mask, which trains the per-patch heat map. Image i of a split is generated from
(seed, split, i) alone, so splits never overlap and any one image can be regenerated.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import cv2
import numpy as np

logger = logging.getLogger(__name__)

CLASSES = ("clean", "scratch", "dent", "stain", "missing_print")
SPLITS = {"train": 0, "val": 1, "test": 2}
SIZE = 224


@dataclass(frozen=True)
class Sample:
    image: np.ndarray  # uint8 [H, W, 3] RGB
    label: int  # index into CLASSES
    mask: np.ndarray  # bool [H, W]: pixels that show the defect
    serial: str  # the text printed on the label


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS[split], index])


def _surface(rng: np.random.Generator) -> np.ndarray:
    """Brushed metal (grain along one direction) or plastic (fine speckle), lit unevenly."""
    if rng.random() < 0.5:
        base = rng.uniform(110, 200) + rng.uniform(-12, 12, size=3)
        noise = rng.normal(0, 1, (SIZE, SIZE)).astype(np.float32)
        length = int(rng.integers(9, 31))
        kernel = np.zeros((length, length), np.float32)
        kernel[length // 2, :] = 1.0 / length
        rot = cv2.getRotationMatrix2D((length / 2 - 0.5, length / 2 - 0.5), float(rng.uniform(0, 180)), 1.0)
        kernel = np.asarray(cv2.warpAffine(kernel, rot, (length, length)), np.float32)
        grain = np.asarray(cv2.filter2D(noise, -1, kernel / max(float(kernel.sum()), 1e-6))) * rng.uniform(25, 45)
    else:
        base = rng.uniform(30, 230, size=3)
        grain = cv2.GaussianBlur(rng.normal(0, 1, (SIZE, SIZE)).astype(np.float32), (0, 0), 0.8) * rng.uniform(3, 8)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    angle = rng.uniform(0, 2 * np.pi)
    light = (np.cos(angle) * (xx - 0.5) + np.sin(angle) * (yy - 0.5)) * rng.uniform(20, 60)
    img = base[None, None, :] + (grain + light)[:, :, None]
    return np.asarray(np.clip(img, 0, 255), np.float32)


def _serial(rng: np.random.Generator) -> str:
    letters = "ABCDEFGHJKLMNPRSTUVWXYZ"
    return f"SN-{int(rng.integers(1000, 9999))}-{''.join(rng.choice(list(letters), 2))}{int(rng.integers(0, 9))}"


def _label(img: np.ndarray, rng: np.random.Generator, missing: bool) -> tuple[str, np.ndarray]:
    """Print a label; with `missing`, leave part of its text unprinted. Returns the serial
    and the mask of the unprinted text (empty unless missing)."""
    serial = _serial(rng)
    scale = float(rng.uniform(0.45, 0.6))
    (tw, th), base = cv2.getTextSize(serial, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
    pad = 6
    w, h = tw + 2 * pad, th + base + 2 * pad
    x0 = int(rng.integers(4, SIZE - w - 4))
    y0 = int(rng.integers(4, SIZE - h - 4))
    paper = rng.uniform(225, 250)
    img[y0 : y0 + h, x0 : x0 + w] = paper
    ink = np.zeros((SIZE, SIZE), np.uint8)
    cv2.putText(ink, serial, (x0 + pad, y0 + pad + th), cv2.FONT_HERSHEY_SIMPLEX, scale, 255, 1, cv2.LINE_AA)
    hole = np.zeros((SIZE, SIZE), bool)
    if missing:
        # A print head that skipped: a band of the text is absent.
        frac = rng.uniform(0.35, 0.6)
        start = x0 + pad + int(rng.uniform(0, 1 - frac) * tw)
        band = np.zeros((SIZE, SIZE), bool)
        band[y0 : y0 + h, start : start + int(frac * tw)] = True
        hole = band & (ink > 0)
        hole = cv2.dilate(hole.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool) & band
        ink[band] = 0
    alpha = ink.astype(np.float32)[:, :, None] / 255.0
    img[:] = img * (1 - alpha) + rng.uniform(10, 40) * alpha
    return serial, hole


def _scratch(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    p0 = rng.uniform(20, SIZE - 20, size=2)
    length = rng.uniform(50, 140)
    angle = rng.uniform(0, np.pi)
    bend = rng.uniform(-15, 15)
    pts = []
    for t in np.linspace(0, 1, 12):
        along = p0 + length * t * np.array([np.cos(angle), np.sin(angle)])
        normal = np.array([-np.sin(angle), np.cos(angle)]) * bend * np.sin(np.pi * t)
        pts.append(along + normal)
    cv2.polylines(mask, [np.clip(np.array(pts), 0, SIZE - 1).astype(np.int32)], False, 1, int(rng.integers(1, 3)))
    shade = rng.choice([rng.uniform(225, 255), rng.uniform(0, 40)])
    m = np.asarray(mask, bool)
    img[m] = img[m] * 0.25 + shade * 0.75
    return m


def _dent(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    cx, cy = rng.uniform(30, SIZE - 30, size=2)
    r = rng.uniform(10, 24)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    dx, dy = (xx - cx) / r, (yy - cy) / r
    d2 = dx**2 + dy**2
    inside = d2 < 1.0
    angle = rng.uniform(0, 2 * np.pi)
    # A crater lit from one side: dark on the near slope, bright on the far one.
    slope = (np.cos(angle) * dx + np.sin(angle) * dy) * np.exp(-d2 * 1.5)
    img += (slope * rng.uniform(45, 80))[:, :, None] * inside[:, :, None]
    return np.asarray(inside, bool)


def _stain(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    blob = np.zeros((SIZE, SIZE), np.float32)
    cx, cy = rng.uniform(30, SIZE - 30, size=2)
    for _ in range(int(rng.integers(3, 7))):
        ox, oy = rng.normal(0, 10, size=2)
        axes = (int(rng.uniform(6, 22)), int(rng.uniform(6, 18)))
        cv2.ellipse(blob, (int(cx + ox), int(cy + oy)), axes, float(rng.uniform(0, 180)), 0, 360, 1.0, -1)
    blob = np.asarray(cv2.GaussianBlur(blob, (0, 0), 3.0), np.float32)
    colour = rng.uniform([40, 30, 0], [110, 90, 50])
    alpha = (np.clip(blob, 0, 1) * rng.uniform(0.45, 0.7))[:, :, None]
    img[:] = img * (1 - alpha) + colour[None, None, :] * alpha
    return np.asarray(blob > 0.3)


def make_sample(seed: int, split: str, index: int) -> Sample:
    rng = _rng(seed, split, index)
    label = index % len(CLASSES)  # balanced classes, order fixed by index
    img = _surface(rng)
    serial, hole = _label(img, rng, missing=CLASSES[label] == "missing_print")
    mask = hole
    if CLASSES[label] == "scratch":
        mask = _scratch(img, rng)
    elif CLASSES[label] == "dent":
        mask = _dent(img, rng)
    elif CLASSES[label] == "stain":
        mask = _stain(img, rng)
    img += rng.normal(0, rng.uniform(1, 4), img.shape).astype(np.float32)  # sensor noise
    return Sample(np.clip(img, 0, 255).astype(np.uint8), label, mask, serial)


def iter_split(seed: int, split: str, count: int) -> Iterator[Sample]:
    for i in range(count):
        yield make_sample(seed, split, i)


def patch_targets(mask: np.ndarray, grid: int) -> np.ndarray:
    """Share of each patch's pixels that show the defect, [grid, grid] float32."""
    return cv2.resize(mask.astype(np.float32), (grid, grid), interpolation=cv2.INTER_AREA)
