"""First-start builds: an engine the profile needs that is not built yet is built in a
child process (`python -m engines.<branch>.<build> ...`), which a stop request ends at once.

A build takes minutes (the student's training, the adapter's); a build running inside
this process could not be stopped, and systemd's start timeout (TimeoutStartSec) is
shorter than that. So while the child runs, systemd is asked for more time
(EXTEND_TIMEOUT_USEC, sent again before each extension runs out) and told what is being
built (STATUS). Builds write to a scratch directory and rename it when done, so a
stopped one leaves nothing half-built. Serving never imports the build pipeline: it only
knows each build's module name and arguments, here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from edge.artifacts import EngineMissing, check_readable, damaged, find, open_engine
from edge.config.profile import Profile
from edge.health.notify import Notifier

logger = logging.getLogger(__name__)

EXTEND_S = 60.0  # each extension systemd is asked for
EXTEND_EVERY_S = 10.0  # sent this often while building, well inside each extension


class BuildStopped(Exception):
    """A first-start build ended by a stop request."""


@dataclass(frozen=True)
class BuildCommand:
    what: str
    module: str
    args: tuple[str, ...]


def build_command(task: str, profile: Profile) -> BuildCommand:
    """The build that makes `task`'s engine as the profile describes it."""
    models = profile.models
    if task == "inspect":
        inspect = models.inspect
        args = ("--size", inspect.build_size, "--dataset", inspect.dataset)
        return BuildCommand("the inspection model", "engines.vision.vision_build", args)
    if task == "qa":
        qa = models.qa
        return BuildCommand(
            "the text engine",
            "engines.text.text_build",
            (
                "--source",
                qa.source,
                "--adapter",
                qa.adapter,
                "--quantization",
                qa.quantization,
                *(("--layers", json.dumps([rule.to_selector() for rule in qa.layers])) if qa.layers else ()),
                *(("--qat", json.dumps(qa.qat.model_dump(exclude={"enabled"}))) if qa.qat.enabled else ()),
            ),
        )
    raise ValueError(f"task {task!r} has no engine to build")


def plan_command(
    profile: Profile,
    student: Path | None = None,
    checkpoint: Path | None = None,
    models: tuple[str, ...] | None = None,
    compute_capability: str | None = None,
    student_precisions: tuple[str, ...] = ("fp16", "int8"),
) -> BuildCommand:
    """The build that makes the TensorRT plans of `models` (student, ocr, text: by
    default every one the profile serves) from the builds named."""
    m = profile.models
    if models is None:
        models = tuple(
            name for name, on in (("student", m.inspect.enabled), ("ocr", m.ocr.enabled), ("text", m.qa.enabled)) if on
        )
    args: list[str] = ["--models", ",".join(models)]
    if "student" in models:
        if student is None:
            raise ValueError("the student's plans need its build directory")
        args += ["--student", str(student), "--max-batch", str(m.inspect.max_batch)]
        args += ["--student-precisions", ",".join(student_precisions)]
    if "ocr" in models:
        args += ["--det-limit-side-len", str(m.ocr.det_limit_side_len)]
    if "text" in models:
        if checkpoint is None:
            raise ValueError("the text model's plan needs its checkpoint directory")
        args += ["--text", str(checkpoint), "--max-context", str(m.qa.max_context_tokens)]
        args += ["--max-sequences", str(m.qa.max_sequences)]
    if compute_capability:
        args += ["--compute-capability", compute_capability]
    return BuildCommand("TensorRT plans for " + ", ".join(models), "engines.trt_build", tuple(args))


def plan_selector(task: str, profile: Profile, built_from: Path | None) -> dict[str, object]:
    """What the plan that serves `task` as the profile asks is found by (its precision
    included)."""
    m = profile.models
    if task == "inspect":
        assert built_from is not None
        precision = m.inspect.backend.precision if m.inspect.backend.type == "tensorrt" else "fp16"
        return {"task": "inspect", "student": built_from.name, "precision": precision}
    if task == "ocr":
        from edge.vision.ocr import DET_MODEL

        return {"task": "ocr", "file": DET_MODEL, "precision": "fp16"}
    raise ValueError(f"task {task!r} has no plan selector")


class Builds(Protocol):
    """What runs a build to its end (ChildBuilds)."""

    def run(self, cmd: BuildCommand) -> None: ...


def ensure_plans(profile: Profile, task: str, built_from: Path | None, builds: Builds | None) -> None:
    """On a box with TensorRT, a first start builds the plans `task` serves from when
    its backend is tensorrt and none was built for this GPU and TensorRT version. Where
    TensorRT is absent nothing is built: loading says so."""
    cfg = profile.models.inspect if task == "inspect" else profile.models.ocr
    if cfg.backend.type != "tensorrt" or builds is None or not profile.build_missing_engines:
        return
    from edge.artifacts import PlanMismatch
    from edge.backends.tensorrt_backend import TRT_SUPPORT, load_plan

    if not TRT_SUPPORT:
        return
    try:
        load_plan(profile.paths.engine_dir, plan_selector(task, profile, built_from))
        return
    except (EngineMissing, PlanMismatch) as err:
        logger.info("%s: %s; building", task, err)
    wanted = plan_selector(task, profile, built_from)
    models = ("student",) if task == "inspect" else ("ocr",)
    builds.run(plan_command(profile, built_from, None, models, None, (str(wanted["precision"]),)))


def command_line(cmd: BuildCommand, engine_dir: Path, progress: bool) -> list[str]:
    line = [sys.executable, "-m", cmd.module, "--engine-dir", str(engine_dir), *cmd.args]
    return line if progress else [*line, "--no-progress"]


class ChildBuilds:
    def __init__(self, engine_dir: Path, notifier: Notifier, stop: threading.Event) -> None:
        self._engine_dir = engine_dir
        self._notifier = notifier
        self._stop = stop
        # What is being built now (status, metrics), and how the builds so far ended.
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None
        self.results: dict[str, int] = {"built": 0, "failed": 0, "stopped": 0}

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            current = self._current
            running = None
            if current is not None:
                running = {"what": current[0], "seconds": round(time.monotonic() - current[1], 1)}
            return {"running": running, **self.results}

    def _ended(self, result: str) -> None:
        with self._lock:
            self._current = None
            self.results[result] += 1

    def run(self, cmd: BuildCommand) -> None:
        """Run one build to its end; BuildStopped if a stop request ended it first,
        RuntimeError if it failed (its log lines are in ours: its stderr is ours)."""
        line = command_line(cmd, self._engine_dir, progress=False)
        logger.info("building %s (first start only): %s", cmd.what, " ".join(line[1:]))
        started = time.monotonic()
        with self._lock:
            self._current = (cmd.what, started)
        try:
            child = subprocess.Popen(line, stdout=subprocess.DEVNULL)
        except OSError:
            self._ended("failed")
            raise
        extended_at = -EXTEND_EVERY_S
        while child.poll() is None:
            now = time.monotonic()
            if now - extended_at >= EXTEND_EVERY_S:
                self._notifier.extend_timeout(EXTEND_S)
                self._notifier.status(f"building {cmd.what} (first start only), {now - started:.0f} s so far")
                extended_at = now
            if self._stop.wait(0.2):
                logger.info("stopping the %s build (pid %d)", cmd.module, child.pid)
                child.terminate()
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                self._ended("stopped")
                raise BuildStopped(cmd.module)
        if child.returncode != 0:
            self._ended("failed")
            raise RuntimeError(f"{cmd.module} exited with {child.returncode}; its log is above")
        self._ended("built")
        logger.info("built %s in %.0f s", cmd.what, time.monotonic() - started)


KINDS = {"inspect": "vision-student", "qa": "llama-"}


def source_id(source: str) -> str:
    """How builds name a source (text model, adapter, image dataset): the built-in's name,
    or the user's path with the size and modification time of each file under it, so
    that one changed in place is built again rather than served from the old build."""
    path = Path(source)
    if not path.is_absolute():
        return source
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    stamp = ",".join(f"{f.relative_to(path.parent)}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return f"{path}@{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"


def selector(task: str, profile: Profile) -> dict[str, object]:
    """What the profile asks of `task`'s engine, in the words builds tag manifests with."""
    models = profile.models
    if task == "inspect":
        inspect = models.inspect
        return {"task": "inspect", "size": inspect.build_size, "distilled": True, "dataset": source_id(inspect.dataset)}
    if task == "qa":
        qa = models.qa
        wanted: dict[str, object] = {
            "task": "qa",
            "source": source_id(qa.source),
            "adapter": source_id(qa.adapter),
            "quantization": qa.quantization,
        }
        if qa.layers:  # only then: builds from before per-layer rules are found as they were
            wanted["layers"] = [rule.to_selector() for rule in qa.layers]
        if qa.qat.enabled:  # likewise
            wanted["qat"] = qa.qat.to_selector()
        return wanted
    raise ValueError(f"task {task!r} has no engine")


def locate(profile: Profile, task: str, builds: ChildBuilds | None) -> Path:
    """The engine directory `task` serves from: the one the profile names, or the newest
    build in the engine directory that matches the profile; built first (in a child
    process) when there is none and the profile allows it. EngineMissing otherwise."""
    named = profile.models.inspect.engine if task == "inspect" else profile.models.qa.engine
    if named is not None:
        return open_engine(named, KINDS[task]).path
    wanted = selector(task, profile)
    engine_dir = profile.paths.engine_dir
    check_readable(engine_dir)
    found = find(engine_dir, **wanted)
    if found is None:
        broken = [p for p in damaged(engine_dir) if _could_serve(p, engine_dir, task)]
        if broken:
            names = ", ".join(p.name for p in broken)
            raise EngineMissing(
                f"no readable engine for {task}, and {names} in {engine_dir} holds an unreadable manifest: "
                "not building over it; repair or remove it"
            )
        if builds is None or not profile.build_missing_engines:
            raise EngineMissing(
                f"no engine for {task} ({_describe(wanted)}) in {engine_dir}; run `edgectl build --profile ...`"
            )
        builds.run(build_command(task, profile))
        found = find(engine_dir, **wanted)
        if found is None:
            raise EngineMissing(f"the {task} build finished but no engine in {engine_dir} serves it")
    logger.info("%s serves from %s", task, found.path)
    return found.path


def _could_serve(directory: Path, engine_dir: Path, task: str) -> bool:
    """Whether a build directory is of the kind `task`'s build writes (by where the
    builds put them: text checkpoints under text/, students as vision-student-*)."""
    if task == "qa":
        return directory.parent.name == "text" and directory.parent.parent == engine_dir
    return directory.name.startswith("vision-student-")


def _describe(wanted: dict[str, object]) -> str:
    return ", ".join(f"{k} {v}" for k, v in wanted.items() if k != "task")
