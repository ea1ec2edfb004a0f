"""setup.sh's Jetson checks (scripts/jetson_check.py) on faked boxes: the release files
and the probes for torch, nvcc and TensorRT are the hardware seam."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.jetson_check import check, jetpack, l4t_release

REPO = Path(__file__).resolve().parent.parent
ORIN_62 = (
    "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
    "DATE: Wed Jan  8 01:49:37 UTC 2025\n"
)


def box(tmp_path: Path, release: str | None = ORIN_62, nvcc: bool = True) -> Path:
    if release is not None:
        (tmp_path / "etc").mkdir(parents=True, exist_ok=True)
        (tmp_path / "etc" / "nv_tegra_release").write_text(release)
    if nvcc:
        (tmp_path / "usr/local/cuda/bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / "usr/local/cuda/bin/nvcc").write_text("")
    return tmp_path


def no_dpkg(package: str) -> str | None:
    return None


def ready(root: Path, **probes: object) -> object:
    kwargs: dict[str, object] = {
        "python": (3, 10),
        "torch_probe": lambda: ("2.5.0a0+872d972e41.nv24.08", True, True),
        "dpkg": no_dpkg,
        "which": lambda name: None,
        "tensorrt_probe": lambda: "10.3.0",
    }
    kwargs.update(probes)
    return check(root, **kwargs)  # type: ignore[arg-type]


def test_the_release_is_read_from_the_file_or_the_package() -> None:
    assert jetpack((36, 4, 3))[0].startswith("JetPack 6.2")
    assert jetpack((36, 4, 0))[0].startswith("JetPack 6.1")
    assert jetpack((38, 2, 0)) == ("JetPack 7 (L4T r38.2.0)", None)


def test_a_ready_orin_passes(tmp_path: Path) -> None:
    found = ready(box(tmp_path))
    assert found.problems == [] and found.warnings == []  # type: ignore[attr-defined]
    assert found.found[0] == "JetPack 6.2 (L4T r36.4.3)"  # type: ignore[attr-defined]
    assert "torch 2.5.0a0+872d972e41.nv24.08 with CUDA" in found.found  # type: ignore[attr-defined]


def test_without_the_release_file_the_package_version_tells(tmp_path: Path) -> None:
    root = box(tmp_path, release=None)
    assert l4t_release(root, lambda p: "36.4.0-20240912212859" if p == "nvidia-l4t-core" else None) == (36, 4, 0)
    found = ready(root, dpkg=lambda p: "38.2.0-20250821" if p == "nvidia-l4t-core" else None, python=(3, 12))
    assert found.problems == [] and found.found[0] == "JetPack 7 (L4T r38.2.0)"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("release", "says"),
    [
        ("# R35 (release), REVISION: 5.0, GCID: 1\n", "JetPack 5 ships Python 3.8"),
        ("# R36 (release), REVISION: 3.0, GCID: 1\n", "TensorRT 8.6"),
    ],
)
def test_an_unsupported_jetpack_is_refused_with_the_upgrade(tmp_path: Path, release: str, says: str) -> None:
    found = ready(box(tmp_path, release))
    assert len(found.problems) == 1 and says in found.problems[0]  # type: ignore[attr-defined]


def test_not_a_jetson(tmp_path: Path) -> None:
    found = ready(box(tmp_path, release=None))
    assert "does not look like a Jetson" in found.problems[0]  # type: ignore[attr-defined]


def test_each_wrong_piece_is_named_with_its_fix(tmp_path: Path) -> None:
    root = box(tmp_path, nvcc=False)
    assert "Python 3.9 is not supported" in ready(root, python=(3, 9)).problems[0]  # type: ignore[attr-defined]
    missing = ready(root, torch_probe=lambda: None).problems[0]  # type: ignore[attr-defined]
    assert "PyTorch is not installed for Python 3.10" in missing and "JetPack 6.2" in missing
    cpu = ready(root, torch_probe=lambda: ("2.13.0+cpu", False, False)).problems[0]  # type: ignore[attr-defined]
    assert "PyPI's CPU build" in cpu and "pip3 uninstall torch" in cpu
    blind = ready(root, torch_probe=lambda: ("2.5.0", True, False)).problems[0]  # type: ignore[attr-defined]
    assert "sees no GPU" in blind and "video group" in blind
    # Building an image no GPU is visible: a CUDA build is enough, a CPU build is not.
    assert ready(root, torch_probe=lambda: ("2.5.0", True, False), image=True).problems == []  # type: ignore[attr-defined]
    assert ready(root, torch_probe=lambda: ("2.13.0+cpu", False, False), image=True).problems  # type: ignore[attr-defined]
    warned = ready(root, tensorrt_probe=lambda: "8.6.2").warnings  # type: ignore[attr-defined]
    assert any("nvcc not found" in w for w in warned) and any("TensorRT 8.6.2 is older than 10" in w for w in warned)


def test_on_a_box_that_is_no_jetson_the_script_says_so_and_fails() -> None:
    # The real script, as setup.sh runs it: this machine has no L4T release.
    done = subprocess.run([sys.executable, str(REPO / "scripts/jetson_check.py")], capture_output=True, text=True)
    assert done.returncode == 1
    assert "cannot continue: this does not look like a Jetson" in done.stderr
