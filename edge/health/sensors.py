"""The box's own sensors as metrics, where it has them; nothing where it does not.

- Discrete NVIDIA GPUs through NVML (nvidia-ml-py): utilisation, memory in use,
  temperature, power draw and graphics clock per GPU. NVML is not on a Jetson (before
  JetPack 7).
- A Jetson's integrated GPU and memory controller from sysfs (`tegra`): the same GPU
  gauges where they mean the same thing, and the EMC's own.
- The kernel's thermal zones (/sys/class/thermal/thermal_zone*/temp, millidegrees):
  every Linux box has some; on a Jetson they are the CPU, GPU, SoC and board sensors.
- A Jetson's power rails: its INA3221 monitors through hwmon (in*_label, in*_input in
  mV, curr*_input in mA), each rail's power their product.

Each read happens at a scrape, and a sensor that fails to answer is left out of that
scrape, never an error. `root` is where sysfs is (/sys; a test gives a faked tree).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from edge.health import sysfs, tegra

logger = logging.getLogger(__name__)

_nvml: Any = None
_nvml_tried = False


def thermal(root: Path) -> Iterator[Metric]:
    gauge = GaugeMetricFamily("edge_thermal_celsius", "Temperature of each kernel thermal zone.", labels=["zone"])
    seen: dict[str, int] = {}
    for name, celsius in sysfs.thermal_zones(root):
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"  # boards repeat names
        gauge.add_metric([label], celsius)
    if gauge.samples:
        yield gauge


def power_rails(root: Path) -> Iterator[Metric]:
    gauge = GaugeMetricFamily("edge_power_rail_watts", "Power drawn on each monitored rail (a Jetson's INA3221).",
                              labels=["rail"])  # fmt: skip
    for rail, watts in sysfs.ina3221_rails(root):
        gauge.add_metric([rail], watts)
    if gauge.samples:
        yield gauge


def nvml_module() -> Any:
    """The pynvml module, initialised on first use; None where NVML does not answer."""
    global _nvml, _nvml_tried
    if not _nvml_tried:
        _nvml_tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception as err:  # no NVIDIA driver here (or a Jetson): no GPU figures
            logger.debug("metrics: no NVML (%s)", err)
    return _nvml


def gpus(nvml: Any = None) -> Iterator[Metric]:
    """Per-GPU figures from NVML (`nvml`: the pynvml module, or found on first use)."""
    nv = nvml if nvml is not None else nvml_module()
    if nv is None:
        return
    util = GaugeMetricFamily("edge_gpu_utilization_ratio", "GPU busy fraction over NVML's last sample period.",
                             labels=["gpu"])  # fmt: skip
    mem = GaugeMetricFamily("edge_gpu_memory_used_bytes", "GPU memory in use, all processes.", labels=["gpu"])
    temp = GaugeMetricFamily("edge_gpu_temperature_celsius", "GPU temperature.", labels=["gpu"])
    power = GaugeMetricFamily("edge_gpu_power_watts", "GPU power draw.", labels=["gpu"])
    clock = GaugeMetricFamily("edge_gpu_frequency_hertz", "GPU graphics clock.", labels=["gpu"])
    try:
        count = nv.nvmlDeviceGetCount()
    except Exception:
        return
    for i in range(count):
        label = [str(i)]
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(i)
        except Exception:
            continue
        reads: list[tuple[GaugeMetricFamily, Callable[[Any], float]]] = [
            (util, lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
            (mem, lambda h: nv.nvmlDeviceGetMemoryInfo(h).used),
            (temp, lambda h: nv.nvmlDeviceGetTemperature(h, 0)),
            (power, lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            (clock, lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_GRAPHICS) * 1e6),  # MHz
        ]
        for family, read in reads:
            try:
                family.add_metric(label, float(read(handle)))
            except Exception:  # NVML_ERROR_NOT_SUPPORTED for that figure on this board
                continue
    yield from (f for f in (util, mem, temp, power, clock) if f.samples)


def gpu_figures(root: Path, nvml: Any = None) -> Iterator[Metric]:
    """The GPU gauges from NVML where it answers, else from a Jetson's sysfs (`tegra`),
    under the same names so one dashboard serves either box. A JetPack 7 Jetson has NVML
    too: a family NVML gives stands, sysfs fills only those it lacks, so that no family
    is exported twice (a scrape with a name twice is refused)."""
    from_nvml = list(gpus(nvml))
    have = {family.name for family in from_nvml}
    yield from from_nvml
    yield from (family for family in tegra.gpu(root) if family.name not in have)


def metrics(root: Path, nvml: Any = None) -> Iterator[Metric]:
    yield from gpu_figures(root, nvml)
    yield from tegra.emc(root)
    yield from thermal(root)
    yield from power_rails(root)
