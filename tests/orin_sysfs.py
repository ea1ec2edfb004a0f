"""A sysfs tree laid out as a Jetson AGX Orin's, for the sensor tests (the hardware seam).

Where each file is, with the links that lead to it, as jetson_stats reads them
(github.com/rbonghi/jetson_stats: jtop/core/gpu.py find_igpu and igpu_read_status,
memory.py read_emc, power.py, temperature.py; its tegrastats sample of an AGX Orin names
the zones and rails; its nvpmodel sample puts the JetPack 5 GPU at
/sys/devices/17000000.ga10b), NVIDIA's Jetson documentation (the GPU at
/sys/devices/platform/bus@0/17000000.gpu on JetPack 6; the INA3221s at I2C 1-0040 and
1-0041) and NVIDIA's Orin device tree (those on the I2C controller at c240000). Not
copied from an Orin: none was at hand, so the values are made up and the layout is as
those sources give it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Orin:
    """The figures written into the tree, and the paths a test breaks."""

    root: Path
    gpu_device: Path  # the nvgpu device: load
    gpu_devfreq: Path  # its devfreq node: cur_freq, max_freq, min_freq, governor
    emc_rate: Path
    emc_activity: Path
    gpu_load_permille: int = 613
    gpu_hertz: int = 918_000_000
    emc_hertz: int = 2_133_000_000
    # tegrastats' EMC_FREQ percent is activity / (clock in kHz): 25 % at 2133 MHz.
    emc_activity_count: int = 25 * 2_133_000
    gpu_celsius: float = 47.625
    cpu_celsius: float = 52.968
    soc0_celsius: float = 49.531
    gpu_rail_watts: float = 5.1 * 1.008  # VDD_GPU_SOC: 5100 mV, 1008 mA


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="ascii")


def _link(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs' are, so the tree works wherever it is."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _devfreq_device(root: Path, device: Path, node_name: str, of_node: Path, of_name: str) -> Path:
    """A device with a devfreq node, reached as class/devfreq/<node_name> (jtop's igpu path)."""
    _write(of_node / "name", of_name + "\x00")  # a device-tree property: NUL-terminated
    _link(device / "of_node", of_node)
    devfreq = device / "devfreq" / node_name
    devfreq.mkdir(parents=True)
    _link(devfreq / "device", device)
    _link(root / "class" / "devfreq" / node_name, devfreq)
    return devfreq


def _ina3221(root: Path, address: str, hwmon: str, channels: list[tuple[str, int, int]]) -> None:
    """An INA3221 through the kernel's hwmon driver (Documentation/hwmon/ina3221.rst):
    channels 1-3 (label, bus mV, mA), their shunt voltages in4-6 and in7, the sum
    channel with a label and no current of its own."""
    device = root / "devices/platform/bus@0/c240000.i2c/i2c-1" / address
    _write(device / "name", "ina3221")
    folder = device / "hwmon" / hwmon
    _write(folder / "name", "ina3221")
    for number, (label, mv, ma) in enumerate(channels, start=1):
        _write(folder / f"in{number}_label", label)
        _write(folder / f"in{number}_input", str(mv))
        _write(folder / f"curr{number}_input", str(ma))
        _write(folder / f"in{number + 3}_input", str(ma * 5))  # shunt µV across 5 mΩ
        _write(folder / f"curr{number}_crit", "32760")
    _write(folder / "in7_label", "sum of shunt voltage")
    _write(folder / "in7_input", "100")
    _write(folder / "curr4_input", "1800")
    _link(root / "class" / "hwmon" / hwmon, folder)
    _link(root / "bus/i2c/drivers/ina3221" / address, device)


def build(root: Path, jetpack: int = 6) -> Orin:
    """The tree under `root` (where /sys would be), with the GPU where JetPack 6 (or 5)
    puts it; with debugfs' EMC files as root reads them."""
    firmware = root / "firmware/devicetree/base"
    if jetpack >= 6:
        gpu_device = root / "devices/platform/bus@0/17000000.gpu"
        gpu_devfreq = _devfreq_device(root, gpu_device, "17000000.gpu", firmware / "bus@0/gpu@17000000", "gpu")
    else:
        gpu_device = root / "devices/17000000.ga10b"
        gpu_devfreq = _devfreq_device(root, gpu_device, "17000000.ga10b", firmware / "gpu@17000000", "ga10b")
    orin = Orin(
        root=root,
        gpu_device=gpu_device,
        gpu_devfreq=gpu_devfreq,
        emc_rate=root / "kernel/debug/bpmp/debug/clk/emc/rate",
        emc_activity=root / "kernel/debug/bpmp/debug/actmon/mc_all_avg_activity",
    )
    _write(gpu_device / "load", str(orin.gpu_load_permille))
    _write(gpu_device / "railgate_enable", "1")
    for name, value in (("cur_freq", orin.gpu_hertz), ("max_freq", 1_300_500_000), ("min_freq", 306_000_000)):
        _write(gpu_devfreq / name, str(value))
    _write(gpu_devfreq / "governor", "nvhost_podgov")
    # Another devfreq device that is not the GPU: the video image compositor.
    vic = _devfreq_device(root, root / "devices/platform/bus@0/15340000.vic", "15340000.vic",
                          firmware / "bus@0/vic@15340000", "vic")  # fmt: skip
    _write(vic / "cur_freq", "115200000")
    _write(root / "devices/platform/bus@0/15340000.vic/load", "999")

    # Thermal zones, typed as an AGX Orin's (tegrastats: cpu, gpu, cv0-2, soc0-2, tj).
    zones = [
        ("cpu-thermal", orin.cpu_celsius),
        ("gpu-thermal", orin.gpu_celsius),
        ("cv0-thermal", None),  # the CV cluster powered off: the read fails (-256C in tegrastats)
        ("cv1-thermal", None),
        ("cv2-thermal", None),
        ("soc0-thermal", orin.soc0_celsius),
        ("soc1-thermal", 48.937),
        ("soc2-thermal", 48.406),
        ("tj-thermal", 52.968),
    ]
    for index, (zone_type, celsius) in enumerate(zones):
        zone = root / "devices/virtual/thermal" / f"thermal_zone{index}"
        _write(zone / "type", zone_type)
        if celsius is not None:
            _write(zone / "temp", str(round(celsius * 1000)))
        else:
            (zone / "temp").mkdir()  # a file that cannot be read (the driver's EIO)
        _link(root / "class/thermal" / zone.name, zone)

    # The INA3221s of an AGX Orin module, with the rails jtop's tegrastats sample of one names.
    _ina3221(root, "1-0040", "hwmon1", [("VDD_GPU_SOC", 5100, 1008), ("VDD_CPU_CV", 5100, 640),
                                        ("VIN_SYS_5V0", 5000, 704)])  # fmt: skip
    _ina3221(root, "1-0041", "hwmon2", [("NC", 0, 0), ("VDDQ_VDD2_1V8AO", 5000, 60), ("NC", 0, 0)])
    _write(root / "devices/platform/pwm-fan/hwmon/hwmon0/name", "pwmfan")
    _link(root / "class/hwmon/hwmon0", root / "devices/platform/pwm-fan/hwmon/hwmon0")

    # The EMC: its clock and activity in debugfs (as root reads it).
    _write(orin.emc_rate, str(orin.emc_hertz))
    _write(orin.emc_rate.parent / "max_rate", "3199000000")
    _write(orin.emc_activity, str(orin.emc_activity_count))
    return orin
