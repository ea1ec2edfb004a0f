"""The vision build, one command: data -> teacher tokens -> teacher probe -> distilled
student -> ONNX with a dynamic batch axis, verified against PyTorch -> manifest.

    python -m engines.vision.vision_build --engine-dir .edge/engines [--size default|quick]

Every step is cached by its inputs (generator version and seed, split sizes, the
teacher file's hash, the training recipe), so a second call returns at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.builds import source_id
from edge.vision import student as artifact
from edge.vision.vit import ExportWrapper, InspectViT, ViTConfig
from engines.cache import build_cached, cache_key, file_sha256, stop_on_sigterm
from engines.vision.distill import TrainData, TrainRecipe, predict, train_student
from engines.vision.factory_data import CLASSES, iter_split, patch_targets
from engines.vision.folder_data import DatasetError, fingerprint, scan, split_arrays
from engines.vision.shipped_student import find_shipped, load_shipped
from engines.vision.vision_stream import StreamPlan, train_student_streaming
from engines.vision.vision_teacher import (
    probe_features,
    teacher_onnx_path,
    teacher_tokens,
    teacher_weights,
    train_probe,
)

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 1
# The files and names serving reads (edge/vision/student.py is the contract).
STUDENT_ONNX = artifact.ONNX
ONNX_INPUT = artifact.INPUT
ONNX_OUTPUTS = artifact.OUTPUTS


@dataclass(frozen=True)
class VisionSize:
    train: int
    val: int
    test: int
    epochs: int
    seed: int = 0
    stream_steps: int = 0  # > 0: distil on freshly generated images instead (vision_stream)
    stream_batch: int = 128


# default: what the accuracy figures are measured on (a few minutes on two CPU cores);
# quick: a smoke-sized build for tests of the serving path, never for accuracy figures;
# stream: trained on 256,000 freshly generated images, distilled with the teacher on the
# same device, or with --no-distill the baseline on the same images (meant for a GPU:
# `--device cuda`, about 4 minutes on an H200 with 32 cores generating images; the
# result is an ordinary build directory to copy into another box's engine directory).
# At this length distillation still clearly beats the baseline (bench/vision_data.py);
# stream-long: three times as many images (768,000, about 13 minutes): a little more
# accurate, but there the baseline has caught up with the distilled student;
# quick-stream: the stream's smoke-sized test.
SIZES = {
    "default": VisionSize(train=600, val=150, test=500, epochs=16),
    "quick": VisionSize(train=60, val=20, test=20, epochs=1),
    "stream": VisionSize(train=600, val=150, test=500, epochs=0, stream_steps=2000),
    "stream-long": VisionSize(train=600, val=150, test=500, epochs=0, stream_steps=6000),
    "quick-stream": VisionSize(train=60, val=20, test=20, epochs=0, stream_steps=2, stream_batch=4),
}

LONG_ON_CPU = 100  # stream steps beyond which a CPU build takes too long to start unasked


class BuildRefused(ValueError):
    """A build this machine should not attempt as asked (a long stream build without CUDA)."""


def _split_arrays(seed: int, split: str, count: int, grid: int) -> dict[str, np.ndarray]:
    samples = list(iter_split(seed, split, count))
    return {
        "images": np.stack([s.image for s in samples]),
        "labels": np.array([s.label for s in samples], np.int64),
        "targets": np.stack([patch_targets(s.mask, grid) for s in samples]).astype(np.float32),
    }


def dataset_inputs(size: VisionSize) -> dict[str, Any]:
    """What a dataset build is cached by (and a student build, through it); not the
    epochs: retraining must not regenerate the data."""
    return {
        "generator": GENERATOR_VERSION,
        "seed": size.seed,
        "counts": {"train": size.train, "val": size.val, "test": size.test},
        "grid": ViTConfig().grid,
        "teacher_sha256": file_sha256(teacher_onnx_path()),
    }


def folder_inputs(folder: Path) -> tuple[list[str], dict[str, Any], Any]:
    """A user's dataset folder: its classes, what its builds are cached by (its content),
    and its items."""
    classes, items = scan(folder)
    inputs = {
        "folder": fingerprint(items, folder),
        "classes": classes,
        "grid": ViTConfig().grid,
        "image_size": ViTConfig().image_size,
        "teacher_sha256": file_sha256(teacher_onnx_path()),
    }
    return classes, inputs, items


def build_folder_dataset(engine_dir: Path, folder: Path, progress: bool = True) -> Path:
    """A user's labelled images, split by their names, with the teacher's tokens."""
    classes, inputs, items = folder_inputs(folder)
    grid, size = int(inputs["grid"]), int(inputs["image_size"])

    def build(out: Path) -> dict[str, Any]:
        counts = {}
        for split in ("train", "val", "test"):
            arrays = split_arrays(items, split, size, grid)
            counts[split] = len(arrays["labels"])
            cls, patches = teacher_tokens(arrays["images"], grid, progress=progress, desc=f"teacher tokens ({split})")
            np.savez(out / f"{split}.npz", teacher_cls=cls, teacher_patches=patches, **arrays)  # type: ignore[arg-type]
        return {"kind": "vision-dataset", "classes": classes, "counts": counts, "folder": folder.name}

    return build_cached(engine_dir / f"vision-data-{folder.name[:32]}-{cache_key(inputs)}", inputs, build)


def build_dataset(engine_dir: Path, size: VisionSize, progress: bool = True) -> Path:
    """Images, labels, patch targets and the teacher's tokens for every split."""
    inputs = dataset_inputs(size)
    counts: dict[str, int] = inputs["counts"]
    grid: int = inputs["grid"]

    def build(out: Path) -> dict[str, Any]:
        for split, count in counts.items():
            arrays = _split_arrays(size.seed, split, count, grid)
            cls, patches = teacher_tokens(arrays["images"], grid, progress=progress, desc=f"teacher tokens ({split})")
            np.savez(out / f"{split}.npz", teacher_cls=cls, teacher_patches=patches, **arrays)  # type: ignore[arg-type]
        return {"kind": "vision-dataset", "classes": list(CLASSES), "counts": counts}

    return build_cached(engine_dir / f"vision-data-{cache_key(inputs)}", inputs, build)


def load_split(data_dir: Path, split: str) -> dict[str, np.ndarray]:
    with np.load(data_dir / f"{split}.npz") as f:
        return {k: f[k] for k in f.files}


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float((probs.argmax(1) == labels).mean())


def export_onnx(model: InspectViT, path: Path) -> float:
    """Export with a dynamic batch axis; returns the largest difference from PyTorch
    over batches of 1 and 3 (the export is refused above 1e-4)."""
    import onnxruntime as ort

    wrapper = ExportWrapper(model).eval()
    size = model.config.image_size
    example = torch.randn(2, 3, size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter announces its deprecation
        torch.onnx.export(
            wrapper,
            (example,),
            str(path),
            input_names=[ONNX_INPUT],
            output_names=list(ONNX_OUTPUTS),
            dynamic_axes={name: {0: "batch"} for name in (ONNX_INPUT, *ONNX_OUTPUTS)},
            opset_version=17,
            dynamo=False,
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 3):
        x = torch.randn(batch, 3, size, size, generator=gen)
        with torch.inference_mode():
            ref = [t.numpy() for t in wrapper(x)]
        got = session.run(list(ONNX_OUTPUTS), {ONNX_INPUT: x.numpy()})
        worst = max(worst, *(float(np.abs(a - b).max()) for a, b in zip(got, ref, strict=True)))
    if worst > 1e-4:
        raise RuntimeError(f"ONNX export disagrees with PyTorch by {worst:.2e}")
    return worst


def teacher_probe(data_dir: Path, classes: int = len(CLASSES)) -> tuple[torch.nn.Linear, dict[str, Any]]:
    splits = {s: load_split(data_dir, s) for s in ("train", "val", "test")}
    feats = {s: probe_features(d["teacher_cls"], d["teacher_patches"]) for s, d in splits.items()}
    labels = {s: torch.from_numpy(d["labels"]) for s, d in splits.items()}
    probe, info = train_probe(feats["train"], labels["train"], feats["val"], labels["val"], classes)
    with torch.no_grad():
        info["test_accuracy"] = float((probe(feats["test"]).argmax(1) == labels["test"]).float().mean())
    return probe, info


def install_shipped(shipped: Path, out: Path, size: VisionSize) -> dict[str, Any]:
    """A shipped student (engines/vision/shipped_student.py) written as a build: its weights,
    config and ONNX export, and its accuracy measured here on the held-out test split."""
    model, manifest = load_shipped(shipped)
    logger.info("installing the shipped student %s (trained on %s)", shipped.name, manifest.get("trained_on"))
    torch.save(model.serving_state(), out / artifact.WEIGHTS)
    (out / artifact.CONFIG).write_text(model.config.to_json() + "\n", encoding="utf-8")
    onnx_error = export_onnx(model, out / STUDENT_ONNX)
    test = _split_arrays(size.seed, "test", size.test, model.config.grid)
    probs, _ = predict(model, test["images"])
    details = {k: v for k, v in manifest.items() if k not in ("inputs", "built_at", "val_accuracy", "test_accuracy")}
    details.update(
        {
            "installed_from": f"engines/vision/students/{shipped.name}",
            "onnx_max_abs_diff": onnx_error,
            "test_accuracy": accuracy(probs, test["labels"]),
            "test_accuracy_at_training": manifest.get("test_accuracy"),
            "val_accuracy_at_training": manifest.get("val_accuracy"),
        }
    )
    return details


def build_student(
    engine_dir: Path,
    size_name: str = "default",
    distill: bool = True,
    progress: bool = True,
    device: str = "auto",
    dataset: Path | None = None,
) -> Path:
    """`device` trains a stream size there, "auto" on CUDA if there is a GPU (the result
    is the same build wherever it was trained, so it is not part of the cache key).
    `dataset`: a folder of the user's labelled images (engines/vision/folder_data.py) instead
    of the synthetic factory set; its classes are the student's, and `size_name` gives
    the training length only (default or quick: stream sizes generate synthetic images)."""
    size = SIZES[size_name]
    classes = list(CLASSES)
    folder: dict[str, Any] | None = None
    if dataset is not None:
        if size.stream_steps:
            raise BuildRefused(f"size {size_name!r} trains on generated images; with a dataset use default or quick")
        dataset = dataset.resolve()
        classes, folder, _ = folder_inputs(dataset)
    auto = device == "auto"
    if auto:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # "auto" on a machine without CUDA refuses a long stream build (in build() below, so
    # a build copied here from a GPU machine is still found).
    refuse = auto and device == "cpu" and size.stream_steps > LONG_ON_CPU
    config = ViTConfig(num_classes=len(classes))
    batch = size.stream_batch if size.stream_steps else TrainRecipe.batch_size
    recipe = TrainRecipe(epochs=size.epochs, batch_size=batch, distill=distill, init="teacher" if distill else "random")
    # The dataset's inputs, not the dataset: finding a built student needs no data.
    inputs = {"data": dataset_inputs(size) if folder is None else folder, "recipe": recipe.to_dict()}
    inputs["model"] = asdict(config)
    plan = StreamPlan(steps=size.stream_steps, first_index=size.train, seed=size.seed) if size.stream_steps else None
    if plan is not None:
        inputs["stream"] = {"steps": plan.steps, "first_index": plan.first_index, "seed": plan.seed}

    def build(out: Path) -> dict[str, Any]:
        # A student trained on a GPU and shipped with the code, from these very inputs,
        # is installed rather than trained again (minutes on a GPU, hours on a CPU).
        shipped = find_shipped(size_name, distill, inputs) if auto and dataset is None else None
        if shipped is not None:
            return install_shipped(shipped, out, size)
        if refuse:
            # Refused rather than started: nobody asking for a build expects it to take
            # hours, and a daemon's first start would sit in it.
            raise BuildRefused(
                f"size {size_name!r} trains on {size.stream_steps * size.stream_batch:,} generated images and "
                "there is no CUDA device here: build it on a GPU machine and copy the build directory into "
                "this engine directory, or pass device 'cpu' (--device cpu) to train here anyway (hours)"
            )
        if dataset is None:
            data_dir = build_dataset(engine_dir, size, progress)
        else:
            data_dir = build_folder_dataset(engine_dir, dataset, progress)
        probe, probe_info = teacher_probe(data_dir, len(classes))
        weights = teacher_weights() if distill else None
        t0 = time.perf_counter()
        if plan is not None:
            if device == "cpu" and plan.steps > LONG_ON_CPU:
                why = "size %r trains %d steps of %d new images; on the CPU that takes hours"
                logger.warning(why, size_name, plan.steps, size.stream_batch)
            model, info = train_student_streaming(config, recipe, plan, probe, weights, device, progress)
        else:
            # The stored training split, with the probe's logits for it (a stream's
            # teacher targets are made batch by batch instead).
            train = load_split(data_dir, "train")
            with torch.no_grad():
                t_logits = probe(probe_features(train["teacher_cls"], train["teacher_patches"])).numpy()
            data = TrainData(
                images=train["images"],
                labels=train["labels"],
                patch_targets=train["targets"],
                teacher_cls=train["teacher_cls"],
                teacher_patches=train["teacher_patches"],
                teacher_logits=t_logits,
                patch_weights=train.get("patch_weights"),
            )
            model, info = train_student(data, config, recipe, progress, weights)
            info["images"] = len(data.labels)
        train_s = time.perf_counter() - t0
        torch.save(model.serving_state(), out / artifact.WEIGHTS)
        model.drop_distillation()
        (out / artifact.CONFIG).write_text(config.to_json() + "\n", encoding="utf-8")
        onnx_error = export_onnx(model, out / STUDENT_ONNX)
        scores: dict[str, float] = {}
        for split in ("val", "test"):
            d = load_split(data_dir, split)
            probs, _ = predict(model, d["images"])
            scores[f"{split}_accuracy"] = accuracy(probs, d["labels"])
        params = sum(p.numel() for n, p in model.named_parameters())
        return {
            "kind": artifact.KIND,
            "classes": classes,
            "dataset": "synthetic" if dataset is None else source_id(str(dataset)),
            "distilled": distill,
            "size": size_name,
            "parameters": params,
            "train_seconds": train_s,
            "trained_on": device if plan is not None else "cpu",
            "train_images": info["images"],
            "onnx_max_abs_diff": onnx_error,
            "teacher_probe": probe_info,
            **scores,
            "history": info["history"],
        }

    tag = "distilled" if distill else "plain"
    where = "" if dataset is None else f"{dataset.name[:32]}-"
    return build_cached(engine_dir / f"vision-student-{tag}-{where}{size_name}-{cache_key(inputs)}", inputs, build)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the inspection student (cached by its inputs).")
    parser.add_argument("--engine-dir", type=Path, default=Path(".edge/engines"))
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--no-distill", action="store_true", help="the baseline: same student, true labels only")
    parser.add_argument(
        "--device", default="auto", help="where a stream size trains: cpu, cuda, or auto (cuda if there is a GPU)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, services)")
    parser.add_argument(
        "--dataset", default="synthetic", help="'synthetic' (the factory set) or a folder of labelled images"
    )
    args = parser.parse_args(argv)
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dataset = None if args.dataset == "synthetic" else Path(args.dataset)
    try:
        path = build_student(
            args.engine_dir,
            args.size,
            distill=not args.no_distill,
            progress=not args.no_progress,
            device=args.device,
            dataset=dataset,
        )
    except (BuildRefused, DatasetError) as err:  # said as a usage error, not a traceback
        parser.error(str(err))
    manifest = json.loads((path / "manifest.json").read_text())
    print(
        f"{path}\n  test accuracy {manifest['test_accuracy']:.3f} "
        f"(teacher probe {manifest['teacher_probe']['test_accuracy']:.3f}), "
        f"{manifest['parameters'] / 1e6:.2f}M parameters, trained in {manifest['train_seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
