#!/usr/bin/env python3
"""`edgectl verify` as a benchmark record: every model through every backend on this
box against its reference, written to bench/results/verify_<cpu|cuda>.json (the same
object `edgectl verify --json` prints) and printed as a table.

    python -m bench.verify_backends --profile profiles/gpu-dev.yaml [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common import RESULTS, write_json
from edge.config.loader import load_profile
from edge.verify import render, verify


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--out", type=Path, help="default: bench/results/verify_cuda.json on a GPU, else _cpu")
    args = parser.parse_args()
    doc = verify(load_profile(args.profile))
    doc["profile"] = args.profile.name
    out = args.out or RESULTS / f"verify_{'cuda' if doc['gpu'] else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    print(render(doc))
    print(f"written to {out}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
