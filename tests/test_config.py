from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from edge.config.loader import ProfileError, load_profile, parse_profile
from edge.config.profile import ModelsConfig
from tests.conftest import REPO, edgectl


def test_shipped_profiles_load() -> None:
    for path in (REPO / "profiles").glob("*.yaml"):
        profile = load_profile(path)
        assert profile.jobs_filter == f"edge/{profile.device_id}/jobs/+"


def test_defaults_and_derived_topics() -> None:
    profile = parse_profile({"device_id": "line-3", "topics": {"shared_group": "plant"}})
    assert profile.memory_budget_mib == 8192
    assert profile.results_topic == "edge/line-3/results"
    assert profile.available_topic == "edge/line-3/available"
    assert profile.shared_jobs_filter == "$share/plant/edge/jobs/+"
    assert profile.client_id == "edge-line-3"


@pytest.mark.parametrize(
    ("data", "path_in_message"),
    [
        ({"device_id": "a", "models": {"qa": {"max_new_tokenz": 3}}}, "models.qa.max_new_tokenz"),
        ({"device_id": "a", "broker": {"port": "not-a-port"}}, "broker.port"),
        ({"device_id": "a", "broker": {"port": 70000}}, "broker.port"),
        ({"device_id": "a/b"}, "device_id"),
        ({}, "device_id"),
        ({"device_id": "a", "broker": {"tls": {"cert_file": "/x.pem"}}}, "broker.tls"),
        ({"device_id": "a", "broker": {"password": "x", "password_file": "/y"}}, "broker"),
        ({"device_id": "a", "topics": {"shared_group": "a/+"}}, "topics.shared_group"),
        ({"device_id": "a", "memory_budget_mib": 512, "memory_headroom_mib": 512}, "memory_headroom_mib"),
        ({"device_id": "a", "models": {"inspect": {"max_batch": 4, "preferred_batch_sizes": [8]}}}, "max_batch"),
        ({"device_id": "a", "models": {"inspect": {"backend": "tensorrt"}}}, "models.inspect"),
        ({"device_id": "a", "models": {"ocr": {"backend": "tensorrt"}}}, "models.ocr"),
        (
            {
                "device_id": "a",
                "models": {"ocr": {"device": "cuda", "backend": {"type": "tensorrt", "precision": "int8"}}},
            },
            "models.ocr",
        ),
        ({"device_id": "a", "models": {"qa": {"quantization": "awq-int3"}}}, "models.qa.quantization"),
    ],
)
def test_bad_profile_names_the_field(data: dict[str, object], path_in_message: str) -> None:
    with pytest.raises(ProfileError) as err:
        parse_profile(data, "p.yaml")
    assert path_in_message in str(err.value)


def test_every_field_is_described() -> None:
    from pydantic import BaseModel

    from edge.config.profile import Profile

    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            annotation = info.annotation
            for candidate in (annotation, *getattr(annotation, "__args__", ())):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    walk(candidate)

    walk(Profile)
    assert len(seen) >= 8


def test_serve_with_bad_profile_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"device_id": "x", "queue": {"max_size": -1}}))
    res = edgectl("serve", "--profile", str(bad))
    assert res.returncode == 2
    assert "queue.max_size" in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b"device_id: x\n# caf\xe9\n", "not UTF-8 text (a byte 0xe9"),
        (b"device_id: x\nmetrics:\n  listen: 127.0.0..1:9464\n", "metrics.listen"),
        (b"device_id: x\nmetrics:\n  listen: 999.1.1.1:9464\n", "neither an IP address nor a host name"),
    ],
)
def test_serve_with_a_profile_it_could_not_apply_exits_2_saying_why(tmp_path: Path, text: bytes, said: str) -> None:
    """Values the box could not use are refused when the profile is read, in one line and
    status 2, not by a traceback when they are applied."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(text)
    res = edgectl("serve", "--profile", str(bad))
    assert res.returncode == 2, res.stderr
    assert said in res.stderr and "Traceback" not in res.stderr


def test_serve_with_unreadable_yaml_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("device_id: [unclosed\n")
    res = edgectl("serve", "--profile", str(bad))
    assert res.returncode == 2
    assert "not valid YAML" in res.stderr


def test_a_user_model_and_adapter_are_paths_checked_at_load(tmp_path: Path) -> None:
    model, adapter = tmp_path / "model", tmp_path / "lora"
    model.mkdir()
    adapter.mkdir()

    def qa(**fields: str) -> str:
        with pytest.raises(ProfileError) as err:
            parse_profile({"device_id": "a", "models": {"qa": fields}}, "p.yaml")
        return str(err.value)

    assert "models.qa.source" in qa(source=str(tmp_path / "missing"), adapter="none")
    assert "no config.json" in qa(source=str(model), adapter="none")
    (model / "config.json").write_text("{}")
    assert "'clinic' was trained for smollm2-135m-instruct" in qa(source=str(model))
    assert "no adapter_config.json" in qa(source=str(model), adapter=str(adapter))
    (adapter / "adapter_config.json").write_text("{}")
    profile = parse_profile({"device_id": "a", "models": {"qa": {"source": str(model), "adapter": str(adapter)}}})
    assert profile.models.qa.source == str(model.resolve()) and profile.models.qa.adapter == str(adapter.resolve())


def test_per_layer_rules_are_checked_and_reach_the_build() -> None:
    from edge.builds import build_command, selector

    def refused(**qa: object) -> str:
        with pytest.raises(ProfileError) as err:
            parse_profile({"device_id": "a", "models": {"qa": qa}}, "p.yaml")
        return str(err.value)

    assert "group_size applies to format 'int4' only" in refused(
        layers=[{"match": "*.self_attn.*", "format": "float", "group_size": 32}]
    )
    assert "quantization is 'float'" in refused(quantization="float", layers=[{"match": "*", "format": "float"}])
    assert "models.qa.layers[0].group_size" in refused(layers=[{"match": "*", "format": "int4", "group_size": 48}])
    rules: list[dict[str, Any]] = [
        {"match": "*.self_attn.*", "format": "float"},
        {"match": "*.mlp.*", "format": "int4", "group_size": 128},
    ]
    profile = parse_profile({"device_id": "a", "models": {"qa": {"layers": rules}}})
    wanted = selector("qa", profile)
    assert wanted["layers"] == [{**rules[0], "group_size": None}, rules[1]]
    args = build_command("qa", profile).args
    assert args[args.index("--layers") + 1] == json.dumps(wanted["layers"])
    assert "layers" not in selector("qa", parse_profile({"device_id": "a"}))  # earlier builds still found


def test_the_shipped_student_is_the_default_and_a_dataset_trains_at_the_default_length(tmp_path: Path) -> None:
    assert parse_profile({"device_id": "a"}).models.inspect.build_size == "stream"
    folder = tmp_path / "parts"
    (folder / "clean").mkdir(parents=True)
    own = parse_profile({"device_id": "a", "models": {"inspect": {"dataset": str(folder)}}})
    assert own.models.inspect.build_size == "default"  # stream sizes generate their images
    asked = parse_profile({"device_id": "a", "models": {"inspect": {"dataset": str(folder), "build_size": "quick"}}})
    assert asked.models.inspect.build_size == "quick"


def test_tensorrt_backends_parse_with_their_settings() -> None:
    profile = parse_profile(
        {
            "device_id": "a",
            "models": {
                "ocr": {"device": "cuda"},
                "inspect": {
                    "device": "cuda",
                    "backend": {"type": "tensorrt", "precision": "int8", "cuda_graphs": False},
                },
                "qa": {"quantization": "awq-int4-sym"},
            },
        },
        "p.yaml",
    )
    assert profile.models.ocr.backend.type == "tensorrt"  # the OCR models have no torch weights to run on CUDA
    assert profile.models.inspect.backend.type == "tensorrt"
    assert profile.models.inspect.backend.precision == "int8" and not profile.models.inspect.backend.cuda_graphs


def test_the_tensorrt_backend_is_refused_by_name_where_tensorrt_is_absent() -> None:
    pytest.importorskip("tensorrt_rtx")  # the dev install; full TensorRT is absent here
    from edge.backends import BackendUnavailable, get_backend
    from edge.backends.tensorrt_backend import TRT_SUPPORT

    assert not TRT_SUPPORT
    with pytest.raises(
        BackendUnavailable, match=r"backend 'tensorrt' is not available here \(TensorRT's Python runtime"
    ):
        get_backend("tensorrt")


def test_a_backend_whose_runtime_is_not_installed_is_refused_and_the_others_serve(embed_engine_dir: Path) -> None:
    """In an interpreter where torch cannot be imported at all, torch-cuda is refused by
    name with the reason, and onnxruntime still loads and runs a model (the encoder); a
    module of the project's own missing still fails."""
    script = """
import sys
sys.modules["torch"] = None  # torch not installed: its import fails
from pathlib import Path
from edge.backends import BackendUnavailable, get_backend
from edge.docs.embed import Embedder, locate
try:
    get_backend("torch-cuda")
except BackendUnavailable as err:
    print("refused:", err)
print("dimensions:", Embedder.load(locate(Path(sys.argv[1]))).embed(["Pump alarm"]).shape[1])
"""
    run = subprocess.run(
        [sys.executable, "-c", script, str(embed_engine_dir)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "refused: backend 'torch-cuda' is not available here (torch is not installed)" in run.stdout
    assert "dimensions: 384" in run.stdout
    # One of our own modules missing is not a missing runtime: discovery fails loudly.
    broken = subprocess.run(
        [sys.executable, "-c", 'import sys; sys.modules["edge.gpu_streams"] = None\n'
         'from edge.backends import get_backend; get_backend("onnxruntime")'],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert broken.returncode == 1 and "ModuleNotFoundError: import of edge.gpu_streams halted" in broken.stderr


@pytest.mark.parametrize(
    ("cpus", "text_device", "want"),
    [
        (2, "cpu", (1, 1, 1)),  # the trial box: a core a branch
        (8, "cpu", (4, 4, 4)),
        (1, "cpu", (1, 1, 1)),
        (12, "cuda", (0, 12, 12)),  # the text model on the GPU: the vision branch takes the cores
    ],
)
def test_threads_left_at_zero_become_each_branchs_share_of_the_cores(
    cpus: int, text_device: str, want: tuple[int, int, int]
) -> None:
    """Every backend given every core spins at its barriers while the other branch's
    threads hold them; the daemon splits the box's cores between the branches instead."""
    models = ModelsConfig.model_validate({"qa": {"device": text_device}})
    got = models.with_cpu_threads(cpus)
    assert (got.qa.threads, got.ocr.threads, got.inspect.threads) == want


def test_thread_counts_the_profile_names_are_kept_and_a_branch_alone_takes_every_core() -> None:
    named = ModelsConfig.model_validate({"qa": {"threads": 3}, "inspect": {"threads": 2}})
    got = named.with_cpu_threads(8)
    assert (got.qa.threads, got.inspect.threads, got.ocr.threads) == (3, 2, 4)
    text_alone = ModelsConfig.model_validate({"ocr": {"enabled": False}, "inspect": {"enabled": False}})
    assert text_alone.with_cpu_threads(8).qa.threads == 8
    vision_alone = ModelsConfig.model_validate({"qa": {"enabled": False}})
    assert vision_alone.with_cpu_threads(8).inspect.threads == 8
