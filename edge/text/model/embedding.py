"""The token table kept compact: codes with a scale per group, only the rows asked for
turned back into floats.

A step reads one row of the table per sequence, so the table's size is pure residency:
an 8B model's 128256 x 4096 bfloat16 table holds 0.98 GiB for the few kilobytes a step
uses. On a Jetson that memory is the same DRAM the weights and the KV cache need.

- "int8": symmetric 8-bit codes, one float16 scale per 64 values (1.03 bytes a value,
  0.52x the bfloat16 table). The rounding error is under 0.4% of each group's largest
  value: below what the bfloat16 activations already carry.
- "int4": symmetric 4-bit codes, one float16 scale per 32 values, two codes a byte
  (0.5625 bytes a value, the size of llama.cpp's Q4_0 table; 0.28x the bfloat16 one).

The lookup is a gather of codes and scales and one multiply: no kernel of its own, so it
runs on every device and inside a captured CUDA graph.
"""

from __future__ import annotations

import copy
import logging
from typing import Literal

import torch
from torch import nn

logger = logging.getLogger(__name__)

EmbeddingFormat = Literal["float", "int8", "int4"]
GROUPS = {"int8": 64, "int4": 32}
LEVELS = {"int8": 127, "int4": 7}
# The float32 working copy of the table's rows compacted at once (16 MiB: 1024 rows of
# an 8B model's 4096).
SLAB_BYTES = 16 << 20


class QuantizedEmbedding(nn.Module):
    """An embedding table of `fmt` codes ("int8" or "int4"); `forward(ids)` gives the rows
    in `dtype`, as nn.Embedding would."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, fmt: Literal["int8", "int4"], device: torch.device | str | None = None
    ) -> None:
        """The codes are made and kept on `device` (default: the table's): a table on the
        host reaches it a slab of rows at a time, never whole."""
        super().__init__()
        vocab, hidden = weight.shape
        group = GROUPS[fmt]
        if hidden % group:
            raise ValueError(f"an {fmt} token table needs a width divisible by {group}, got {hidden}")
        device = weight.device if device is None else torch.device(device)
        self.fmt = fmt
        self.group = group
        self.num_embeddings, self.embedding_dim = vocab, hidden
        self.dtype = weight.dtype
        levels = LEVELS[fmt]
        width = hidden if fmt == "int8" else hidden // 2
        codes = torch.empty(vocab, width, dtype=torch.int8, device=device)
        scales = torch.empty(vocab, hidden // group, dtype=torch.float16, device=device)
        # A slice of rows at a time: a float32 working copy of a whole 8B table would be
        # twice the table being replaced. A slice's copies (float32, quotient, rounded)
        # are about three of SLAB_BYTES at once.
        step = max(1, SLAB_BYTES // (hidden * 4))
        for start in range(0, vocab, step):
            rows = weight[start : start + step].to(device).float().view(-1, hidden // group, group)
            scale = (rows.abs().amax(dim=-1) / levels).clamp_min(torch.finfo(torch.float16).tiny)
            scale = scale.to(torch.float16)  # rounded first: the codes are for the scale stored
            q = torch.round(rows / scale.float().unsqueeze(-1)).clamp_(-levels, levels).view(rows.shape[0], hidden)
            if fmt == "int4":
                # Two codes a byte, offset to 1..15: value 2j in the low nibble, 2j+1 in the high.
                u = (q + 8).to(torch.uint8).view(-1, hidden // 2, 2)
                q = (u[..., 0] | (u[..., 1] << 4)).view(torch.int8)
            codes[start : start + step] = q.to(torch.int8)
            scales[start : start + step] = scale
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def with_dtype(self, dtype: torch.dtype) -> QuantizedEmbedding:
        """The same codes and scales (shared, not copied), their rows given in `dtype`."""
        twin = copy.copy(self)
        twin._buffers = dict(self._buffers)  # its own buffer table, the same tensors
        twin.dtype = dtype
        return twin

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        codes = self.codes.index_select(0, flat)
        if self.fmt == "int4":
            u = codes.view(torch.uint8)
            codes = torch.stack(((u & 15), (u >> 4)), dim=-1).view(flat.numel(), -1).to(torch.int8) - 8
        scales = self.scales.index_select(0, flat).float()
        rows = codes.view(flat.numel(), -1, self.group).float() * scales.unsqueeze(-1)
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}, group={self.group}"


def compact_embedding(model: nn.Module, fmt: EmbeddingFormat, device: torch.device | str | None = None) -> int:
    """Replace `model.embed_tokens` by its `fmt` form, made on `device` (default: the
    table's; the loader keeps the float table on the host and makes the compact one on
    its device); returns the bytes saved (0 for "float", or where the table is also the
    output projection's weight: a tied float lm_head still reads the whole table every
    step, so compacting a copy would add memory, not save it)."""
    table = model.embed_tokens
    if fmt == "float" or not isinstance(table, nn.Embedding):
        return 0
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.weight is table.weight:
        logger.info("token table left in float: it is also the float output projection's weight")
        return 0
    before = table.weight.numel() * table.weight.element_size()
    compact = QuantizedEmbedding(table.weight.detach(), fmt, device)
    model.embed_tokens = compact
    saved = before - compact.nbytes
    logger.info("token table as %s: %.0f MiB (saves %.0f MiB)", fmt, compact.nbytes / 2**20, saved / 2**20)
    return saved
