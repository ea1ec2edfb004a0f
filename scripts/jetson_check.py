"""What setup.sh checks on a Jetson before it installs anything: the JetPack release, the
Python, JetPack's PyTorch, nvcc and TensorRT, each problem said in words a plant engineer
can act on. Standard library only, so that it runs on whatever Python the box has.

    python3 scripts/jetson_check.py [--image]   exit 0: ready (what was found); 1: what to fix first

--image: building a container image, where no GPU is visible yet: torch must be a CUDA
build, but need not see the GPU.

Supported: JetPack 6.1 and 6.2 (L4T r36.4, Ubuntu 22.04, Python 3.10, TensorRT 10.3) and
JetPack 7 (L4T r38, Ubuntu 24.04, Python 3.12, TensorRT 10.13 and later). JetPack 6.0
(r36.2 and r36.3) ships TensorRT 8.6, whose engine API our TensorRT backend does not use,
and JetPack 5 (r35) ships Python 3.8: both are refused with the upgrade to make.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PYTORCH_PAGE = "https://docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform/"
SDK_MANAGER = "NVIDIA SDK Manager (or the JetPack SD card image)"


@dataclass
class Findings:
    """What the checks found: lines to print, and the problems that stop the setup."""

    found: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def l4t_release(root: Path, dpkg: Callable[[str], str | None]) -> tuple[int, int, int] | None:
    """The L4T release (major, minor, patch) from /etc/nv_tegra_release ("# R36 (release),
    REVISION: 4.3, ...") or, where that file is missing, the nvidia-l4t-core package's
    version ("36.4.3-20250107174145")."""
    text = _read(root / "etc" / "nv_tegra_release")
    if text:
        m = re.search(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)(?:\.(\d+))?", text)
        if m:
            return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    version = dpkg("nvidia-l4t-core")
    if version:
        m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
        if m:
            return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    return None


def jetpack(release: tuple[int, int, int]) -> tuple[str, str | None]:
    """(the JetPack release name, why it is refused or None)."""
    major, minor, patch = release
    r = f"L4T r{major}.{minor}.{patch}"
    if major == 36 and minor >= 4:
        return f"JetPack 6.{1 if patch < 3 else 2} ({r})", None
    if major == 36:
        return f"JetPack 6.0 ({r})", (
            "JetPack 6.0 ships TensorRT 8.6, which edge does not support: upgrade to JetPack 6.1 or later "
            "(sudo apt update && sudo apt dist-upgrade on r36, or flash it with " + SDK_MANAGER + ")"
        )
    if major >= 38:
        return f"JetPack 7 ({r})", None
    if major == 35:
        return f"JetPack 5 ({r})", (
            "JetPack 5 ships Python 3.8, which edge does not support: flash JetPack 6.1 or later with " + SDK_MANAGER
        )
    return f"L4T {r}", f"{r} is not a JetPack release edge knows: use JetPack 6.1 or later"


def check(
    root: Path = Path("/"),
    python: tuple[int, int] = (sys.version_info[0], sys.version_info[1]),
    torch_probe: Callable[[], tuple[str, bool, bool] | None] | None = None,
    dpkg: Callable[[str], str | None] | None = None,
    which: Callable[[str], str | None] = shutil.which,
    tensorrt_probe: Callable[[], str | None] | None = None,
    image: bool = False,
) -> Findings:
    """Every check; the probes are replaceable so that the checks are tested without a
    Jetson (`root`: where /etc and /usr/local/cuda are)."""
    out = Findings()
    release = l4t_release(root, dpkg or _dpkg_version)
    if release is None:
        out.problems.append(
            "this does not look like a Jetson (no /etc/nv_tegra_release, no nvidia-l4t-core package): "
            "run setup on the Jetson itself"
        )
        return out
    name, refused = jetpack(release)
    out.found.append(name)
    if refused:
        out.problems.append(refused)
    py = f"{python[0]}.{python[1]}"
    if not (3, 10) <= python <= (3, 13):
        out.problems.append(
            f"Python {py} is not supported (3.10 to 3.13 are): run setup with JetPack's python3 "
            "(PYTHON=/usr/bin/python3 scripts/setup.sh)"
        )
    else:
        out.found.append(f"Python {py}")
    torch = (torch_probe or _torch_version)()
    if torch is None:
        out.problems.append(
            f"PyTorch is not installed for Python {py}: install the wheel NVIDIA builds for {name.split(' (')[0]} "
            f"(see {PYTORCH_PAGE}), then run setup again"
        )
    elif not torch[1]:
        out.problems.append(
            f"torch {torch[0]} is installed but is not a CUDA build: that is PyPI's CPU build, not JetPack's. "
            f"Remove it (pip3 uninstall torch) and install NVIDIA's wheel for {name.split(' (')[0]} "
            f"(see {PYTORCH_PAGE})"
        )
    elif not torch[2] and not image:
        out.problems.append(
            f"torch {torch[0]} is a CUDA build but sees no GPU: run setup as a user in the video group "
            "(or as root), and in a container with the NVIDIA runtime (--runtime nvidia)"
        )
    else:
        out.found.append(
            f"torch {torch[0]} with CUDA" + ("" if torch[2] else " (no GPU visible while the image builds)")
        )
    nvcc = which("nvcc") or next((str(p) for p in [root / "usr/local/cuda/bin/nvcc"] if p.exists()), None)
    if nvcc is None:
        out.warnings.append(
            "nvcc not found: our CUDA INT4 kernel cannot be built and torch's slower kernel serves instead. "
            "Install JetPack's CUDA toolkit (sudo apt install nvidia-jetpack) to fix it"
        )
    else:
        out.found.append(f"nvcc {nvcc}")
    trt = (tensorrt_probe or _tensorrt_version)()
    if trt is None:
        out.warnings.append(
            "TensorRT's Python module is not there: the vision branch serves through onnxruntime and torch "
            "instead of TensorRT plans (sudo apt install python3-libnvinfer to add it)"
        )
    elif int(trt.split(".")[0]) < 10:
        out.warnings.append(f"TensorRT {trt} is older than 10: its plans are not used (JetPack 6.1 or later has 10)")
    else:
        out.found.append(f"TensorRT {trt}")
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _dpkg_version(package: str) -> str | None:
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _torch_version() -> tuple[str, bool, bool] | None:
    """(version, built with CUDA, sees a GPU), or None where torch does not import."""
    try:
        import torch
    except Exception:  # not installed, or a wheel built for another JetPack fails to load
        return None
    return str(torch.__version__), torch.version.cuda is not None, bool(torch.cuda.is_available())


def _tensorrt_version() -> str | None:
    try:
        tensorrt = importlib.import_module("tensorrt")  # JetPack's, untyped
    except Exception:
        return None
    return str(tensorrt.__version__)


def main() -> int:
    found = check(image="--image" in sys.argv[1:])
    for line in found.found:
        print(f"setup: found {line}")
    for line in found.warnings:
        print(f"setup: warning: {line}", file=sys.stderr)
    for line in found.problems:
        print(f"setup: cannot continue: {line}", file=sys.stderr)
    return 1 if found.problems else 0


if __name__ == "__main__":
    sys.exit(main())
