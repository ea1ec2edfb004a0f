#!/usr/bin/env python3
"""Vision-branch accuracy and speed, against baselines measured in the same run.

    python -m bench.vision cpu    # accuracy table + onnxruntime speed, 2 threads
    python -m bench.vision cuda   # student: torch FP16 + CUDA graphs vs eager FP32

cpu: accuracy on the held-out test split of the teacher's linear probe, the distilled
student and the same student trained without distillation: the default builds (600
training images, built if missing) and the stream builds (256,000 generated images, and
768,000 for stream-long, trained on a GPU; reported if they are in the engine
directory); images/s at batch 1, 8 and 32 for teacher and student on onnxruntime; OCR
lines/s on the sample labels.
cuda: the student's images/s at batch 1, 8 and 32, optimised path (FP16 weights, SDPA,
one CUDA graph per batch size) against plain eager FP32, same weights, same run (speed
does not depend on weight values, so the student here has random weights).

Writes bench/results/vision_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import REPO, RESULTS, write_json
from edge.vision.vit import ExportWrapper, InspectViT, ViTConfig

BATCHES = (1, 8, 32)


def _rate(fn: Callable[[], Any], images: int, min_seconds: float = 2.0, min_runs: int = 3) -> float:
    """Images per second: median over runs, after one warm-up run."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return images / statistics.median(times)


# ----------------------------------------------------------------------------- CPU


# (row name, build size, distilled); the stream builds are found, never built here: on a
# CPU they would take hours (build them on a GPU machine, see engines/vision/vision_build.py).
STUDENTS = (
    ("student, distilled", "default", True),
    ("student, no distillation", "default", False),
    ("student, distilled (stream)", "stream", True),
    ("student, no distillation (stream)", "stream", False),
    ("student, distilled (stream-long)", "stream-long", True),
    ("student, no distillation (stream-long)", "stream-long", False),
)


def _accuracy(engine_dir: Path) -> dict[str, Any]:
    from edge.vision.vit import load_student
    from engines.cache import EngineMissing, existing_only
    from engines.vision.distill import predict
    from engines.vision.vision_build import SIZES, build_dataset, build_student, load_split, teacher_probe
    from engines.vision.vision_teacher import probe_features

    data_dir = build_dataset(engine_dir, SIZES["default"])  # every size's stored splits
    test = load_split(data_dir, "test")
    probe, info = teacher_probe(data_dir)
    with torch.no_grad():
        probe_pred = probe(probe_features(test["teacher_cls"], test["teacher_patches"])).argmax(1).numpy()
    data_manifest = json.loads((data_dir / "manifest.json").read_text())
    train_images = data_manifest["counts"]["train"]
    rows: list[dict[str, Any]] = [
        {
            "model": "teacher ViT-S linear probe",
            "test_accuracy": float((probe_pred == test["labels"]).mean()),
            "train_images": train_images,
        }
    ]
    missing: list[str] = []
    for name, size, distill in STUDENTS:
        if SIZES[size].stream_steps:
            try:
                with existing_only():
                    path = build_student(engine_dir, size, distill=distill, progress=False)
            except EngineMissing:
                missing.append(name)
                continue
        else:
            path = build_student(engine_dir, size, distill=distill)
        manifest = json.loads((path / "manifest.json").read_text())
        if data_manifest["inputs"] != manifest["inputs"]["data"]:
            raise RuntimeError(f"{path} was not built on this test split")
        probs, _ = predict(load_student(path), test["images"])
        rows.append(
            {
                "model": name,
                "test_accuracy": float((probs.argmax(1) == test["labels"]).mean()),
                "parameters": manifest["parameters"],
                # Builds from before these fields were recorded are default-size ones:
                # the stored training split, on the CPU.
                "train_images": manifest.get("train_images", train_images),
                "trained_on": manifest.get("trained_on", "cpu"),
                "train_seconds": manifest["train_seconds"],
                "build": path.name,
            }
        )
    return {
        "test_images": len(test["labels"]),
        "train_images": train_images,
        "probe": info,
        "rows": rows,
        "not_built": missing,
        "student_dir": rows[1]["build"],
    }


def _cpu_speed(engine_dir: Path, student_dir: str, threads: int) -> dict[str, Any]:
    import onnxruntime as ort

    from engines.vision.factory_data import make_sample
    from engines.vision.vision_teacher import TOKENS_OUTPUT, normalise, token_model_bytes

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    teacher = ort.InferenceSession(token_model_bytes(), sess_options=opts, providers=["CPUExecutionProvider"])
    student = ort.InferenceSession(
        str(engine_dir / student_dir / "student.onnx"), sess_options=opts, providers=["CPUExecutionProvider"]
    )
    images = np.stack([make_sample(9, "test", i).image for i in range(max(BATCHES))])
    rows: dict[str, dict[str, float]] = {"teacher": {}, "student": {}}
    for batch in BATCHES:
        x = normalise(images[:batch])

        def run_teacher(x: np.ndarray = x) -> None:
            teacher.run([TOKENS_OUTPUT], {"input_image": x})

        def run_student(x: np.ndarray = x) -> None:
            student.run(None, {"pixels": x})

        rows["teacher"][str(batch)] = _rate(run_teacher, batch)
        rows["student"][str(batch)] = _rate(run_student, batch)
    speedup = {b: rows["student"][b] / rows["teacher"][b] for b in rows["student"]}
    return {"images_per_s": rows, "student_vs_teacher": speedup}


def _ocr_speed(threads: int) -> dict[str, Any]:
    import cv2

    from edge.backends import BackendOptions
    from edge.vision.ocr import OCRPipeline, OCRSettings

    labels = json.loads((REPO / "samples/labels/labels.json").read_text())
    images = [np.asarray(cv2.imread(str(REPO / "samples/labels" / lab["name"])), np.uint8) for lab in labels]
    pipeline = OCRPipeline.load(OCRSettings(), "onnxruntime", BackendOptions(threads=threads))
    lines = sum([len(pipeline(img)) for img in images])

    def run_all() -> None:
        for img in images:
            pipeline(img)

    per_s = _rate(run_all, len(images))
    return {"images": len(images), "lines": lines, "images_per_s": per_s, "lines_per_s": per_s * lines / len(images)}


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    accuracy = _accuracy(args.engine_dir)
    speed = _cpu_speed(args.engine_dir, accuracy["student_dir"], args.threads)
    return {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "accuracy": accuracy,
        "speed": speed,
        "ocr": _ocr_speed(args.threads),
    }


def print_cpu(result: dict[str, Any]) -> None:
    acc = result["accuracy"]
    print(f"accuracy on {acc['test_images']} held-out test images")
    print(f"  {'model':<40} {'accuracy':>8} {'trained on':>22}")
    for row in acc["rows"]:
        where = f" ({row['trained_on']})" if "trained_on" in row else ""
        trained = f"{row['train_images']:,} images{where}"
        print(f"  {row['model']:<40} {row['test_accuracy'] * 100:7.1f}% {trained:>22}")
    for name in acc["not_built"]:
        size, distill = next((size, distill) for n, size, distill in STUDENTS if n == name)
        how = f"--size {size}" + ("" if distill else " --no-distill")
        print(f"  {name:<40} not built here (python -m engines.vision.vision_build {how} on a GPU machine)")
    print(f"onnxruntime, {result['threads']} threads, images/s")
    print(f"  {'batch':<8}" + "".join(f"{b:>10}" for b in BATCHES))
    for name, rates in result["speed"]["images_per_s"].items():
        print(f"  {name:<8}" + "".join(f"{rates[str(b)]:>10.1f}" for b in BATCHES))
    ratio = result["speed"]["student_vs_teacher"]
    print(f"  {'ratio':<8}" + "".join(f"{ratio[str(b)]:>9.1f}x" for b in BATCHES))
    ocr = result["ocr"]
    print(f"OCR: {ocr['lines_per_s']:.1f} lines/s ({ocr['images_per_s']:.1f} label images/s)")


# ----------------------------------------------------------------------------- CUDA


def _cuda_rate(fn: Callable[[], Any], images: int) -> float:
    from bench.text import cuda_time  # the same CUDA-event timing as the text benchmark

    return images / cuda_time(fn, repeat=20, warmup=3)


def run_cuda(args: argparse.Namespace) -> dict[str, Any]:
    from edge.backends.torch_backend import TorchCudaSession
    from edge.vision import student as student_artifact

    torch.manual_seed(0)
    model = InspectViT(ViTConfig()).eval()
    eager = ExportWrapper(model).cuda().eval()  # float32, no graphs: the baseline
    fp16 = ExportWrapper(InspectViT(ViTConfig()).eval()).eval()
    fp16.model.load_state_dict(model.state_dict())
    session = TorchCudaSession(fp16.cuda().half(), max(BATCHES), (student_artifact.INPUT,), student_artifact.OUTPUTS)
    rows: dict[str, dict[str, float]] = {"eager fp32": {}, "fp16 + CUDA graphs": {}}
    worst = 0.0
    for batch in BATCHES:
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        with torch.inference_mode():
            ref = eager(x)
            got = session.run_tensor(x)
        worst = max(worst, float((got[0] - ref[0]).abs().max()))

        def run_eager(x: torch.Tensor = x) -> None:
            with torch.inference_mode():
                eager(x)

        rows["eager fp32"][str(batch)] = _cuda_rate(run_eager, batch)

        def run_graphs(x: torch.Tensor = x) -> None:
            session.run_tensor(x)

        rows["fp16 + CUDA graphs"][str(batch)] = _cuda_rate(run_graphs, batch)
    speedup = {b: rows["fp16 + CUDA graphs"][b] / rows["eager fp32"][b] for b in rows["eager fp32"]}
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "class_prob_max_abs_diff": worst,
        "images_per_s": rows,
        "optimised_vs_eager": speedup,
    }


def print_cuda(result: dict[str, Any]) -> None:
    print(
        f"{result['device']}, student images/s (class-probability max |diff| {result['class_prob_max_abs_diff']:.1e})"
    )
    print(f"  {'batch':<20}" + "".join(f"{b:>10}" for b in BATCHES))
    for name, rates in result["images_per_s"].items():
        print(f"  {name:<20}" + "".join(f"{rates[str(b)]:>10.0f}" for b in BATCHES))
    ratio = result["optimised_vs_eager"]
    print(f"  {'ratio':<20}" + "".join(f"{ratio[str(b)]:>9.1f}x" for b in BATCHES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge/engines")
    parser.add_argument("--threads", type=int, default=2, help="cpu: threads for every model")
    parser.add_argument("--out", type=Path, help="default: bench/results/vision_<device>.json")
    args = parser.parse_args()
    result = run_cpu(args) if args.device == "cpu" else run_cuda(args)
    out = args.out or RESULTS / f"vision_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    (print_cpu if args.device == "cpu" else print_cuda)(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
