"""An inspection student with random weights, in the serving format: for speed and memory
figures on a machine that cannot build the trained one (no teacher wheel there). Its
answers mean nothing; its manifest says so, and it is never used for accuracy."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from edge.vision import student as artifact
from edge.vision.vit import InspectViT, ViTConfig
from engines.vision.factory_data import CLASSES

logger = logging.getLogger(__name__)


def write_random_student(out_dir: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = ViTConfig(num_classes=len(CLASSES))
    model = InspectViT(config).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.serving_state(), out_dir / artifact.WEIGHTS)
    (out_dir / artifact.CONFIG).write_text(config.to_json() + "\n", encoding="utf-8")
    manifest = {
        "kind": artifact.KIND,
        "classes": list(CLASSES),
        "size": "random",
        "distilled": False,
        "random_weights": True,
        "seed": seed,
        "built_at": time.time(),
    }
    (out_dir / artifact.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return out_dir
