"""The Jetson install set (requirements/jetson*.txt, what setup.sh installs on a Jetson):
in step with pyproject.toml, and every pin of it installable from PyPI's wheels on the
Pythons JetPack brings: 3.10 (JetPack 6, Ubuntu 22.04) and 3.12 (JetPack 7, Ubuntu 24.04),
on aarch64. Asked of the package index itself (pip's resolver, no install)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from scripts.jetson_requirements import FROM_SOURCE, LEFT_OUT, OUT, jetson_sets, name_of

# glibc of Ubuntu 22.04 (2.35) and 24.04 (2.39): the newest manylinux tag each takes.
JETPACKS = {"3.10": 35, "3.12": 39}


def test_the_jetson_files_are_what_pyproject_pins() -> None:
    for name, text in jetson_sets().items():
        assert (OUT / name).read_text(encoding="utf-8") == text, f"run python -m scripts.jetson_requirements ({name})"
    listed = {
        name_of(line) for line in (OUT / "jetson.txt").read_text(encoding="utf-8").splitlines() if line[:1].isalpha()
    }
    assert "torch" not in listed and "triton" not in listed
    assert not listed & set(LEFT_OUT)


def _target_pins(python: str) -> list[str]:
    """The jetson.txt pins that apply on `python` on an aarch64 Linux box, markers
    evaluated for that target (pip evaluates them for the Python it runs on)."""
    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "platform_machine": "aarch64",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    pins = []
    for line in (OUT / "jetson.txt").read_text(encoding="utf-8").splitlines():
        if not line[:1].isalpha():
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            pins.append(f"{req.name}{req.specifier}")
    return pins


def test_markers_give_one_pin_per_package_on_each_python() -> None:
    for python in JETPACKS:
        names = [name_of(p) for p in _target_pins(python)]
        assert len(names) == len(set(names)), python
    assert "numpy==2.2.6" in _target_pins("3.10") and "numpy==2.4.6" in _target_pins("3.12")


@pytest.mark.slow
@pytest.mark.parametrize("python", sorted(JETPACKS))
def test_every_pin_has_an_aarch64_wheel(python: str, tmp_path: Path) -> None:
    wheels = [p for p in _target_pins(python) if name_of(p) not in FROM_SOURCE]
    platforms = [f"--platform=manylinux_2_{minor}_aarch64" for minor in range(17, JETPACKS[python] + 1)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-deps",
         "--only-binary=:all:", f"--python-version={python}", "--implementation=cp", *platforms,
         f"--target={tmp_path}", *wheels],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_what_is_built_on_the_box_has_its_source_on_the_index() -> None:
    for name in FROM_SOURCE:
        pin = next(p for p in _target_pins("3.10") if name_of(p) == name)
        version = pin.split("==")[1]
        done = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert version in done.stdout.replace(",", " ").split(), done.stdout
