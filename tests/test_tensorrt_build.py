"""TensorRT plans built from every model (engines/trt_build.py), through
`edgectl build --backend tensorrt`, with tensorrt-rtx: it builds on a machine without a
GPU for desktop targets, so what can be checked here is checked: the parser takes each
graph, the layers have the precision asked, the plans serialize, the manifests say
what was built and for what, and a plan for another GPU or TensorRT is refused. Running
plans needs TensorRT on its target (tests/test_tensorrt_runtime.py, marker `jetson`)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest

from edge.artifacts import PlanMismatch, Target, find_plan, plans
from tests.conftest import edgectl, write_profile

trt = pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx builds the plans (x86_64 dev install)")
pytestmark = pytest.mark.slow

TARGET = "sm86"


@pytest.fixture(scope="module")
def built(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`edgectl build --backend tensorrt` on a profile serving all three kinds of model,
    the text model quantized symmetrically (what TensorRT's INT4 takes)."""
    directory = tmp_path_factory.mktemp("trt-build")
    models = {
        "ocr": {"threads": 1},
        "inspect": {"build_size": "quick", "threads": 1, "max_batch": 8},
        "qa": {"quantization": "rtn-int4-sym", "max_context_tokens": 256, "max_sequences": 2},
    }
    profile = write_profile(directory, 1883, engine_dir, device_id="trt", models=models)
    done = edgectl(
        "build", "--profile", str(profile), "--backend", "tensorrt", "--compute-capability", TARGET, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    here = [p for p in plans(engine_dir) if p.target.compute_capability == TARGET]
    by_model = {p.manifest["model"] + "-" + p.manifest["precision"]: p for p in here}
    return {"profile": profile, "plans": by_model, "stdout": done.stdout}


def layer_table(plan_dir: Path) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = json.loads((plan_dir / "layers.json").read_text())
    return rows


def test_every_model_gets_a_plan_with_its_manifest(built: dict[str, Any]) -> None:
    found = built["plans"]
    for name in ("student-fp16", "student-int8", "ocr-det-fp16", "ocr-cls-fp16", "ocr-rec-fp16", "text-int4-fp16"):
        assert name in found, f"no {name} plan; built {sorted(found)}"
        plan = found[name]
        m = plan.manifest
        assert m["kind"] == "tensorrt-plan"
        assert m["target"] == {"runtime": "tensorrt-rtx", "version": trt.__version__, "compute_capability": TARGET}
        blob = plan.plan_file.read_bytes()
        assert len(blob) == m["plan_bytes"] > 1_000_000
        assert hashlib.sha256(blob).hexdigest() == m["plan_sha256"]
        assert (plan.directory / "model.onnx").is_file() and (plan.directory / m["timing_cache"]).is_file()
        assert len(m["source_sha256"]) >= 64 and len(m["onnx_sha256"]) == 64
        rows = layer_table(plan.directory)
        assert dict(Counter(r["precision"] for r in rows)) == m["layer_precisions"]
    assert "tensorrt: TensorRT plans for student, ocr, text" in built["stdout"]


def test_the_fp16_plans_compute_in_half_precision(built: dict[str, Any]) -> None:
    for name in ("student-fp16", "ocr-det-fp16", "ocr-cls-fp16", "ocr-rec-fp16"):
        rows = layer_table(built["plans"][name].directory)
        products = [r for r in rows if r["type"] in ("CONVOLUTION", "MATRIX_MULTIPLY")]
        assert products, name
        assert {r["precision"] for r in products} == {"HALF"}, name
        # Inputs and outputs stay float32 (a cast at each end): callers need not change.
        graph = onnx.load(str(built["plans"][name].directory / "model.onnx")).graph
        assert {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]} == {onnx.TensorProto.FLOAT}


def test_the_int8_student_has_explicit_qdq_on_its_weight_products(built: dict[str, Any]) -> None:
    plan = built["plans"]["student-int8"]
    rows = layer_table(plan.directory)
    kinds = Counter(r["type"] for r in rows)
    assert kinds["QUANTIZE"] >= 20 and kinds["DEQUANTIZE"] >= 40  # 4 linears x 12 blocks, both operands
    graph = onnx.load(str(plan.directory / "model.onnx")).graph
    quantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    linears = [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in quantized]
    assert len(linears) >= 48
    # Attention's products of two activations stay float (their ranges change per image).
    both = [n for n in graph.node if n.op_type == "MatMul" and not any(i in quantized for i in n.input)]
    assert len(both) >= 2 * 12
    check = plan.manifest["onnx_check"]
    assert check["images"] == 128 and check["agreement"] >= 0.9
    assert abs(check["int8_accuracy"] - check["float_accuracy"]) <= 0.05


def test_the_ocr_plans_take_the_shapes_the_pipeline_feeds(built: dict[str, Any]) -> None:
    from edge.vision import ocr

    det = built["plans"]["ocr-det-fp16"].manifest["profiles"][0]["shapes"]["x"]
    assert det[0] == [1, 3, 32, 32] and det[2] == [1, 3, 960, 960]
    rec = built["plans"]["ocr-rec-fp16"].manifest["profiles"][0]["shapes"]["x"]
    assert rec[2] == [ocr.LINE_BATCH, 3, 48, 48 * ocr.REC_MAX_RATIO]
    # The models name height and width alike ("?"): TensorRT would hold them equal.
    for name in ("ocr-det-fp16", "ocr-rec-fp16"):
        graph = onnx.load(str(built["plans"][name].directory / "model.onnx"), load_external_data=False).graph
        dims = [d.dim_param for d in graph.input[0].type.tensor_type.shape.dim if d.dim_param]
        assert len(dims) == len(set(dims)) >= 2
    meta = built["plans"]["ocr-rec-fp16"].manifest["metadata"]
    assert len(meta["character"].splitlines()) > 5000  # the recogniser's character list travels with it


def test_the_text_plan_is_int4_weight_only_with_prefill_and_decode_profiles(built: dict[str, Any]) -> None:
    plan = built["plans"]["text-int4-fp16"]
    rows = layer_table(plan.directory)
    dq = [r for r in rows if r["type"] == "DEQUANTIZE"]
    assert len(dq) == 211 and {r["precision"] for r in dq} == {"HALF"}
    assert {r["precision"] for r in rows if r["type"] == "MATRIX_MULTIPLY"} == {"HALF"}
    graph = onnx.load(str(plan.directory / "model.onnx"), load_external_data=False).graph
    codes = {t.name: t.data_type for t in graph.initializer}
    assert {codes[n.input[0]] for n in graph.node if n.op_type == "DequantizeLinear"} == {onnx.TensorProto.INT4}
    profiles = {p["name"]: p["shapes"] for p in plan.manifest["profiles"]}
    assert profiles["prefill"]["input_ids"] == [[1, 1], [2, 128], [2, 256]]
    assert profiles["prefill"]["past_key_values.0.key"][2] == [2, 3, 0, 64]
    assert profiles["decode"]["input_ids"][2] == [2, 1]
    assert profiles["decode"]["past_key_values.29.value"][2] == [2, 3, 255, 64]


def test_a_plan_built_for_another_gpu_or_version_is_refused_and_rebuilt(
    built: dict[str, Any], engine_dir: Path
) -> None:
    plan = built["plans"]["student-fp16"]
    wanted = {"task": "inspect", "student": plan.manifest["serves"][0]["student"], "precision": "fp16"}
    here = Target("tensorrt-rtx", trt.__version__, TARGET)
    assert find_plan(engine_dir, wanted, here).directory == plan.directory
    orin = Target("tensorrt", "10.3.0", "sm87")
    with pytest.raises(
        PlanMismatch,
        match=r"built for sm86 with tensorrt-rtx .*this box is sm87 with tensorrt 10.3.0.*--backend tensorrt",
    ):
        find_plan(engine_dir, wanted, orin)
    # Built again for the other target (the builder a first start runs): a plan of its own
    # beside the first, each found by its target.
    student = Path(plan.manifest["source"]).parent
    line = [sys.executable, "-m", "engines.trt_build", "--engine-dir", str(engine_dir), "--models", "student"]
    line += ["--student", str(student), "--student-precisions", "fp16", "--compute-capability", "sm89"]
    done = subprocess.run(line, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    other = find_plan(engine_dir, wanted, Target("tensorrt-rtx", trt.__version__, "sm89"))
    assert other.directory != plan.directory and other.target.compute_capability == "sm89"
    assert find_plan(engine_dir, wanted, here).directory == plan.directory
    assert Path(other.manifest["source"]).parent == student


def test_an_asymmetric_text_model_or_an_unknown_gpu_is_refused_by_name(built: dict[str, Any], engine_dir: Path) -> None:
    from edge.builds import locate
    from edge.config.loader import load_profile
    from edge.config.profile import Profile
    from engines.trt_build import PlanBuildError, current_target, text_job

    asymmetric = load_profile(built["profile"]).model_dump()
    asymmetric["models"]["qa"]["quantization"] = "awq-int4"
    served = locate(Profile.model_validate(asymmetric), "qa", None)  # the session's build
    with pytest.raises(PlanBuildError, match=r"models\.qa\.quantization to awq-int4-sym"):
        text_job(served, 256, 1)
    with pytest.raises(PlanBuildError, match=r"cannot build for sm87.*sm86"):
        current_target("sm87")
    done = edgectl("build", "--profile", str(built["profile"]), "--backend", "tensorrt", timeout=300)
    assert done.returncode == 2 and "pass --compute-capability" in done.stderr
