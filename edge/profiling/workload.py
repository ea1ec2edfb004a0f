"""A given workload run in this process, as the daemon would serve it: the engines the
profile serves, found and loaded the way the daemon loads them (builds.locate, then the
task's start_* through a model manager and its memory ledger), and jobs validated by the
protocol's parser, run through the tasks' own code.

- qa: questions with their own context (no collection: retrieval is not profiled), as
  sequences of the engine's continuous batcher, decoded together (`run_all`). Each
  prefill and decode step is timed and marked for the profiler (`edge.prefill`,
  `edge.decode`) with the bytes it moves from the model's shapes (edge/profiling/shapes.py).
- inspect: the sample parts, in batches of the profile's max_batch, through the
  inspection task (image decoding included).
- ocr: the sample labels, one at a time, through the OCR task.

Each job's stages are laid on the timeline as they end (edge/timing.py's watcher).
Nothing is built here: a workload whose engine is missing is refused with the command
that builds it.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edge import builds, timing
from edge.config.profile import Profile
from edge.memory import HostProbe, open_cuda
from edge.profiling.records import Window
from edge.profiling.shapes import Product, products, weight_bytes
from edge.protocol.errors import JobError
from edge.protocol.images import ImageLimits
from edge.protocol.jobs import JobLimits, parse_job
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.models import ModelManager
from edge.scheduler.work import Reply, WorkItem

logger = logging.getLogger(__name__)

WORKLOADS = ("qa", "inspect", "ocr")
SAMPLES = Path(__file__).resolve().parents[2] / "samples"
MIB = 2**20
# Questions a clinic's box is asked, each with the passage of the sample leaflets
# (samples/leaflets) that answers it.
QUESTIONS = (
    ("How long does the pump battery last?",
     "The battery lasts 6 hours; plug the pump in when the battery icon flashes."),
    ("When is the pharmacy open on Saturdays?",
     "The pharmacy is open from 8 am to 7 pm on weekdays and from 9 am to 1 pm on Saturdays. It is closed on Sundays."),
    ("What are the visiting hours on ward 2?",
     "Visiting hours on ward 2 are 3 pm to 7 pm every day. Two visitors per bed."),
    ("How often should the dressing be changed?",
     "Change the dressing every 48 hours, or sooner if it is wet or soiled."),
)  # fmt: skip

Progress = Callable[[str], None]


class WorkloadError(Exception):
    """A workload that cannot run here, said in one line (no engine, a model off)."""


@dataclass(frozen=True)
class HostRecord:
    name: str
    kind: str  # "stage" or "step"
    start: float
    seconds: float
    nbytes: float | None = None


@dataclass
class Recorded:
    """What a run recorded beside the profiler's own records."""

    host: list[HostRecord] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    products: list[Product] | None = None


@dataclass(frozen=True)
class Workload:
    """A loaded workload: `run(count, progress)` runs that many jobs and returns what it
    recorded; `device` is where its model runs ("cpu" or "cuda"); `engines` what serves."""

    task: str
    device: str
    engines: dict[str, str]
    run: Callable[[int, Progress], Recorded]


def _manager(profile: Profile, on_cuda: bool) -> ModelManager:
    ledger = MemoryLedger(profile.memory_budget_mib * MIB, profile.memory_headroom_mib * MIB)
    probe: Any = HostProbe()
    if on_cuda:
        try:
            probe, _runtime = open_cuda()
        except RuntimeError as err:
            raise WorkloadError(str(err)) from err
    return ModelManager(ledger, probe)


def _limits(profile: Profile) -> JobLimits:
    return JobLimits(
        max_payload_bytes=profile.limits.max_payload_bytes,
        max_prompt_chars=profile.limits.max_prompt_chars,
        max_new_tokens_limit=profile.models.qa.max_new_tokens_limit,
    )


def _items(task: str, payloads: list[dict[str, Any]], limits: JobLimits) -> list[WorkItem]:
    items = []
    for payload in payloads:
        try:
            parsed = parse_job(payload, task, limits)
        except JobError as err:  # the profile's limits refuse the sample job itself
            raise WorkloadError(f"the {task} sample job is refused by the profile's limits: {err.message}") from err
        items.append(WorkItem(parsed, Reply("profile")))
    return items


def _images(folder: str, count: int, task: str, limits: JobLimits) -> list[WorkItem]:
    files = sorted((SAMPLES / folder).glob("*.png"))
    if not files:
        raise WorkloadError(f"no sample images in {SAMPLES / folder}")
    data = [base64.b64encode(f.read_bytes()).decode() for f in files]
    payloads = [{"id": f"profile-{i}", "task": task, "image": {"data": data[i % len(data)]}} for i in range(count)]
    return _items(task, payloads, limits)


class _StageWatch:
    """Each stage of the task's jobs as it ends, onto the host records."""

    def __init__(self, task: str, host: list[HostRecord]) -> None:
        self._task, self._host = task, host

    def __enter__(self) -> None:
        timing.watcher = lambda name, start, end: self._host.append(
            HostRecord(f"{self._task}: {name}", "stage", start, end - start)
        )

    def __exit__(self, *exc: object) -> None:
        timing.watcher = None


def _job(item: WorkItem, start: float, seconds: float, outcome: object) -> dict[str, Any]:
    error = outcome if isinstance(outcome, JobError) else None
    doc: dict[str, Any] = {"id": item.job.id, "task": item.job.task, "start": start, "seconds": seconds,
                           "status": "error" if error else "ok", "stages_ms": dict(item.stages)}  # fmt: skip
    if error is not None:
        doc["error"] = f"{error.code}: {error.message}"
    return doc


def _vision(profile: Profile, task: str) -> Workload:
    from edge.tasks.inspect import start_inspect
    from edge.tasks.media import MediaLoader
    from edge.tasks.ocr import start_ocr

    models = profile.models.with_cpu_threads(len(os.sched_getaffinity(0)))
    cfg = models.inspect if task == "inspect" else models.ocr
    if not cfg.enabled:
        raise WorkloadError(f"the profile does not serve {task} (models.{task}.enabled is false)")
    device = getattr(cfg, "device", "cpu")
    manager = _manager(profile, device == "cuda")
    media = MediaLoader(
        ImageLimits(profile.limits.max_image_bytes, profile.limits.max_image_pixels), profile.paths.media_dir
    )
    engine_dir = profile.paths.engine_dir
    engines: dict[str, str] = {}
    runner: Any
    if task == "inspect":
        student = builds.locate(profile, "inspect", None)
        runner = start_inspect(models.inspect, student, manager, media, None, engine_dir)
        engines["inspect"] = f"{student} ({models.inspect.backend.type})"
        batch, folder = max(1, runner.policy.max_batch), "parts"
    else:
        runner = start_ocr(models.ocr, manager, media, engine_dir)
        engines["ocr"] = f"bundled PP-OCR ({models.ocr.backend.type})"
        batch, folder = 1, "labels"
    limits = _limits(profile)

    def run(count: int, progress: Progress) -> Recorded:
        recorded = Recorded()
        items = _images(folder, count, task, limits)
        with _StageWatch(task, recorded.host):
            for first in range(0, len(items), batch):
                part = items[first : first + batch]
                t0 = time.perf_counter()
                outcomes = runner.run(part)
                seconds = time.perf_counter() - t0
                if device == "cuda":
                    torch.cuda.synchronize()
                recorded.host.append(HostRecord(f"{task}: batch", "step", t0, seconds))
                recorded.jobs.extend(_job(i, t0, seconds, o) for i, o in zip(part, outcomes, strict=True))
                progress(f"{task}: {first + len(part)}/{len(items)} jobs done")
        return recorded

    return Workload(task, device, engines, run)


def _qa(profile: Profile) -> Workload:
    from edge.protocol.jobs import QAJob
    from edge.tasks.qa import job_sequence, load_text_engine, stages

    models = profile.models.with_cpu_threads(len(os.sched_getaffinity(0)))
    cfg = models.qa
    if not cfg.enabled:
        raise WorkloadError("the profile does not serve qa (models.qa.enabled is false)")
    manager = _manager(profile, cfg.device == "cuda")
    checkpoint = builds.locate(profile, "qa", None)
    engine = load_text_engine(cfg, checkpoint, manager, None, profile.device_id)
    engines = {"qa": f"{checkpoint} (torch-{cfg.device} {engine.int4_kernel or 'float'})"}
    limits = _limits(profile)
    batcher = engine.batcher
    weights = weight_bytes(engine.model)
    per_token = float(batcher.kv_bytes_per_token)

    def run(count: int, progress: Progress) -> Recorded:
        recorded = Recorded(products=products(engine.model))
        payloads = [
            {"id": f"profile-{i}", "task": "qa", "question": q, "context": c}
            for i, (q, c) in ((i, QUESTIONS[i % len(QUESTIONS)]) for i in range(count))
        ]
        items = _items("qa", payloads, limits)
        jobs = [item.job.request for item in items]
        seqs = [job_sequence(engine, job) for job in jobs if isinstance(job, QAJob)]
        admit, step = batcher.admit, batcher.step
        started: dict[int, float] = {}
        ended: dict[int, float] = {}
        done = 0

        def timed_admit(seq: Any, slot: Any) -> None:
            kv = len(seq.prompt) * per_token
            t0 = time.perf_counter()
            with torch.profiler.record_function("edge.prefill"):
                admit(seq, slot)
            started.setdefault(id(seq), t0)
            recorded.windows.append(Window("edge.prefill", kv))
            recorded.host.append(HostRecord("qa: prefill", "step", t0, time.perf_counter() - t0, weights + kv))

        def timed_step() -> Any:
            nonlocal done
            kv = sum(s.length for s in batcher.running) * per_token
            t0 = time.perf_counter()
            with torch.profiler.record_function("edge.decode"):
                finished = step()
            recorded.windows.append(Window("edge.decode", kv))
            recorded.host.append(HostRecord("qa: decode step", "step", t0, time.perf_counter() - t0, weights + kv))
            for seq in finished:
                ended[id(seq)] = time.perf_counter()
            if finished:
                done += len(finished)
                progress(f"qa: {done}/{len(seqs)} jobs done")
            return finished

        # The batcher's own methods, timed for this run only (instance attributes over them).
        batcher.admit, batcher.step = timed_admit, timed_step  # type: ignore[method-assign]
        try:
            batcher.run_all(seqs)
        finally:
            del batcher.admit, batcher.step
        end = time.perf_counter()
        for item, seq in zip(items, seqs, strict=True):
            t0 = started.get(id(seq), end)
            item.stages.update(stages(seq))
            doc = _job(item, t0, ended.get(id(seq), end) - t0, None)
            doc["completion_tokens"] = len(seq.tokens)
            recorded.jobs.append(doc)
        return recorded

    return Workload("qa", cfg.device, engines, run)


def load(profile: Profile, task: str) -> Workload:
    """The workload's engines loaded as the daemon loads them; WorkloadError (or
    EngineMissing, from builds.locate) where it cannot run."""
    if task not in WORKLOADS:
        raise WorkloadError(f"unknown workload {task!r}; one of {', '.join(WORKLOADS)}")
    return _qa(profile) if task == "qa" else _vision(profile, task)
