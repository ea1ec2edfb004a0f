"""Finding TensorRT plans by the manifests their builds wrote (engines/trt_build.py,
which serving never imports).

A plan runs only on the GPU and TensorRT version it was built for. Each plan's
manifest records that target (`target`: runtime, version, compute_capability) and what
it serves (`serves`: the model it was built from and its precision). A plan that
matches the model but not this box is refused with a reason that says what it was
built for, what this box is, and how to build one for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.engines import EngineMissing, read_manifest

logger = logging.getLogger(__name__)

PLAN_KIND = "tensorrt-plan"
PLANS_DIR = "tensorrt"
REBUILD = "edgectl build --profile PROFILE --backend tensorrt"


class PlanMismatch(RuntimeError):
    """Plans for the model exist, none for this GPU and TensorRT version."""


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
    def plan_file(self) -> Path:
        return self.directory / str(self.manifest.get("plan", "model.plan"))

    @property
    def target(self) -> Target:
        t = self.manifest.get("target") or {}
        return Target(str(t.get("runtime", "?")), str(t.get("version", "?")), str(t.get("compute_capability", "?")))


def plans(engine_dir: Path) -> list[Plan]:
    """Every complete plan build under engine_dir/tensorrt."""
    root = engine_dir / PLANS_DIR
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    found = []
    for directory in children:
        manifest = read_manifest(directory)
        if manifest is not None and manifest.get("kind") == PLAN_KIND:
            found.append(Plan(directory, manifest))
    return found


def _serves(plan: Plan, wanted: dict[str, Any]) -> bool:
    listed = plan.manifest.get("serves")
    if not isinstance(listed, list):
        return False
    return any(isinstance(s, dict) and all(s.get(k) == v for k, v in wanted.items()) for s in listed)


def find_plan(engine_dir: Path, wanted: dict[str, Any], target: Target) -> Plan:
    """The newest plan that serves `wanted` (model selector and precision) and was
    built for `target`. PlanMismatch where plans exist only for other targets;
    EngineMissing where none was built for the model at all."""
    matching = [p for p in plans(engine_dir) if _serves(p, wanted)]
    here = [p for p in matching if p.target == target]
    if here:
        return max(here, key=lambda p: float(p.manifest.get("built_at", 0.0)))
    what = ", ".join(f"{k} {v}" for k, v in wanted.items())
    if matching:
        built = "; ".join(sorted({p.target.describe() for p in matching}))
        raise PlanMismatch(
            f"the TensorRT plans for {what} were built for {built}, and this box is {target.describe()}: "
            f"plans do not carry across GPUs or TensorRT versions; run `{REBUILD}` on this box"
        )
    raise EngineMissing(f"no TensorRT plan for {what} in {engine_dir / PLANS_DIR}; run `{REBUILD}`")
