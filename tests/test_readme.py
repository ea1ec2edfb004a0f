"""The README's promises: its first two commands, and plots drawn from the results."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import plots as bench_plots
from tests.conftest import REPO


def test_readme_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    fence = lines.index("```sh")
    assert lines[fence + 1].startswith("./scripts/demo.sh")
    assert lines[fence + 2].startswith("./scripts/test.sh")
    assert fence < 4


def test_ci_runs_the_readme_test_command() -> None:
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_a_changed_result_makes_its_plot_stale() -> None:
    plot = next(p for p in bench_plots.PLOTS if p.name == "decode_cuda")
    results = bench_plots.load(plot)
    assert results is not None
    assert bench_plots.stored_fingerprint(plot.path) == bench_plots.fingerprint(plot, results)
    # One figure changed in the results: the committed plot no longer matches them.
    results["text_cuda.json"]["rows"][0]["decode_tok_s"] += 1.0
    assert bench_plots.stored_fingerprint(plot.path) != bench_plots.fingerprint(plot, results)


def test_plots_are_drawn_once_per_result_and_carry_their_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_plots, "PLOT_DIR", tmp_path)
    plots = tuple(p for p in bench_plots.PLOTS if p.name in ("decode_cuda", "memory_daemon"))
    assert bench_plots.stale(plots) == [str(tmp_path / "decode_cuda.png"), str(tmp_path / "memory_daemon.png")]
    assert len(bench_plots.write(plots)) == 2
    assert bench_plots.stale(plots) == []
    assert bench_plots.write(plots) == []  # unchanged results: nothing redrawn
    from PIL import Image

    with Image.open(tmp_path / "decode_cuda.png") as image:
        assert image.format == "PNG" and image.size == (1200, 280)
        assert "Software" not in getattr(image, "text", {})
