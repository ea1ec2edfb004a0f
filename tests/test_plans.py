"""A first start on a box with TensorRT builds the plans its profile serves from, when
none was built for this GPU and TensorRT version (edge/builds.py ensure_plans). What is
faked is the hardware seam: whether TensorRT is installed and what this box's target
is; the plan lookup, the build command and the child build are the real ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edge import builds
from edge.artifacts import Target
from edge.backends import tensorrt_backend
from edge.builds import BuildCommand
from edge.config.profile import Profile


class Recorder:
    """Stands in for ChildBuilds: records the build asked for instead of running it."""

    def __init__(self) -> None:
        self.commands: list[BuildCommand] = []

    def run(self, cmd: BuildCommand) -> None:
        self.commands.append(cmd)


def gpu_profile(engine_dir: Path) -> Profile:
    return Profile.model_validate(
        {
            "device_id": "orin",
            "paths": {"engine_dir": str(engine_dir)},
            "models": {
                "inspect": {"device": "cuda", "backend": {"type": "tensorrt", "precision": "int8"}, "max_batch": 4},
                "ocr": {"device": "cuda"},
            },
        }
    )


def test_a_first_start_with_tensorrt_builds_the_missing_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorrt_backend, "TRT_SUPPORT", True)
    monkeypatch.setattr(tensorrt_backend, "runtime_target", lambda device=0: Target("tensorrt", "10.3.0", "sm87"))
    profile = gpu_profile(tmp_path)
    student = tmp_path / "vision-student-distilled-stream-abc"
    recorder = Recorder()
    builds.ensure_plans(profile, "inspect", student, recorder)
    builds.ensure_plans(profile, "ocr", None, recorder)
    student_cmd, ocr_cmd = recorder.commands
    assert student_cmd.module == "engines.trt_build"
    args = list(student_cmd.args)
    assert args[args.index("--models") + 1] == "student" and args[args.index("--student") + 1] == str(student)
    assert args[args.index("--student-precisions") + 1] == "int8" and args[args.index("--max-batch") + 1] == "4"
    assert list(ocr_cmd.args)[:2] == ["--models", "ocr"] and "--det-limit-side-len" in ocr_cmd.args
    line = builds.command_line(student_cmd, tmp_path, progress=False)
    assert line[:3] == [sys.executable, "-m", "engines.trt_build"] and "--no-progress" in line


def test_nothing_is_built_without_tensorrt_or_with_builds_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    monkeypatch.setattr(tensorrt_backend, "TRT_SUPPORT", False)  # loading says why, by name
    builds.ensure_plans(gpu_profile(tmp_path), "inspect", tmp_path / "s", recorder)
    monkeypatch.setattr(tensorrt_backend, "TRT_SUPPORT", True)
    off = gpu_profile(tmp_path).model_copy(update={"build_missing_engines": False})
    builds.ensure_plans(off, "inspect", tmp_path / "s", recorder)
    cpu = Profile.model_validate({"device_id": "x", "paths": {"engine_dir": str(tmp_path)}})
    builds.ensure_plans(cpu, "inspect", tmp_path / "s", recorder)  # not on tensorrt
    assert recorder.commands == []


@pytest.mark.parametrize("version", ["10.3.0", "10.13.2.6", "11.0.0"])
def test_tensorrt_10_and_later_builds_and_runs_plans(version: str) -> None:
    from edge.artifacts import unsupported_tensorrt

    assert unsupported_tensorrt(version) is None


def test_jetpack_60s_tensorrt_is_refused_with_the_release_to_take() -> None:
    from edge.artifacts import unsupported_tensorrt

    why = unsupported_tensorrt("8.6.2.3")
    assert why is not None and "TensorRT 8.6.2.3" in why and "JetPack 6.1" in why
    assert "not a release number" in (unsupported_tensorrt("unknown") or "")


def test_a_full_tensorrt_older_than_10_builds_no_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # The version is the seam: this box's TensorRT (where there is one) is faked as 8.6.
    from types import SimpleNamespace

    from engines import trt_build

    monkeypatch.setattr(trt_build, "trt", SimpleNamespace(__version__="8.6.2.3"))
    monkeypatch.setattr(trt_build, "RUNTIME", "tensorrt")
    with pytest.raises(trt_build.PlanBuildError, match=r"TensorRT 8\.6\.2\.3 is installed"):
        trt_build.current_target()
