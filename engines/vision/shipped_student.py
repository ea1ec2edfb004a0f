"""Students trained once on a GPU and shipped with the code, installed where no GPU is.

A `stream` student distils 256,000 generated images with the teacher on the GPU: about
four minutes on an H200, hours on two CPU cores. A box without CUDA asking for one gets
the shipped weights instead of a refusal. `engines/vision/students/<tag>-<size>/` holds:

  student.safetensors  the serving weights in float16 (half the size of float32; the
                       install measures what that rounding costs, see below)
  manifest.json        the build's own manifest as trained: its inputs (teacher hash,
                       data, recipe, model), where and how long it trained, its scores
  provenance.json      the weights file's SHA-256 and the command that trains it again

Installing (engines/vision/vision_build.py, when the shipped manifest's inputs are the ones the
build asks for) checks the hash, writes student.pt and config.json, exports the ONNX
model, and measures the installed student on the held-out test split: the manifest's
test_accuracy is the installed model's own, test_accuracy_at_training the GPU build's.

`python -m engines.vision.shipped_student --export <build dir>` writes a shipped directory from
a build (the one `python -m engines.vision.vision_build --size stream --device cuda` makes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from edge.vision import student as artifact
from edge.vision.vit import InspectViT, ViTConfig, load_student
from engines.cache import file_sha256

logger = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parent / "students"
WEIGHTS = "student.safetensors"
PROVENANCE = "provenance.json"


class ShippedStudentError(ValueError):
    """A shipped student that does not match its provenance (a damaged checkout)."""


def shipped_dir(size_name: str, distill: bool, root: Path = SHIPPED) -> Path:
    return root / f"{'distilled' if distill else 'plain'}-{size_name}"


def find_shipped(size_name: str, distill: bool, inputs: dict[str, Any], root: Path = SHIPPED) -> Path | None:
    """The shipped student built from exactly these inputs, or None."""
    directory = shipped_dir(size_name, distill, root)
    try:
        manifest = json.loads((directory / artifact.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if manifest.get("inputs") != inputs:
        logger.info("the shipped %s student was built from other inputs: not used", directory.name)
        return None
    return directory


def load_shipped(directory: Path) -> tuple[InspectViT, dict[str, Any]]:
    """The shipped student as a float32 model ready to serve, and its manifest."""
    provenance = json.loads((directory / PROVENANCE).read_text(encoding="utf-8"))
    digest = file_sha256(directory / WEIGHTS)
    if digest != provenance["sha256"]:
        raise ShippedStudentError(
            f"{directory / WEIGHTS} has SHA-256 {digest[:16]}..., its provenance says "
            f"{provenance['sha256'][:16]}...: the checkout is damaged"
        )
    manifest: dict[str, Any] = json.loads((directory / artifact.MANIFEST).read_text(encoding="utf-8"))
    config = ViTConfig(**manifest["inputs"]["model"])
    model = InspectViT(config)
    model.drop_distillation()
    state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS)).items()}
    model.load_state_dict(state)
    return model.eval(), manifest


def export_shipped(build_dir: Path, root: Path = SHIPPED) -> Path:
    """A shipped directory from a student build: float16 weights, the build's manifest,
    the provenance."""
    manifest = json.loads((build_dir / artifact.MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("kind") != artifact.KIND:
        raise ShippedStudentError(f"{build_dir} is not a student build")
    out = shipped_dir(str(manifest["size"]), bool(manifest["distilled"]), root)
    out.mkdir(parents=True, exist_ok=True)
    model = load_student(build_dir)
    half = {k: v.half().contiguous() for k, v in model.serving_state().items()}
    save_file(half, str(out / WEIGHTS))
    (out / artifact.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    command = f"python -m engines.vision.vision_build --size {manifest['size']} --device cuda"
    if not manifest["distilled"]:
        command += " --no-distill"
    provenance = {
        "sha256": file_sha256(out / WEIGHTS),
        "build": build_dir.name,
        "trained_on": manifest.get("trained_on"),
        "train_seconds": manifest.get("train_seconds"),
        "test_accuracy": manifest.get("test_accuracy"),
        "reproduce": f"{command}, then python -m engines.vision.shipped_student --export <the build directory>",
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Ship a student build with the code (float16 weights).")
    parser.add_argument("--export", type=Path, required=True, metavar="BUILD_DIR")
    parser.add_argument("--root", type=Path, default=SHIPPED)
    args = parser.parse_args(argv)
    out = export_shipped(args.export, args.root)
    provenance = json.loads((out / PROVENANCE).read_text(encoding="utf-8"))
    print(f"wrote {out}: {(out / WEIGHTS).stat().st_size / 2**20:.1f} MiB, sha256 {provenance['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
