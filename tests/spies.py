"""Watching what a model runs, for tests that assert which prefills a batcher made."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from edge.text.model.llama import LlamaModel
from edge.text.model.splice import Splice


@contextmanager
def prefills_run(model: LlamaModel) -> Iterator[list[tuple[int, int]]]:
    """(start, tokens) of each forward pass `model` runs inside the block, in order."""
    runs: list[tuple[int, int]] = []
    forward = model.forward

    def recording(
        ids: torch.Tensor, cache: object, start: int, last_only: bool = True, splices: Sequence[Splice] = ()
    ) -> torch.Tensor:
        runs.append((start, ids.shape[1]))
        return forward(ids, cache, start, last_only, splices)  # type: ignore[arg-type]

    model.forward = recording  # type: ignore[method-assign]
    try:
        yield runs
    finally:
        model.forward = forward  # type: ignore[method-assign]
