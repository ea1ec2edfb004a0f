"""Rows spliced into a prompt in place of its tokens' embeddings: how a prompt carries an
image (its features, projected into the language model's width, at the positions of its
image tokens; edge/vlm builds them).

The prompt keeps a token id at every position (the image token's, repeated), so
everything that counts, caches or drafts by ids goes on as before; only the prefill
reads the rows instead of the token table there. The rows are the residual stream's
input as it is: a family's embedding scale (Gemma's) applies to the token table's rows,
not to these, as transformers has it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Splice:
    at: int  # the prompt position of its first row
    rows: torch.Tensor  # [n, hidden]: the input of positions at .. at + n - 1

    @property
    def end(self) -> int:
        return self.at + int(self.rows.shape[0])


def first_spliced(splices: Sequence[Splice]) -> int | None:
    """The first position a splice covers (None: none does): the rows before it are the
    token table's own, so a prefix kept by ids alone is valid up to there."""
    return min((s.at for s in splices), default=None)


def apply_splices(x: torch.Tensor, splices: Sequence[Splice], start: int) -> torch.Tensor:
    """`x` [1, T, hidden], the embeddings of positions start .. start + T - 1, with every
    splice's rows written over the positions it shares with them (in place)."""
    if not splices:
        return x
    if x.shape[0] != 1:
        raise ValueError(f"spliced rows go into one sequence's prefill, not a batch of {x.shape[0]}")
    end = start + x.shape[1]
    for splice in splices:
        lo, hi = max(start, splice.at), min(end, splice.end)
        if lo < hi:
            x[0, lo - start : hi - start] = splice.rows[lo - splice.at : hi - splice.at].to(x.device, x.dtype)
    return x
