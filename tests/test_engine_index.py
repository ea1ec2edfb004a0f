"""Serving finds builds by the manifests they wrote (edge/artifacts.py), never by importing
or re-running the build pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edge.artifacts import EngineMissing, find, open_engine, read_manifest
from edge.builds import locate, selector
from edge.config.profile import Profile
from edge.config.service import PathsConfig
from engines.cache import tag_serves

QA = {"task": "qa", "source": "smollm2-135m-instruct", "adapter": "clinic", "quantization": "awq-int4"}


def _build(path: Path, built_at: float, **manifest: Any) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"built_at": built_at, **manifest}))
    return path


def test_the_newest_matching_build_is_found_two_levels_deep(tmp_path: Path) -> None:
    old = _build(tmp_path / "text" / "a", 1.0, kind="llama-int4", serves=[QA])
    new = _build(tmp_path / "text" / "b", 2.0, kind="llama-int4", serves=[QA])
    _build(tmp_path / "text" / "c", 3.0, kind="llama-int4", serves=[{**QA, "adapter": "none"}])
    _build(tmp_path / ".text-scratch", 9.0, kind="llama-int4", serves=[QA])  # a build in progress
    (tmp_path / "text" / "half").mkdir()  # no manifest: a crash mid-build
    found = find(tmp_path, **QA)
    assert found is not None and found.path == new and old.exists()
    assert find(tmp_path, **{**QA, "quantization": "float"}) is None
    assert find(tmp_path / "missing", **QA) is None


def test_student_builds_are_found_by_size_and_recipe(tmp_path: Path) -> None:
    _build(tmp_path / "s1", 1.0, kind="vision-student", size="stream", distilled=True, classes=["clean"])
    _build(tmp_path / "s2", 2.0, kind="vision-student", size="stream", distilled=False, classes=["clean"])
    found = find(tmp_path, task="inspect", size="stream", distilled=True)
    assert found is not None and found.path.name == "s1"


def test_tagging_adds_a_selector_once_and_keeps_the_manifest(tmp_path: Path) -> None:
    path = _build(tmp_path / "x", 1.0, kind="llama-checkpoint", inputs={"a": 1})
    tag_serves(path, QA)
    tag_serves(path, QA)
    tag_serves(path, {**QA, "adapter": "none"})
    manifest = read_manifest(path)
    assert manifest is not None and manifest["inputs"] == {"a": 1} and len(manifest["serves"]) == 2
    assert not list(path.glob(".*"))  # the temporary file was renamed into place


def test_a_named_engine_must_be_a_complete_build_of_its_kind(tmp_path: Path) -> None:
    student = _build(tmp_path / "st", 1.0, kind="vision-student")
    assert open_engine(student, "vision-student").path == student
    with pytest.raises(EngineMissing, match="not a llama-"):
        open_engine(student, "llama-")
    with pytest.raises(EngineMissing, match=r"no readable manifest\.json"):
        open_engine(tmp_path / "nothing", "llama-")


def test_without_a_build_and_without_leave_to_build_the_error_says_what_to_run(tmp_path: Path) -> None:
    profile = Profile(device_id="e", build_missing_engines=False, paths=PathsConfig(engine_dir=tmp_path))
    assert selector("qa", profile) == QA
    with pytest.raises(EngineMissing, match=r"edgectl build"):
        locate(profile, "qa", None)
    _build(tmp_path / "text" / "q", 1.0, kind="llama-int4", serves=[QA])
    assert locate(profile, "qa", None) == tmp_path / "text" / "q"


def test_serving_never_imports_the_build_pipeline() -> None:
    """The daemon, with every task handler, loads in a process where `engines` cannot
    be imported at all."""
    code = (
        "import sys; sys.modules['engines'] = None\n"
        "import edge.daemon, edge.cli, edge.tasks.inspect, edge.tasks.qa, edge.tasks.ocr\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_user_model_replaced_in_place_is_another_build(tmp_path: Path) -> None:
    from edge.builds import source_id

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = source_id(str(tmp_path))
    assert first.startswith(f"{tmp_path}@") and source_id(str(tmp_path)) == first
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)
    assert source_id(str(tmp_path)) != first
    assert source_id("smollm2-135m-instruct") == "smollm2-135m-instruct"
