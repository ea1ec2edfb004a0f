#!/usr/bin/env python3
"""Both branches under one memory budget: cameras send bursts of inspect jobs with
deadlines, alone and while a Q&A stream runs.

    python -m bench.scheduler cpu    # ViT student on onnxruntime + SmolLM2 INT4, 2 cores
    python -m bench.scheduler cuda   # student FP16 + CUDA graphs + Llama-3-8B shape INT4
                                     # (random weights), process capped at 8 GiB

The scheduler's own parts run as the daemon runs them (the vision worker's dynamic
batcher, the text worker's continuous batching, the memory ledger with the text KV pool);
MQTT is left out so the figures are the scheduler's. Reported per run: p50/p99 latency
per task, deadline misses, throughput, evictions, the ledger's peak against the budget
and the process's peak memory (resident on CPU, CUDA allocator on GPU). Also vision
throughput at batch 1 and at the best batch. Writes bench/results/scheduler_<device>.json
and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import random
import resource
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from bench.common import REPO, RESULTS, percentile, write_json
from bench.text_engines import engine_fields
from edge.backends import BackendOptions
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import ImageRef, InspectJob, ParsedJob, QAJob
from edge.scheduler.branch import (
    BranchWorker,
    Outcome,
    share_interpreter_between_branches,
)
from edge.scheduler.ledger import MemoryLedger, measure
from edge.scheduler.queue import BatchPolicy, PriorityDeadlineQueue
from edge.scheduler.text_worker import TextMemory, TextWorker
from edge.scheduler.work import Reply, WorkItem
from edge.tasks.qa import result_of
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams
from edge.vision.inspect import InspectPipeline

GIB = 1 << 30
BUDGET = 8 * GIB


@dataclass(frozen=True)
class Load:
    cameras: int
    burst: int  # images per burst
    period_s: float  # between bursts, per camera
    deadline_ms: int
    qa_every_s: float
    qa_new_tokens: int
    max_batch: int
    seconds: float


LOADS = {
    "cpu": Load(
        cameras=4, burst=4, period_s=1.6, deadline_ms=2000, qa_every_s=2.0, qa_new_tokens=32, max_batch=8, seconds=30
    ),
    "cuda": Load(
        cameras=8, burst=8, period_s=0.25, deadline_ms=200, qa_every_s=0.5, qa_new_tokens=64, max_batch=32, seconds=20
    ),
}


class Probe:
    def __init__(self, device: str) -> None:
        self.device = device

    def used_bytes(self) -> int:
        if self.device == "cuda":
            return int(torch.cuda.memory_allocated())
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def peak_bytes(self) -> int:
        if self.device == "cuda":
            return int(torch.cuda.max_memory_allocated())
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def part_images() -> list[np.ndarray]:
    out = []
    for path in sorted((REPO / "samples" / "parts").glob("*.png")):
        img = cv2.imread(str(path))
        if img is None:
            raise FileNotFoundError(path)
        out.append(cv2.cvtColor(img, cv2.COLOR_BGR2RGB))
    return out


@dataclass
class Record:
    task: str
    latency_ms: float
    missed: bool
    error: str | None


@dataclass
class Collector:
    records: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def complete(self, item: WorkItem, outcome: Outcome) -> None:
        latency = (outcome.finished_at - item.received_at) * 1000.0
        late = item.deadline_at is not None and outcome.finished_at > item.deadline_at
        code = outcome.error.code.value if outcome.error else None
        with self.lock:
            self.records.append(Record(item.job.task, latency, late or code is not None, code))


def vision_throughput(pipeline: InspectPipeline, images: list[np.ndarray], batches: list[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for b in batches:
        batch = [images[i % len(images)] for i in range(b)]
        pipeline.run(batch)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 3.0:
            pipeline.run(batch)
            n += b
        out[b] = n / (time.perf_counter() - t0)
    return out


def build_text_cpu(
    ledger: MemoryLedger, probe: Probe, engine_dir: Path
) -> tuple[ContinuousBatcher, Callable[[WorkItem], Sequence], Any]:
    from bench.text_engines import load_engine
    from edge.tasks.qa import job_sequence
    from engines.text.text_build import build_text_engine

    path = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    changes: dict[str, Any] = {"max_context_tokens": 1024, "max_new_tokens": 32, "max_sequences": 4}
    engine, used = measure(probe, lambda: load_engine(path, "cpu", **changes))
    assert ledger.add_model("text", "text", used), "text model over budget"

    def prepare(item: WorkItem) -> Sequence:
        assert isinstance(item.job.request, QAJob)
        return job_sequence(engine, item.job.request, item)

    return engine.batcher, prepare, engine


def build_text_cuda(
    ledger: MemoryLedger, probe: Probe, new_tokens: int, workdir: Path
) -> tuple[ContinuousBatcher, Callable[[WorkItem], Sequence], Any]:
    """The served CUDA engine (the shipped profile's qa section) over a Llama-3-8B-shaped
    checkpoint with random weights, quantized at `edgectl build`'s group size: 4
    sequences x 1,024 positions, the 4,096-token KV budget."""
    from bench.text_engines import load_engine
    from engines.text.random_llama import LLAMA3_8B, write_random_checkpoint
    from engines.text.text_build import serving_group

    group = serving_group(LLAMA3_8B.parameter_count())  # as `edgectl build` quantizes it

    path = write_random_checkpoint(workdir / "llama3-8b-int4-random", LLAMA3_8B, device="cuda", group=group)
    changes: dict[str, Any] = {"max_context_tokens": 1024, "max_new_tokens": new_tokens, "max_sequences": 4}
    # Loaded and warmed up (GEMV tuned, kernels built, graphs captured) before the vision
    # thread uses the GPU, as the daemon's start steps do.
    engine, used = measure(probe, lambda: load_engine(path, "cuda", **changes))
    assert ledger.add_model("text", "text", used), "text model over budget"
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    # Every prompt 256 random tokens, each run to its full length (random weights: speed only).
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    def prepare(item: WorkItem) -> Sequence:
        return engine.sequence([rng.randrange(1000, vocab) for _ in range(256)], params, item)

    return engine.batcher, prepare, engine


def run_load(
    load: Load,
    with_qa: bool,
    pipeline: InspectPipeline,
    images: list[np.ndarray],
    ledger: MemoryLedger,
    text: tuple[ContinuousBatcher, Callable[[WorkItem], Sequence], Any],
) -> dict[str, Any]:
    collector = Collector()
    per_image = pipeline.batch_bytes(1) + max(img.nbytes for img in images)

    def inspect_batch(items: list[WorkItem]) -> list[dict[str, Any] | JobError]:
        res = ledger.reserve(items[0].job.id, "inspect", per_image * len(items))
        if res is None:
            return [JobError(ErrorCode.OVER_BUDGET, "batch buffers do not fit") for _ in items]
        try:
            found = pipeline.run([images[int(it.job.id.rsplit("-", 1)[1]) % len(images)] for it in items])
            return [{"label": f.label} for f in found]
        finally:
            ledger.release(res)

    @dataclass
    class InspectBatches:
        name: str
        policy: BatchPolicy

        def run(self, items: list[WorkItem]) -> list[dict[str, Any] | JobError]:
            return inspect_batch(items)

    @dataclass
    class Questions:
        name: str
        prepare: Callable[[WorkItem], Sequence]
        output: Callable[[Sequence], dict[str, Any]]
        kv_tokens: Callable[[Sequence], int]

        def ready(self, item: WorkItem, wait_s: float) -> bool:
            return True  # plain questions: nothing to prepare off the worker's thread

    vq = PriorityDeadlineQueue(4096)
    policy = BatchPolicy(load.max_batch, 0.005, frozenset({load.max_batch}))
    vision = BranchWorker("vision", vq, {"inspect": InspectBatches("inspect", policy)}, collector.complete)
    tq = PriorityDeadlineQueue(4096)
    batcher, prepare, engine = text
    questions_task = Questions("qa", prepare, result_of, engine.kv_tokens)
    text_worker = TextWorker("text", tq, questions_task, batcher, TextMemory(ledger, "text", 0.05), collector.complete)
    vision.start()
    text_worker.start()
    stop = threading.Event()
    counter = iter(range(10**9))

    def camera(cam: int) -> None:
        rng = random.Random(cam)
        time.sleep(rng.random() * load.period_s)
        while not stop.is_set():
            for _ in range(load.burst):
                n = next(counter)
                job = ParsedJob(
                    f"cam{cam}-{n}",
                    "inspect",
                    1,
                    load.deadline_ms,
                    InspectJob(id=f"cam{cam}-{n}", image=ImageRef(path="part.png")),
                )
                now = time.monotonic()
                vq.put(WorkItem(job, Reply("r"), now, now + load.deadline_ms / 1000.0))
            stop.wait(load.period_s * (0.8 + 0.4 * rng.random()))

    def questions() -> None:
        n = 0
        while not stop.is_set():
            job_id = f"qa-{n}"
            req = QAJob(id=job_id, question="What are the signs of dehydration?", max_new_tokens=load.qa_new_tokens)
            tq.put(WorkItem(ParsedJob(job_id, "qa", 5, None, req), Reply("r")))
            n += 1
            stop.wait(load.qa_every_s)

    threads = [threading.Thread(target=camera, args=(c,)) for c in range(load.cameras)]
    if with_qa:
        threads.append(threading.Thread(target=questions))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(load.seconds)
    stop.set()
    for t in threads:
        t.join()
    # Let what was accepted finish: nothing is dropped at the end of a run.
    deadline = time.monotonic() + 120
    while (len(vq) or len(tq) or vision.running or text_worker.running) and time.monotonic() < deadline:
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    vision.stop(10)
    text_worker.stop(60)
    tasks: dict[str, Any] = {}
    for task in ("inspect", "qa"):
        recs = [r for r in collector.records if r.task == task]
        if not recs:
            continue
        lat = [r.latency_ms for r in recs if r.error is None]
        tasks[task] = {
            "jobs": len(recs),
            "p50_ms": percentile(lat, 0.5),
            "p99_ms": percentile(lat, 0.99),
            "missed": sum(r.missed for r in recs),
            "errors": sorted({r.error for r in recs if r.error}),
            "per_s": len(recs) / elapsed,
        }
    if "qa" in tasks:
        tasks["qa"]["tokens_per_s"] = sum(s * n for s, n in batcher.batch_sizes.items()) / elapsed
    return {
        "with_qa": with_qa,
        "seconds": elapsed,
        "tasks": tasks,
        "vision_batches": dict(sorted(vision.batch_sizes.items())),
        "text_batches": dict(sorted(batcher.batch_sizes.items())),
        "paused": text_worker.paused,
        "over_budget": text_worker.over_budget,
    }


def run(device: str, seconds: float | None, engine_dir: Path, student_size: str) -> dict[str, Any]:
    load = LOADS[device]
    if seconds:
        load = Load(**{**load.__dict__, "seconds": seconds})
    probe = Probe(device)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        torch.cuda.set_per_process_memory_fraction(BUDGET / props.total_memory)
    else:
        torch.set_num_threads(1)
    ledger = MemoryLedger(BUDGET, 256 << 20)
    assert ledger.add_model("runtime", "daemon", probe.used_bytes(), keep_alive_s=float("inf"))
    images = part_images()
    workdir = Path(tempfile.mkdtemp(prefix="edge-bench-scheduler-"))
    try:
        return _run_loaded(device, load, probe, ledger, images, workdir, engine_dir, student_size)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_loaded(
    device: str,
    load: Load,
    probe: Probe,
    ledger: MemoryLedger,
    images: list[np.ndarray],
    workdir: Path,
    engine_dir: Path,
    student_size: str,
) -> dict[str, Any]:
    student = student_dir(device, workdir, engine_dir, student_size)
    backend = "torch-cuda" if device == "cuda" else "onnxruntime"
    pipeline, used = measure(
        probe, lambda: InspectPipeline.load(student, backend, BackendOptions(threads=1, max_batch=load.max_batch))
    )
    assert ledger.add_model("inspect", "vision", used), "student over budget"
    batches = [1, 8, 32] if device == "cuda" else [1, 8]
    throughput = vision_throughput(pipeline, images, batches)
    text = (
        build_text_cuda(ledger, probe, load.qa_new_tokens, workdir)
        if device == "cuda"
        else build_text_cpu(ledger, probe, engine_dir)
    )
    resident = ledger.snapshot()
    share_interpreter_between_branches()  # as the daemon does before its workers start
    alone = run_load(load, False, pipeline, images, ledger, text)
    mixed = run_load(load, True, pipeline, images, ledger, text)
    best = max(throughput, key=lambda b: throughput[b])
    snap = ledger.snapshot()
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "student": "ViT-Tiny, random weights" if device == "cuda" else f"{student_size} student build",
        "load": load.__dict__,
        "budget_bytes": BUDGET,
        "resident_models": {k: v["bytes"] for k, v in resident["models"].items()},
        "kv_pool_bytes": text[0].kv.capacity_bytes,
        "kv_pool_tokens": text[0].slots * text[0].slot_len,
        **engine_fields(text[2]),
        "ledger_peak_bytes": snap["peak_bytes"],
        "process_peak_bytes": probe.peak_bytes(),
        "evictions": snap["evictions"],
        "vision_images_per_s": {str(b): v for b, v in throughput.items()},
        "vision_best_batch": best,
        "vision_best_over_batch1": throughput[best] / throughput[1],
        "alone": alone,
        "with_qa": mixed,
        "inspect_p99_ratio": mixed["tasks"]["inspect"]["p99_ms"] / alone["tasks"]["inspect"]["p99_ms"],
    }


def student_dir(device: str, workdir: Path, engine_dir: Path, size: str) -> Path:
    """On CUDA a ViT-Tiny student with random weights (speed only, as bench.daemon's), or
    the one carried under .edge/exp/student; on the CPU the build of that size."""
    if device == "cuda":
        carried = REPO / ".edge" / "exp" / "student"
        if carried.is_dir():
            return carried
        from engines.vision.random_student import write_random_student

        return write_random_student(workdir / "student-random")
    from engines.vision.vision_build import build_student

    return build_student(engine_dir, size, progress=False)


def print_result(r: dict[str, Any]) -> None:
    print(f"{r['device']}, torch {r['torch']}, budget {r['budget_bytes'] / GIB:.0f} GiB")
    print("| run | task | jobs | p50 ms | p99 ms | missed | jobs/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in ("alone", "with_qa"):
        for task, t in r[name]["tasks"].items():
            print(
                f"| {name} | {task} | {t['jobs']} | {t['p50_ms']:.0f} | {t['p99_ms']:.0f} | {t['missed']} | "
                f"{t['per_s']:.1f} |"
            )
    print(f"inspect p99 with Q&A / alone: {r['inspect_p99_ratio']:.2f}x")
    ips = r["vision_images_per_s"]
    print(f"vision images/s by batch: {ips}; best/batch 1: {r['vision_best_over_batch1']:.1f}x")
    print(
        f"ledger peak {r['ledger_peak_bytes'] / GIB:.2f} GiB, process peak {r['process_peak_bytes'] / GIB:.2f} GiB "
        f"of {r['budget_bytes'] / GIB:.0f} GiB; KV pool {r['kv_pool_tokens']} tokens; evictions {r['evictions']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("--seconds", type=float, default=None, help="length of each load run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines", help="cpu: built engines")
    parser.add_argument("--student-size", default="default", help="cpu: the student build to serve")
    args = parser.parse_args()
    result = run(args.device, args.seconds, args.engine_dir, args.student_size)
    out = args.out or RESULTS / f"scheduler_{args.device}.json"
    write_json(out, result)
    print_result(result)
    assert result["ledger_peak_bytes"] <= BUDGET and result["process_peak_bytes"] <= BUDGET, "over budget"
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
