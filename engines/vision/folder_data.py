"""A user's own labelled images as the inspection student's dataset.

A dataset folder holds one sub-folder per class, named for it; one of them must be
`clean` (the verdict "no defect"). Images are PNG or JPEG; a defect image may have its
mask beside it as `<name>.mask.png` (white where the defect is), which trains the heat
map; a defect image without one trains the class only. Each image's split (train,
validation, test) follows from a hash of its class and file name, so adding images never
moves the others, and the same folder always splits the same way.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from engines.vision.factory_data import patch_targets

logger = logging.getLogger(__name__)

FOLDER_VERSION = 1
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
MASK_SUFFIX = ".mask.png"
CLEAN = "clean"
# Shares of each class kept for validation and test (the rest trains).
VAL_SHARE = 0.15
TEST_SHARE = 0.15


class DatasetError(ValueError):
    """A folder that cannot be a dataset, with what is wrong."""


@dataclass(frozen=True)
class FolderItem:
    path: Path
    label: int
    mask: Path | None
    split: str


def _split_of(class_name: str, name: str) -> str:
    digest = hashlib.sha256(f"{class_name}/{name}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "val" if u < VAL_SHARE else "test" if u < VAL_SHARE + TEST_SHARE else "train"


def scan(folder: Path) -> tuple[list[str], list[FolderItem]]:
    """(class names, items) of a dataset folder; DatasetError naming what is wrong."""
    if not folder.is_dir():
        raise DatasetError(f"{folder} is not a directory")
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    if CLEAN not in classes:
        raise DatasetError(f"{folder} has no {CLEAN!r} class folder (found: {', '.join(classes) or 'none'})")
    if len(classes) < 2:
        raise DatasetError(f"{folder} has only the {CLEAN!r} class: a defect class is needed too")
    items: list[FolderItem] = []
    for label, name in enumerate(classes):
        files = sorted(
            f
            for f in (folder / name).iterdir()
            if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES and not f.name.endswith(MASK_SUFFIX)
        )
        mine = []
        for f in files:
            mask = f.with_name(f.stem + MASK_SUFFIX)
            mine.append(FolderItem(f, label, mask if mask.is_file() else None, _split_of(name, f.name)))
        if not any(i.split == "train" for i in mine):
            raise DatasetError(f"class {name!r} has {len(files)} images and none falls in the training split: add more")
        items += mine
    return classes, items


def fingerprint(items: list[FolderItem], folder: Path) -> dict[str, Any]:
    """The dataset by content: every image and mask's hash, by its path in the folder."""

    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    files: dict[str, str] = {}
    for item in items:
        files[str(item.path.relative_to(folder))] = sha(item.path)
        if item.mask is not None:
            files[str(item.mask.relative_to(folder))] = sha(item.mask)
    return {"version": FOLDER_VERSION, "files": files}


def _image(path: Path, size: int) -> np.ndarray:
    img = cv2.imread(str(path), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if img is None:
        raise DatasetError(f"{path} is not a readable PNG or JPEG image")
    # As serving sees it (edge/vision/inspect.py): the whole view, area filter, RGB.
    return cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA)[:, :, ::-1]


def split_arrays(items: list[FolderItem], split: str, size: int, grid: int) -> dict[str, np.ndarray]:
    """Images (RGB uint8 [N, size, size, 3]), labels, patch targets and patch weights
    (0 for a defect image without a mask: its heat map is unknown) of one split."""
    chosen = [i for i in items if i.split == split]
    if not chosen:
        raise DatasetError(f"the dataset has no image in its {split} split: add more images")
    images, targets, weights = [], [], []
    for item in chosen:
        images.append(_image(item.path, size))
        if item.mask is not None:
            mask = cv2.imread(str(item.mask), cv2.IMREAD_GRAYSCALE)
            if mask is None:
                raise DatasetError(f"{item.mask} is not a readable mask image")
            targets.append(patch_targets((mask > 127).astype(np.float32), grid))
            weights.append(1.0)
        else:
            targets.append(np.zeros((grid, grid), np.float32))
            weights.append(1.0 if item.path.parent.name == CLEAN else 0.0)
    return {
        "images": np.ascontiguousarray(np.stack(images)),
        "labels": np.array([i.label for i in chosen], np.int64),
        "targets": np.stack(targets).astype(np.float32),
        "patch_weights": np.array(weights, np.float32),
    }
