#!/usr/bin/env python3
"""Inspection accuracy against the number of training images, with and without
distillation, on one GPU (`--device cuda`; the CPU takes hours at these sizes).

    python -m bench.vision_data [--images 16000,32000,64000,128000,256000] [--variants ...]

For each stream length the students below train on exactly the same freshly generated
images (engines/vision/vision_stream.train_students_streaming: each batch made once, the
teacher's targets made once), with the stream build's recipe and a cosine schedule over
that length, then are measured on the held-out test split, against the teacher's linear
probe (trained on the 600 stored training images, as in bench/vision.py):
  distilled   the shipped recipe: weight selection from the teacher, true labels,
              the probe's soft labels, cosine distillation of CLS and patch tokens
  features    the same without the probe's soft labels (kd_weight 0): what the
              teacher's features bring on their own
  plain       the baseline: random initial weights, true labels only

With --probe-images N also:
  distilled_stream_head  the distilled recipe with soft labels from a teacher head trained
              on the stream's first N images (which every student sees first) instead
and --extra-test N measures everything on N more held-out images as well (test_large):
on 500 images one image is 0.2 points.

The lengths can be split between GPUs, one run per GPU with the same options, and the
results joined with --combine:
    CUDA_VISIBLE_DEVICES=0 python -m bench.vision_data --images 256000 --out a.json &
    CUDA_VISIBLE_DEVICES=1 python -m bench.vision_data --images 32000,64000,128000 --out b.json
    python -m bench.vision_data --combine a.json b.json

Writes bench/results/vision_data.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import REPO, RESULTS, write_json
from edge.vision.vit import ViTConfig
from engines.vision.distill import TrainRecipe, predict
from engines.vision.factory_data import CLASSES
from engines.vision.vision_build import SIZES, build_dataset, load_split, teacher_probe
from engines.vision.vision_stream import StreamPlan, TeacherFeatures, generate, train_students_streaming
from engines.vision.vision_teacher import teacher_weights, train_probe

VARIANTS = ("distilled", "distilled_stream_head", "features", "plain")


def recipes(batch: int) -> dict[str, TrainRecipe]:
    distilled = TrainRecipe(epochs=0, batch_size=batch)  # what build_student uses for a stream size
    return {
        "distilled": distilled,
        "distilled_stream_head": distilled,  # the same, soft labels from the stream-trained head
        "features": replace(distilled, kd_weight=0.0),
        "plain": replace(distilled, distill=False, init="random"),
    }


def _accuracy(pred: np.ndarray, labels: np.ndarray) -> float:
    return float((pred == labels).mean())


def run(
    engine_dir: Path,
    lengths: list[int],
    variants: list[str],
    batch: int,
    device: str,
    probe_images: int,
    extra_test: int,
    workers: int,
    progress: bool,
    out: Path,
) -> dict[str, Any]:
    if "distilled_stream_head" in variants and not probe_images:
        raise ValueError("variant distilled_stream_head needs --probe-images")  # before any work
    size = SIZES["stream"]
    data_dir = build_dataset(engine_dir, size, progress)
    # Two test sets: the stored split every other figure is measured on, and, with
    # --extra-test, more held-out images from the same generator (unseen by every
    # model here) so that differences of a point or two stand out of the noise.
    tests = {"test": load_split(data_dir, "test")}
    if extra_test:
        more = range(size.test, size.test + extra_test)
        tests["test_large"] = generate(size.seed, "test", more, ViTConfig().grid, workers)
    val = load_split(data_dir, "val")
    probe, probe_info = teacher_probe(data_dir)
    features = TeacherFeatures(ViTConfig().grid, device)
    feats = {name: features(t["images"]) for name, t in tests.items()}

    @torch.no_grad()
    def head_scores(head: torch.nn.Linear) -> dict[str, float]:
        return {f"{n}_accuracy": _accuracy(head(x).argmax(1).numpy(), tests[n]["labels"]) for n, x in feats.items()}

    # The stored head's figures here come from the PyTorch teacher's features (bfloat16
    # on CUDA), as its soft labels do in training; bench/vision.py's from onnxruntime's.
    heads = {"stored": {**probe_info, "train_images": size.train, **head_scores(probe)}}
    stream_head = None
    if probe_images:
        # A teacher head trained on the stream itself: the first `probe_images` images,
        # which every student below also sees first.
        plan = StreamPlan(max(1, probe_images // batch), size.train, size.seed, workers)
        xs, ys = features.stream(plan, batch, progress)
        val_x, val_y = features(val["images"]), torch.from_numpy(val["labels"])
        stream_head, head_info = train_probe(xs, ys, val_x, val_y, len(CLASSES))
        heads["stream"] = {**head_info, "train_images": len(ys), **head_scores(stream_head)}
    config = ViTConfig(num_classes=len(CLASSES))
    weights = teacher_weights()
    by_name = recipes(batch)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "batch": batch,
        "test_images": {n: len(t["labels"]) for n, t in tests.items()},
        "teacher_heads": heads,
        "rows": [],
    }
    for images in lengths:
        steps = max(1, images // batch)
        # The first `steps` batches of the stream build's own stream.
        plan = StreamPlan(steps, size.train, size.seed, workers)
        t0 = time.perf_counter()
        trained = train_students_streaming(
            config,
            [by_name[v] for v in variants],
            plan,
            probe,
            weights,
            device,
            progress,
            probes=[stream_head if v == "distilled_stream_head" else probe for v in variants],
        )
        seconds = time.perf_counter() - t0
        for variant, (model, info) in zip(variants, trained, strict=True):
            model.to(device)  # measured where it trained: thousands of test images
            scores = {}
            for name, d in (("val", val), *tests.items()):
                probs, _ = predict(model, d["images"])
                scores[f"{name}_accuracy"] = _accuracy(probs.argmax(1), d["labels"])
            last = info["history"][-1] if info["history"] else {}
            row = {
                "images": steps * batch,
                "variant": variant,
                **scores,
                "final_ce": last.get("ce"),
                "train_seconds_all_variants": seconds,
            }
            result["rows"].append(row)
            print(
                f"{steps * batch:>9,} {variant:<22} " + " ".join(f"{k} {v * 100:5.1f}%" for k, v in scores.items()),
                flush=True,
            )
        # Written after every length: a long run cut short keeps what it measured.
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, result)
    return result


def print_table(result: dict[str, Any]) -> None:
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in result["rows"])]
    for test, count in result["test_images"].items():
        heads = ", ".join(
            f"{name} head {h[f'{test}_accuracy'] * 100:.1f}% (trained on {h['train_images']:,})"
            for name, h in result["teacher_heads"].items()
        )
        print(f"{test}: accuracy on {count:,} held-out images; teacher linear probe: {heads}")
        print(f"  {'images':>9}" + "".join(f"{v:>24}" for v in variants) + f"{'distilled - plain':>20}")
        for images in sorted({r["images"] for r in result["rows"]}):
            acc = {r["variant"]: r[f"{test}_accuracy"] for r in result["rows"] if r["images"] == images}
            diff = f"{(acc['distilled'] - acc['plain']) * 100:>+19.1f}" if {"distilled", "plain"} <= set(acc) else ""
            print(f"  {images:>9,}" + "".join(f"{acc[v] * 100:>23.1f}%" for v in variants) + diff)


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs that split the stream lengths between them (one per GPU, say):
    they must agree on everything but their rows, or their rows do not compare."""
    first = results[0]
    for other in results[1:]:
        for key in ("device", "torch", "batch", "test_images", "teacher_heads"):
            if other[key] != first[key]:
                raise ValueError(f"the runs differ in {key!r}: {first[key]!r} and {other[key]!r}")
    rows = [row for r in results for row in r["rows"]]
    seen = [(row["images"], row["variant"]) for row in rows]
    if len(set(seen)) != len(seen):
        raise ValueError("the runs measured some stream length and variant twice")
    rows.sort(key=lambda row: (row["images"], VARIANTS.index(row["variant"])))
    return {**first, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge/engines")
    parser.add_argument("--images", default="16000,32000,64000,128000,256000", help="stream lengths, comma-separated")
    parser.add_argument(
        "--variants", default="distilled,features,plain", help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--probe-images", type=int, default=0,
        help="also train a teacher head on this many streamed images (for distilled_stream_head)",
    )  # fmt: skip
    parser.add_argument("--extra-test", type=int, default=0, help="also measure on this many more held-out images")
    parser.add_argument("--workers", type=int, default=0, help="image generator processes (0: all cores but one)")
    parser.add_argument("--batch", type=int, default=SIZES["stream"].stream_batch)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "vision_data.json")
    parser.add_argument(
        "--combine", type=Path, nargs="+", metavar="RESULT",
        help="write the union of these results (runs that split --images between GPUs) to --out instead",
    )  # fmt: skip
    args = parser.parse_args()
    if args.combine:
        try:
            result = combine([json.loads(p.read_text(encoding="utf-8")) for p in args.combine])
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--combine: {e}")
        write_json(args.out, result)
        print_table(result)
        print(f"wrote {args.out}")
        return
    lengths = [int(x) for x in args.images.split(",") if x.strip()]
    if not lengths or min(lengths) < args.batch:
        parser.error(f"--images: each length must be at least one batch ({args.batch})")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants: each of {', '.join(VARIANTS)}")
    if "distilled_stream_head" in variants and args.probe_images < args.batch:
        parser.error("--probe-images: variant distilled_stream_head needs a head trained on at least one batch")
    result = run(
        args.engine_dir, lengths, variants, args.batch, args.device, args.probe_images, args.extra_test,
        args.workers, not args.no_progress, args.out,
    )  # fmt: skip
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
