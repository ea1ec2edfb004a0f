"""`edgectl profile`: record a window of work and write it as profile.json and heat maps.

Three ways in:
- a given workload (`record_workload`): the profile's engines loaded in this process and
  N jobs run under torch.profiler (CUPTI's kernel and memcpy records on CUDA, torch's
  operators on the CPU), the stages and text steps timed beside it, the box sampled;
- a running daemon (`record_daemon`): for N seconds, the box sampled and the daemon's
  own stage timings read from its metrics endpoint (edge_job_stage_seconds) at each
  sample; no kernel records, as those can only be taken inside the daemon's process;
- a document written before (`draw_again`): its heat maps drawn again.
"""

from __future__ import annotations

import logging
import platform
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.profiling import document, heatmap
from edge.profiling.sampler import GpuProbe, Sampler, Series
from edge.profiling.timeline import Timeline

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
STAGE_SUMS = "edge_job_stage_seconds"


@dataclass(frozen=True)
class Settings:
    out: Path
    columns: int = 60
    interval_s: float = 0.1
    draw: bool = True


@dataclass
class Written:
    json: Path
    pngs: list[Path]
    # Why the heat maps were not drawn (matplotlib missing), or None.
    not_drawn: str | None = None


def _finish(doc: dict[str, Any], settings: Settings, progress: Progress) -> Written:
    path = document.write(doc, settings.out)
    progress(f"wrote {path}")
    if not settings.draw:
        return Written(path, [])
    try:
        pngs = heatmap.draw(doc, settings.out)
    except heatmap.Unavailable as err:
        return Written(path, [], str(err))
    for png in pngs:
        progress(f"wrote {png}")
    return Written(path, pngs)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record_workload(
    profile: Any, task: str, jobs: int, settings: Settings, progress: Progress, gpu: GpuProbe | None = None
) -> Written:
    """Load `task`'s engines as the daemon does, run `jobs` jobs under the profiler, write
    the document and the heat maps. WorkloadError / EngineMissing where it cannot run."""
    import torch
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    from edge.profiling import records
    from edge.profiling.bandwidth import DEFAULT_BYTES, copy_bandwidth
    from edge.profiling.workload import load

    progress(f"loading the {task} engines as the daemon does (profile {profile.device_id})")
    workload = load(profile, task)
    on_cuda = workload.device == "cuda"
    progress("measuring the copy bandwidth" + (" on the GPU" if on_cuda else " of the CPU's memory"))
    bandwidth = copy_bandwidth(device="cuda" if on_cuda else "cpu")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    sampler = Sampler(settings.interval_s, gpu, clock=time.perf_counter)
    progress(f"running {jobs} {task} job(s) under the profiler")
    sampler.start()
    try:
        with torch_profile(activities=activities) as prof:
            # The window starts here, once the profiler has started (which takes a while).
            marked_at = start = time.perf_counter()
            with record_function(records.CLOCK_MARK):
                pass
            recorded = workload.run(jobs, progress)
            if on_cuda:
                torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        series = sampler.stop()
    progress("reading the profiler's records")
    events = records.trace_events(prof)
    offset = records.clock_offset(events, marked_at)
    timeline = Timeline(start, max(end, start + 1e-6), settings.columns)
    held = {"kernels": False, "memcpy": False, "occupancy": False}
    if offset is not None:
        held = records.add_records(timeline, events, offset, records.Attribution(recorded.products, recorded.windows))
    for r in recorded.host:
        timeline.add(r.name, r.kind, r.start, r.seconds, r.nbytes)
    for job in recorded.jobs:
        job["start_s"] = round(job.pop("start") - start, 6)
        job["seconds"] = round(job["seconds"], 6)
    device = {
        "backend": "cuda" if on_cuda else "cpu",
        "name": torch.cuda.get_device_name() if on_cuda else _cpu_name(),
        "copy_bandwidth_bytes_per_s": round(bandwidth, 1),
        "copy_bandwidth_method": f"torch copy_ {'device to device' if on_cuda else 'in host memory'}, "
        f"{DEFAULT_BYTES // 2**20} MiB, bytes read + written, median of 20",
    }
    available = _available(on_cuda, held, series, offset is not None)
    workload_doc = {"task": task, "jobs": jobs, "profile": profile.device_id, "engines": workload.engines}
    doc = document.document("workload", timeline, series, device, available, workload_doc, recorded.jobs,
                            records.transfers(events))  # fmt: skip
    return _finish(doc, settings, progress)


NO_CUDA = (
    "no CUDA here: no kernel timing; rows are the jobs' stages, the text steps and torch's operators; work "
    "inside our C kernels and ONNX Runtime shows in the stage or step that calls it"
)
DAEMON = (
    "a running daemon: no kernel or copy records (they are taken inside the daemon's process only), and no "
    "bytes; stage rows are the daemon's edge_job_stage_seconds, each job's stages counted in the column its "
    "result was sent"
)


def _available(
    on_cuda: bool, held: dict[str, bool], series: Series, traced: bool, without_cuda: str = NO_CUDA
) -> dict[str, Any]:
    notes = []
    if not traced:
        notes.append("the profiler's records could not be placed on the timeline (no clock mark): only stages, "
                     "steps and samples are shown")  # fmt: skip
    if on_cuda:
        if not held["kernels"]:
            notes.append("no kernel records: CUPTI gave none (another profiler attached, or no permission)")
        if held["kernels"] and not held["occupancy"]:
            notes.append("SM occupancy not available: the kernel records carry no 'est. achieved occupancy %'")
    else:
        notes.append(without_cuda)
    gpu = series.source if series.source != "none" else None
    if gpu is None:
        notes.append("no GPU load or memory-controller figures: no NVML and no Jetson GPU in sysfs")
    return {
        "kernel_timing": held["kernels"],
        "sm_occupancy": held["occupancy"],
        "memcpy": held["memcpy"],
        "gpu_load": gpu,
        "memory_controller": gpu,
        "cpu_load": "/proc/stat" if any(v is not None for v in series.cpu_load) else None,
        "notes": notes,
    }


def metrics_url(profile: Any) -> str | None:
    address = profile.metrics.address
    if address is None:
        return None
    host, port = address
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/metrics"


class DaemonUnreachable(Exception):
    """The daemon's metrics endpoint did not answer."""


def scrape_stages(url: str, timeout: float = 2.0) -> dict[tuple[str, str], tuple[float, float]]:
    """(task, stage) -> (seconds, count) so far, from the daemon's edge_job_stage_seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            text = answer.read().decode("utf-8")
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise DaemonUnreachable(f"the daemon's metrics at {url} did not answer: {err}") from err
    out: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != STAGE_SUMS:
            continue
        for sample in family.samples:
            key = (sample.labels.get("task", "?"), sample.labels.get("stage", "?"))
            if sample.name == f"{STAGE_SUMS}_sum":
                out.setdefault(key, [0.0, 0.0])[0] = sample.value
            elif sample.name == f"{STAGE_SUMS}_count":
                out.setdefault(key, [0.0, 0.0])[1] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def record_daemon(
    profile: Any,
    seconds: float,
    settings: Settings,
    progress: Progress,
    url: str | None = None,
    gpu: GpuProbe | None = None,
) -> Written:
    """Sample the box for `seconds` while the daemon serves, reading its stage timings at
    each sample; DaemonUnreachable where its metrics endpoint does not answer."""
    url = url or metrics_url(profile)
    if url is None:
        raise DaemonUnreachable("the profile has no metrics listener (metrics.listen is null); give --metrics-url")
    last = scrape_stages(url)  # before anything: a daemon that does not answer is said at once
    sampler = Sampler(settings.interval_s, gpu, clock=time.perf_counter)
    start = time.perf_counter()
    timeline = Timeline(start, start + seconds, settings.columns)
    sampler.start()
    said = start
    try:
        while (now := time.perf_counter()) < start + seconds:
            time.sleep(min(settings.interval_s, start + seconds - now))
            at = time.perf_counter()
            try:
                current = scrape_stages(url)
            except DaemonUnreachable as err:
                logger.warning("%s", err)
                continue
            for key, (total, count) in current.items():
                before = last.get(key, (0.0, 0.0))
                if count > before[1]:
                    # Stage time of the jobs answered since the last reading, in this column.
                    timeline.add_total(f"{key[0]}: {key[1]}", "stage", at, total - before[0], int(count - before[1]))
            last = current
            if at - said >= 5.0:
                progress(f"recording: {at - start:.0f} of {seconds:.0f} s")
                said = at
    finally:
        series = sampler.stop()
    device = {"backend": "box", "name": _cpu_name(), "copy_bandwidth_bytes_per_s": None,
              "copy_bandwidth_method": None}  # fmt: skip
    available = _available(False, {"kernels": False, "memcpy": False, "occupancy": False}, series, True, DAEMON)
    workload = {"task": None, "jobs": None, "profile": profile.device_id, "engines": {}, "metrics": url}
    doc = document.document("daemon", timeline, series, device, available, workload)
    return _finish(doc, settings, progress)


def draw_again(path: Path, out: Path) -> list[Path]:
    """The heat maps of a profile.json written before (NotAProfile, heatmap.Unavailable)."""
    return heatmap.draw(document.read(path), out)
