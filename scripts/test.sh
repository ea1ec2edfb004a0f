#!/usr/bin/env bash
# Set up (including test tools) and run the checks CI runs: lint, types, tests.
# Extra arguments go to pytest, e.g. scripts/test.sh -k ocr
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy edge engines scripts tests
.venv/bin/python -m pytest -m "not gpu and not jetson" --durations=15 "$@"
