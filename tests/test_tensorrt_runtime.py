"""TensorRT plans run (marker `jetson`: a box with TensorRT and a CUDA GPU, e.g. a Jetson
under JetPack). Plans are built on the box for its own GPU, then every model runs
through the tensorrt backend and agrees with onnxruntime, torch and the text model's
own runtime (`edgectl verify`); the daemon serves inspect jobs from the student's plan.

    pytest -m jetson tests/test_tensorrt_runtime.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import edgectl, write_profile

pytestmark = pytest.mark.jetson


@pytest.fixture(scope="module")
def on_box(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tensorrt")
    directory = tmp_path_factory.mktemp("trt-run")
    models = {
        "ocr": {"device": "cuda", "backend": "tensorrt", "threads": 1},
        "inspect": {"build_size": "quick", "device": "cuda", "backend": "tensorrt", "max_batch": 8},
        "qa": {"device": "cuda", "quantization": "rtn-int4-sym", "max_context_tokens": 512},
    }
    profile = write_profile(directory, 1883, engine_dir, device_id="trt-run", models=models)
    done = edgectl("build", "--profile", str(profile), "--backend", "tensorrt", timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return profile


def test_every_plan_agrees_with_the_other_backends(on_box: Path) -> None:
    done = edgectl("verify", "--profile", str(on_box), "--json", timeout=900)
    doc: dict[str, Any] = json.loads(done.stdout)
    ran = {(c["model"], c["backend"]) for c in doc["checks"]}
    for model in ("student", "ocr-det", "ocr-cls", "ocr-rec"):
        assert (model, "tensorrt fp16") in ran
    assert ("student", "tensorrt int8") in ran and ("text", "tensorrt int4-fp16") in ran
    assert done.returncode == 0 and doc["ok"], [c for c in doc["checks"] if not c["ok"]]


def test_the_student_plan_serves_in_batches_with_graphs(on_box: Path) -> None:
    from edge.backends import BackendOptions, get_backend
    from edge.builds import locate
    from edge.config.backends import TensorRTConfig
    from edge.config.loader import load_profile
    from edge.verify import sample_images
    from edge.vision.student import StudentArtifact

    profile = load_profile(on_box)
    artifact = StudentArtifact.open(locate(profile, "inspect", None))
    options = BackendOptions(max_batch=8, config=TensorRTConfig(), engine_dir=profile.paths.engine_dir)
    session = get_backend("tensorrt").load(artifact.source(), options)
    assert session.accepts_images and session.device.startswith("cuda")
    images = sample_images(8)
    whole = session.run_images(images)
    for n in (1, 3, 8):  # padded batch sizes replay their graphs; rows do not depend on the batch
        part = session.run_images(images[:n])
        np.testing.assert_allclose(part[0], whole[0][:n], atol=2e-3)


def test_a_plan_for_another_box_is_refused_at_load(on_box: Path, tmp_path: Path) -> None:
    from edge.artifacts import plans
    from edge.backends import BackendUnavailable, get_backend
    from edge.backends.base import BackendOptions
    from edge.builds import locate
    from edge.config.backends import TensorRTConfig
    from edge.config.loader import load_profile
    from edge.vision.student import StudentArtifact

    profile = load_profile(on_box)
    artifact = StudentArtifact.open(locate(profile, "inspect", None))
    moved = tmp_path / "engines" / "tensorrt"
    moved.mkdir(parents=True)
    for plan in plans(profile.paths.engine_dir):
        if plan.manifest["model"] == "student":
            manifest = dict(plan.manifest, target={**plan.manifest["target"], "compute_capability": "sm00"})
            target = moved / plan.directory.name
            target.mkdir()
            (target / "manifest.json").write_text(json.dumps(manifest))
    options = BackendOptions(config=TensorRTConfig(), engine_dir=tmp_path / "engines")
    with pytest.raises(BackendUnavailable, match=r"built for sm00 .* run `edgectl build"):
        get_backend("tensorrt").load(artifact.source(), options)
