"""`edgectl profile`: the box's load sampled over time (a faked AGX Orin's sysfs and a fake
NVML, the hardware seam), the profiler's records turned into rows with bytes and shares
of the copy bandwidth, heat maps drawn from a document alone, and the command itself run
on this box's CPU with real engines (its JSON valid against docs/schemas/profile.schema.json,
its PNG files real images). The CUDA run is marked gpu."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch
from PIL import Image

from edge.profiling import command, document, heatmap, records, sampler
from edge.profiling.sampler import CpuLoad, GpuProbe, GpuReading, Sampler, Series
from edge.profiling.shapes import Product
from edge.profiling.timeline import Timeline
from tests import orin_sysfs
from tests.conftest import REPO, edgectl, free_port, write_profile

SCHEMA = json.loads((REPO / "docs" / "schemas" / "profile.schema.json").read_text(encoding="utf-8"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _valid(doc: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(doc, SCHEMA)


def _real_png(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        return int(width), int(height)


def _fake_nvml(rates: dict[int, tuple[int, int] | None]) -> SimpleNamespace:
    """NVML as pynvml shows it: a GPU whose rates are None answers NOT_SUPPORTED."""

    def utilization(handle: int) -> SimpleNamespace:
        rate = rates[handle]
        if rate is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return SimpleNamespace(gpu=rate[0], memory=rate[1])

    return SimpleNamespace(
        nvmlDeviceGetCount=lambda: len(rates),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=utilization,
    )


# -- the sampler --------------------------------------------------------------------------


@pytest.mark.parametrize("jetpack", [6, 5])
def test_the_sampler_reads_an_orins_gpu_load_and_emc_utilisation_from_sysfs(tmp_path: Path, jetpack: int) -> None:
    """Without NVML the GPU probe is the Jetson's sysfs (the GPU found through devfreq
    wherever the release puts it, the video compositor beside it not taken for one): its
    load in per mille and the EMC's activity over its clock, one reading a sample, each
    sample what the files say then."""
    orin = orin_sysfs.build(tmp_path, jetpack=jetpack)
    probe = sampler.default_gpu_probe(tmp_path, nvml=lambda: None)
    assert probe.source == "sysfs"
    ((index, load, memory),) = [(g.index, g.load, g.memory_controller) for g in probe.read()]
    assert index == 0 and load == pytest.approx(0.613) and memory == pytest.approx(0.25)
    ticks = iter(range(100))
    s = Sampler(0.1, probe, cpu=lambda: 0.5, clock=lambda: float(next(ticks)))
    s.sample()
    (orin.gpu_device / "load").write_text("250\n")
    orin.emc_activity.write_text(f"{75 * orin.emc_hertz // 1000}\n")
    s.sample()
    orin.emc_activity.unlink()  # debugfs gone (root's alone): the EMC reads as nothing
    s.sample()
    series = s.series
    assert series.source == "sysfs" and series.times == [0.0, 1.0, 2.0]
    assert series.gpu_load == {0: pytest.approx([0.613, 0.25, 0.25])}
    assert series.memory_controller[0][:2] == pytest.approx([0.25, 0.75]) and series.memory_controller[0][2] is None
    assert series.cpu_load == [0.5, 0.5, 0.5]


def test_the_sampler_prefers_nvml_and_keeps_a_gpu_that_does_not_answer(tmp_path: Path) -> None:
    """A discrete GPU box (a fake NVML, the seam a scheduler's hardware probe is): NVML's
    utilization.gpu and utilization.memory per GPU; one that answers NOT_SUPPORTED is in
    the series with no values. NVML listing no GPU leaves a Jetson's sysfs to answer."""
    orin_sysfs.build(tmp_path)
    nvml = _fake_nvml({0: (87, 64), 1: None})
    probe = sampler.default_gpu_probe(tmp_path, nvml=lambda: nvml)
    assert probe.source == "nvml"
    assert probe.read() == [GpuReading(0, 0.87, 0.64), GpuReading(1, None, None)]
    assert sampler.default_gpu_probe(tmp_path, nvml=lambda: _fake_nvml({})).source == "sysfs"
    assert sampler.default_gpu_probe(tmp_path / "nowhere", nvml=lambda: None).source == "none"

    # A GPU that stops answering mid-run, and one that appears late, keep aligned series.
    series = Series("nvml")
    series.add(0.0, 0.1, [GpuReading(0, 0.5, 0.4)])
    series.add(1.0, None, [GpuReading(1, 0.9, 0.8)])
    assert series.gpu_load == {0: [0.5, None], 1: [None, 0.9]}
    assert series.memory_controller == {0: [0.4, None], 1: [None, 0.8]}


def test_the_sampler_thread_samples_until_stopped_and_survives_a_failing_probe() -> None:
    calls = {"n": 0}

    def flaky() -> list[GpuReading]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("the driver went away")
        return [GpuReading(0, 0.3, 0.2)]

    s = Sampler(0.01, GpuProbe("nvml", flaky), cpu=lambda: 0.25)
    s.start()
    time.sleep(0.2)
    series = s.stop()
    n = len(series.times)
    assert n >= 3 and len(series.cpu_load) == n and len(series.gpu_load[0]) == n
    assert None in series.gpu_load[0] and 0.3 in series.gpu_load[0]
    time.sleep(0.05)
    assert len(series.times) == n  # stopped means stopped


def test_cpu_load_is_busy_time_between_two_readings_of_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 50 0 50 400 0 0 0 0 0 0\n")
    load = CpuLoad(tmp_path)
    # 300 ticks more, 150 of them idle or waiting on I/O: half busy.
    stat.write_text("cpu  200 0 150 900 50 0 0 0 0 0\n")
    assert load() == pytest.approx(0.5)
    assert load() is None  # no time passed
    stat.write_text("garbage\n")
    assert load() is None
    assert CpuLoad(tmp_path / "absent")() is None


# -- rows and columns ---------------------------------------------------------------------


def test_a_call_is_shared_over_the_columns_it_overlaps() -> None:
    t = Timeline(10.0, 11.0, 4)  # columns of 0.25 s
    t.add("gemv_kernel", "kernel", 10.2, 0.1, nbytes=1000, occupancy=0.5)
    t.add("gemv_kernel", "kernel", 10.9, 0.5, nbytes=1000, occupancy=1.0)  # runs past the window
    t.add("decode", "stage", 9.0, 0.5)  # before it: counted, in no column
    (row,) = [r for r in t.rows() if r.kind == "kernel"]
    assert row.calls == 2 and row.seconds == pytest.approx(0.6) and row.known_bytes == 2000
    assert row.busy == pytest.approx([0.05, 0.05, 0.0, 0.1])
    assert row.moved == pytest.approx([500, 500, 0, 200])
    assert row.occupancy == pytest.approx((0.5 * 0.1 + 1.0 * 0.5) / 0.6)
    doc = document.row_doc(row, t.width, bandwidth=4000.0)
    assert doc["bandwidth_share"] == pytest.approx(2000 / 0.6 / 4000)
    assert doc["bandwidth_share_by_column"] == pytest.approx([0.5, 0.5, 0.0, 0.2])
    assert doc["busy"] == pytest.approx([0.2, 0.2, 0.0, 0.4])
    # Many names of a kind: the longest kept, the rest summed into one row.
    for i in range(40):
        t.add(f"op{i:02d}", "op", 10.0, 0.001 * (i + 1))
    ops = [r for r in t.rows() if r.kind == "op"]
    assert len(ops) == 12 and ops[0].name == "op39" and ops[-1].name == "other ops"
    assert ops[-1].calls == 29 and sum(r.calls for r in ops) == 40
    with pytest.raises(ValueError, match="record kind"):
        t.add("x", "nonsense", 10.0, 0.1)


def test_sampled_readings_are_averaged_into_columns_and_held_where_a_column_has_none() -> None:
    t = Timeline(0.0, 1.0, 5)
    series = Series("sysfs", times=[-0.05, 0.05, 0.1, 0.65], cpu_load=[0.9, 0.2, 0.4, 0.8],
                    gpu_load={0: [None, 0.5, None, 1.0]}, memory_controller={0: [0.1, 0.1, 0.1, 0.3]})  # fmt: skip
    doc = document.samples_doc(series, t)
    assert doc["t_s"] == [-0.05, 0.05, 0.1, 0.65]
    assert doc["cpu_load_by_column"] == pytest.approx([0.3, 0.3, 0.3, 0.8, 0.8])
    assert doc["gpus"][0]["load_by_column"] == [0.5, 0.5, 0.5, 1.0, 1.0]


# -- the profiler's records ----------------------------------------------------------------


def _kernel(name: str, ts: float, dur: float, correlation: int, occupancy: float | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"correlation": correlation}
    if occupancy is not None:
        args[records.OCCUPANCY] = occupancy
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}


def _trace(gemvs: int) -> list[dict[str, Any]]:
    """Kineto's records of one decode step as a CUDA graph: the step's annotation, the
    graph's launch, and its kernels (correlated to that launch) on the GPU after it."""
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": records.CLOCK_MARK, "ts": 1000.0, "dur": 1.0},
        {"ph": "X", "cat": "user_annotation", "name": "edge.decode", "ts": 2000.0, "dur": 400.0, "tid": 1},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaGraphLaunch",
            "ts": 2100.0,
            "dur": 5.0,
            "args": {"correlation": 7},
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::argmax", "ts": 2300.0, "dur": 50.0, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::max", "ts": 2310.0, "dur": 20.0, "tid": 1},  # inside argmax
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pageable -> Device)",
            "ts": 2050.0,
            "dur": 2.0,
            "args": {"bytes": 4096},
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoH (Device -> Pinned)",
            "ts": 2390.0,
            "dur": 4.0,
            "args": {"bytes": 1024},
        },
        {"ph": "i", "cat": "instant", "name": "not a span", "ts": 0.0},
    ]
    at = 2200.0
    for _ in range(gemvs):
        events.append(_kernel("void gemv_kernel<4, 8>(uint4 const*)", at, 10.0, 7, occupancy=50.0))
        at += 12.0
    events.append(_kernel("void attn_split_kernel<__half>", at, 20.0, 7, occupancy=25.0))
    events.append(_kernel("void attn_merge_kernel<__half>", at + 30, 5.0, 7))
    events.append(_kernel("elementwise_kernel", at + 40, 5.0, 99))  # launched outside any step
    return events


PRODUCTS = [Product("qkv", 0, 300), Product("o", 0, 100), Product("gate_up", 0, 800), Product("down", 0, 400),
            Product("lm_head", None, 1000)]  # fmt: skip


def test_kernel_records_become_rows_with_the_bytes_their_shapes_move() -> None:
    """A decode step's INT4 products, matched to the model's products in call order, carry
    each weight's bytes; its attention kernel the step's KV bytes (the merge of partials
    none); occupancy from Kineto's estimate; copies with their bytes by direction; torch's
    operators only where Python called them."""
    events = _trace(gemvs=5)
    offset = records.clock_offset(events, marked_at=50.0)
    assert offset == pytest.approx(50.0 - 0.001)
    assert offset is not None
    timeline = Timeline(50.0, 50.002, 4)
    attribution = records.Attribution(PRODUCTS, [records.Window("edge.decode", kv_bytes=6000.0)])
    held = records.add_records(timeline, events, offset, attribution)
    assert held == {"kernels": True, "memcpy": True, "occupancy": True}
    rows = {(r.kind, r.name): r for r in timeline.rows()}
    gemv = rows[("kernel", "void gemv_kernel<4, 8>(uint4 const*)")]
    assert gemv.calls == 5 and gemv.known_bytes == 2600 and gemv.seconds == pytest.approx(50e-6)
    assert gemv.occupancy == pytest.approx(0.5)
    attention = rows[("kernel", "void attn_split_kernel<__half>")]
    assert attention.known_bytes == 6000 and attention.occupancy == pytest.approx(0.25)
    assert not rows[("kernel", "void attn_merge_kernel<__half>")].has_bytes
    assert rows[("kernel", "void attn_merge_kernel<__half>")].occupancy is None
    assert not rows[("kernel", "elementwise_kernel")].has_bytes
    assert rows[("memcpy", "memcpy HtoD")].known_bytes == 4096
    assert ("op", "aten::argmax") in rows and ("op", "aten::max") not in rows
    (dtoh, htod) = records.transfers(events)
    assert dtoh == {"direction": "DtoH", "count": 1, "bytes": 1024, "seconds": pytest.approx(4e-6),
                    "bytes_per_s": pytest.approx(256e6)}  # fmt: skip
    assert htod == {"direction": "HtoD", "count": 1, "bytes": 4096, "seconds": pytest.approx(2e-6),
                    "bytes_per_s": pytest.approx(2048e6)}  # fmt: skip


def test_kernels_that_are_not_one_forwards_products_get_no_guessed_bytes() -> None:
    """Four GEMVs in a step of a model with five products (a kernel not ours among them,
    say), or annotations that are not the steps timed: bytes unknown, never guessed."""
    events = _trace(gemvs=4)
    offset = records.clock_offset(events, 0.0)
    assert offset is not None
    timeline = Timeline(0.0, 1.0, 2)
    records.add_records(timeline, events, offset, records.Attribution(PRODUCTS, [records.Window("edge.decode", 10.0)]))
    rows = {r.name: r for r in timeline.rows()}
    assert not rows["void gemv_kernel<4, 8>(uint4 const*)"].has_bytes
    assert rows["void attn_split_kernel<__half>"].known_bytes == 10.0  # attention is known apart
    two_windows = [records.Window("edge.decode", 1.0), records.Window("edge.decode", 1.0)]
    timeline = Timeline(0.0, 1.0, 2)
    records.add_records(timeline, _trace(gemvs=5), offset, records.Attribution(PRODUCTS, two_windows))
    assert not any(r.has_bytes for r in timeline.rows() if r.kind == "kernel")
    assert records.clock_offset([e for e in events if e["name"] != records.CLOCK_MARK], 0.0) is None


def test_the_profilers_own_records_on_this_cpu_land_on_the_timeline() -> None:
    """torch.profiler on this box: the clock mark found, the operators Python called in
    rows, the time where it was spent."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        marked_at = start = time.perf_counter()
        with record_function(records.CLOCK_MARK):
            pass
        for _ in range(20):
            x = torch.tanh(x @ x)
        end = time.perf_counter()
    events = records.trace_events(prof)
    offset = records.clock_offset(events, marked_at)
    assert offset is not None
    timeline = Timeline(start, end, 10)
    held = records.add_records(timeline, events, offset)
    assert held == {"kernels": False, "memcpy": False, "occupancy": False}
    rows = {r.name: r for r in timeline.rows()}
    assert rows["aten::matmul"].calls == 20 and rows["aten::tanh"].calls == 20
    assert "aten::mm" not in rows  # inside matmul
    busy = sum(sum(r.busy) for r in rows.values())
    assert 0.3 * (end - start) < busy <= 1.01 * (end - start)


# -- the document and its heat maps -------------------------------------------------------


def _document() -> dict[str, Any]:
    t = Timeline(0.0, 2.0, 8)
    for i in range(16):
        t.add("void gemv_kernel<4, 8>", "kernel", i * 0.12, 0.05, nbytes=2e8, occupancy=0.5)
        t.add("void attn_split_kernel", "kernel", i * 0.12 + 0.05, 0.02, nbytes=1e7)
    t.add("memcpy HtoD", "memcpy", 0.01, 0.001, 4096)
    t.add("qa: decode step", "step", 0.0, 1.9, nbytes=3.4e9)
    t.add("aten::argmax", "op", 0.3, 0.01)
    series = Series("nvml", times=[0.1 * i for i in range(20)], cpu_load=[0.5] * 20,
                    gpu_load={0: [0.9] * 20}, memory_controller={0: [0.6] * 20})  # fmt: skip
    device = {"backend": "cuda", "name": "a test GPU", "copy_bandwidth_bytes_per_s": 5.0e9,
              "copy_bandwidth_method": "given"}  # fmt: skip
    available = {"kernel_timing": True, "sm_occupancy": True, "memcpy": True, "gpu_load": "nvml",
                 "memory_controller": "nvml", "cpu_load": "/proc/stat", "notes": []}  # fmt: skip
    workload = {"task": "qa", "jobs": 1, "profile": "t", "engines": {"qa": "x"}}
    jobs = [{"id": "j", "task": "qa", "status": "ok", "start_s": 0.0, "seconds": 1.9, "stages_ms": {"decode": 1900.0}}]
    doc = document.document("workload", t, series, device, available, workload, jobs, [])
    doc["created"] = "2026-01-01T00:00:00Z"
    doc["host"] = {"name": "box", "machine": "x86_64", "cpus": 2}
    return doc


def test_the_heat_maps_are_drawn_from_a_given_document_the_same_each_time(tmp_path: Path) -> None:
    doc = _document()
    _valid(doc)
    first = heatmap.draw(doc, tmp_path / "a")
    second = heatmap.draw(json.loads(json.dumps(doc)), tmp_path / "b")
    assert [p.name for p in first] == ["bandwidth.png", "activity.png"]
    for a, b in zip(first, second, strict=True):
        width, height = _real_png(a)
        assert width >= 800 and height >= 200
        assert a.read_bytes() == b.read_bytes(), a.name
    # Another document draws another picture.
    doc["rows"][0]["bandwidth_share_by_column"] = [0.0] * 8
    third = heatmap.draw(doc, tmp_path / "c")
    assert third[0].read_bytes() != first[0].read_bytes()
    # A document with no rows at all still draws (the samples alone).
    doc["rows"] = []
    assert [_real_png(p) for p in heatmap.draw(doc, tmp_path / "d")]


def test_without_matplotlib_the_json_is_still_written_and_the_cli_says_how_to_draw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = _document()
    path = document.write(doc, tmp_path / "out")
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as on a box without the profile extra\n"
        "from edge import cli\n"
        f"sys.exit(cli.main(['profile', '--draw', {str(path)!r}, '--out', {str(tmp_path / 'png')!r}]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "pip install '.[profile]'" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "png" / "bandwidth.png").exists()

    def missing() -> None:
        raise heatmap.Unavailable(heatmap.MISSING)

    written = command._finish(doc, command.Settings(tmp_path / "again"), lambda line: None)
    assert written.pngs and written.not_drawn is None
    monkeypatch.setattr(heatmap, "_pyplot", missing)
    written = command._finish(doc, command.Settings(tmp_path / "nompl"), lambda line: None)
    assert written.json.is_file() and written.pngs == [] and written.not_drawn == heatmap.MISSING
    assert document.read(written.json)["rows"] == doc["rows"]
    # And drawn again later from the file, elsewhere.
    done = edgectl("profile", "--draw", str(written.json), "--out", str(tmp_path / "later"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert _real_png(tmp_path / "later" / "activity.png")


# -- the command --------------------------------------------------------------------------


def _check_run(out: Path, task: str, jobs: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "profile.json").read_text(encoding="utf-8"))
    _valid(doc)
    assert doc["mode"] == "workload" and doc["workload"]["task"] == task and doc["workload"]["jobs"] == jobs
    assert len(doc["jobs"]) == jobs and all(j["status"] == "ok" for j in doc["jobs"]), doc["jobs"]
    assert doc["device"]["copy_bandwidth_bytes_per_s"] > 1e8
    assert doc["available"]["cpu_load"] == "/proc/stat" and doc["samples"]["cpu_load"]
    for png in ("bandwidth.png", "activity.png"):
        width, height = _real_png(out / png)
        assert width >= 800 and height >= 100
    return doc


def test_edgectl_profile_runs_ocr_jobs_on_this_cpu(tmp_path: Path, ocr_engine_dir: Path) -> None:
    """The real OCR models (the bundled PP-OCR, onnxruntime) through the OCR task: no
    kernel timing on a CPU, said so; each job's stages as rows, with time in them."""
    models = {"inspect": {"enabled": False}, "qa": {"enabled": False}, "ocr": {"threads": 1}}
    profile = write_profile(tmp_path, 1883, ocr_engine_dir, device_id="p1", models=models)
    out = tmp_path / "out"
    done = edgectl("profile", "--profile", str(profile), "--workload", "ocr", "--jobs", "3", "--out", str(out),
                   "--columns", "20", "--interval-ms", "20", timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ocr: 3/3 jobs done" in done.stderr and "Traceback" not in done.stderr
    doc = _check_run(out, "ocr", 3)
    assert doc["device"]["backend"] == "cpu" and doc["available"]["kernel_timing"] is False
    assert any("no CUDA here" in note for note in doc["available"]["notes"])
    stages = {r["name"]: r for r in doc["rows"] if r["kind"] == "stage"}
    assert {"ocr: decode", "ocr: model"} <= set(stages), set(stages)
    assert stages["ocr: model"]["calls"] >= 3 and stages["ocr: model"]["seconds"] > 0
    assert sum(b for b in stages["ocr: model"]["busy"] if b) > 0
    assert len(stages["ocr: model"]["busy"]) == doc["window"]["columns"] == 20


@pytest.mark.slow
def test_edgectl_profile_runs_qa_jobs_on_this_cpu(tmp_path: Path, engine_dir: Path) -> None:
    """The profile's real text engine (SmolLM2 with the clinic adapter, AWQ INT4) through
    the continuous batcher: prefill and decode steps as rows with the bytes their shapes
    move and their share of the copy bandwidth; torch's operators beside them."""
    models = {"inspect": {"enabled": False}, "ocr": {"enabled": False},
              "qa": {"max_new_tokens": 8, "max_context_tokens": 512}}  # fmt: skip
    profile = write_profile(tmp_path, 1883, engine_dir, device_id="p2", models=models)
    out = tmp_path / "out"
    done = edgectl("profile", "--profile", str(profile), "--workload", "qa", "--jobs", "3", "--out", str(out),
                   timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "qa: 3/3 jobs done" in done.stderr
    doc = _check_run(out, "qa", 3)
    steps = {r["name"]: r for r in doc["rows"] if r["kind"] == "step"}
    decode = steps["qa: decode step"]
    assert decode["calls"] >= 7 and decode["bytes"] > 0 and 0 < decode["bandwidth_share"] < 5
    assert steps["qa: prefill"]["calls"] == 3 and steps["qa: prefill"]["bytes"] > 0
    assert any(v for v in decode["bandwidth_share_by_column"] if v)
    assert any(r["kind"] == "op" and r["name"].startswith("aten::") for r in doc["rows"])
    assert all(j["completion_tokens"] >= 1 and j["stages_ms"]["decode"] >= 0 for j in doc["jobs"])


def test_bad_input_is_said_in_one_line_never_a_traceback(tmp_path: Path) -> None:
    empty = tmp_path / "engines"
    empty.mkdir()
    port = free_port()
    profile = write_profile(tmp_path, 1883, empty, device_id="p3", metrics={"listen": f"127.0.0.1:{port}"},
                            models={"inspect": {"enabled": False}})  # fmt: skip
    out = str(tmp_path / "out")
    cases = [
        (["--profile", str(profile), "--workload", "translate", "--out", out], 2, "invalid choice: 'translate'"),
        (["--profile", str(profile), "--workload", "qa", "--jobs", "0", "--out", out], 2, "0 is not above 0"),
        (["--profile", str(profile), "--workload", "qa", "--jobs", "many", "--out", out], 2, "not a whole number"),
        (["--profile", str(profile), "--attach", "--seconds", "-3", "--out", out], 2, "not a finite number above 0"),
        (["--profile", str(profile), "--attach", "--interval-ms", "nan", "--out", out], 2, "not a finite number"),
        (["--workload", "qa", "--out", out], 2, "--profile is required"),
        (["--profile", str(profile), "--workload", "qa", "--out", out], 2, "no engine for qa"),
        (["--profile", str(profile), "--workload", "inspect", "--out", out], 2, "does not serve inspect"),
        (["--profile", str(profile), "--attach", "--seconds", "1", "--out", out], 1, "is the daemon running?"),
        (["--draw", str(profile), "--out", out], 2, "cannot read a profile"),
        (["--draw", str(tmp_path / "none.json"), "--out", out], 2, "cannot read a profile"),
    ]
    for args, code, said in cases:
        done = edgectl("profile", *args, timeout=300)
        assert done.returncode == code, (args, done.stderr[-2000:])
        assert said in done.stderr, (args, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (args, done.stderr[-2000:])
    assert "edgectl build" in edgectl("profile", *cases[6][0]).stderr
    assert not (tmp_path / "out" / "profile.json").exists()


RESULT = {"task": "qa", "status": "ok", "timings": {"total_ms": 40.0, "stages": {"prefill": 10.0, "decode": 30.0}}}


def test_attaching_records_a_running_daemons_stages_and_its_box(tmp_path: Path) -> None:
    """Mode (b): the daemon's own metrics endpoint (its MetricsServer, fed results as the
    responder feeds it) read at each sample, the box sampled beside it (a faked Orin):
    each stage's time lands in the column its results were sent in."""
    from edge.health.metrics import MetricsServer

    orin_sysfs.build(tmp_path / "sys")
    metrics = MetricsServer(lambda: {"state": "ready"}, sensors_root=tmp_path / "sys")
    assert metrics.start(("127.0.0.1", 0)) and metrics.address is not None
    host, port = metrics.address
    profile = write_profile(tmp_path, 1883, tmp_path / "engines", device_id="p4",
                            metrics={"listen": f"{host}:{port}"})  # fmt: skip
    from edge.config.loader import load_profile

    loaded = load_profile(profile)
    assert command.metrics_url(loaded) == f"http://127.0.0.1:{port}/metrics"
    stop = threading.Event()

    def serve() -> None:  # results sent while the window records
        time.sleep(0.25)
        while not stop.wait(0.05):
            metrics.jobs.observe(RESULT)

    feeder = threading.Thread(target=serve)
    feeder.start()
    said: list[str] = []
    try:
        settings = command.Settings(tmp_path / "out", columns=5, interval_s=0.05)
        written = command.record_daemon(loaded, 1.0, settings, said.append, gpu=sampler.tegra_probe(tmp_path / "sys"))
    finally:
        stop.set()
        feeder.join()
        metrics.stop()
    doc = json.loads(written.json.read_text(encoding="utf-8"))
    _valid(doc)
    assert doc["mode"] == "daemon" and doc["available"]["kernel_timing"] is False
    assert doc["available"]["gpu_load"] == "sysfs" and any("running daemon" in n for n in doc["available"]["notes"])
    rows = {r["name"]: r for r in doc["rows"]}
    decode = rows["qa: decode"]
    assert decode["kind"] == "stage" and decode["calls"] >= 5
    assert decode["seconds"] == pytest.approx(decode["calls"] * 0.030)
    assert decode["busy"][0] == 0 and sum(decode["busy"]) > 0  # nothing was sent in the first column
    assert rows["qa: prefill"]["seconds"] == pytest.approx(rows["qa: prefill"]["calls"] * 0.010)
    gpu = doc["samples"]["gpus"][0]
    assert set(gpu["load"]) == {0.613} and set(gpu["memory_controller"]) == {0.25}
    assert [p.name for p in written.pngs] == ["bandwidth.png", "activity.png"]
    assert any(line.startswith("wrote") for line in said)


# -- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_edgectl_profile_runs_qa_on_cuda_with_kernel_rows_and_gemv_bandwidth(tmp_path: Path) -> None:
    """A random INT4 model of a Llama shape served on CUDA (as the daemon serves it: our
    INT4 GEMV, the fused step, CUDA graphs): CUPTI's kernel records through torch.profiler,
    each INT4 GEMV kernel's bytes from the model's shapes and its share of the measured
    copy bandwidth, attention's bytes, occupancy, copies and the GPU's load from NVML."""
    from edge.text.architecture import LlamaConfig
    from engines.text.random_llama import write_random_checkpoint

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=8, num_heads=16,
                         num_kv_heads=4, max_position=2048)  # fmt: skip
    checkpoint = write_random_checkpoint(tmp_path / "ckpt", config, device="cuda", group=128)
    models = {"inspect": {"enabled": False}, "ocr": {"enabled": False},
              "qa": {"engine": str(checkpoint), "device": "cuda", "max_new_tokens": 48, "max_context_tokens": 1024,
                     "max_sequences": 4}}  # fmt: skip
    profile = write_profile(tmp_path, 1883, tmp_path / "engines", device_id="g1", models=models)
    out = tmp_path / "out"
    done = edgectl("profile", "--profile", str(profile), "--workload", "qa", "--jobs", "4", "--out", str(out),
                   "--no-png", timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads((out / "profile.json").read_text(encoding="utf-8"))
    _valid(doc)
    assert doc["device"]["backend"] == "cuda" and doc["available"]["kernel_timing"] is True
    kernels = [r for r in doc["rows"] if r["kind"] == "kernel"]
    gemvs = [r for r in kernels if records.PRODUCT_KERNELS.search(r["name"])]
    assert gemvs, [r["name"] for r in kernels]
    known = [r for r in gemvs if r["bytes"]]
    assert known, gemvs
    for row in known:
        assert 0.02 < row["bandwidth_share"] < 1.5, row
        assert row["bytes_per_s"] > 1e10 and any(v for v in row["bandwidth_share_by_column"] if v)
    assert any(r["bytes"] for r in kernels if "attn" in r["name"] and "merge" not in r["name"])
    if doc["available"]["sm_occupancy"]:
        assert any(r["occupancy"] is not None and 0 < r["occupancy"] <= 1 for r in kernels)
    else:
        assert any("SM occupancy not available" in note for note in doc["available"]["notes"])
    assert doc["samples"]["source"] == "nvml" and any(v for v in doc["samples"]["gpus"][0]["load"] if v)
    assert any(t["direction"] in ("HtoD", "DtoH") and t["bytes"] > 0 for t in doc["transfers"]), doc["transfers"]
