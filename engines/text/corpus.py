"""Real English text that ships with Python itself, split into disjoint parts.

The Python reference manual's topics (`pydoc_data.topics`) are ~460 kB of prose and
examples available offline on every machine. Calibration and evaluation use disjoint
topics, so quality is never measured on text the quantizer saw.
"""

from __future__ import annotations

import hashlib
from pydoc_data.topics import topics


def _split(part: str) -> list[str]:
    keys = sorted(topics)
    # A stable hash decides the side, so adding topics in a new Python moves nothing.
    chosen = [k for k in keys if (hashlib.sha256(k.encode()).digest()[0] % 4 == 0) == (part == "eval")]
    return [topics[k] for k in chosen]


def calibration_text() -> str:
    return "\n\n".join(_split("calib"))


def evaluation_text() -> str:
    return "\n\n".join(_split("eval"))


def corpus_fingerprint() -> str:
    blob = "\x00".join(f"{k}\x01{topics[k]}" for k in sorted(topics)).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
