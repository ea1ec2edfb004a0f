"""The README's promises: its first two commands, and figures that come from results."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_readme_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    fence = lines.index("```sh")
    assert lines[fence + 1].startswith("./scripts/demo.sh")
    assert lines[fence + 2].startswith("./scripts/test.sh")
    assert fence < 4


def test_ci_runs_the_readme_test_command() -> None:
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_benchmark_tables_match_the_results() -> None:
    res = subprocess.run(
        [sys.executable, "scripts/render_bench.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout
