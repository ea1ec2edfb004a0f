"""The box's own sensors as metrics, where it has them; nothing where it does not.

- Discrete NVIDIA GPUs through NVML (nvidia-ml-py): utilisation, memory in use,
  temperature and power draw per GPU. NVML is not on a Jetson.
- The kernel's thermal zones (/sys/class/thermal/thermal_zone*/temp, millidegrees):
  every Linux box has some; on a Jetson they are the CPU, GPU, SoC and board sensors.
- A Jetson's power rails: its INA3221 monitors through hwmon (in*_label, in*_input in
  mV, curr*_input in mA), each rail's power their product.

Each read happens at a scrape, and a sensor that fails to answer is left out of that
scrape, never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

_nvml: Any = None
_nvml_tried = False


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _number(path: Path) -> float | None:
    text = _read(path)
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def thermal(root: Path) -> Iterator[Metric]:
    zones = sorted((root / "class" / "thermal").glob("thermal_zone*"))
    gauge = GaugeMetricFamily("edge_thermal_celsius", "Temperature of each kernel thermal zone.", labels=["zone"])
    seen: dict[str, int] = {}
    for zone in zones:
        temp = _number(zone / "temp")
        if temp is None:
            continue
        name = _read(zone / "type") or zone.name
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"  # boards repeat names
        gauge.add_metric([label], temp / 1000.0)
    if gauge.samples:
        yield gauge


def power_rails(root: Path) -> Iterator[Metric]:
    gauge = GaugeMetricFamily("edge_power_rail_watts", "Power drawn on each monitored rail (a Jetson's INA3221).",
                              labels=["rail"])  # fmt: skip
    for hwmon in sorted((root / "class" / "hwmon").glob("hwmon*")):
        if not (_read(hwmon / "name") or "").startswith("ina3221"):
            continue
        for label_file in sorted(hwmon.glob("in*_label")):
            channel = label_file.name[2 : -len("_label")]
            mv = _number(hwmon / f"in{channel}_input")
            ma = _number(hwmon / f"curr{channel}_input")
            rail = _read(label_file)
            if mv is None or ma is None or not rail or rail.startswith("NC"):
                continue
            gauge.add_metric([rail], mv * ma / 1e6)
    if gauge.samples:
        yield gauge


def _pynvml() -> Any:
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
    nv = nvml if nvml is not None else _pynvml()
    if nv is None:
        return
    util = GaugeMetricFamily("edge_gpu_utilization_ratio", "GPU busy fraction over NVML's last sample period.",
                             labels=["gpu"])  # fmt: skip
    mem = GaugeMetricFamily("edge_gpu_memory_used_bytes", "GPU memory in use, all processes.", labels=["gpu"])
    temp = GaugeMetricFamily("edge_gpu_temperature_celsius", "GPU temperature.", labels=["gpu"])
    power = GaugeMetricFamily("edge_gpu_power_watts", "GPU power draw.", labels=["gpu"])
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
        ]
        for family, read in reads:
            try:
                family.add_metric(label, float(read(handle)))
            except Exception:  # NVML_ERROR_NOT_SUPPORTED for that figure on this board
                continue
    yield from (f for f in (util, mem, temp, power) if f.samples)


def metrics(root: Path) -> Iterator[Metric]:
    yield from gpus()
    yield from thermal(root)
    yield from power_rails(root)
