"""Benchmarks and evaluations measure the text engine the daemon builds: a bench module
that builds a text model by hand (a checkpoint loaded, a batcher, graphs or a random
model assembled outside `TextEngine.load`), or loads an engine other than through
bench/text_engines.py (which records the profile and the fields changed), fails here.
The engine's own figures say what they ran (`engine_config`, `served`)."""

from __future__ import annotations

import ast

from bench.common import REPO
from bench.text_engines import is_served, served_cpu_kernel
from engines.text.random_llama import LLAMA3_8B

BUILDERS = frozenset(
    {"load_checkpoint", "ContinuousBatcher", "random_int4_llama", "LlamaModel", "GraphDecoder", "StepGraphs",
     "PrefillGraphs"}
)  # fmt: skip


def _built_by_hand(stem: str, source: str) -> set[str]:
    """The functions of a bench module that build a text model other than through
    load_engine (only text_engines itself calls TextEngine.load)."""
    found = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            engine_load = (
                isinstance(f, ast.Attribute)
                and f.attr == "load"
                and isinstance(f.value, ast.Name)
                and f.value.id == "TextEngine"
            )
            if name in BUILDERS or (engine_load and stem != "text_engines"):
                found.add(fn.name)
    return found


def test_no_benchmark_builds_a_text_model_by_hand() -> None:
    built = {
        (path.stem, name)
        for path in sorted((REPO / "bench").glob("*.py"))
        for name in _built_by_hand(path.stem, path.read_text(encoding="utf-8"))
    }
    assert built == set(), "text models built outside bench/text_engines.py's load_engine"


def test_the_check_finds_a_model_built_by_hand() -> None:
    source = (
        "def loads(p):\n    return load_checkpoint(p)\n\n"
        "def batcher(m):\n    return ContinuousBatcher(m, None, frozenset(), 1, 64)\n\n"
        "def engine(p, c):\n    return TextEngine.load(p, c)\n\n"
        "def through(p):\n    return load_engine(p, 'cpu')\n"
    )
    assert _built_by_hand("kv", source) == {"loads", "batcher", "engine"}
    assert _built_by_hand("text_engines", source) == {"loads", "batcher"}


def test_a_row_is_served_only_from_the_shipped_profile_with_neutral_changes() -> None:
    served = {
        "device": "cuda",
        "group_size": 32,
        "origin": {"profile": "gpu-dev", "changed": {"engine": "/x", "max_context_tokens": 4608}},
    }
    assert is_served(served)
    assert not is_served({**served, "origin": {"profile": "gpu-dev", "changed": {"dtype": "bfloat16"}}})
    assert not is_served({**served, "group_size": 128})
    assert not is_served({**served, "origin": {"profile": "cpu-dev", "changed": {}}})
    assert not is_served({"device": "cuda", "group_size": 32})
    # On the CPU, only the kernel the shipped profile names.
    cpu = {**served, "device": "cpu", "origin": {"profile": "cpu-dev", "changed": {}}}
    assert is_served({**cpu, "kernel": served_cpu_kernel()})
    assert not is_served({**cpu, "kernel": "cpu"})
    # An 8B model is built at group 128 (text_build.serving_group): its served row too.
    large = {**served, "parameters": LLAMA3_8B.parameter_count()}
    assert not is_served(large)
    assert is_served({**large, "group_size": 128})


def test_the_served_engine_records_its_profile() -> None:
    """The engine a benchmark loads says where its section came from and what changed."""
    from bench.text_engines import section

    cfg, origin = section("cpu", max_context_tokens=256)
    assert cfg.device == "cpu" and cfg.max_context_tokens == 256
    assert origin == {"profile": "cpu-dev", "changed": {"max_context_tokens": 256}}


def _rows(node: object) -> list[dict]:  # type: ignore[type-arg]
    """Every figure row of a result (a dict carrying `engine_config`), however nested."""
    if isinstance(node, dict):
        own = [node] if isinstance(node.get("engine_config"), dict) else []
        return own + [r for v in node.values() for r in _rows(v)]
    if isinstance(node, list):
        return [r for v in node for r in _rows(v)]
    return []


def test_every_committed_row_called_served_is_what_the_profiles_serve_today() -> None:
    """A figure measured before a shipped profile changed (its CPU kernel, say) is not
    the served configuration's any more: it must be measured again, not called served."""
    import json

    stale = [
        (path.name, row.get("name", ""))
        for path in sorted((REPO / "bench" / "results").glob("*.json"))
        for row in _rows(json.loads(path.read_text(encoding="utf-8")))
        if row.get("served") and not is_served(row["engine_config"])
    ]
    assert stale == []
