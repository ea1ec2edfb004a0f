"""A Jetson's integrated GPU and external memory controller (EMC) as metrics, read where
tegrastats and jetson_stats (jtop) read them, since NVML is not on a Jetson before
JetPack 7. Every path is relative to the sysfs root (`root`, /sys; tests give a tree laid
out as an AGX Orin's) and comes from jetson_stats' source (github.com/rbonghi/jetson_stats,
jtop/core/gpu.py, memory.py, power.py, temperature.py); none has been read on an Orin here.

- The iGPU is the devfreq device (class/devfreq/*) whose device/of_node/name is a GPU's
  (jtop's find_igpu: "gpu" on JetPack 6, where it is devices/platform/bus@0/17000000.gpu;
  "ga10b" on JetPack 5, devices/17000000.ga10b). Globbed, since the node's name changes
  between releases. Its load is the device's `load`, busy time in per mille (jtop's
  igpu_read_status divides by 10 for a percent; tegrastats' GR3D_FREQ); its clock the
  devfreq node's `cur_freq` in Hz.
- Its temperature is the thermal zone whose type names the GPU ("gpu-thermal" on Orin,
  "GPU-therm" on Xavier; jtop names a zone by the type's part before the "-").
- Its power is the INA3221 rail that feeds it: VDD_GPU_SOC on an AGX Orin, which it
  shares with the SoC (the board has no rail for the GPU alone). A rail that also feeds
  the CPU (VDD_CPU_GPU_CV on Orin NX and Nano) is not the GPU's and is not used.
- GPU memory in use is left out: the iGPU allocates from the one DRAM the CPU uses, so
  /proc/meminfo counts both alike, and the GPU's own allocations (nvmap) are only in
  debugfs. edge_memory_* and edge_process_* already show the daemon's share.
- The EMC clock is debugfs' kernel/debug/bpmp/debug/clk/emc/rate (Hz; Orin and Xavier,
  readable by root only) or, on Thor, devfreq's class/devfreq/bwmgr/cur_freq. Its
  activity is the actmon's average, kernel/actmon_avg_activity/mc_all where the kernel
  has it, else debugfs (kernel/debug/cactmon/mc_all, kernel/debug/bpmp/debug/actmon/
  mc_all_avg_activity); utilisation is activity / (clock in kHz) as a percent, jtop's
  read_emc formula (from NVIDIA's forum: "real-time EMC bandwidth with sysfs").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric

from edge.health import sysfs

# jtop's KNOWN_GPU_DEVICE_NAMES: of_node names of Jetson iGPUs (gb10b Thor, ga10b Orin,
# gv11b Xavier, gp10b TX2, "gpu" from JetPack 6 on); jtop also takes any name with "gpu".
GPU_NODE_NAMES = frozenset({"gv11b", "gp10b", "ga10b", "gb10b", "gpu"})

EMC_CLOCKS = ("kernel/debug/bpmp/debug/clk/emc/rate", "class/devfreq/bwmgr/cur_freq")
EMC_ACTIVITY = (
    "kernel/actmon_avg_activity/mc_all",
    "kernel/debug/cactmon/mc_all",
    "kernel/debug/bpmp/debug/actmon/mc_all_avg_activity",
)


def igpus(root: Path) -> list[Path]:
    """The devfreq nodes of the box's integrated GPUs (one on every Jetson so far)."""
    found = []
    for node in sorted((root / "class" / "devfreq").glob("*")):
        name = (sysfs.read(node / "device" / "of_node" / "name") or "").lower()
        if name in GPU_NODE_NAMES or "gpu" in name:
            found.append(node)
    return found


def _is_gpu_zone(zone_type: str) -> bool:
    return zone_type.lower().split("-")[0].split("_")[0] == "gpu"


def _is_gpu_rail(rail: str) -> bool:
    parts = rail.upper().split("_")
    return "GPU" in parts and "CPU" not in parts


def gpu(root: Path) -> Iterator[Metric]:
    """The iGPU's gauges under the NVML gauges' names, labelled gpu="0", "1", ... in
    devfreq's order: CUDA's index for a Jetson's one GPU, as NVML's would be."""
    nodes = igpus(root)
    if not nodes:
        return
    util = GaugeMetricFamily("edge_gpu_utilization_ratio", "GPU busy fraction (nvgpu's load, as tegrastats' GR3D).",
                             labels=["gpu"])  # fmt: skip
    clock = GaugeMetricFamily("edge_gpu_frequency_hertz", "GPU clock (devfreq's cur_freq).", labels=["gpu"])
    temp = GaugeMetricFamily("edge_gpu_temperature_celsius", "GPU temperature (its thermal zone).", labels=["gpu"])
    power = GaugeMetricFamily("edge_gpu_power_watts", "Power on the rail that feeds the GPU (INA3221).",
                              labels=["gpu"])  # fmt: skip
    for index, node in enumerate(nodes):
        label = [str(index)]
        load = gpu_load(node)
        if load is not None:
            util.add_metric(label, load)
        hertz = sysfs.number(node / "cur_freq")
        if hertz is not None:
            clock.add_metric(label, hertz)
    # The zone and the rail are the SoC's, not a device's: they go with the first GPU.
    celsius = next((c for zone_type, c in sysfs.thermal_zones(root) if _is_gpu_zone(zone_type)), None)
    if celsius is not None:
        temp.add_metric(["0"], celsius)
    watts = next((w for rail, w in sysfs.ina3221_rails(root) if _is_gpu_rail(rail)), None)
    if watts is not None:
        power.add_metric(["0"], watts)
    yield from (f for f in (util, clock, temp, power) if f.samples)


def gpu_load(node: Path) -> float | None:
    """An iGPU's busy fraction (its devfreq node's device/load, in per mille)."""
    load = sysfs.number(node / "device" / "load")
    return None if load is None else load / 1000.0


def _first(root: Path, paths: tuple[str, ...]) -> float | None:
    return next((v for v in (sysfs.number(root / p) for p in paths) if v is not None), None)


def emc_clock(root: Path) -> float | None:
    """The memory controller's clock in Hz; None where it cannot be read (or reads 0)."""
    hertz = _first(root, EMC_CLOCKS)
    return hertz if hertz is not None and hertz > 0 else None


def emc_utilization(root: Path) -> float | None:
    """The memory controller's utilisation as a fraction of its current clock (jtop's
    read_emc); None without the clock or the activity."""
    hertz = emc_clock(root)
    activity = _first(root, EMC_ACTIVITY)
    if hertz is None or activity is None:
        return None
    return activity / (hertz / 1000.0) / 100.0


def emc(root: Path) -> Iterator[Metric]:
    """The memory controller's clock and utilisation; neither has an NVML twin."""
    hertz = emc_clock(root)
    if hertz is None:
        return  # without the clock there is no utilisation either: it is relative to it
    clock = GaugeMetricFamily("edge_emc_frequency_hertz", "External memory controller (EMC) clock.")
    clock.add_metric([], hertz)
    yield clock
    used = emc_utilization(root)
    if used is not None:
        doc = "EMC bandwidth in use relative to its current clock (tegrastats' EMC_FREQ %)."
        util = GaugeMetricFamily("edge_emc_utilization_ratio", doc)
        util.add_metric([], used)
        yield util
