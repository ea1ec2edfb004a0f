"""The box's load over time, sampled on a thread of its own while a profile records:
GPU load and memory-controller utilisation per GPU, and the CPUs' load.

Where each figure comes from:
- a discrete GPU: NVML's utilization rates (nvmlDeviceGetUtilizationRates), `gpu` (the
  share of the last sample period some kernel ran) and `memory` (the share the device
  memory was read or written), through nvidia-ml-py as the metrics read it;
- a Jetson (no NVML before JetPack 7): the iGPU's devfreq load and the external memory
  controller's (EMC) utilisation, read from sysfs as the metrics read them (`tegra`);
- the CPUs: /proc/stat's first line, busy time (all but idle and iowait) over all time
  between two samples.

The GPU probe is a plain function (`GpuProbe`) chosen once, at the start, and replaceable:
tests give a fake NVML or a faked Jetson tree, as the hardware seam. A figure a probe
cannot read is None in that sample, never an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.health import sensors, sysfs, tegra

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one moment: busy fraction and memory-controller utilisation (0..1)."""

    index: int
    load: float | None
    memory_controller: float | None


@dataclass(frozen=True)
class GpuProbe:
    """Where GPU readings come from (`source`: "nvml", "sysfs" or "none") and the
    function that takes one set of them."""

    source: str
    read: Callable[[], list[GpuReading]]


def nvml_probe(nv: Any) -> GpuProbe:
    """Readings of every GPU NVML (`nv`: the pynvml module, or a fake) lists."""

    def read() -> list[GpuReading]:
        out = []
        try:
            count = int(nv.nvmlDeviceGetCount())
        except Exception:
            return []
        for i in range(count):
            try:
                rates = nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByIndex(i))
            except Exception:  # NVML_ERROR_NOT_SUPPORTED on this board, or a GPU gone
                out.append(GpuReading(i, None, None))
                continue
            out.append(GpuReading(i, float(rates.gpu) / 100.0, float(rates.memory) / 100.0))
        return out

    return GpuProbe("nvml", read)


def tegra_probe(root: Path) -> GpuProbe:
    """Readings of a Jetson's iGPU from sysfs under `root`; the EMC is the SoC's one
    memory controller, given with the first GPU."""
    nodes = tegra.igpus(root)

    def read() -> list[GpuReading]:
        emc = tegra.emc_utilization(root)
        return [GpuReading(i, tegra.gpu_load(node), emc if i == 0 else None) for i, node in enumerate(nodes)]

    return GpuProbe("sysfs", read)


NO_GPU = GpuProbe("none", lambda: [])


def default_gpu_probe(root: Path = Path("/sys"), nvml: Callable[[], Any] = sensors.nvml_module) -> GpuProbe:
    """NVML where it answers with a GPU, else a Jetson's sysfs where it has an iGPU, else
    no GPU readings. `nvml` finds the pynvml module (None where NVML is absent)."""
    nv = nvml()
    if nv is not None:
        probe = nvml_probe(nv)
        if probe.read():
            return probe
    if tegra.igpus(root):
        return tegra_probe(root)
    return NO_GPU


class CpuLoad:
    """The CPUs' busy fraction between successive calls, from /proc/stat under `proc`."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._stat = proc / "stat"
        self._last = self._read()

    def _read(self) -> tuple[float, float] | None:
        text = sysfs.read(self._stat)
        if not text:
            return None
        fields = text.splitlines()[0].split()
        if not fields or fields[0] != "cpu":
            return None
        try:
            ticks = [float(v) for v in fields[1:]]
        except ValueError:
            return None
        # user nice system idle iowait irq softirq steal (guest time is inside user already)
        total = sum(ticks[:8])
        idle = sum(ticks[3:5])
        return total, idle

    def __call__(self) -> float | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return max(0.0, min(1.0, 1.0 - (now[1] - last[1]) / (now[0] - last[0])))


@dataclass
class Series:
    """What a sampler took: times (seconds on the monotonic clock), the CPUs' load, and
    per GPU its load and memory-controller utilisation, one value a time (None: unread)."""

    source: str
    times: list[float] = field(default_factory=list)
    cpu_load: list[float | None] = field(default_factory=list)
    gpu_load: dict[int, list[float | None]] = field(default_factory=dict)
    memory_controller: dict[int, list[float | None]] = field(default_factory=dict)

    def add(self, at: float, cpu: float | None, gpus: list[GpuReading]) -> None:
        n = len(self.times)
        self.times.append(at)
        self.cpu_load.append(cpu)
        for g in gpus:
            self.gpu_load.setdefault(g.index, [None] * n).append(g.load)
            self.memory_controller.setdefault(g.index, [None] * n).append(g.memory_controller)
        for series in (self.gpu_load, self.memory_controller):
            for values in series.values():  # a GPU that did not answer this time
                if len(values) == n:
                    values.append(None)


class Sampler:
    """Samples every `interval_s` on a daemon thread between `start` and `stop`."""

    def __init__(
        self,
        interval_s: float,
        gpu: GpuProbe | None = None,
        cpu: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"a sampling interval must be above 0 s, not {interval_s}")
        self.interval_s = interval_s
        self.gpu = gpu if gpu is not None else default_gpu_probe()
        self._cpu = cpu if cpu is not None else CpuLoad()
        self._clock = clock
        self.series = Series(self.gpu.source)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """One sample now (the thread's loop calls this; tests may too)."""
        try:
            gpus = self.gpu.read()
        except Exception as err:  # a probe must never end a profile
            logger.debug("GPU probe failed: %s", err)
            gpus = []
        self.series.add(self._clock(), self._cpu(), gpus)

    def start(self) -> None:
        self._cpu()  # the first CPU figure is a difference from here
        self._thread = threading.Thread(target=self._run, name="profile-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> Series:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.series
