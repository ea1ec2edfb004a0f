"""The `inspect` task: an image of a part in, its defect class, score and (if asked) a
per-patch heat map out, for a batch of images at a time.

The student runs through the backend seam: its ONNX export on onnxruntime (CPU
default) or its FP16 weights with CUDA graphs on torch-cuda. Both return probabilities
(`class_probs` [B, C], `patch_probs` [B, g, g]), so nothing here depends on which; what a
student build holds is edge/vision/student.py's business.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from edge.backends import BackendOptions, InferenceSession, get_backend
from edge.memory import device_working_bytes
from edge.timing import StageClock
from edge.vision.student import INPUT, StudentArtifact
from edge.vision.vit import IMAGE_MEAN, IMAGE_STD

logger = logging.getLogger(__name__)

CLEAN = "clean"


@dataclass(frozen=True)
class Inspection:
    label: str
    score: float
    defect_score: float
    probabilities: dict[str, float]
    heatmap: list[list[float]]

    def to_dict(self, heatmap: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "class": self.label,
            "score": round(self.score, 5),
            "defect": self.label != CLEAN,
            "defect_score": round(self.defect_score, 5),
            "probabilities": {k: round(v, 5) for k, v in self.probabilities.items()},
        }
        if heatmap:
            out["heatmap"] = self.heatmap
        return out


def preprocess(images: list[np.ndarray], size: int, bgr: bool = False) -> np.ndarray:
    """RGB uint8 images of any size (BGR with `bgr`) -> float32 RGB [B, 3, size, size],
    normalised.

    Parts are framed by the camera; the whole view is resized (area filter when
    shrinking) rather than cropped, so a defect at the edge is never cut off. BGR images
    are resized first and turned to RGB after: the same pixels, without a copy of the
    full frame (a channel-reversed view is not contiguous, and resizing one copies it
    first: three times slower on a 5 MP frame).
    """
    batch = np.empty((len(images), 3, size, size), np.float32)
    mean = np.array(IMAGE_MEAN, np.float32)
    std = np.array(IMAGE_STD, np.float32)
    for i, img in enumerate(images):
        h, w = img.shape[:2]
        interp = cv2.INTER_AREA if h > size or w > size else cv2.INTER_LINEAR
        resized = cv2.resize(img, (size, size), interpolation=interp) if (h, w) != (size, size) else img
        if bgr:
            resized = resized[:, :, ::-1]
        batch[i] = ((resized.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)
    return batch


class InspectPipeline:
    def __init__(self, session: InferenceSession, classes: list[str], image_size: int) -> None:
        self.session = session
        self.classes = classes
        self.image_size = image_size
        # Device bytes a batch of n images takes while it runs (upload, resize, outputs),
        # measured at warm-up for each size it ran; empty for a session on the CPU.
        self.device_batch_bytes: dict[int, int] = {}
        if CLEAN not in classes:
            raise ValueError(f"the student's classes {classes} have no {CLEAN!r} class")

    @property
    def device_floor_bytes(self) -> int:
        """What the session's runtime says it holds on the device (0 where it says nothing)."""
        return int(getattr(self.session, "device_bytes", 0))

    @classmethod
    def load(cls, student_dir: Path, backend: str, options: BackendOptions) -> InspectPipeline:
        artifact = StudentArtifact.open(student_dir)
        session = get_backend(backend).load(artifact.source(), options)
        pipeline = cls(session, artifact.classes, artifact.image_size)
        pipeline.warm_up(options.max_batch)
        return pipeline

    def warm_up(self, max_batch: int) -> None:
        """Run every batch size a backend may specialise for (powers of two up to the
        largest, and the largest), so the runtime's working memory is held and measured
        into the model's footprint, and no CUDA graph is captured later while another
        branch's thread launches work on the GPU. On a GPU each size runs once more with
        its working memory measured: what a batch of that size reserves."""
        size = self.image_size
        blank = np.zeros((size, size, 3), np.uint8)
        top = max(1, max_batch)
        sizes = sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top})
        for n in sizes:
            self.run([blank] * n)
        if self.session.device.startswith("cuda"):
            index = int(self.session.device.partition(":")[2] or 0)
            for n in sizes:
                self.device_batch_bytes[n] = device_working_bytes(partial(self.run, [blank] * n), index)

    def device_bytes_for(self, count: int) -> int:
        """A batch's device working memory: the measured figure of the smallest warm-up
        size that holds it (a larger batch runs in chunks of the largest)."""
        if not self.device_batch_bytes:
            return 0
        fitting = [n for n in self.device_batch_bytes if n >= count]
        return self.device_batch_bytes[min(fitting)] if fitting else max(self.device_batch_bytes.values())

    @property
    def host_preprocessing(self) -> bool:
        """Whether a batch's float input tensor is built on the host (else on the device)."""
        return not self.session.accepts_images

    def batch_bytes(self, count: int) -> int:
        """The input tensor a batch of `count` images needs (float32, NCHW)."""
        return self.batch_bytes_at(self.image_size, count)

    @staticmethod
    def batch_bytes_at(image_size: int, count: int) -> int:
        return count * 3 * image_size * image_size * 4

    def run(self, images: list[np.ndarray], bgr: bool = False, clock: StageClock | None = None) -> list[Inspection]:
        """One inspection per RGB uint8 image (BGR with `bgr`, as decoded), all through
        the model as one batch; the batch's preprocess, model and postprocess times go
        to `clock` (a session on a GPU times its own on the GPU's clock, and one that
        takes images resizes them itself, as its "preprocess")."""
        if not images:
            return []
        clock = clock or StageClock()
        if self.session.accepts_images:
            rgb = [img[:, :, ::-1] for img in images] if bgr else images
            class_probs, patch_probs = self.session.run_images_staged(rgb, clock)
        else:
            with clock.stage("preprocess"):
                tensor = preprocess(images, self.image_size, bgr)
            class_probs, patch_probs = self.session.run_staged({INPUT: tensor}, clock)
        with clock.stage("postprocess"):
            return self._inspections(class_probs, patch_probs)

    def _inspections(self, class_probs: np.ndarray, patch_probs: np.ndarray) -> list[Inspection]:
        clean = self.classes.index(CLEAN)
        results = []
        for probs, patches in zip(class_probs, patch_probs, strict=True):
            best = int(np.argmax(probs))
            results.append(
                Inspection(
                    label=self.classes[best],
                    score=float(probs[best]),
                    defect_score=float(1.0 - probs[clean]),
                    probabilities={c: float(p) for c, p in zip(self.classes, probs, strict=True)},
                    heatmap=np.round(patches.astype(np.float64), 3).tolist(),
                )
            )
        return results
