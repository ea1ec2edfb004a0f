"""`edgectl verify`: every model through every backend here, against its reference;
exit 0 only when all agree within their tolerance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.verify import TOLERANCES, compare, render
from tests.conftest import edgectl, write_profile

KEYS = {"model", "backend", "reference", "max_abs_diff", "cosine", "agreement", "ok"}


def top1(outputs: list[np.ndarray]) -> np.ndarray:
    return np.asarray(np.asarray(outputs[0]).argmax(-1))


def test_compare_holds_each_precision_to_its_tolerance() -> None:
    rng = np.random.default_rng(0)
    ref = [rng.random((16, 4)).astype(np.float32)]
    same = compare("m", "b", "r", "float32", [ref[0] + 1e-5], ref, top1)
    assert same.ok and same.agreement == 1.0 and same.max_abs_diff == pytest.approx(1e-5, rel=0.1)
    off = compare("m", "b", "r", "float32", [ref[0] + 2e-3], ref, top1)
    assert not off.ok and off.max_abs_diff > TOLERANCES["float32"].max_abs_diff
    # A changed choice fails even a loose precision's check when too many change.
    flipped = ref[0].copy()
    flipped[:4] = flipped[:4, ::-1]
    changed = compare("m", "b", "r", "int8", [flipped], ref, top1)
    assert changed.agreement <= 0.75 + 1e-9 and not changed.ok
    assert compare("m", "b", "r", "float16", [ref[0] + 1e-3], ref, top1).ok
    with pytest.raises(ValueError, match="outputs of 32 values"):
        compare("m", "b", "r", "float32", [ref[0][:8]], ref, top1)


@pytest.mark.slow
def test_verify_passes_on_this_box_and_prints_the_interface(engine_dir: Path, tmp_path: Path) -> None:
    profile = write_profile(tmp_path, 1883, engine_dir, device_id="v1")
    done = edgectl("verify", "--profile", str(profile), "--json", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert doc["ok"] is True
    checks = doc["checks"]
    assert all(KEYS <= set(c) and c["ok"] for c in checks)
    pairs = {(c["model"], c["backend"].split(" (")[0]) for c in checks}
    assert {("student", "onnxruntime"), ("ocr-det", "onnxruntime"), ("ocr-cls", "onnxruntime")} <= pairs
    assert {("ocr-rec", "onnxruntime"), ("text", "onnxruntime")} <= pairs
    text = next(c for c in checks if c["model"] == "text" and c["backend"] == "onnxruntime")
    assert text["agreement"] == 1.0 and text["max_abs_diff"] < 5e-3 and text["samples"] > 4 * 32
    int8 = next(c for c in checks if c["backend"] == "torch-cpu (cpu-int8)")  # ours with int8 activations
    assert int8["precision"] == "int8" and int8["agreement"] >= 0.9
    if any(c["backend"] == "torch-cpu (cpu)" for c in checks):  # torch's INT4 CPU kernel, where it has one
        bf16 = next(c for c in checks if c["backend"] == "torch-cpu (cpu)")
        assert bf16["precision"] == "bfloat16" and bf16["agreement"] >= 0.9
    skipped = {(s["model"], s["backend"]) for s in doc["skipped"]}
    assert ("student", "tensorrt fp16") in skipped and ("text", "torch-cuda") in skipped
    table = render(doc)  # what `edgectl verify` prints without --json
    assert "verify: all checks pass" in table and "skipped: TensorRT is not installed here" in table


def test_verify_fails_when_a_backend_computes_another_model(engine_dir: Path, tmp_path: Path) -> None:
    """A student whose ONNX file is not its weights' (an export of other weights, as a
    stale or swapped file would be) is out of tolerance: exit 1, the check not ok."""
    from edge.artifacts import find
    from edge.vision.vit import load_student
    from engines.vision.vision_build import export_onnx

    student = find(engine_dir, task="inspect", size="quick", distilled=True, dataset="synthetic")
    assert student is not None
    copy = tmp_path / "student"
    shutil.copytree(student.path, copy)
    model = load_student(copy)
    with torch.no_grad():
        model.head.weight.mul_(1.5)
    export_onnx(model, copy / "student.onnx")
    models = {"ocr": {"enabled": False}, "qa": {"enabled": False}, "inspect": {"engine": str(copy)}}
    profile = write_profile(tmp_path, 1883, engine_dir, device_id="v2", models=models)
    done = edgectl("verify", "--profile", str(profile), "--json", timeout=300)
    assert done.returncode == 1
    doc = json.loads(done.stdout)
    bad = [c for c in doc["checks"] if not c["ok"]]
    assert doc["ok"] is False and [(c["model"], c["backend"]) for c in bad] == [("student", "onnxruntime")]
    assert bad[0]["max_abs_diff"] > 1e-3
