"""A Jetson's sensors as the daemon's metrics (edge/health/tegra.py, sensors.py), read from
a faked sysfs tree laid out as an AGX Orin's (tests/orin_sysfs.py, the hardware seam):
the GPU under the NVML gauges' names, the memory controller under its own, the thermal
zones and rails as before; a file that is gone or unreadable leaves its figure out."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge.health import sensors
from edge.health.metrics import SnapshotCollector
from tests import orin_sysfs

SNAPSHOT = {"state": "ready"}
SENSOR_PREFIXES = ("edge_gpu_", "edge_emc_", "edge_thermal_", "edge_power_rail_")


@pytest.fixture(autouse=True)
def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """The faked Orin is the only GPU here: NVML on the test box (a GPU runner's) is not
    asked, as on a Jetson without it."""
    monkeypatch.setattr(sensors, "_nvml_tried", True)
    monkeypatch.setattr(sensors, "_nvml", None)


def _registry(root: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: SNAPSHOT, sensors_root=root))
    return registry


def _sensor_names(registry: CollectorRegistry) -> set[str]:
    return {s.name for family in registry.collect() for s in family.samples if s.name.startswith(SENSOR_PREFIXES)}


@pytest.mark.parametrize("jetpack", [6, 5])
def test_an_orins_gpu_emc_temperatures_and_rails_are_exported(tmp_path: Path, jetpack: int) -> None:
    """The GPU found through devfreq wherever the release puts it (17000000.gpu under
    bus@0 on JetPack 6, 17000000.ga10b on 5), the video compositor beside it not taken
    for a GPU; every figure in its unit."""
    orin = orin_sysfs.build(tmp_path, jetpack=jetpack)
    registry = _registry(tmp_path)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("edge_gpu_utilization_ratio", gpu="0") == pytest.approx(orin.gpu_load_permille / 1000)
    assert value("edge_gpu_frequency_hertz", gpu="0") == orin.gpu_hertz
    assert value("edge_gpu_temperature_celsius", gpu="0") == pytest.approx(orin.gpu_celsius)
    assert value("edge_gpu_power_watts", gpu="0") == pytest.approx(orin.gpu_rail_watts)
    assert value("edge_gpu_utilization_ratio", gpu="1") is None  # the VIC is no GPU
    assert value("edge_emc_frequency_hertz") == orin.emc_hertz
    assert value("edge_emc_utilization_ratio") == pytest.approx(0.25)
    # CPU and SoC temperatures stay under the kernel's zone names; the CV zones that
    # cannot be read are left out.
    assert value("edge_thermal_celsius", zone="cpu-thermal") == pytest.approx(orin.cpu_celsius)
    assert value("edge_thermal_celsius", zone="soc0-thermal") == pytest.approx(orin.soc0_celsius)
    assert value("edge_thermal_celsius", zone="gpu-thermal") == pytest.approx(orin.gpu_celsius)
    assert value("edge_thermal_celsius", zone="cv0-thermal") is None
    rails = {
        s.labels["rail"]: s.value for f in registry.collect() for s in f.samples if s.name == "edge_power_rail_watts"
    }
    assert rails == pytest.approx({"VDD_GPU_SOC": 5.1 * 1.008, "VDD_CPU_CV": 5.1 * 0.64, "VIN_SYS_5V0": 5.0 * 0.704,
                                   "VDDQ_VDD2_1V8AO": 5.0 * 0.06})  # fmt: skip
    # On a Jetson the GPU's memory is the one DRAM: no figure claims to be the GPU's alone.
    assert value("edge_gpu_memory_used_bytes", gpu="0") is None
    # The scrape is one a Prometheus server accepts: each family once.
    text = generate_latest(registry).decode()
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), names


def test_files_that_are_gone_or_unreadable_leave_their_figure_out(tmp_path: Path) -> None:
    """Each figure stands alone: debugfs out of reach (root's alone; gone here, as these
    tests run as root) takes the EMC's figures and nothing else; a GPU load that is not a
    number takes the load and leaves the clock."""
    orin = orin_sysfs.build(tmp_path)
    shutil.rmtree(tmp_path / "kernel" / "debug")
    orin.gpu_device.joinpath("load").write_text("busy\n")
    names = _sensor_names(_registry(tmp_path))
    assert not {n for n in names if n.startswith("edge_emc_")}
    assert "edge_gpu_utilization_ratio" not in names
    assert {"edge_gpu_frequency_hertz", "edge_gpu_temperature_celsius", "edge_gpu_power_watts"} <= names

    # The clock without the activity: the clock alone. The activity without the clock:
    # nothing, since utilisation is relative to the clock.
    orin2 = orin_sysfs.build(tmp_path / "b")
    orin2.emc_activity.unlink()
    names = _sensor_names(_registry(tmp_path / "b"))
    assert "edge_emc_frequency_hertz" in names and "edge_emc_utilization_ratio" not in names
    orin3 = orin_sysfs.build(tmp_path / "c")
    orin3.emc_rate.write_text("0\n")
    assert not {n for n in _sensor_names(_registry(tmp_path / "c")) if n.startswith("edge_emc_")}

    # The sysfs actmon file (no debugfs needed) where a kernel has it.
    orin4 = orin_sysfs.build(tmp_path / "d")
    orin4.emc_activity.unlink()
    (tmp_path / "d/kernel/actmon_avg_activity").mkdir(parents=True)
    (tmp_path / "d/kernel/actmon_avg_activity/mc_all").write_text(f"{50 * orin4.emc_hertz // 1000}\n")
    assert _registry(tmp_path / "d").get_sample_value("edge_emc_utilization_ratio") == pytest.approx(0.5)


def test_without_a_gpu_node_there_are_no_gpu_gauges_at_all(tmp_path: Path) -> None:
    """The GPU's devfreq node gone: its zone and rail are not called a GPU's (they still
    show as a zone and a rail), and an empty tree gives no sensor figures and no error."""
    orin_sysfs.build(tmp_path)
    (tmp_path / "class/devfreq/17000000.gpu").unlink()
    names = _sensor_names(_registry(tmp_path))
    assert not {n for n in names if n.startswith("edge_gpu_")}
    assert {"edge_thermal_celsius", "edge_power_rail_watts", "edge_emc_frequency_hertz"} <= names
    (tmp_path / "empty").mkdir()
    assert _sensor_names(_registry(tmp_path / "empty")) == set()
    assert _sensor_names(_registry(tmp_path / "nonexistent")) == set()


def test_nvml_figures_stand_and_sysfs_fills_only_what_nvml_lacks(tmp_path: Path) -> None:
    """A Jetson with NVML (JetPack 7) that gives utilisation and temperature: those are
    NVML's, the clock and the power come from sysfs, and no family is exported twice."""
    orin_sysfs.build(tmp_path)
    nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=12),
        nvmlDeviceGetTemperature=lambda h, s: 40,
    )
    families = list(sensors.metrics(tmp_path, nvml))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names
    by_name = {f.name: f for f in families}
    assert by_name["edge_gpu_utilization_ratio"].samples[0].value == pytest.approx(0.12)
    assert by_name["edge_gpu_temperature_celsius"].samples[0].value == 40
    assert by_name["edge_gpu_frequency_hertz"].samples[0].value == 918_000_000
    assert by_name["edge_gpu_power_watts"].samples[0].value == pytest.approx(5.1 * 1.008)


def test_the_gpu_rail_is_one_that_feeds_the_gpu_and_not_the_cpu(tmp_path: Path) -> None:
    """An Orin NX's rail feeds CPU, GPU and CV together: not the GPU's power. A TX2's
    VDD_SYS_GPU and an AGX Xavier's GPU are."""
    orin_sysfs.build(tmp_path)
    hwmon = tmp_path / "class/hwmon/hwmon1"
    hwmon.joinpath("in1_label").write_text("VDD_CPU_GPU_CV\n")
    assert "edge_gpu_power_watts" not in _sensor_names(_registry(tmp_path))
    for label in ("VDD_SYS_GPU", "GPU"):
        hwmon.joinpath("in1_label").write_text(f"{label}\n")
        assert _registry(tmp_path).get_sample_value("edge_gpu_power_watts", {"gpu": "0"}) == pytest.approx(5.1 * 1.008)
