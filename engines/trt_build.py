"""TensorRT plans for every model a profile serves, built on the box that runs them.

    python -m engines.trt_build --engine-dir DIR --models student,ocr,text
        [--student DIR] [--text DIR] [--compute-capability sm86] [--max-batch 16]

Plans are not portable across GPUs or TensorRT versions, so each is built for one
target (the TensorRT runtime and its version, the GPU's compute capability) and the
target is part of its cache key: after a JetPack upgrade the old plan is simply not
the one asked for, and a new one is built beside it.

Each plan lives in its own directory under `engine_dir/tensorrt/`, beside the ONNX
file it was built from, with the timing cache the build ended with and a manifest:
the runtime and version, the compute capability, the optimisation profiles, the
precision of every layer (layers.json, counted in the manifest), and the hashes of its
inputs. Serving reads only that manifest (edge/artifacts.py).

What is built:
  student   FP16 (the float ONNX converted, inputs and outputs kept float32) and INT8
            with explicit Q/DQ: activations calibrated on the student's own validation
            images (onnxruntime's static QDQ quantizer, symmetric, per-channel weights),
            its accuracy on the held-out test images measured here before the build.
  ocr       detection, angle and recognition in FP16, with profiles for the shapes the
            OCR pipeline feeds (edge/vision/ocr.py's bounds).
  text      the INT4 checkpoint exported by engines/text/text_onnx.py in float16, with a
            prefill and a decode profile. TensorRT's INT4 is weight-only and symmetric:
            an asymmetric checkpoint is refused, naming models.qa.quantization.

TensorRT is imported from `tensorrt` (JetPack, or a full install) or else from
`tensorrt_rtx`, which builds on a machine without a GPU for desktop targets only
(sm75/80/86/89/120): the build path can be checked anywhere, the plans run only on
their target.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge.artifacts import PLANS_DIR, Target, unsupported_tensorrt
from engines.cache import build_cached, cache_key, file_sha256, stop_on_sigterm

logger = logging.getLogger(__name__)

trt: Any = None
RUNTIME = ""
for _module, _runtime in (("tensorrt", "tensorrt"), ("tensorrt_rtx", "tensorrt-rtx")):
    try:
        trt = importlib.import_module(_module)
    except ImportError:
        continue
    RUNTIME = _runtime
    break
TRT_BUILD_SUPPORT = trt is not None

PLAN_BUILDER_VERSION = 1
KIND = "tensorrt-plan"
PLAN_FILE = "model.plan"
ONNX_FILE = "model.onnx"
TIMING_CACHE = "timing.cache"
LAYERS_FILE = "layers.json"
MODELS = ("student", "ocr", "text")
WORKSPACE_BYTES = 2 << 30
# Images the student's INT8 activations are calibrated on, and held-out images its
# accuracy is measured on before a plan is built from it.
CALIBRATION_IMAGES = 128


class PlanBuildError(RuntimeError):
    """A plan that cannot be built as asked, with the reason (and the setting to change)."""


@dataclass(frozen=True)
class Profile:
    """One optimisation profile: (min, opt, max) shapes per input."""

    name: str
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}


def _gpu_capability() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return f"sm{major}{minor}"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return None


def current_target(compute_capability: str | None = None) -> Target:
    """The target plans built here are for. Full TensorRT builds for the GPU it runs on;
    tensorrt-rtx for the capability named (or the GPU's, where there is one)."""
    if trt is None:
        raise PlanBuildError(
            "TensorRT is not installed: on a Jetson it comes with JetPack (python3-libnvinfer); on a "
            "desktop, pip install 'edge[tensorrt]' builds plans for desktop GPUs with tensorrt-rtx"
        )
    gpu = _gpu_capability()
    if RUNTIME == "tensorrt":
        refused = unsupported_tensorrt(str(trt.__version__))
        if refused:
            raise PlanBuildError(refused)
        if gpu is None:
            raise PlanBuildError("TensorRT builds plans for the GPU it runs on, and there is no CUDA GPU here")
        if compute_capability and compute_capability != gpu:
            raise PlanBuildError(f"TensorRT builds for this box's GPU ({gpu}), not {compute_capability}")
        return Target(RUNTIME, trt.__version__, gpu)
    wanted = compute_capability or gpu
    if wanted is None:
        raise PlanBuildError("tensorrt-rtx needs a target without a GPU here: pass --compute-capability (e.g. sm86)")
    if not hasattr(trt.ComputeCapability, wanted.upper()):
        known = sorted(c.lower() for c in dir(trt.ComputeCapability) if c.startswith("SM"))
        raise PlanBuildError(
            f"tensorrt-rtx {trt.__version__} cannot build for {wanted}; it builds for {', '.join(known)}"
        )
    return Target(RUNTIME, trt.__version__, wanted)


# -- ONNX preparation -----------------------------------------------------------------


def to_float16(src: Path, dst: Path) -> None:
    """The float ONNX model with its weights and activations in float16, its inputs and
    outputs kept float32 (a Cast at each end): what a strongly typed FP16 plan is built
    from."""
    import onnx
    from onnxconverter_common import float16

    model = onnx.load(str(src))
    name_free_axes(model)
    converted = float16.convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)
    onnx.save(converted, str(dst))


def onnx_metadata(path: Path) -> dict[str, str]:
    """The model's custom metadata (the recogniser's character list): a plan does not
    carry it, so its manifest does."""
    import onnx

    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def name_free_axes(model: Any) -> None:
    """Give every free axis of the graph's inputs a name of its own. TensorRT holds
    axes of one name equal: the OCR models call height and width both "?", and a plan
    built from them would take square images only."""
    for value in model.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                dim.dim_param = f"{value.name}_axis{axis}"


def weight_products(path: Path, keep_float: tuple[str, ...] = ()) -> list[str]:
    """The nodes that multiply an activation by a weight (MatMul, Gemm, Conv with an
    initializer operand), less those whose name contains one of `keep_float`. Products
    of two activations (attention's q.k and p.v) stay float: their ranges change with
    every image, and quantized they cost most of the accuracy."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    return [
        n.name
        for n in graph.node
        if n.op_type in ("MatMul", "Gemm", "Conv")
        and any(i in weights for i in n.input[1:2])
        and not any(k in n.name for k in keep_float)
    ]


def quantize_int8(
    src: Path, dst: Path, calibration: list[np.ndarray], input_name: str, keep_float: tuple[str, ...] = ()
) -> None:
    """Explicit INT8 Q/DQ before every product with a weight (weight_products):
    symmetric activations calibrated on `calibration` (each a batch), per-channel
    symmetric weights, biases left float: the form TensorRT takes."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._batches = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else {input_name: batch}

    quantize_static(
        str(src),
        str(dst),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul", "Gemm", "Conv"],
        nodes_to_quantize=weight_products(src, keep_float),
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
    )


# -- the build ------------------------------------------------------------------------


def _layer_table(network: Any) -> list[dict[str, str]]:
    """Each layer's type and the type of what it computes (in a strongly typed network
    a layer's precision is its output's type)."""
    rows = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        out = layer.get_output(0) if layer.num_outputs else None
        rows.append(
            {"name": layer.name, "type": layer.type.name, "precision": out.dtype.name if out is not None else "NONE"}
        )
    return rows


def build_plan(
    onnx_path: Path,
    out_dir: Path,
    profiles: list[Profile],
    target: Target,
    timing_cache: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Parse `onnx_path` into a strongly typed network (the precision is the ONNX
    file's own types and Q/DQ), build it for `target` with `profiles`, and write the
    plan, its timing cache and its layer table into `out_dir`; returns the manifest's
    plan fields. PlanBuildError names what the parser or builder refused."""
    logger_ = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger_)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger_)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)).splitlines()[0] for i in range(parser.num_errors))
        raise PlanBuildError(f"TensorRT's ONNX parser refused {onnx_path.name}: {errors}")
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if RUNTIME == "tensorrt-rtx":
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, target.compute_capability.upper()), 0)
    for spec in profiles:
        missing = inputs - set(spec.shapes)
        if missing:
            raise PlanBuildError(f"profile {spec.name!r} gives no shapes for {', '.join(sorted(missing))}")
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in spec.shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    # A timing cache carried from earlier builds for the same target: a rebuild (a new
    # adapter, say) re-times only layers it has not seen.
    blob = timing_cache.read_bytes() if timing_cache is not None and timing_cache.exists() else b""
    cache = config.create_timing_cache(blob)
    config.set_timing_cache(cache, ignore_mismatch=False)
    layers = _layer_table(network)
    if progress:
        progress(f"building {onnx_path.name}: {len(layers)} layers for {target.compute_capability}")
    started = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise PlanBuildError(f"TensorRT could not build {onnx_path.name} (its log is above)")
    seconds = time.perf_counter() - started
    (out_dir / PLAN_FILE).write_bytes(memoryview(plan))
    cache_bytes = bytes(memoryview(config.get_timing_cache().serialize()))
    (out_dir / TIMING_CACHE).write_bytes(cache_bytes)
    if timing_cache is not None:
        tmp = timing_cache.with_name(f".{timing_cache.name}.{os.getpid()}")
        tmp.write_bytes(cache_bytes)
        os.replace(tmp, timing_cache)
    (out_dir / LAYERS_FILE).write_text(json.dumps(layers, indent=0) + "\n", encoding="utf-8")
    logger.info("built %s in %.1f s: %d bytes", onnx_path.name, seconds, plan.nbytes)
    return {
        "kind": KIND,
        "plan": PLAN_FILE,
        "onnx": ONNX_FILE,
        "timing_cache": TIMING_CACHE,
        "layers_file": LAYERS_FILE,
        "target": target.to_dict(),
        "profiles": [p.to_dict() for p in profiles],
        "layer_precisions": dict(Counter(row["precision"] for row in layers)),
        "plan_bytes": int(plan.nbytes),
        "plan_sha256": hashlib.sha256(memoryview(plan)).hexdigest(),
        "build_seconds": round(seconds, 2),
    }


@dataclass(frozen=True)
class PlanJob:
    """One plan to build: its model name, the ONNX it starts from (prepared into the
    plan's directory by `prepare`), and what serving finds it by."""

    model: str
    precision: str
    source: Path
    source_sha256: str
    profiles: list[Profile]
    prepare: Callable[[Path], dict[str, Any]]
    serves: dict[str, Any]


def build_job(engine_dir: Path, job: PlanJob, target: Target) -> Path:
    inputs = {
        "model": job.model,
        "precision": job.precision,
        "source_sha256": job.source_sha256,
        "profiles": [p.to_dict() for p in job.profiles],
        "target": target.to_dict(),
        "builder": PLAN_BUILDER_VERSION,
    }
    out = engine_dir / PLANS_DIR / f"{job.model}-{job.precision}-{target.compute_capability}-{cache_key(inputs)}"
    shared_cache = (
        engine_dir / PLANS_DIR / f"timing-{target.runtime}-{target.version}-{target.compute_capability}.cache"
    )

    def build(scratch: Path) -> dict[str, Any]:
        details = job.prepare(scratch / ONNX_FILE)
        plan = build_plan(scratch / ONNX_FILE, scratch, job.profiles, target, shared_cache, logger.info)
        serves = {**job.serves, "precision": job.precision, **target.to_dict()}
        return {
            **plan,
            "model": job.model,
            "precision": job.precision,
            "source": str(job.source),
            "source_sha256": job.source_sha256,
            "onnx_sha256": file_sha256(scratch / ONNX_FILE),
            **details,
            "serves": [serves],
        }

    return build_cached(out, inputs, build)


# -- what each model needs --------------------------------------------------------------


def _student_onnx(student_dir: Path, dst: Path) -> None:
    """The student exported again from its weights by this code (a constant attention
    scale: builds exported before that hold a square root of a shape)."""
    from edge.vision.vit import load_student
    from engines.vision.vision_build import export_onnx

    export_onnx(load_student(student_dir), dst)


def _student_images(split: str, count: int, manifest: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Normalised images and labels of the student's own dataset split."""
    from edge.vision.vit import ViTConfig
    from engines.vision.vision_build import SIZES, _split_arrays
    from engines.vision.vision_teacher import normalise

    if manifest.get("dataset", "synthetic") != "synthetic":
        raise PlanBuildError("INT8 calibration of a student trained on a user's folder is not supported yet")
    size = SIZES[str(manifest.get("size", "default"))]
    arrays = _split_arrays(size.seed, split, count, ViTConfig().grid)
    return normalise(arrays["images"]).astype(np.float32), arrays["labels"]


def _onnx_accuracy(path: Path, images: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    probs = np.concatenate(
        [session.run(["class_probs"], {"pixels": images[i : i + 32]})[0] for i in range(0, len(images), 32)]
    )
    return float((probs.argmax(1) == labels).mean()), probs.argmax(1)


def student_jobs(student_dir: Path, max_batch: int, precisions: tuple[str, ...] = ("fp16", "int8")) -> list[PlanJob]:
    manifest = json.loads((student_dir / "manifest.json").read_text(encoding="utf-8"))
    size = int(json.loads((student_dir / "config.json").read_text(encoding="utf-8"))["image_size"])
    weights = student_dir / "student.pt"
    sha = file_sha256(weights)
    batch = max(1, max_batch)
    shapes = {"pixels": ((1, 3, size, size), (batch, 3, size, size), (batch, 3, size, size))}
    profiles = [Profile("batch", shapes)]
    serves = {"task": "inspect", "student": student_dir.name}

    def fp16(dst: Path) -> dict[str, Any]:
        float_onnx = dst.with_name("float.onnx")
        _student_onnx(student_dir, float_onnx)
        to_float16(float_onnx, dst)
        float_onnx.unlink()
        return {}

    def int8(dst: Path) -> dict[str, Any]:
        float_onnx = dst.with_name("float.onnx")
        _student_onnx(student_dir, float_onnx)
        calib, _ = _student_images("val", CALIBRATION_IMAGES, manifest)
        quantize_int8(float_onnx, dst, [calib[i : i + 16] for i in range(0, len(calib), 16)], "pixels")
        test, labels = _student_images("test", CALIBRATION_IMAGES, manifest)
        float_acc, float_pred = _onnx_accuracy(float_onnx, test, labels)
        int8_acc, int8_pred = _onnx_accuracy(dst, test, labels)
        float_onnx.unlink()
        logger.info("student INT8 Q/DQ on %d held-out images: %.3f (float %.3f)", len(labels), int8_acc, float_acc)
        return {
            "calibration": {"split": "val", "images": len(calib), "method": "minmax, symmetric, per-channel weights"},
            "onnx_check": {
                "split": "test",
                "images": len(labels),
                "float_accuracy": float_acc,
                "int8_accuracy": int8_acc,
                "agreement": float((float_pred == int8_pred).mean()),
            },
        }

    prepare = {"fp16": fp16, "int8": int8}
    return [
        PlanJob(
            "student",
            p,
            weights,
            sha + (f":calib{CALIBRATION_IMAGES}" if p == "int8" else ""),
            profiles,
            prepare[p],
            serves,
        )
        for p in precisions
    ]


def ocr_jobs(model_dir: Path, det_limit_side_len: int = 960) -> list[PlanJob]:
    from edge.vision import ocr

    side = -(-det_limit_side_len // 32) * 32
    rec_c, rec_h, rec_w = ocr.REC_SHAPE
    cls_c, cls_h, cls_w = ocr.CLS_SHAPE
    batch = ocr.LINE_BATCH
    specs = {
        "ocr-det": (ocr.DET_MODEL, {"x": ((1, 3, 32, 32), (1, 3, 640, 640), (1, 3, side, side))}),
        "ocr-cls": (
            ocr.CLS_MODEL,
            {"x": ((1, cls_c, cls_h, cls_w), (batch, cls_c, cls_h, cls_w), (batch, cls_c, cls_h, cls_w))},
        ),
        "ocr-rec": (
            ocr.REC_MODEL,
            {
                "x": (
                    (1, rec_c, rec_h, 32),
                    (batch, rec_c, rec_h, rec_w),
                    (batch, rec_c, rec_h, rec_h * ocr.REC_MAX_RATIO),
                )
            },
        ),
    }
    jobs = []
    for name, (file, shapes) in specs.items():
        src = model_dir / file

        def prepare(dst: Path, src: Path = src) -> dict[str, Any]:
            to_float16(src, dst)
            return {"metadata": onnx_metadata(src)}

        jobs.append(
            PlanJob(
                name, "fp16", src, file_sha256(src), [Profile("lines", shapes)], prepare, {"task": "ocr", "file": file}
            )
        )
    return jobs


def text_job(checkpoint: Path, max_context: int, max_sequences: int) -> PlanJob:
    from engines.text.text_onnx import export_checkpoint, is_symmetric, past_names

    quant_path = checkpoint / "quant.json"
    if not quant_path.exists():
        raise PlanBuildError(f"{checkpoint.name} is a float checkpoint; the text plan is built from an INT4 one")
    if not is_symmetric(checkpoint):
        raise PlanBuildError(
            f"{checkpoint.name} is quantized with zero points (asymmetric INT4); TensorRT's INT4 is weight-only "
            "and symmetric: set models.qa.quantization to awq-int4-sym (or rtn-int4-sym) and build again"
        )
    exported = export_checkpoint(checkpoint, "float16")
    manifest = json.loads((exported / "manifest.json").read_text(encoding="utf-8"))
    heads, dim = int(manifest["num_kv_heads"]), int(manifest["head_dim"])
    batch = max(1, max_sequences)

    def kv(low: int, opt: int, high: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (1, heads, low, dim), (batch, heads, opt, dim), (batch, heads, high, dim)

    def shapes(seq: tuple[int, int, int], past: tuple[int, int, int]) -> dict[str, Any]:
        out: dict[str, Any] = {"input_ids": ((1, seq[0]), (batch, seq[1]), (batch, seq[2]))}
        for i in range(int(manifest["num_layers"])):
            for name in past_names(i):
                out[name] = kv(*past)
        return out

    profiles = [
        Profile("prefill", shapes((1, min(128, max_context), max_context), (0, 0, 0))),
        Profile("decode", shapes((1, 1, 1), (1, min(256, max_context - 1), max_context - 1))),
    ]

    def prepare(dst: Path) -> dict[str, Any]:
        _link_or_copy(exported / manifest["onnx"], dst)
        if manifest.get("external_data"):
            _link_or_copy(exported / manifest["external_data"], dst.parent / manifest["external_data"])
        return {"text_onnx": exported.name, "linears": manifest["precisions"], "max_context": max_context}

    sha = file_sha256(exported / manifest["onnx"])
    return PlanJob("text", "int4-fp16", exported, sha, profiles, prepare, {"task": "qa", "checkpoint": checkpoint.name})


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the file system allows (the text model's weights are large),
    a copy otherwise."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build TensorRT plans (cached by their inputs and target).")
    parser.add_argument("--engine-dir", type=Path, default=Path(".edge/engines"))
    parser.add_argument("--models", default="student,ocr,text", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--student", type=Path, help="the student build directory (for student)")
    parser.add_argument("--text", type=Path, help="the INT4 text checkpoint directory (for text)")
    parser.add_argument("--ocr-models", type=Path, help="the OCR ONNX directory (default: the rapidocr wheel's)")
    parser.add_argument("--det-limit-side-len", type=int, default=960)
    parser.add_argument("--max-batch", type=int, default=16, help="largest student batch")
    parser.add_argument("--student-precisions", default="fp16,int8", help="the student's plans: fp16, int8 or both")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--max-sequences", type=int, default=1)
    parser.add_argument("--compute-capability", help="tensorrt-rtx only: the target GPU, e.g. sm86")
    parser.add_argument("--no-progress", action="store_true", help="accepted for the build command line")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    wanted = [m for m in args.models.split(",") if m]
    unknown = [m for m in wanted if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    try:
        target = current_target(args.compute_capability)
        jobs: list[PlanJob] = []
        if "student" in wanted:
            if args.student is None:
                parser.error("--models student needs --student DIR")
            precisions = tuple(x for x in args.student_precisions.split(",") if x)
            if not precisions or any(x not in ("fp16", "int8") for x in precisions):
                parser.error("--student-precisions: fp16, int8 or both")
            jobs += student_jobs(args.student, args.max_batch, precisions)
        if "ocr" in wanted:
            from edge.vision.ocr import bundled_model_dir

            jobs += ocr_jobs(args.ocr_models or bundled_model_dir(), args.det_limit_side_len)
        if "text" in wanted:
            if args.text is None:
                parser.error("--models text needs --text DIR")
            jobs.append(text_job(args.text, args.max_context, args.max_sequences))
        for i, job in enumerate(jobs, 1):
            logger.info("plan %d of %d: %s %s", i, len(jobs), job.model, job.precision)
            print(build_job(args.engine_dir, job, target))
    except PlanBuildError as err:
        print(f"trt_build: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
