"""The documentation pages and the rule their figures follow.

Every page is README.md or a Markdown file under docs/. A figure on a page is either
rendered from bench/results/ (between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`,
written by `python -m bench.render`) or its line names where it comes from: a results file
(`bench/results/...`), a file of the repository (`tests/test_budget.py`,
`edge/config/text.py`: a test that shows it, the code that sets it) or a web address.
`unsourced_figures` finds the ones that do neither; the tests fail on any.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO

DOCS = REPO / "docs"

# A number with a unit a measurement or a size carries: 451 tok/s, 7.3 GiB, 18 ms, 95%,
# 1.06x. Times in plain seconds and minutes count too ("under two minutes" is words).
_UNIT = r"(?:tok/s|tokens/s|ms|µs|us|ns|s|min|h|GiB|MiB|KiB|GB|MB|kB|KB|TB/s|GB/s|%|W|mW|°C|Hz|kHz|MHz|GHz)"
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?" + _UNIT + r"(?![\w/])|x(?![\w/]))")
# Where a figure comes from, named on its line.
SOURCE = re.compile(r"bench/results/|https?://|`[\w.-]+/[\w./-]*\.(?:py|json|yaml|yml|conf|sh|toml|service|md)`")
_CODE_SPAN = re.compile(r"`[^`]*`")
_OPEN = re.compile(r"<!-- bench:(\w+) -->")
_CLOSE = re.compile(r"<!-- /bench:(\w+) -->")


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(text: str) -> list[str]:
    """The names of the rendered blocks a page holds, in order."""
    return _OPEN.findall(text)


@dataclass(frozen=True)
class Unsourced:
    line: int
    figure: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.figure!r} in {self.text.strip()[:120]!r}"


def unsourced_figures(text: str) -> list[Unsourced]:
    """Figures outside rendered blocks and code whose line names no source."""
    found: list[Unsourced] = []
    rendered = fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if _OPEN.search(line):
            rendered = True
            continue
        if _CLOSE.search(line):
            rendered = False
            continue
        if rendered or fenced or SOURCE.search(line):
            continue
        prose = _CODE_SPAN.sub(" ", line)
        found += [Unsourced(number, m.group(0), line) for m in FIGURE.finditer(prose)]
    return found
