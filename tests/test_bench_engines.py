"""Benchmarks and evaluations measure the text engine the daemon builds: a bench module
that builds a text model by hand (a checkpoint loaded, a batcher or a random model
assembled outside `TextEngine.load`) fails here, unless it is listed below as still to be
moved onto the engine. The list only shrinks; the engine's own figures say what they ran
(`engine_config`, `served`)."""

from __future__ import annotations

import ast

from bench.common import REPO
from bench.text_engines import is_served

BUILDERS = frozenset({"load_checkpoint", "ContinuousBatcher", "random_int4_llama", "LlamaModel", "GraphDecoder"})

# (module, function): built by hand still, each to be moved onto the engine (issue: "One
# text engine"): the CUDA text benchmark's rows, the KV benchmark, the scheduler's
# random-weight CUDA model, the quality evaluation's perplexity over checkpoints.
NOT_YET = frozenset(
    {
        ("eval_text_quality", "token_tables"),
        ("eval_text_quality", "main"),
        ("kv", "continuations"),
        ("kv", "chunked_prefill"),
        ("kv", "decode_4k"),
        ("kv", "offload_figures"),
        ("kv", "prefix_ttft"),
        ("kv", "run_cuda"),
        ("kv", "main"),
        ("scheduler", "build_text_cuda"),
        ("scheduler", "load"),
        ("text", "ours_cuda"),
        ("text", "single_sequence"),
        ("text", "batched"),
        ("text", "check_cuda"),
    }
)


def _hand_built() -> set[tuple[str, str]]:
    found = set()
    for path in sorted((REPO / "bench").glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    if name in BUILDERS:
                        found.add((path.stem, fn.name))
    return found


def test_no_benchmark_builds_a_text_model_by_hand_beyond_the_list() -> None:
    built = _hand_built()
    assert built <= NOT_YET, f"text models built outside TextEngine.load: {sorted(built - NOT_YET)}"
    # A function moved onto the engine leaves the list with it.
    assert NOT_YET <= built, f"listed but no longer built by hand (take them off): {sorted(NOT_YET - built)}"


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


def test_the_served_engine_records_its_profile() -> None:
    """The engine a benchmark loads says where its section came from and what changed."""
    from bench.text_engines import section

    cfg, origin = section("cpu", max_context_tokens=256)
    assert cfg.device == "cpu" and cfg.max_context_tokens == 256
    assert origin == {"profile": "cpu-dev", "changed": {"max_context_tokens": 256}}
