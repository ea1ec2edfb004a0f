"""The documentation as a whole: a short README that links one page per need, a
configuration page generated from the schema, links that lead somewhere, and no figure
written by hand (bench/pages.py says what counts as one and as its source)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import pages, plots
from bench import render as bench_render
from scripts import config_reference
from tests.conftest import REPO

README_MAX_LINES = 250
NEEDS = (
    "getting-started.md",
    "jetson.md",
    "production.md",
    "operations.md",
    "guarantees.md",
    "protocol.md",
    "configuration.md",
    "models.md",
    "inspection-parts.md",
    "retrieval.md",
    "gpu.md",
    "tensorrt.md",
    "benchmarks.md",
    "verification.md",
    "design/text-runtime.md",
    "design/kv-cache.md",
    "design/scheduler.md",
    "design/vision.md",
    "development.md",
)
# Pages generated from code and checked against it: their figures are the code's.
GENERATED = {REPO / "docs" / "configuration.md"}
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_links_a_page_for_each_need() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for page in NEEDS:
        assert (REPO / "docs" / page).is_file(), page
        assert f"](docs/{page}" in readme, f"README does not link docs/{page}"


def test_the_configuration_page_is_the_schemas_own() -> None:
    assert (REPO / "docs" / "configuration.md").read_text() == config_reference.render()
    res = subprocess.run(
        [sys.executable, "-m", "scripts.config_reference", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout


def test_every_profile_field_is_on_the_configuration_page() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    from edge.config.text import QAModelConfig

    for name in QAModelConfig.model_fields:
        assert f"| `{name}` |" in page, name
    assert "## `models.qa`" in page and "## `broker.tls`" in page


def test_no_page_holds_a_figure_without_its_source() -> None:
    unsourced = {
        str(page.relative_to(REPO)): [str(u) for u in pages.unsourced_figures(page.read_text())]
        for page in pages.pages()
        if page not in GENERATED
    }
    assert not {k: v for k, v in unsourced.items() if v}


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("The daemon decodes at 451 tok/s on the H200.", ["451 tok/s"]),
        ("Its peak was 7.29 GiB, 1.06x its bare loop, 95% of the time.", ["7.29 GiB", "1.06x", "95%"]),
        ("It took 18 ms.", ["18 ms"]),
        ("Its peak was 7.29 GiB (`bench/results/daemon_cuda.json`).", []),
        ("2,000 jobs (`tests/test_budget.py`) within 8 GiB.", []),
        ("Run `edgectl status` every 30 s", ["30 s"]),
        ("A 2448x2048 camera, SmolLM2-135M, 5 MP, 2 cores.", []),
        ("`--timeout 300s` in code", []),
    ],
)
def test_a_figure_counts_as_sourced_only_when_its_line_names_a_source(line: str, found: list[str]) -> None:
    assert [u.figure for u in pages.unsourced_figures(line)] == found


def test_figures_inside_rendered_blocks_and_code_need_no_source() -> None:
    text = "<!-- bench:rag -->\n| 451 tok/s |\n<!-- /bench:rag -->\n```sh\nsleep 5 s\n```\nthen 3 ms\n"
    assert [(u.line, u.figure) for u in pages.unsourced_figures(text)] == [(7, "3 ms")]


def test_every_docs_page_is_rendered_and_checked(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "bench.render", "--check"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    # A table on a docs page, changed by hand, is what the check finds.
    page = REPO / "docs" / "benchmarks.md"
    text = page.read_text()
    assert pages.blocks(text), "docs/benchmarks.md renders no table"
    name = pages.blocks(text)[0]
    tampered = re.sub(rf"(<!-- bench:{name} -->\n)", r"\1| a figure by hand |\n", text, count=1)
    assert bench_render.render(tampered) == text


def test_every_table_and_plot_is_on_the_benchmarks_page() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    rendered = set(pages.blocks(text))
    assert set(bench_render.TABLES) <= rendered, set(bench_render.TABLES) - rendered
    for plot in plots.PLOTS:
        assert f"](plots/{plot.name}.png)" in text, plot.name
        assert plot.path.exists(), plot.path
    # Heat maps of a profile document: their blocks link them where the document exists.
    assert set(bench_render.MAPS) <= rendered, set(bench_render.MAPS) - rendered


def test_links_between_pages_lead_to_files_that_exist() -> None:
    broken = []
    for page in pages.pages():
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_the_attention_table_keeps_the_split_rules_tried_apart() -> None:
    """Rows timed at another spread (bench.attention_kernels --spreads) are listed under
    their own table with the served one marked, never as the kernel's row against Triton."""
    row = {"kernels": "cuda", "kv_dtype": "float16", "context": 4096, "kernel": "mma"}
    doc = {
        "device": "GPU",
        "cuda_arch": "compute_80",
        "shape": {"heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 32},
        "rows": [
            {**row, "us_per_layer": 12.0, "splits": 16, "chunk": 256},
            {**row, "us_per_layer": 12.5, "splits": 16, "chunk": 256, "spread": 1, "served": True},
            {**row, "us_per_layer": 14.5, "splits": 64, "chunk": 64, "spread": 4, "served": False},
            {"kernels": "triton", "kv_dtype": "float16", "context": 4096, "us_per_layer": 12.6},
        ],
    }
    text = bench_render.attention_kernels(doc)
    main, _, tried = text.partition("blocks an SM (`--spreads`")
    assert tried
    assert "| float16 | 4096 | 12.00 | 12.60 | 1.05x | 16 x 256 | mma |" in main
    assert "14.50" not in main and "12.50" not in main
    assert "| float16 | 4096 | 1 (served) | 16 x 256 | 12.50 |" in tried
    assert "| float16 | 4096 | 4 | 64 x 64 | 14.50 |" in tried
