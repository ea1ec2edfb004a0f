#!/usr/bin/env python3
"""Write samples/parts: one generated part image per inspection class, with its truth.

    python -m scripts.make_parts

The images come from the same generator the student is trained on, from a seed and
split the builds never use (seed 1000, test split), so they are held out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import cv2

from engines.vision.factory_data import CLASSES, make_sample

REPO = Path(__file__).resolve().parents[1]

SEED = 1000


def main() -> int:
    out = REPO / "samples" / "parts"
    out.mkdir(parents=True, exist_ok=True)
    truth = []
    for index in range(len(CLASSES)):
        sample = make_sample(SEED, "test", index)
        name = f"part_{index:02d}_{CLASSES[sample.label]}.png"
        cv2.imwrite(str(out / name), cv2.cvtColor(sample.image, cv2.COLOR_RGB2BGR))
        truth.append({"name": name, "class": CLASSES[sample.label], "serial": sample.serial})
    (out / "parts.json").write_text(json.dumps(truth, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {len(truth)} part images to {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
