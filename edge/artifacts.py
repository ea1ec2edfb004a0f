"""Finding built artifacts by the manifests their builds wrote: serving's whole contract
with the build pipeline (`engines/`, which serving never imports).

Every build writes `manifest.json` into its directory, last, so a directory with a
readable manifest is complete. A manifest says what the directory is (`kind`) and what
it serves: `serves` is a list of selectors (for the text model: task, source, adapter,
quantization), and a student build carries its size and recipe at the top level.
Nothing is hashed or rebuilt here: a box serves the newest build that matches what its
profile asks for, wherever it was built (a student trained on a GPU machine and copied
into the engine directory is found like one built here). Rebuilding after an upgrade is
`edgectl build`'s business.

TensorRT plans (engines/trt_build.py) are found the same way, under
`engine_dir/tensorrt/`, with one check more: a plan runs only on the GPU and TensorRT
version it was built for. Its manifest records that target (`target`: runtime, version,
compute_capability) beside what it serves (the model it was built from and its
precision). A plan that matches the model but not this box is refused with a reason that
says what it was built for, what this box is, and how to build one for it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PLAN_KIND = "tensorrt-plan"
PLANS_DIR = "tensorrt"
REBUILD = "edgectl build --profile PROFILE --backend tensorrt"


class EngineMissing(FileNotFoundError):
    """No built engine matches, or a directory named in the profile is not one."""


class PlanMismatch(RuntimeError):
    """Plans for the model exist, none for this GPU and TensorRT version."""


def _built_at(manifest: dict[str, Any]) -> float:
    value = manifest.get("built_at")
    return float(value) if isinstance(value, int | float) else 0.0


@dataclass(frozen=True)
class Engine:
    path: Path
    manifest: dict[str, Any]

    @property
    def built_at(self) -> float:
        return _built_at(self.manifest)


# The oldest TensorRT whose plans we build and run: the engine API of TensorRT 10
# (device_memory_size_v2, named tensors with execute_async_v3, weight streaming). JetPack
# 6.1 and later ship 10.x; JetPack 6.0's 8.6 is not supported.
OLDEST_TENSORRT = 10


def unsupported_tensorrt(version: str) -> str | None:
    """Why full TensorRT `version` cannot build or run our plans, or None where it can."""
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return f"TensorRT reports version {version!r}, which is not a release number"
    if major < OLDEST_TENSORRT:
        return (
            f"TensorRT {version} is installed; edge builds and runs plans with TensorRT {OLDEST_TENSORRT} or later "
            "(JetPack 6.1 and later ship it; JetPack 6.0's 8.6 is not supported)"
        )
    return None


@dataclass(frozen=True)
class Target:
    runtime: str
    version: str
    compute_capability: str

    def to_dict(self) -> dict[str, str]:
        return {"runtime": self.runtime, "version": self.version, "compute_capability": self.compute_capability}

    def describe(self) -> str:
        return f"{self.compute_capability} with {self.runtime} {self.version}"


@dataclass(frozen=True)
class Plan:
    directory: Path
    manifest: dict[str, Any]

    @property
    def built_at(self) -> float:
        return _built_at(self.manifest)

    @property
    def plan_file(self) -> Path:
        return self.directory / str(self.manifest.get("plan", "model.plan"))

    @property
    def target(self) -> Target:
        t = self.manifest.get("target") or {}
        return Target(str(t.get("runtime", "?")), str(t.get("version", "?")), str(t.get("compute_capability", "?")))


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a complete build directory, or None."""
    try:
        data = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def selectors(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """What a build serves. Student builds from before `serves` existed are described by
    their kind, size and recipe at the top level, which is what they are selected by."""
    listed = manifest.get("serves")
    found = [s for s in listed if isinstance(s, dict)] if isinstance(listed, list) else []
    if manifest.get("kind") == "vision-student":
        found.append(
            {
                "task": "inspect",
                "size": manifest.get("size"),
                "distilled": manifest.get("distilled", True),
                "dataset": manifest.get("dataset", "synthetic"),  # builds before datasets: the synthetic set
            }
        )
    return found


def _serves(manifest: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether one of the build's selectors has every key of `wanted` with its value."""
    return any(all(s.get(key) == value for key, value in wanted.items()) for s in selectors(manifest))


def check_readable(engine_dir: Path) -> None:
    """EngineMissing, in one sentence, when the engine directory exists but cannot be
    listed (its permissions, a broken mount): finding no engine there would otherwise
    look like an empty directory and send the box building into it."""
    try:
        next(iter(engine_dir.iterdir()), None)
    except FileNotFoundError:
        return  # created when the first build writes into it
    except OSError as err:
        why = (err.strerror or str(err)).lower()
        raise EngineMissing(f"the engine directory {engine_dir} cannot be read ({why}): check its permissions") from err


def _subdirs(parent: Path) -> list[Path]:
    """The directories in `parent`, sorted, without scratch directories of builds in
    progress (dot names); none where `parent` cannot be listed."""
    try:
        return sorted(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _build_dirs(engine_dir: Path, depth: int = 2) -> list[Path]:
    """Directories under engine_dir, two levels deep (builds group their outputs, e.g.
    text/)."""
    found: list[Path] = []
    level = [engine_dir]
    for _ in range(depth):
        level = [child for parent in level for child in _subdirs(parent)]
        found.extend(level)
    return found


def damaged(engine_dir: Path) -> list[Path]:
    """Published build directories whose manifest is there but cannot be read. A build
    writes its manifest last and publishes its directory by renaming it whole, so such a
    directory was complete once and has been damaged since: it must be looked at, never
    silently built over."""
    out = []
    for directory in _build_dirs(engine_dir):
        path = directory / MANIFEST
        if path.exists() and read_manifest(directory) is None:
            out.append(directory)
    return out


def find(engine_dir: Path, **wanted: Any) -> Engine | None:
    """The newest complete build in `engine_dir` that serves `wanted`, or None."""
    best: Engine | None = None
    for directory in _build_dirs(engine_dir):
        manifest = read_manifest(directory)
        if manifest is None or not _serves(manifest, wanted):
            continue
        engine = Engine(directory, manifest)
        if best is None or engine.built_at > best.built_at:
            best = engine
    return best


def open_engine(directory: Path, kind_prefix: str) -> Engine:
    """A directory the profile names outright; EngineMissing if it is not a complete
    build of the expected kind."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise EngineMissing(f"{directory} holds no readable {MANIFEST}: not a complete build")
    kind = str(manifest.get("kind", ""))
    if not kind.startswith(kind_prefix):
        raise EngineMissing(f"{directory} holds a {kind or 'build of unknown kind'}, not a {kind_prefix} build")
    return Engine(directory, manifest)


def plans(engine_dir: Path) -> list[Plan]:
    """Every complete plan build under engine_dir/tensorrt."""
    found = []
    for directory in _subdirs(engine_dir / PLANS_DIR):
        manifest = read_manifest(directory)
        if manifest is not None and manifest.get("kind") == PLAN_KIND:
            found.append(Plan(directory, manifest))
    return found


def find_plan(engine_dir: Path, wanted: dict[str, Any], target: Target) -> Plan:
    """The newest plan that serves `wanted` (model selector and precision) and was
    built for `target`. PlanMismatch where plans exist only for other targets;
    EngineMissing where none was built for the model at all."""
    matching = [p for p in plans(engine_dir) if _serves(p.manifest, wanted)]
    here = [p for p in matching if p.target == target]
    if here:
        return max(here, key=lambda p: p.built_at)
    what = ", ".join(f"{k} {v}" for k, v in wanted.items())
    if matching:
        built = "; ".join(sorted({p.target.describe() for p in matching}))
        raise PlanMismatch(
            f"the TensorRT plans for {what} were built for {built}, and this box is {target.describe()}: "
            f"plans do not carry across GPUs or TensorRT versions; run `{REBUILD}` on this box"
        )
    raise EngineMissing(f"no TensorRT plan for {what} in {engine_dir / PLANS_DIR}; run `{REBUILD}`")
