#!/usr/bin/env bash
# Set up (including test tools) and run the checks CI runs: lint, types, tests.
# Extra arguments go to pytest, e.g. scripts/test.sh -k ocr
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
# The suite starts hundreds of Python processes (daemons, edgectl, builds); where the
# environment says not to write byte code, each would compile what it imports from source
# again (torch alone: 3 s of CPU). Written once here, on first import.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy edge engines scripts bench tests samples
.venv/bin/lint-imports
# Two test processes (EDGE_TEST_WORKERS; 0 runs in this one), each taking whole files, so
# a module's daemon and fixtures stay in one process; files in the order tests/conftest.py
# gives them (the longest first), not xdist's (most tests first).
.venv/bin/python -m pytest -m "not gpu and not jetson" -n "${EDGE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
