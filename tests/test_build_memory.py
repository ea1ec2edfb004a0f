"""A build that fits the box: the INT4 text build reads, merges, quantizes and writes a
decoder layer at a time (engines/text/layerwise.py) and is the whole-model quantizer's
build bit for bit; a build stopped at any point leaves nothing taken for built, and the
next one is whole; the measurement script (bench/build_memory.py) runs end to end."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from bench.build_memory import SHAPES, write_hf
from engines.text.float_source import CheckpointSource, layer_of
from engines.text.import_gguf import import_gguf
from engines.text.import_hf import import_hf
from engines.text.layerwise import write_layerwise
from engines.text.peft_adapter import merge_checkpoint
from engines.text.quantize import QuantRecipe
from engines.text.safetensors_writer import SafetensorsWriter, Spec
from engines.text.text_build import build_text_engine, layer_recipe, serving_group, write_quantized
from tests.conftest import REPO

# Layer 1's MLP and the output projection kept in float: the build's float paths too.
RULES = [{"match": "layers.1.mlp.*", "format": "float"}, {"match": "lm_head", "format": "float"}]
# Layer 0 pruned to 2:4 (engines/text/prune.py), by two methods, besides those rules.
SPARSE_RULES = [
    {"match": "layers.0.mlp.*", "format": "int4", "group_size": None, "sparsity": "2:4", "pruning": "sparsegpt"},
    {"match": "layers.0.self_attn.*", "format": "int4", "group_size": None, "sparsity": "2:4", "pruning": "wanda"},
    *RULES,
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Small random models of both families as Hugging Face directories and GGUF files,
    and a PEFT adapter for each."""
    from tests import test_import_gguf, test_import_hf
    from tests.test_peft_adapter import make_adapter

    root = tmp_path_factory.mktemp("build-memory-models")
    out: dict[str, Any] = {"root": root}
    for family in ("llama", "qwen2"):
        hf, _ = test_import_hf.make_model(root / f"hf-{family}", family)
        make_adapter(hf, root / f"adapter-{family}")
        gguf_model, tokenizer = test_import_gguf.make_model(root / f"gguf-{family}-tok", family)
        test_import_gguf.write_gguf(gguf_model, tokenizer, root / f"{family}.gguf", family)
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _same_checkpoint(got: Path, want: Path) -> None:
    a, b = _tensors(got), _tensors(want)
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, differ
    for side in ("quant.json", "config.json", "tokenizer.json", "generation.json"):
        assert (got / side).read_bytes() == (want / side).read_bytes(), side


@pytest.mark.parametrize(
    ("kind", "family", "adapter", "quant", "layers"),
    [
        ("hf", "llama", False, "awq-int4", None),
        ("hf", "qwen2", True, "awq-int4", None),  # tied head, q/k/v biases, the merge a layer at a time
        ("gguf", "llama", False, "awq-int4", None),  # llama.cpp's q/k order, Llama 3's rope_freqs
        ("gguf", "qwen2", True, "awq-int4-sym", RULES),
        ("hf", "llama", False, "awq-int4", SPARSE_RULES),  # the pruning a layer at a time too
    ],
)
def test_the_layer_at_a_time_build_is_the_whole_model_build_bit_for_bit(
    models: dict[str, Any],
    tmp_path: Path,
    kind: str,
    family: str,
    adapter: bool,
    quant: str,
    layers: list[dict[str, Any]] | None,
) -> None:
    """The build `edgectl build` runs against the whole-model quantizer on the float
    import (text_build.write_quantized, what every build ran before): every packed code,
    scale and zero, every float16 tensor, quant.json and the manifest's account equal."""
    root = models["root"]
    source = root / (f"hf-{family}" if kind == "hf" else f"{family}.gguf")
    adapter_dir = root / f"adapter-{family}"
    built = build_text_engine(
        tmp_path / "engines",
        str(adapter_dir) if adapter else "none",
        quant,
        progress=False,
        source=str(source),
        layers=layers,
    )
    # It wrote no float model: the INT4 build is the only directory.
    assert [p.name for p in (tmp_path / "engines" / "text").iterdir() if not p.name.startswith(".")] == [built.name]

    reference = tmp_path / "reference"
    if kind == "hf":
        imported = import_hf(source, reference / "engines", progress=False)
    else:
        imported = import_gguf(source, reference / "engines", source.stem, progress=False)
    float_model = merge_checkpoint(imported, adapter_dir) if adapter else imported
    config = CheckpointSource(float_model).config
    recipe = layer_recipe(
        quant.split("-")[0], layers or [], group_size=serving_group(config.parameter_count()), symmetric="sym" in quant
    )
    (reference / "int4").mkdir()
    details = write_quantized(float_model, reference / "int4", recipe, progress=False)
    _same_checkpoint(built, reference / "int4")
    manifest = json.loads((built / "manifest.json").read_text())
    for key in ("kind", "recipe", "layers", "weight_bytes", "kv_bytes_per_token_fp16"):
        assert manifest[key] == details[key], key
    assert any(entry["bits"] == 4 and entry["clipped"] for entry in manifest["layers"].values())
    if layers:
        assert manifest["layers"]["layers.1.mlp.down_proj"] == {"bits": 16}
    if layers == SPARSE_RULES:
        assert manifest["layers"]["layers.0.mlp.down_proj"]["sparsity"] == "2:4"


class _Recording(CheckpointSource):
    """A float checkpoint that records what each read asked for."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: list[list[str]] = []

    def read(self, names: Any) -> dict[str, torch.Tensor]:
        self.reads.append(list(names))
        return super().read(names)


def test_the_build_reads_each_tensor_once_and_no_more_than_a_layer_at_a_time(
    models: dict[str, Any], tmp_path: Path
) -> None:
    imported = import_hf(models["root"] / "hf-llama", tmp_path / "engines", progress=False)
    source = _Recording(imported)
    (tmp_path / "int4").mkdir()
    write_layerwise(source, tmp_path / "int4", QuantRecipe(method="awq", group_size=32), progress=False)
    read = [name for names in source.reads for name in names]
    assert sorted(read) == sorted(source.names())  # every tensor, once
    for names in source.reads:
        assert len({layer_of(n) for n in names}) == 1, names
        if layer_of(names[0]) is None:
            assert len(names) == 1 or "embed_tokens.weight" not in names


def test_a_safetensors_file_written_in_pieces_reads_back_as_one_of_its_own(tmp_path: Path) -> None:
    tensors = {
        "b.codes": torch.randint(0, 255, (7, 3), dtype=torch.uint8),
        "a.weight": torch.randn(3, 5),
        "c.scales": torch.randn(5).half(),
        "d.table": torch.randn(2, 3).bfloat16(),
    }
    path = tmp_path / "model.safetensors"
    with SafetensorsWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}) as writer:
        for name in ("c.scales", "b.codes", "d.table", "a.weight"):  # any order
            writer.write(name, tensors[name])
    got = load_file(str(path))
    assert sorted(got) == sorted(tensors)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in tensors.items())
    with safe_open(str(path), framework="pt") as fh:
        assert fh.get_slice("a.weight").get_shape() == [3, 5]
    with SafetensorsWriter(tmp_path / "b.safetensors", {"x": (torch.float32, (2,))}) as writer:
        with pytest.raises(ValueError, match="expects"):
            writer.write("x", torch.zeros(3))
        writer.write("x", torch.zeros(2))
    two: dict[str, Spec] = {"x": (torch.float32, (2,)), "y": (torch.float16, (1,))}
    with pytest.raises(ValueError, match="never written: y"), SafetensorsWriter(tmp_path / "c.safetensors", two) as w:
        w.write("x", torch.zeros(2))


# --- stopped builds -------------------------------------------------------------------

DEEP = dataclasses.replace(SHAPES["tiny"], num_layers=8)


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An eight-layer random model (bench/build_memory.py's writer) and its build, uninterrupted."""
    root = tmp_path_factory.mktemp("stopped")
    source = root / "source"
    write_hf(DEEP, source)
    built = build_text_engine(root / "engines", "none", "awq-int4", progress=False, source=str(source))
    return {"source": source, "built": built}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_a_build_stopped_part_way_is_never_taken_for_built_and_the_next_is_whole(
    deep: dict[str, Path], tmp_path: Path, sig: signal.Signals
) -> None:
    engines = tmp_path / "engines"
    line = [sys.executable, "-m", "engines.text.text_build", "--engine-dir", str(engines), "--source"]
    line += [str(deep["source"]), "--adapter", "none", "--quantization", "awq-int4", "--no-progress"]
    child = subprocess.Popen(line, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None
    seen = []
    for text in child.stderr:
        seen.append(text)
        if "layer 3/8 quantized" in text:
            child.send_signal(sig)
            break
    seen.append(child.stderr.read())
    # Killed: by the signal; stopped: through stop_on_sigterm's exit, which cleans up first.
    assert child.wait(60) == (-sig if sig == signal.SIGKILL else 128 + sig), "".join(seen)
    text_dir = engines / "text"
    assert [p for p in text_dir.iterdir() if not p.name.startswith(".")] == []  # nothing published
    scratch = [p for p in text_dir.iterdir() if p.is_dir()]
    if sig == signal.SIGKILL:
        # Killed where it stood: its half-written checkpoint is there, under a scratch name.
        assert len(scratch) == 1 and (scratch[0] / "model.safetensors").is_file()
        assert not (scratch[0] / "manifest.json").exists()
    else:
        assert scratch == []  # a stop request: removed on the way out

    again = build_text_engine(engines, "none", "awq-int4", progress=False, source=str(deep["source"]))
    assert again.name == deep["built"].name
    assert [p for p in text_dir.iterdir() if p.is_dir()] == [again]  # the killed build's scratch is gone
    assert (again / "model.safetensors").read_bytes() == (deep["built"] / "model.safetensors").read_bytes()
    assert (again / "quant.json").read_bytes() == (deep["built"] / "quant.json").read_bytes()


# --- the measurement ----------------------------------------------------------------


@pytest.mark.slow
def test_the_measurement_builds_each_source_format_in_a_child_and_writes_its_figures(tmp_path: Path) -> None:
    from bench import render

    out, work = tmp_path / "build_memory.json", tmp_path / "work"
    line = [sys.executable, "-m", "bench.build_memory", "--shape", "tiny", "--out", str(out), "--work", str(work)]
    done = subprocess.run(line, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["limit_bytes"] == 12 * 2**30 and result["shape_name"] == "tiny"
    assert result["shape"]["num_layers"] == SHAPES["tiny"].num_layers
    assert [r["source"] for r in result["rows"]] == ["safetensors", "gguf"]
    for row in result["rows"]:
        assert row["exit_code"] == 0 and row["within_limit"] is True
        # A real process's figures: a Python with torch takes more than 100 MiB, a tiny build less than 4 GiB.
        assert 100 * 2**20 < row["peak_rss_bytes"] < 4 * 2**30
        assert 0 < row["seconds"] < 600 and row["threads"] >= 1
        assert row["recipe"]["method"] == "awq" and row["int4_bytes"] > 0
        assert row["command"][1:4] == ["-m", "engines.text.text_build", "--engine-dir"]
        assert row["layer_seconds"]["mean"] > 0
        assert max(rss for _, rss in row["rss_timeline"]) <= row["peak_rss_bytes"]
    assert list(work.iterdir()) == []  # the sources and builds deleted
    table = render.build_memory(result)  # what docs/models.md shows of it
    for row in result["rows"]:
        assert f"| {row['source_format']} |" in table


def test_a_run_of_one_source_keeps_the_other_sources_row_of_the_same_shape(tmp_path: Path) -> None:
    from bench.build_memory import kept_rows

    out = tmp_path / "build_memory.json"
    st, gguf = {"source": "safetensors", "seconds": 1.0}, {"source": "gguf", "seconds": 2.0}
    assert kept_rows(out, "llama3-8b", [gguf]) == [gguf]  # nothing earlier
    out.write_text(json.dumps({"shape_name": "llama3-8b", "rows": [st, {"source": "gguf", "seconds": 9.0}]}))
    assert kept_rows(out, "llama3-8b", [gguf]) == [st, gguf]  # the same source's row replaced
    assert kept_rows(out, "tiny", [gguf]) == [gguf]  # another shape's rows are not this one's


def test_the_docs_say_which_source_is_not_measured_yet() -> None:
    from bench import render

    row = {"source": "safetensors", "source_format": "safetensors", "source_bytes": 2**30, "exit_code": 0}
    row |= {"peak_rss_bytes": 2**30, "within_limit": True, "seconds": 60.0, "threads": 2}
    result = {"shape_name": "llama3-8b", "parameters": 8e9, "quantization": "awq-int4", "adapter": "none"}
    result |= {"cpus": 2, "machine": "x86_64", "torch": "2", "limit_bytes": 12 * 2**30, "rows": [row]}
    assert "**Not measured at this shape yet:** the gguf source" in render.build_memory(result)
    both = result | {"rows": [row, row | {"source": "gguf"}]}
    assert "Not measured" not in render.build_memory(both)


def test_builders_of_one_output_take_turns_and_leave_nothing_beside_it(tmp_path: Path) -> None:
    """Builds of the same output from several threads: one builds, the others wait and
    find its result; the lock file goes with the last holder (a refused or finished build
    leaves only its output), and a waiter never holds a removed lock beside a new one."""
    import threading

    from engines.cache import build_cached

    out = tmp_path / "engine"
    inside = 0
    most = 0
    builds = 0
    guard = threading.Lock()

    def build(scratch: Path) -> dict[str, object]:
        nonlocal inside, most, builds
        with guard:
            inside += 1
            builds += 1
            most = max(most, inside)
        time.sleep(0.2)
        (scratch / "weights").write_bytes(b"w")
        with guard:
            inside -= 1
        return {}

    def build_together(inputs: list[dict[str, object]]) -> None:
        threads = [threading.Thread(target=build_cached, args=(out, i, build)) for i in inputs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    build_together([{"k": 1}] * 4)
    assert builds == 1 and most == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    # Other inputs: built again, one at a time, and again nothing left beside it.
    build_together([{"k": i} for i in (2, 3, 4)])
    assert most == 1 and builds == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_a_build_removes_what_killed_builds_of_other_outputs_left_unless_one_runs(tmp_path: Path) -> None:
    """A build killed under one cache key leaves its scratch directory; once the inputs
    change, no build of that output's name clears it. Any build in the folder removes
    such scratch directories of other outputs, unless a build of that output is running
    (its lock held): then it is left alone, and not waited for."""
    import fcntl

    from engines.cache import build_cached

    stale = tmp_path / ".text-clinic-awq-1234abcd.k3x9_q2z"  # as tempfile.mkdtemp names them
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    live = tmp_path / ".text-clinic-awq-5678efgh.a1b2c3d4"
    live.mkdir()
    (live / "model.safetensors").write_bytes(b"being written")
    unrelated = tmp_path / ".keep"  # not a scratch name
    unrelated.mkdir()
    with (tmp_path / ".text-clinic-awq-5678efgh.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build of that output in progress
        import threading

        build = threading.Thread(target=build_cached, args=(tmp_path / "vision-quick", {"k": 1}, lambda scratch: {}))
        build.start()
        build.join(10)
        assert not build.is_alive(), "the build waited for another output's lock"
        assert not stale.exists() and live.is_dir() and unrelated.is_dir()
        assert (live / "model.safetensors").read_bytes() == b"being written"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".keep", ".text-clinic-awq-5678efgh.a1b2c3d4", ".text-clinic-awq-5678efgh.lock", "vision-quick"]
