#!/usr/bin/env python3
"""Inspection accuracy against the number of training images, with and without
distillation, on one GPU (`--device cuda`; the CPU takes hours at these sizes).

    python scripts/bench_vision_data.py [--images 16000,32000,64000,128000,256000]

For each stream length the students below train on exactly the same freshly generated
images (engines/vision_stream.train_students_streaming: each batch made once, the
teacher's targets made once), with the stream build's recipe and a cosine schedule over
that length, then are measured on the held-out test split, against the teacher's linear
probe (trained on the 600 stored training images, as in bench_vision.py):
  distilled   the shipped recipe: weight selection from the teacher, true labels,
              the probe's soft labels, cosine distillation of CLS and patch tokens
  features    the same without the probe's soft labels (kd_weight 0): what the
              teacher's features bring on their own
  plain       the baseline: random initial weights, true labels only

Writes bench/results/vision_data.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge.vision.vit import ViTConfig  # noqa: E402
from engines.distill import TrainRecipe, predict  # noqa: E402
from engines.factory_data import CLASSES  # noqa: E402
from engines.vision_build import SIZES, build_dataset, load_split, teacher_probe  # noqa: E402
from engines.vision_stream import StreamPlan, train_students_streaming  # noqa: E402
from engines.vision_teacher import probe_features, teacher_weights  # noqa: E402

VARIANTS = ("distilled", "features", "plain")


def recipes(batch: int) -> dict[str, TrainRecipe]:
    distilled = TrainRecipe(epochs=0, batch_size=batch)  # what build_student uses for a stream size
    return {
        "distilled": distilled,
        "features": replace(distilled, kd_weight=0.0),
        "plain": replace(distilled, distill=False, init="random"),
    }


def run(engine_dir: Path, lengths: list[int], batch: int, device: str, progress: bool) -> dict[str, Any]:
    size = SIZES["stream"]
    data_dir = build_dataset(engine_dir, size, progress)
    test = load_split(data_dir, "test")
    val = load_split(data_dir, "val")
    probe, probe_info = teacher_probe(data_dir)
    with torch.no_grad():
        probe_pred = probe(probe_features(test["teacher_cls"], test["teacher_patches"])).argmax(1).numpy()
    probe_acc = float((probe_pred == test["labels"]).mean())
    config = ViTConfig(num_classes=len(CLASSES))
    weights = teacher_weights()
    by_name = recipes(batch)
    rows: list[dict[str, Any]] = []
    for images in lengths:
        steps = max(1, images // batch)
        # The first `steps` batches of the stream build's own stream.
        plan = StreamPlan(steps=steps, first_index=size.train, seed=size.seed)
        t0 = time.perf_counter()
        trained = train_students_streaming(
            config, [by_name[v] for v in VARIANTS], plan, probe, weights, device, progress
        )
        seconds = time.perf_counter() - t0
        for variant, (model, info) in zip(VARIANTS, trained, strict=True):
            scores = {}
            for split, d in (("val", val), ("test", test)):
                probs, _ = predict(model, d["images"])
                scores[f"{split}_accuracy"] = float((probs.argmax(1) == d["labels"]).mean())
            last = info["history"][-1] if info["history"] else {}
            rows.append(
                {
                    "images": steps * batch,
                    "variant": variant,
                    **scores,
                    "final_ce": last.get("ce"),
                    "train_seconds_all_variants": seconds,
                }
            )
            print(f"{steps * batch:>9,} {variant:<10} test {scores['test_accuracy'] * 100:5.1f}%", flush=True)
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "batch": batch,
        "test_images": len(test["labels"]),
        "teacher_probe": {**probe_info, "test_accuracy": probe_acc, "train_images": size.train},
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    probe = result["teacher_probe"]
    print(
        f"test accuracy on {result['test_images']} held-out images; teacher linear probe "
        f"{probe['test_accuracy'] * 100:.1f}% (trained on {probe['train_images']})"
    )
    print(f"  {'images':>9}" + "".join(f"{v:>12}" for v in VARIANTS) + f"{'distilled - plain':>20}")
    for images in sorted({r["images"] for r in result["rows"]}):
        acc = {r["variant"]: r["test_accuracy"] for r in result["rows"] if r["images"] == images}
        diff = (acc["distilled"] - acc["plain"]) * 100
        print(f"  {images:>9,}" + "".join(f"{acc[v] * 100:>11.1f}%" for v in VARIANTS) + f"{diff:>+19.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge/engines")
    parser.add_argument("--images", default="16000,32000,64000,128000,256000", help="stream lengths, comma-separated")
    parser.add_argument("--batch", type=int, default=SIZES["stream"].stream_batch)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vision_data.json")
    args = parser.parse_args()
    lengths = [int(x) for x in args.images.split(",") if x.strip()]
    if not lengths or min(lengths) < args.batch:
        parser.error(f"--images: each length must be at least one batch ({args.batch})")
    result = run(args.engine_dir, lengths, args.batch, args.device, not args.no_progress)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
