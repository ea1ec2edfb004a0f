#!/usr/bin/env bash
# Set up, then run the demo: broker (if none runs), daemon with profiles/cpu-dev.yaml,
# sample OCR and Q&A jobs, `edgectl status`, and a clean stop of what it started.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m scripts.demo "$@"
