"""The Prometheus metrics (edge/health/metrics.py, edge/health/sensors.py) without a
daemon: results counted as the responder sends them, the status snapshot read at each
scrape, the box's sensors from a sysfs tree and an NVML stand-in (hardware seams), and
the HTTP endpoint itself."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from edge.config.service import MetricsConfig
from edge.health import sensors
from edge.health.metrics import JobMetrics, MetricsServer, SnapshotCollector
from edge.protocol import results
from edge.protocol.errors import ErrorCode, JobError
from tests import orin_sysfs

SNAPSHOT: dict[str, Any] = {
    "state": "ready",
    "broker": {"connected": True, "connects": 3},
    "branches": {
        "vision": {"available": True, "depth": 4, "max": 64, "running": 2, "batch_sizes": {"1": 7, "4": 2}},
        "text": {
            "available": True,
            "depth": 1,
            "max": 64,
            "running": 1,
            "batch_sizes": {"1": 40},
            "paused": 2,
            "over_budget": 1,
        },
    },
    "memory": {
        "budget_bytes": 8 << 30,
        "used_bytes": 3 << 30,
        "peak_bytes": 4 << 30,
        "reserved_bytes": 5 << 20,
        "rss_bytes": 2 << 30,
        "process_peak_bytes": 3 << 30,
        "evictions": 1,
        "refusals": 0,
        "models": {"ocr": {"bytes": 100 << 20}, "smol-clinic": {"bytes": 900 << 20}},
        "jobs_by_class": {"inspect": 5 << 20},
        "kv": {"capacity_bytes": 48 << 20, "capacity_tokens": 2048, "reserved_tokens": 300, "peak_tokens": 900},
    },
    "models": [{"name": "ocr", "branch": "vision", "backend": "onnxruntime", "loaded": True, "loads": 1}],
    "builds": {"running": {"what": "the inspection student", "seconds": 42.5}, "built": 1, "failed": 0, "stopped": 0},
    "journal": {
        "queued": 2,
        "sent": 1,
        "answered": 10,
        "duplicates": 4,
        "replayed": {"jobs": 1},
        "awaiting_puback": 0,
        "full": False,
    },
}


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_results_are_counted_by_task_status_code_and_stage() -> None:
    registry = CollectorRegistry()
    jobs = JobMetrics(registry)
    ok = results.ok_result(
        "q1",
        "qa",
        "t",
        {"answer": "Yes.", "prompt_tokens": 30, "completion_tokens": 5},
        results.Timings(
            2.0,
            100.0,
            102.0,
            {"tokenize": 1.0, "prefill": 40.0, "decode": 58.0},
            {"ttft_ms": 43.0, "drafted_tokens": 12, "accepted_tokens": 7},
        ),
    )
    err = results.error_result("q2", "qa", "t", JobError(ErrorCode.PROMPT_TOO_LONG, "long", "question"),
                               results.Timings(0.0, 0.0, 0.5))  # fmt: skip
    for doc in (ok, ok, err):
        jobs.observe(doc)
    assert _value(registry, "edge_jobs_total", task="qa", status="ok", code="") == 2
    assert _value(registry, "edge_jobs_total", task="qa", status="error", code="prompt_too_long") == 1
    assert _value(registry, "edge_job_stage_seconds_count", task="qa", stage="prefill") == 2
    assert _value(registry, "edge_job_stage_seconds_sum", task="qa", stage="prefill") == pytest.approx(0.08)
    assert _value(registry, "edge_job_stage_seconds_count", task="qa", stage="queued") == 3  # errors too
    assert _value(registry, "edge_tokens_total", kind="completion") == 10
    assert _value(registry, "edge_tokens_total", kind="prompt") == 60
    assert _value(registry, "edge_ttft_seconds_sum") == pytest.approx(0.086)
    # Speculative decoding's drafts, summed over the results that carry them (not the error's).
    assert _value(registry, "edge_speculative_tokens_total", kind="drafted") == 24
    assert _value(registry, "edge_speculative_tokens_total", kind="accepted") == 14
    assert _value(registry, "edge_job_seconds_count", task="qa") == 3


def test_the_snapshot_becomes_gauges_and_counters_at_each_scrape() -> None:
    snap = {"doc": SNAPSHOT}
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snap["doc"], sensors_root=Path("/nonexistent")))
    assert _value(registry, "edge_queue_depth", branch="vision") == 4
    assert _value(registry, "edge_jobs_in_hand", branch="text") == 1
    assert _value(registry, "edge_batches_total", branch="vision", size="4") == 2
    assert _value(registry, "edge_memory_ledger_bytes", entry="model:smol-clinic") == 900 << 20
    assert _value(registry, "edge_memory_ledger_bytes", entry="jobs:inspect") == 5 << 20
    assert _value(registry, "edge_memory_ledger_bytes", entry="kv_cache") == 48 << 20
    assert _value(registry, "edge_memory_budget_bytes") == 8 << 30
    assert _value(registry, "edge_memory_evictions_total") == 1
    assert _value(registry, "edge_text_pauses_total") == 2 and _value(registry, "edge_text_over_budget_total") == 1
    assert _value(registry, "edge_kv_tokens", kind="reserved") == 300
    assert _value(registry, "edge_journal_rows", state="answered") == 10
    assert _value(registry, "edge_journal_duplicates_total") == 4
    assert _value(registry, "edge_broker_connected") == 1 and _value(registry, "edge_broker_connects_total") == 3
    assert _value(registry, "edge_up", state="ready") == 1
    assert _value(registry, "edge_build_running_seconds", what="the inspection student") == 42.5
    assert _value(registry, "edge_builds_total", result="built") == 1
    # Read again at the next scrape: a queue that drained shows it.
    drained = {"vision": {**SNAPSHOT["branches"]["vision"], "depth": 0}}
    snap["doc"] = {**SNAPSHOT, "state": "stopping", "branches": drained}
    assert _value(registry, "edge_queue_depth", branch="vision") == 0
    assert _value(registry, "edge_up", state="stopping") == 0


def test_a_failing_snapshot_gives_an_empty_scrape_not_an_error() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    registry = CollectorRegistry()
    registry.register(SnapshotCollector(broken, sensors_root=Path("/nonexistent")))
    assert list(registry.collect()) == []


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="ascii")


def test_thermal_zones_and_jetson_power_rails_from_sysfs(tmp_path: Path) -> None:
    """A tree laid out as a Jetson AGX Orin's: two zones of the same name, an INA3221
    with a rail, an unconnected channel and another hwmon that is not a power monitor."""
    _write(tmp_path / "class/thermal/thermal_zone0/type", "cpu-thermal")
    _write(tmp_path / "class/thermal/thermal_zone0/temp", "48500")
    _write(tmp_path / "class/thermal/thermal_zone1/type", "gpu-thermal")
    _write(tmp_path / "class/thermal/thermal_zone1/temp", "51250")
    _write(tmp_path / "class/thermal/thermal_zone2/type", "gpu-thermal")
    _write(tmp_path / "class/thermal/thermal_zone2/temp", "not a number")
    _write(tmp_path / "class/thermal/thermal_zone3/type", "gpu-thermal")
    _write(tmp_path / "class/thermal/thermal_zone3/temp", "50000")
    ina = tmp_path / "class/hwmon/hwmon1"
    _write(ina / "name", "ina3221")
    _write(ina / "in1_label", "VDD_GPU_SOC")
    _write(ina / "in1_input", "5000")  # mV
    _write(ina / "curr1_input", "1200")  # mA
    _write(ina / "in2_label", "NC")
    _write(ina / "in2_input", "0")
    _write(ina / "curr2_input", "0")
    _write(tmp_path / "class/hwmon/hwmon0/name", "acpitz")
    _write(tmp_path / "class/hwmon/hwmon0/in1_label", "X")
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: SNAPSHOT, sensors_root=tmp_path))
    assert _value(registry, "edge_thermal_celsius", zone="cpu-thermal") == 48.5
    assert _value(registry, "edge_thermal_celsius", zone="gpu-thermal") == 51.25
    assert _value(registry, "edge_thermal_celsius", zone="gpu-thermal#2") == 50.0  # the unreadable one skipped
    assert _value(registry, "edge_power_rail_watts", rail="VDD_GPU_SOC") == pytest.approx(6.0)
    assert _value(registry, "edge_power_rail_watts", rail="NC") is None
    assert _value(registry, "edge_power_rail_watts", rail="X") is None


def test_gpu_figures_come_from_nvml_and_a_figure_it_lacks_is_left_out() -> None:
    def unsupported(_handle: object) -> float:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=37),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=5 << 30),
        nvmlDeviceGetTemperature=lambda h, sensor: 61,
        nvmlDeviceGetPowerUsage=unsupported,
        NVML_CLOCK_GRAPHICS=0,
        nvmlDeviceGetClockInfo=lambda h, kind: {0: 1410, 2: 1593}[kind],  # graphics, memory (MHz)
    )
    families = {f.name: f for f in sensors.gpus(nvml)}
    assert families["edge_gpu_frequency_hertz"].samples[0].value == 1410e6
    assert families["edge_gpu_utilization_ratio"].samples[0].value == pytest.approx(0.37)
    assert families["edge_gpu_memory_used_bytes"].samples[0].value == 5 << 30
    assert families["edge_gpu_temperature_celsius"].samples[0].labels == {"gpu": "0"}
    assert "edge_gpu_power_watts" not in families


def _scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_endpoint_serves_and_a_taken_port_is_reported_not_fatal() -> None:
    server = MetricsServer(lambda: SNAPSHOT, sensors_root=Path("/nonexistent"))
    assert server.start(("127.0.0.1", 0))
    try:
        assert server.address is not None
        port = server.address[1]
        server.jobs.observe(results.ok_result("o1", "ocr", "t", {"text": ""}, results.Timings(1.0, 2.0, 3.0)))
        families = _scrape(port)
        assert families["edge_jobs"].samples[0].labels == {"task": "ocr", "status": "ok", "code": ""}
        assert families["edge_queue_depth"].samples[0].value == 4
        assert server.snapshot() == {"listen": f"127.0.0.1:{port}", "serving": True, "error": None}
        other = MetricsServer(lambda: SNAPSHOT)
        assert not other.start(("127.0.0.1", port))
        assert other.snapshot()["serving"] is False and f"127.0.0.1:{port}" in str(other.snapshot()["error"])
    finally:
        server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # stopped: nothing listens any more
    assert not MetricsServer(lambda: SNAPSHOT).start(None)  # metrics.listen: null


@pytest.mark.parametrize("listen", ["9464", "localhost:", ":9464", "127.0.0.1:0x1", "127.0.0.1:70000"])
def test_the_listener_must_be_host_and_port(listen: str) -> None:
    with pytest.raises(ValidationError, match="host:port"):
        MetricsConfig(listen=listen)
    assert MetricsConfig().address == ("127.0.0.1", 9464)
    assert MetricsConfig(listen="[::1]:9100").address == ("::1", 9100)
    assert MetricsConfig(listen=None).address is None


def _nvml_with_every_figure() -> SimpleNamespace:
    """NVML's stand-in (the hardware seam) on a box with one discrete GPU."""
    return SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=1),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=1),
        nvmlDeviceGetTemperature=lambda h, s: 1,
        nvmlDeviceGetPowerUsage=lambda h: 1000,
        NVML_CLOCK_GRAPHICS=0,
        nvmlDeviceGetClockInfo=lambda h, kind: 1000,
    )


def _queries(panel: dict[str, Any]) -> set[str]:
    import re

    return {name for target in panel["targets"] for name in re.findall(r"\bedge_[a-z0-9_]+", target["expr"])}


def test_the_dashboards_gpu_panels_have_figures_on_a_discrete_gpu_and_on_a_jetson(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every GPU gauge a dashboard panel queries is exported on a box with NVML and no
    Jetson files, and on a Jetson (the faked AGX Orin tree) without NVML; the memory
    controller's, which have no NVML twin, on the Jetson."""
    import json

    from tests.conftest import REPO

    discrete = {s.name for f in sensors.metrics(tmp_path / "no-sysfs", _nvml_with_every_figure()) for s in f.samples}
    orin_sysfs.build(tmp_path / "orin")
    monkeypatch.setattr(sensors, "_nvml_tried", True)  # a Jetson without NVML
    monkeypatch.setattr(sensors, "_nvml", None)
    jetson = {s.name for f in sensors.metrics(tmp_path / "orin") for s in f.samples}
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    gpu_panels = [p for p in dashboard["panels"] if any(n.startswith("edge_gpu_") for n in _queries(p))]
    assert {p["title"] for p in gpu_panels} >= {
        "Temperatures",
        "Power",
        "GPU and memory controller utilisation",
        "GPU and memory clocks",
    }
    for panel in gpu_panels:
        gpu_names = {n for n in _queries(panel) if n.startswith("edge_gpu_")}
        assert gpu_names <= discrete, (panel["title"], gpu_names - discrete)
        assert gpu_names <= jetson, (panel["title"], gpu_names - jetson)
    emc_names = {n for p in dashboard["panels"] for n in _queries(p) if n.startswith("edge_emc_")}
    assert emc_names == {"edge_emc_frequency_hertz", "edge_emc_utilization_ratio"} and emc_names <= jetson


def test_the_dashboard_and_the_operations_page_name_only_metrics_the_daemon_exports(tmp_path: Path) -> None:
    """docs/grafana-dashboard.json's queries and docs/operations.md's list: every edge_
    name in them is a sample a daemon exports (its results counted, a full snapshot, a box
    with every sensor), and docs/operations.md lists every one exported."""
    import json
    import re

    from tests.conftest import REPO

    orin_sysfs.build(tmp_path)  # thermal zones, INA3221 rails, the iGPU and the EMC
    journal = tmp_path / "journal.sqlite3"  # a journal on disk: its size is exported too
    journal.write_bytes(b"\0" * 4096)
    snapshot = {**SNAPSHOT, "journal": {**SNAPSHOT["journal"], "path": str(journal)}}
    server = MetricsServer(lambda: snapshot, sensors_root=tmp_path)
    server.jobs.observe(
        results.ok_result(
            "q", "qa", "t", {"answer": "a", "prompt_tokens": 3, "completion_tokens": 2, "grounding": "grounded"},
            results.Timings(1.0, 2.0, 3.0, {"prefill": 1.0},
                            {"ttft_ms": 2.0, "token_p50_ms": 1.0, "drafted_tokens": 4, "accepted_tokens": 2}),
        )
    )  # fmt: skip
    exported = {s.name for family in server.registry.collect() for s in family.samples}
    exported |= {s.name for family in sensors.gpus(_nvml_with_every_figure()) for s in family.samples}
    # The client's own _created timestamps aside, each family once.
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in exported if not n.endswith("_created")}
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for name in _queries(panel)}
    assert queried and queried <= exported, queried - exported
    page = (REPO / "docs" / "operations.md").read_text()
    unlisted = sorted(name for name in families if not re.search(rf"`{name}\b", page))
    assert not unlisted, unlisted
    # And every name the page gives is one (`edge_memory_*` and the like name a family of them).
    named = {n for n in re.findall(r"\bedge_[a-z0-9_]+", page) if not n.endswith("_")}
    assert named and named <= families, sorted(named - families)


def test_builds_say_what_runs_and_how_each_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real child process each: one that fails (no such module), one stopped while it
    runs; the snapshot the metrics read says what is in hand and counts the ends."""
    import os
    import threading
    import time

    (tmp_path / "slow_build.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    from edge.builds import BuildCommand, BuildStopped, ChildBuilds
    from edge.health.notify import Notifier

    stop = threading.Event()
    builds = ChildBuilds(tmp_path, Notifier(), stop)
    with pytest.raises(RuntimeError, match="exited with 1"):
        builds.run(BuildCommand("nothing", "edge.no_such_build", ()))
    assert builds.snapshot() == {"running": None, "built": 0, "failed": 1, "stopped": 0}
    seen: list[dict[str, Any]] = []

    def watch() -> None:
        time.sleep(1.0)
        seen.append(builds.snapshot())
        stop.set()

    threading.Thread(target=watch).start()
    with pytest.raises(BuildStopped):
        builds.run(BuildCommand("a build that takes a minute", "slow_build", ()))
    running = seen[0]["running"]
    assert running["what"] == "a build that takes a minute" and 0.5 <= running["seconds"] <= 5
    assert builds.snapshot() == {"running": None, "built": 0, "failed": 1, "stopped": 1}


@pytest.mark.gpu
def test_the_real_nvml_reports_the_gpu_this_process_uses() -> None:
    """On a GPU box: NVML's own figures, read while this process holds memory there."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB in use
    torch.cuda.synchronize()
    families = {f.name: f for f in sensors.gpus()}
    assert {"edge_gpu_memory_used_bytes", "edge_gpu_temperature_celsius"} <= set(families), sorted(families)
    # NVML numbers the GPUs its own way (not CUDA_VISIBLE_DEVICES'): the one in use is among them.
    assert max(s.value for s in families["edge_gpu_memory_used_bytes"].samples) >= 1 << 30
    assert all(5.0 <= s.value <= 110.0 for s in families["edge_gpu_temperature_celsius"].samples)
    for s in families.get("edge_gpu_power_watts", SimpleNamespace(samples=[])).samples:
        assert s.value > 0.0
    for s in families.get("edge_gpu_utilization_ratio", SimpleNamespace(samples=[])).samples:
        assert 0.0 <= s.value <= 1.0
    for s in families.get("edge_gpu_frequency_hertz", SimpleNamespace(samples=[])).samples:
        assert 100e6 <= s.value <= 4e9  # a graphics clock, in hertz (NVML gives MHz)
    del held
