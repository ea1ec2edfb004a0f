"""Finding built engines by the manifests their builds wrote: serving's whole contract
with the build pipeline (`engines/`, which serving never imports).

Every build writes `manifest.json` into its directory, last, so a directory with a
readable manifest is complete. A manifest says what the directory is (`kind`) and what
it serves: `serves` is a list of selectors (for the text model: task, source, adapter,
quantization), and a student build carries its size and recipe at the top level.
Nothing is hashed or rebuilt here: a box serves the newest build that matches what its
profile asks for, wherever it was built (a student trained on a GPU machine and copied
into the engine directory is found like one built here). Rebuilding after an upgrade is
`edgectl build`'s business.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


class EngineMissing(FileNotFoundError):
    """No built engine matches, or a directory named in the profile is not one."""


@dataclass(frozen=True)
class Engine:
    path: Path
    manifest: dict[str, Any]

    @property
    def built_at(self) -> float:
        value = self.manifest.get("built_at")
        return float(value) if isinstance(value, int | float) else 0.0


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


def _matches(selector: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return all(selector.get(key) == value for key, value in wanted.items())


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
        if manifest is None or not any(_matches(s, wanted) for s in selectors(manifest)):
            continue
        engine = Engine(directory, manifest)
        if best is None or engine.built_at > best.built_at:
            best = engine
    return best


def _build_dirs(engine_dir: Path, depth: int = 2) -> list[Path]:
    """Directories under engine_dir, two levels deep (builds group their outputs, e.g.
    text/), without scratch directories of builds in progress (dot names)."""
    found: list[Path] = []
    level = [engine_dir]
    for _ in range(depth):
        nxt: list[Path] = []
        for parent in level:
            try:
                children = sorted(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            nxt.extend(children)
        found.extend(nxt)
        level = nxt
    return found


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
