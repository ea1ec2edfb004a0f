"""The benchmark and evaluation scripts, run from the repository root as
`python -m bench.<name>` (e.g. `python -m bench.text cpu`); what they write goes to
bench/results/, and `python -m bench.render` turns that into the tables and plots of
README.md and docs/. bench/common.py holds what they share (also used by the tests and the demo)."""

import edge  # noqa: F401  (edge's process settings, set before any script imports torch)
