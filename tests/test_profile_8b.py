"""`edgectl profile` of an 8B-shape Q&A engine under load (bench/profile_8b.py) and its heat
maps on the pages: the random Q4_0 GGUF writer the llama.cpp peer shares (bench/random_gguf.py)
read back by our importer; the profile derived from profiles/gpu-dev.yaml; the whole flow
(write, `edgectl build`, `edgectl profile`) run on this CPU at a tiny shape; `adopt` keeping
only the measured CUDA run; and the render drawing the heat maps and the README's image from
a profile document, or saying it is not measured where there is none. The 8B run itself
needs a GPU (`bash bench/on_device.sh profile8b`)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import yaml
from PIL import Image

from bench import plots, profile_8b, random_gguf
from bench import render as bench_render
from edge.profiling import document, heatmap
from edge.profiling.sampler import Series
from edge.profiling.timeline import Timeline
from tests.conftest import REPO

SCHEMA = json.loads((REPO / "docs" / "schemas" / "profile.schema.json").read_text(encoding="utf-8"))
QUESTION = "How long does the pump battery last?"


# -- the GGUF ---------------------------------------------------------------------------------


def test_the_q4_0_gguf_is_the_shape_asked_and_every_block_linear_is_kept_as_stored(tmp_path: Path) -> None:
    """The writer the llama.cpp peer and the profile share: our importer reads back the
    config it was given, every block linear and the output projection as Q4_0 kept as
    stored (the build repacks, never rounds again), each matrix's bytes where q4_0_bytes
    says, the file whole under its name (no partial left) and the same bytes from the same
    seed; the Llama 3 vocabulary makes text into tokens of a few bytes under its template."""
    import gguf

    from engines.text.gguf_header import GgufHeader
    from engines.text.gguf_int4 import KeptWeights, kept_linears
    from engines.text.import_gguf import GgufSource

    config = profile_8b.shape("tiny")
    path = tmp_path / "m.gguf"
    size = random_gguf.write_q4_0_gguf(path, config, vocabulary="llama3")
    assert size == path.stat().st_size and not list(tmp_path.glob("*.partial"))
    source = GgufSource(path)
    # The file holds the norm's epsilon as float32.
    assert source.config.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert replace(source.config, rms_norm_eps=config.rms_norm_eps) == config
    q4_0 = [t for t in GgufHeader(path).tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_0]
    assert len(q4_0) == 2 + 7 * config.num_layers
    assert sum(t.data.nbytes for t in q4_0) == random_gguf.q4_0_bytes(config)
    kept, why = kept_linears(source)
    assert why is None and isinstance(kept, KeptWeights)
    assert "lm_head" in kept and all(kept.kind(n) == "Q4_0" for n in kept)
    first = kept["layers.0.mlp.down_proj"]
    assert first.group_size == 32 and set(np.unique(first.zeros.numpy()).tolist()) == {8}

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(json.dumps(source.tokenizer))
    ids = tokenizer.encode(QUESTION, add_special_tokens=False).ids
    assert len(QUESTION) / 3 <= len(ids) < len(QUESTION)
    assert tokenizer.decode(ids) == QUESTION
    assert source.generation["chat_template"] == random_gguf.TEMPLATE

    again = tmp_path / "again.gguf"
    random_gguf.write_q4_0_gguf(again, config, vocabulary="llama3")
    assert again.read_bytes() == path.read_bytes()
    # The peer's file: the same weights, a placeholder vocabulary llama-bench never reads.
    peer = tmp_path / "peer.gguf"
    random_gguf.write_q4_0_gguf(peer, config)
    header = GgufHeader(peer)
    assert header.fields["tokenizer.ggml.model"].contents() == "llama"
    tensors = {t.name: t for t in header.tensors}
    assert all(np.array_equal(tensors[t.name].data, t.data) for t in q4_0)
    with pytest.raises(ValueError, match="vocabulary"):
        random_gguf.write_q4_0_gguf(tmp_path / "x.gguf", config, vocabulary="words")


def test_the_profile_is_the_gpu_profile_with_its_qa_model_alone(tmp_path: Path) -> None:
    from edge.config.loader import load_profile

    gpu_dev = yaml.safe_load((REPO / "profiles" / "gpu-dev.yaml").read_text(encoding="utf-8"))
    doc = profile_8b.derived_profile(tmp_path / "m.gguf", tmp_path, "llama3-8b", "cuda")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    (tmp_path / "m.gguf").write_bytes(b"")  # the source must exist to load the profile
    profile = load_profile(path)
    assert profile.device_id == profile_8b.device_id("llama3-8b") == "gpu-dev-llama3-8b"
    assert not profile.models.ocr.enabled and not profile.models.inspect.enabled
    qa = profile.models.qa
    assert qa.enabled and qa.source == str(tmp_path / "m.gguf") and qa.adapter == "none"
    assert qa.device == "cuda" and profile.paths.engine_dir == tmp_path / "engines"
    # Everything else the GPU profile says, as it says it.
    for key, value in gpu_dev["models"]["qa"].items():
        if key not in ("source",):
            assert getattr(qa, key) == value, key
    assert profile.memory_budget_mib == gpu_dev["memory_budget_mib"]


# -- the flow, on this CPU ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_whole_flow_runs_on_this_cpu_at_a_tiny_shape(tmp_path: Path) -> None:
    """What `bash bench/on_device.sh profile8b` runs, at the tiny shape on the CPU: the GGUF
    written, `edgectl build` keeping its Q4_0 weights, `edgectl profile` running more jobs
    than max_sequences through the batcher, several at once; a document valid against the
    schema, that `adopt` refuses as the measured run (a CPU, the tiny shape)."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "bench.profile_8b", "run", "--shape", "tiny", "--device", "cpu", "--jobs", "6",
           "--work", str(work), "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    run = json.loads((out / "run.json").read_text(encoding="utf-8"))
    assert [s["step"] for s in run["steps"]] == ["gguf", "build", "profile"]
    assert all(s.get("exit_code", 0) == 0 for s in run["steps"]) and run["steps"][0]["written"]
    doc = json.loads((out / "profile.json").read_text(encoding="utf-8"))
    jsonschema.validate(doc, SCHEMA)
    assert doc["workload"]["profile"] == "gpu-dev-tiny" and doc["workload"]["jobs"] == 6
    assert all(j["status"] == "ok" and j["completion_tokens"] >= 1 for j in doc["jobs"])
    assert 1 < profile_8b.concurrency(doc["jobs"]) <= 4  # the profile's max_sequences
    # Served from the build that kept the file's Q4_0 weights.
    checkpoint = Path(doc["workload"]["engines"]["qa"].split(" (")[0])
    assert checkpoint.name.startswith("random-tiny-q4_0-") and checkpoint.is_relative_to(work / "engines")
    manifest = json.loads((checkpoint / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["recipe"]["method"] == "gguf-q4_0"
    steps = {r["name"]: r for r in doc["rows"] if r["kind"] == "step"}
    assert steps["qa: decode step"]["bytes"] > 0 and steps["qa: prefill"]["calls"] == 6
    with pytest.raises(profile_8b.NotAdoptable, match="not cuda"):
        profile_8b.adopt(out / "profile.json", tmp_path / "kept.json")
    assert not (tmp_path / "kept.json").exists()
    # A second run on the same machine writes no second GGUF.
    again = subprocess.run([*cmd[:-2], "--out", str(tmp_path / "out2")], cwd=REPO, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert not json.loads((tmp_path / "out2" / "run.json").read_text(encoding="utf-8"))["steps"][0]["written"]


def test_the_device_mode_runs_this_flow() -> None:
    script = (REPO / "bench" / "on_device.sh").read_text(encoding="utf-8")
    mode = script[script.index("  profile8b)") :].split(";;")[0]
    assert 'python3 -m bench.profile_8b run --out "$out/profile8b"' in mode


# -- adopt and the pages ------------------------------------------------------------------------


def measured(jobs: int = 8, backend: str = "cuda") -> dict[str, Any]:
    """A profile document as the 8B run writes one (rows, samples, jobs four at a time)."""
    t = Timeline(0.0, 2.0, 12)
    for i in range(20):
        t.add("void gemv_kernel<__half, 128, 16, 2, 0>(int)", "kernel", i * 0.1, 0.06, nbytes=2.5e8, occupancy=0.4)
        t.add("void _attn_split_kernel(int)", "kernel", i * 0.1 + 0.06, 0.01, nbytes=5e6)
    t.add("Memcpy HtoD (Pageable -> Device)", "memcpy", 0.01, 0.001, 4096)
    t.add("qa: decode step", "step", 0.0, 1.9, nbytes=9.6e10)
    t.add("aten::argmax", "op", 0.3, 0.01)
    series = Series("nvml", times=[0.1 * i for i in range(20)], cpu_load=[0.3] * 20,
                    gpu_load={0: [0.95] * 20}, memory_controller={0: [0.7] * 20})  # fmt: skip
    method = "torch copy_ device to device, 256 MiB, bytes read + written, median of 20"
    device = {"backend": backend, "name": "NVIDIA H200", "copy_bandwidth_bytes_per_s": 3.9e12,
              "copy_bandwidth_method": method}  # fmt: skip
    available = {"kernel_timing": True, "sm_occupancy": True, "memcpy": True, "gpu_load": "nvml",
                 "memory_controller": "nvml", "cpu_load": "/proc/stat", "notes": []}  # fmt: skip
    workload = {"task": "qa", "jobs": jobs, "profile": profile_8b.device_id("llama3-8b"), "engines": {"qa": "x"}}
    rows = [{"id": f"profile-{i}", "task": "qa", "status": "ok", "start_s": 0.45 * (i // 4), "seconds": 0.45,
             "stages_ms": {"decode": 400.0}, "completion_tokens": 96} for i in range(jobs)]  # fmt: skip
    doc = document.document("workload", t, series, device, available, workload, rows, [])
    doc["created"] = "2026-01-01T00:00:00Z"
    doc["host"] = {"name": "gpu", "machine": "x86_64", "cpus": 16}
    return doc


def test_adopt_keeps_the_measured_run_unchanged_and_refuses_any_other(tmp_path: Path) -> None:
    doc = measured()
    jsonschema.validate(doc, SCHEMA)
    run = document.write(doc, tmp_path / "run")
    kept = profile_8b.adopt(run, tmp_path / "results" / "profile_cuda.json")
    assert json.loads(kept.read_text(encoding="utf-8")) == doc
    for change, said in [
        (lambda d: d["jobs"][3].update(status="error"), "not every job"),
        (lambda d: d["workload"].update(profile="gpu-dev-tiny"), "not 'gpu-dev-llama3-8b'"),
        (lambda d: d["device"].update(backend="cpu"), "not cuda"),
        (lambda d: d["window"].update(seconds=-1), "profile.schema.json"),
        (lambda d: [j.update(start_s=float(i)) for i, j in enumerate(d["jobs"])], "not under load"),
    ]:
        other = measured()
        change(other)
        path = document.write(other, tmp_path / said.replace(" ", "-").replace("'", ""))
        with pytest.raises(profile_8b.NotAdoptable, match=said):
            profile_8b.adopt(path, tmp_path / "no.json")
    assert not (tmp_path / "no.json").exists()
    (tmp_path / "yaml.json").write_text("device_id: x\n", encoding="utf-8")
    assert profile_8b.main(["adopt", str(tmp_path / "yaml.json"), "--to", str(tmp_path / "no.json")]) == 2


def _block(text: str, name: str = "profile_cuda") -> str:
    return text.split(f"<!-- bench:{name} -->")[1].split(f"<!-- /bench:{name} -->")[0]


def test_the_heat_maps_and_the_readme_image_are_rendered_from_the_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The document in bench/results: both heat maps drawn by edgectl profile's own code
    (the same bytes as `heatmap.draw` with the fingerprint), once; the README and the
    benchmarks page link them from where each page is, under what ran, from the document."""
    results, drawn = tmp_path / "results", tmp_path / "plots"
    doc = measured()
    results.mkdir()
    (results / "profile_cuda.json").write_text(json.dumps(doc), encoding="utf-8")
    monkeypatch.setattr(bench_render, "RESULTS", results)
    readme = bench_render.render((REPO / "README.md").read_text(encoding="utf-8"), REPO / "README.md")
    block = _block(readme)
    assert "](docs/plots/profile_cuda_bandwidth.png)" in block and "](docs/plots/profile_cuda_activity.png)" in block
    assert "on the NVIDIA H200" in block and "--jobs 8" in block and "at most 4 at once" in block
    assert "`gemv_kernel<__half, 128, 16, 2, 0>`" in block and "Not measured" not in block
    page = bench_render.render((REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8"))
    assert "](plots/profile_cuda_bandwidth.png)" in _block(page)

    monkeypatch.setattr(plots, "PLOT_DIR", drawn)
    maps = plots.PROFILE_MAPS
    names = [str(drawn / "profile_cuda_bandwidth.png"), str(drawn / "profile_cuda_activity.png")]
    assert plots.stale_maps(maps, results) == names
    assert plots.write_maps(maps, results) == [f"drew {name}" for name in names]
    assert plots.stale_maps(maps, results) == [] and plots.write_maps(maps, results) == []
    mark = plots.maps_fingerprint(maps[0], doc)
    direct = heatmap.draw(doc, tmp_path / "direct", prefix="profile_cuda_", text={plots.FINGERPRINT_KEY: mark})
    for path, same in zip(maps[0].paths(), direct, strict=True):
        assert path.read_bytes() == same.read_bytes()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] >= 800
            assert getattr(image, "text", {})[plots.FINGERPRINT_KEY] == mark
    # Another figure in the document: the maps drawn from the old one are stale.
    doc["rows"][0]["calls"] += 1
    (results / "profile_cuda.json").write_text(json.dumps(doc), encoding="utf-8")
    assert plots.stale_maps(maps, results) == names


def test_without_the_document_the_pages_say_not_measured_and_hold_no_heat_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results, drawn = tmp_path / "results", tmp_path / "plots"
    results.mkdir()
    drawn.mkdir()
    monkeypatch.setattr(bench_render, "RESULTS", results)
    monkeypatch.setattr(plots, "PLOT_DIR", drawn)
    readme = bench_render.render((REPO / "README.md").read_text(encoding="utf-8"), REPO / "README.md")
    block = _block(readme)
    assert "Not measured yet" in block and "bash bench/on_device.sh profile8b" in block and "![" not in block
    # A heat map left on the pages with no document to draw it from is stale, and removed.
    left = drawn / "profile_cuda_bandwidth.png"
    left.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert plots.stale_maps(plots.PROFILE_MAPS, results) == [str(left)]
    assert plots.write_maps(plots.PROFILE_MAPS, results) == [f"removed {left} (no bench/results/profile_cuda.json)"]
    assert not left.exists() and plots.stale_maps(plots.PROFILE_MAPS, results) == []
    # A document that is not the measured run is said to be so, not drawn as one.
    (results / "profile_cuda.json").write_text(json.dumps(measured(backend="cpu")), encoding="utf-8")
    block = _block(bench_render.render((REPO / "README.md").read_text(encoding="utf-8"), REPO / "README.md"))
    assert "is not the measured run" in block and "![" not in block
