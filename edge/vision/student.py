"""The inspection student's artifact contract: what a student build writes into its
directory, and how serving turns that into a model source for any backend.

A student directory holds:
  manifest.json  written by the build: kind "vision-student", the class names, the size
                 and recipe it was built with
  config.json    ViTConfig (image size, width, depth, ...)
  student.pt     the serving weights (PyTorch state dict, no training-only parts)
  student.onnx   the same network exported with a dynamic batch axis (onnxruntime,
                 TensorRT builds)
Inputs and outputs: `pixels` [B, 3, S, S] normalised RGB -> `class_probs` [B, C] and
`patch_probs` [B, g, g], probabilities (softmax and sigmoid are inside the network).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.backends.base import ImageInput, ModelSource
from edge.vision.vit import IMAGE_MEAN, IMAGE_STD

logger = logging.getLogger(__name__)

KIND = "vision-student"
MANIFEST = "manifest.json"
CONFIG = "config.json"
WEIGHTS = "student.pt"
ONNX = "student.onnx"
INPUT = "pixels"
OUTPUTS = ("class_probs", "patch_probs")


def weights_bytes(directory: Path) -> int:
    """The serving weights' size: what the student holds in memory at least on the CPU,
    in either format (0 where the build has none)."""
    try:
        return (directory / WEIGHTS).stat().st_size
    except OSError:
        return 0


class StudentArtifactError(ValueError):
    """A directory that is not a usable student build, with what is wrong."""


@dataclass(frozen=True)
class StudentArtifact:
    directory: Path
    classes: list[str]
    image_size: int
    manifest: dict[str, Any]

    @classmethod
    def open(cls, directory: Path) -> StudentArtifact:
        try:
            manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
            config = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise StudentArtifactError(f"{directory.name} is not a readable student build: {err}") from err
        if manifest.get("kind") != KIND:
            raise StudentArtifactError(f"{directory.name} holds a {manifest.get('kind')!r}, not a {KIND}")
        classes = manifest.get("classes")
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise StudentArtifactError(f"{directory.name}: its manifest lists no class names")
        return cls(directory, list(classes), int(config["image_size"]), manifest)

    def source(self) -> ModelSource:
        onnx = self.directory / ONNX
        weights = self.directory / WEIGHTS

        def torch_module() -> Any:
            from edge.vision.vit import ExportWrapper, load_student

            return ExportWrapper(load_student(self.directory))

        return ModelSource(
            name=f"student {self.directory.name}",
            onnx=onnx if onnx.is_file() else None,
            torch_module=torch_module if weights.is_file() else None,
            inputs=(INPUT,),
            outputs=OUTPUTS,
            image=ImageInput(self.image_size, IMAGE_MEAN, IMAGE_STD),
            plan={"task": "inspect", "student": self.directory.name},
        )
