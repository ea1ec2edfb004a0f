"""`edgectl verify`: every model the profile serves, through every backend this box has,
on the same inputs, against one reference each.

What a field engineer runs after a JetPack or driver upgrade: the same student, OCR
models and text model computed by onnxruntime on the CPU, torch on the CPU, torch on
CUDA and TensorRT (where each is present) must agree with the reference within the
tolerance their precision allows. The result is one JSON object:

    {"checks": [{"model", "backend", "reference", "max_abs_diff", "cosine", "agreement",
                 "ok", ...}], "ok": bool, ...}

`agreement` is the share of top-1 choices equal to the reference's: the class of each
image for the student, the character of each position for recognition, the arg-max of
each pixel's text/background call for detection, and for the text model each next
token along prompts continued greedily by the reference (teacher-forced: every backend
reads the same tokens). Backends absent here are listed under `skipped` with why.
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge import builds
from edge.artifacts import EngineMissing, read_manifest
from edge.backends import BackendOptions, BackendUnavailable, ModelSource, available_backends, get_backend
from edge.config.backends import OnnxRuntimeConfig, TensorRTConfig, TorchCudaConfig
from edge.config.profile import Profile

logger = logging.getLogger(__name__)

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
PROMPTS = (
    "What is the normal resting heart rate for adults?",
    "Context: Paracetamol: adults take 500 mg to 1 g every 4 to 6 hours, at most 4 g in 24 hours.\n"
    "Question: What is the most paracetamol an adult may take in a day?",
    "List three signs of dehydration.",
    "Context: The clinic opens at 8:00 and closes at 17:30 on weekdays.\nQuestion: When does the clinic close?",
)
NEW_TOKENS = 32


@dataclass(frozen=True)
class Tolerance:
    max_abs_diff: float
    cosine: float
    agreement: float


# By what the backend computes in: float32 must match to rounding, half precision to
# its own rounding, INT8 (the student's Q/DQ plan) to its calibration.
TOLERANCES = {
    "float32": Tolerance(max_abs_diff=1e-3, cosine=0.99999, agreement=1.0),
    "float16": Tolerance(max_abs_diff=0.05, cosine=0.999, agreement=0.95),
    "int8": Tolerance(max_abs_diff=0.25, cosine=0.98, agreement=0.9),
}
# The text model's logits are tens in size; its float32 paths differ in summation order.
TEXT_TOLERANCES = {
    "float32": Tolerance(max_abs_diff=1e-2, cosine=0.99999, agreement=1.0),
    "float16": Tolerance(max_abs_diff=1.0, cosine=0.999, agreement=0.9),
    # torch's CPU INT4 kernel (models.qa.cpu_kernel: bf16) rounds inputs and sums to bfloat16.
    "bfloat16": Tolerance(max_abs_diff=3.0, cosine=0.998, agreement=0.9),
    # Ours with int8 activations (cpu_kernel: int8): each activation to 1/254 of its block's largest.
    "int8": Tolerance(max_abs_diff=3.0, cosine=0.998, agreement=0.9),
}


@dataclass
class Check:
    model: str
    backend: str
    reference: str
    precision: str
    max_abs_diff: float
    cosine: float
    agreement: float
    ok: bool
    samples: int
    tolerance: dict[str, float] = field(default_factory=dict)
    # For the text model: what the engine under test resolved to (TextEngine.config).
    engine_config: dict[str, Any] | None = None


def compare(
    model: str,
    backend: str,
    reference: str,
    precision: str,
    got: list[np.ndarray],
    ref: list[np.ndarray],
    top1: Callable[[list[np.ndarray]], np.ndarray],
    tolerances: dict[str, Tolerance] = TOLERANCES,
) -> Check:
    """One backend's outputs against the reference's, under its precision's tolerance."""
    a = np.concatenate([np.asarray(x, np.float64).ravel() for x in got])
    b = np.concatenate([np.asarray(x, np.float64).ravel() for x in ref])
    if a.shape != b.shape:
        raise ValueError(f"{model} on {backend}: outputs of {a.size} values, the reference has {b.size}")
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    cosine = float(a @ b / norm) if norm > 0 else float(np.array_equal(a, b))
    picks, ref_picks = top1(got), top1(ref)
    agreement = float((picks == ref_picks).mean()) if picks.size else 1.0
    tol = tolerances[precision]
    ok = diff <= tol.max_abs_diff and cosine >= tol.cosine and agreement >= tol.agreement
    return Check(model, backend, reference, precision, diff, cosine, agreement, ok, int(ref_picks.size), asdict(tol))


# -- the student ------------------------------------------------------------------------


def sample_images(count: int = 8, seed: int = 0) -> list[np.ndarray]:
    """The shipped sample parts (RGB), then smooth random images to make up `count`."""
    import cv2

    images = []
    for path in sorted((SAMPLES / "parts").glob("*.png")):
        bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if bgr is not None:
            images.append(np.ascontiguousarray(bgr[:, :, ::-1]))
    rng = np.random.default_rng(seed)
    while len(images) < count:
        coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        images.append(cv2.resize(coarse, (256, 256), interpolation=cv2.INTER_CUBIC))
    return images[:count]


def _class_top1(outputs: list[np.ndarray]) -> np.ndarray:
    return np.asarray(np.asarray(outputs[0]).argmax(-1))


def verify_student(profile: Profile, student: Path, have: set[str], skipped: list[dict[str, str]]) -> list[Check]:
    import torch

    from edge.vision.inspect import preprocess
    from edge.vision.student import INPUT, StudentArtifact

    artifact = StudentArtifact.open(student)
    source = artifact.source()
    pixels = preprocess(sample_images(), artifact.image_size)
    assert source.torch_module is not None
    with torch.inference_mode():
        module = source.torch_module().float().eval()
        ref = [t.numpy() for t in module(torch.from_numpy(pixels))]
    reference = "torch-cpu float32"
    checks = []
    options = BackendOptions(max_batch=len(pixels), engine_dir=profile.paths.engine_dir)

    def run(backend: str, config: Any) -> list[np.ndarray]:
        return get_backend(backend).load(source, replace(options, config=config)).run({INPUT: pixels})

    def trt_run(precision: str) -> list[np.ndarray]:
        return run("tensorrt", TensorRTConfig(precision="int8" if precision == "int8" else "fp16"))

    checks.append(
        compare(
            "student", "onnxruntime", reference, "float32", run("onnxruntime", OnnxRuntimeConfig()), ref, _class_top1
        )
    )
    if "torch-cuda" in have:
        got = run("torch-cuda", TorchCudaConfig(cuda_graphs=False))
        checks.append(compare("student", "torch-cuda", reference, "float16", got, ref, _class_top1))
    else:
        skipped.append({"model": "student", "backend": "torch-cuda", "why": "no CUDA device"})
    for precision in ("fp16", "int8"):
        _tensorrt_check(checks, skipped, "student", have, precision, reference, ref, _class_top1, trt_run)
    return checks


def _tensorrt_check(
    checks: list[Check],
    skipped: list[dict[str, str]],
    model: str,
    have: set[str],
    precision: str,
    reference: str,
    ref: list[np.ndarray],
    top1: Callable[[list[np.ndarray]], np.ndarray],
    run: Callable[[str], list[np.ndarray]],
) -> None:
    backend = f"tensorrt {precision}"
    if "tensorrt" not in have:
        skipped.append({"model": model, "backend": backend, "why": "TensorRT is not installed here"})
        return
    try:
        got = run(precision)
    except (BackendUnavailable, EngineMissing) as err:
        skipped.append({"model": model, "backend": backend, "why": str(err)})
        return
    checks.append(compare(model, backend, reference, "float16" if precision == "fp16" else "int8", got, ref, top1))


# -- OCR ----------------------------------------------------------------------------------


def _ocr_inputs(name: str) -> np.ndarray:
    """What the OCR pipeline feeds each model, from the shipped label images."""
    import cv2

    from edge.vision import ocr

    labels = sorted((SAMPLES / "labels").glob("*.png"))
    read = cv2.imread(str(labels[0]), cv2.IMREAD_COLOR) if labels else None
    img: np.ndarray = read if read is not None else np.full((96, 320, 3), 255, np.uint8)
    if name == "det":
        h, w = (max(32, (s // 32) * 32) for s in img.shape[:2])
        img = cv2.resize(img, (w, h))
        x = (img.astype(np.float32) / 255.0 - 0.5) / 0.5
        return np.asarray(x.transpose(2, 0, 1)[None])
    _, h, w = ocr.CLS_SHAPE if name == "cls" else ocr.REC_SHAPE
    line = cv2.resize(img, (w, h)).astype(np.float32)
    x = (line / 255.0 - 0.5) / 0.5
    return np.repeat(x.transpose(2, 0, 1)[None], 2, axis=0)


def _last_axis_top1(outputs: list[np.ndarray]) -> np.ndarray:
    out = np.asarray(outputs[0])
    return out.argmax(-1) if out.shape[-1] > 1 else (out > 0.5).astype(np.int64)


def _det_top1(outputs: list[np.ndarray]) -> np.ndarray:
    return (np.asarray(outputs[0]) > 0.3).astype(np.int64)  # the DB threshold's side of each pixel


def verify_ocr(profile: Profile, have: set[str], skipped: list[dict[str, str]]) -> list[Check]:
    import onnxruntime as ort

    from edge.vision import ocr

    model_dir = ocr.bundled_model_dir()
    checks = []
    files = {"det": ocr.DET_MODEL, "cls": ocr.CLS_MODEL, "rec": ocr.REC_MODEL}
    for name, file in files.items():
        x = _ocr_inputs(name)
        plain = ort.SessionOptions()
        plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(model_dir / file), plain, providers=["CPUExecutionProvider"])
        ref = [np.asarray(o) for o in session.run(None, {"x": x})]
        reference = "onnxruntime unoptimised graph"
        top1 = _det_top1 if name == "det" else _last_axis_top1
        source = ModelSource(f"OCR {name}", onnx=model_dir / file, plan={"task": "ocr", "file": file})
        served = get_backend("onnxruntime").load(source, BackendOptions(engine_dir=profile.paths.engine_dir))
        checks.append(compare(f"ocr-{name}", "onnxruntime", reference, "float32", served.run({"x": x}), ref, top1))

        def trt_run(precision: str, source: ModelSource = source, x: np.ndarray = x) -> list[np.ndarray]:
            opts = BackendOptions(engine_dir=profile.paths.engine_dir, config=TensorRTConfig(precision="fp16"))
            return get_backend("tensorrt").load(source, opts).run({"x": x})

        _tensorrt_check(checks, skipped, f"ocr-{name}", have, "fp16", reference, ref, top1, trt_run)
    return checks


# -- the text model ---------------------------------------------------------------------------


def _text_onnx(checkpoint: Path, dtype: str) -> Path:
    """The checkpoint's ONNX export (engines/text/text_onnx.py), made in a child process
    if it is not there yet."""
    for directory in sorted(checkpoint.parent.iterdir()):
        manifest = read_manifest(directory) if directory.is_dir() and not directory.name.startswith(".") else None
        if (
            manifest is not None
            and manifest.get("kind") == "text-onnx"
            and manifest.get("checkpoint") == checkpoint.name
            and manifest.get("dtype") == dtype
        ):
            return directory
    line = [sys.executable, "-m", "engines.text.text_onnx", "--checkpoint", str(checkpoint), "--dtype", dtype]
    done = subprocess.run(line, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"exporting {checkpoint.name} to ONNX failed: {done.stderr.strip()[-500:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _token_top1(outputs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(o).argmax(-1).ravel() for o in outputs])


def verify_text(profile: Profile, checkpoint: Path, have: set[str], skipped: list[dict[str, str]]) -> list[Check]:
    import onnxruntime as ort
    import torch

    from edge.text.engine import TextEngine, variant
    from edge.text.prompt import chatml

    # Every engine here is the profile's qa section with only the named fields changed:
    # the reference is its exact float32 CPU form, one sequence, nothing warmed.
    qa = profile.models.qa

    def engine(**changes: Any) -> TextEngine:
        cfg = variant(qa, max_sequences=1, kv_offload="off", prefix_cache_mib=0, **changes)
        return TextEngine.load(checkpoint, cfg, origin={"profile": profile.device_id, "changed": changes}, warm=False)

    ref_engine = engine(device="cpu", dtype="float32", cpu_kernel="exact")
    model, tok = ref_engine.model, ref_engine.tokenizer
    sequences: list[list[int]] = []
    for question in PROMPTS:
        ids = tok.encode(chatml("You are a careful assistant in a clinic.", question), add_special_tokens=False).ids
        cache = model.new_cache(1, len(ids) + NEW_TOKENS + 1)
        logits = model(torch.tensor([ids]), cache, 0)
        for _ in range(NEW_TOKENS):
            token = int(logits[0, -1].argmax())
            ids.append(token)
            logits = model(torch.tensor([[token]]), cache, len(ids) - 1)
        sequences.append(ids)

    def torch_logits(m: Any, device: str) -> list[np.ndarray]:
        out = []
        for ids in sequences:
            cache = m.new_cache(1, len(ids))
            with torch.inference_mode():
                out.append(m(torch.tensor([ids], device=device), cache, 0, last_only=False)[0].float().cpu().numpy())
        return out

    ref = torch_logits(model, "cpu")
    reference = f"torch-cpu float32 ({ref_engine.int4_kernel})"
    checks = []

    export = _text_onnx(checkpoint, "float32")
    manifest = json.loads((export / "manifest.json").read_text(encoding="utf-8"))
    options = ort.SessionOptions()
    # onnxruntime fuses DequantizeLinear + MatMul into MatMulNBits, whose default
    # accuracy level rounds the activations to int8: ask for float32 products.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    session = ort.InferenceSession(str(export / manifest["onnx"]), options, providers=["CPUExecutionProvider"])
    heads, dim = int(manifest["num_kv_heads"]), int(manifest["head_dim"])
    got = []
    for ids in sequences:
        feed: dict[str, np.ndarray] = {"input_ids": np.array([ids], np.int64)}
        for i in range(int(manifest["num_layers"])):
            for suffix in ("key", "value"):
                feed[f"past_key_values.{i}.{suffix}"] = np.zeros((1, heads, 0, dim), np.float32)
        got.append(session.run(["logits"], feed)[0][0])
    checks.append(compare("text", "onnxruntime", reference, "float32", got, ref, _token_top1, TEXT_TOLERANCES))

    from edge.text.ops.cpu import cpu_int4
    from edge.text.ops.int4 import cpu_kernel_available

    # Our kernel with int8 activations (what the CPU profile serves) and torch's bfloat16 one.
    others = (("int8", "int8", cpu_int4.available(int8=True)), ("bf16", "bfloat16", cpu_kernel_available()))
    for setting, precision, runs in others:
        if not runs:
            continue
        other = engine(device="cpu", dtype="float32", cpu_kernel=setting)
        got = torch_logits(other.model, "cpu")
        check = compare(
            "text", f"torch-cpu ({other.int4_kernel})", reference, precision, got, ref, _token_top1, TEXT_TOLERANCES
        )
        checks.append(replace(check, engine_config=other.config()))
        del other
    if "torch-cuda" in have:
        # The dtype the profile serves on CUDA (its own, or "auto"'s).
        cuda = engine(device="cuda")
        check = compare(
            "text",
            f"torch-cuda ({cuda.int4_kernel})",
            reference,
            cuda.config()["dtype"],
            torch_logits(cuda.model, "cuda"),
            ref,
            _token_top1,
            TEXT_TOLERANCES,
        )
        checks.append(replace(check, engine_config=cuda.config()))
        del cuda
    else:
        skipped.append({"model": "text", "backend": "torch-cuda", "why": "no CUDA device"})
    if "tensorrt" in have:
        try:
            from edge.backends.tensorrt_backend import open_text_plan

            plan = open_text_plan(profile.paths.engine_dir, checkpoint.name)
            got = []
            for ids in sequences:
                plan.reset(1)
                got.append(plan.step(torch.tensor([ids]))[0].float().cpu().numpy())
            checks.append(
                compare("text", "tensorrt int4-fp16", reference, "float16", got, ref, _token_top1, TEXT_TOLERANCES)
            )
        except (BackendUnavailable, EngineMissing) as err:
            skipped.append({"model": "text", "backend": "tensorrt int4-fp16", "why": str(err)})
    else:
        skipped.append({"model": "text", "backend": "tensorrt int4-fp16", "why": "TensorRT is not installed here"})
    return checks


def present_backends() -> set[str]:
    have = set(available_backends())
    try:
        import torch

        if torch.cuda.is_available():
            have.add("torch-cuda")
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return have


def verify(profile: Profile) -> dict[str, Any]:
    """Every check the profile's models allow here; `ok` only when each passes."""
    have = present_backends()
    skipped: list[dict[str, str]] = []
    checks: list[Check] = []
    m = profile.models
    if m.inspect.enabled:
        checks += verify_student(profile, builds.locate(profile, "inspect", None), have, skipped)
    if m.ocr.enabled:
        checks += verify_ocr(profile, have, skipped)
    if m.qa.enabled:
        checks += verify_text(profile, builds.locate(profile, "qa", None), have, skipped)
    import torch

    return {
        "checks": [asdict(c) for c in checks],
        "ok": all(c.ok for c in checks),
        "skipped": skipped,
        "backends": sorted(have),
        "machine": platform.machine(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }


def render(doc: dict[str, Any]) -> str:
    lines = [f"{'model':<8} {'backend':<28} {'max |diff|':>11} {'cosine':>9} {'agree':>6}  ok"]
    for c in doc["checks"]:
        lines.append(
            f"{c['model']:<8} {c['backend']:<28} {c['max_abs_diff']:>11.2e} {c['cosine']:>9.6f} "
            f"{c['agreement']:>6.3f}  {'yes' if c['ok'] else 'NO'}"
        )
    for s in doc["skipped"]:
        lines.append(f"{s['model']:<8} {s['backend']:<28} skipped: {s['why']}")
    lines.append("verify: " + ("all checks pass" if doc["ok"] else "FAILED: some backend is out of tolerance"))
    return "\n".join(lines)
