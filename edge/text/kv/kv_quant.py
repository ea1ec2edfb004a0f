"""Quantized KV-cache formats: how keys and values are stored as int8 or int4 codes.

Keys and values differ in where their outliers sit, so they are scaled differently
(as KIVI and QServe's KV4 found):
- keys have a few large channels, the same ones at every token: a key's scale is per
  channel, over a block of consecutive tokens. A block is quantized once it is full;
  until then its tokens stay float16.
- values have no such channels: a value's scale is per token (per group of channels for
  int4).
int4 also keeps the most recent `window` tokens in float16: the tokens attention weighs
most are the ones it reads exactly.

This module is the formats' reference: packing, unpacking and their sizes, in torch. It
is what the bench measures quality and capacity with, and what kernels reading these
codes are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVDtype = Literal["float16", "int8", "int4"]
SCALE_DTYPE = torch.float16
SYM4_ZERO = 8  # symmetric int4 codes c stand for (c - 8) x scale


@dataclass(frozen=True)
class KVFormat:
    dtype: KVDtype
    key_block: int = 64  # tokens sharing a key scale per channel
    value_group: int = 0  # channels sharing a value scale (0, or more than a head: the whole head)
    window: int = 0  # most recent tokens kept in float16
    # int4 values: codes for -7..7 steps around zero (no zero point stored) instead of
    # 0..15 steps from the minimum. A value's range is roughly centred on zero, and a token's zero point
    # costs as many bytes as its scale.
    value_symmetric: bool = False
    # The first `sink` tokens kept float as well, and left out of their key block's
    # scales: attention leans on a sequence's first tokens whatever follows (the
    # "attention sink"), and their keys are outliers that would set the first block's
    # scales for every channel.
    sink: int = 0

    def group(self, head_dim: int) -> int:
        """Channels sharing a value scale in heads of `head_dim` channels."""
        return min(self.value_group or head_dim, head_dim)

    def float_tokens(self, length: int) -> int:
        """Of a sequence's first `length` tokens, how many (the newest) are float16: the
        window, and the key block not yet full."""
        if self.dtype == "float16":
            return length
        old = max(0, length - self.window)
        return length - old // self.key_block * self.key_block

    def coded(self, length: int) -> int:
        """Of a served row's first `length` tokens, how many (the oldest) are held as
        codes. A key block is coded at the step after its last token leaves the window
        (the step's new token writes first, the block is read from the float ring after),
        so one token later than float_tokens says; a multiple of key_block."""
        if self.dtype == "float16":
            return 0
        return max(0, length - 1 - self.window) // self.key_block * self.key_block

    @property
    def ring(self) -> int:
        """Float slots a served row needs for its uncoded tokens: the window, a key block
        and the new token (position t in slot t % ring)."""
        return self.window + self.key_block + 1


FORMATS: dict[KVDtype, KVFormat] = {
    "float16": KVFormat("float16"),
    "int8": KVFormat("int8", key_block=64),
    # Chosen on the real model (bench/kv.py): Δppl under 0.5% and over 3.5x the
    # tokens of float16 in the same bytes.
    "int4": KVFormat("int4", key_block=64, value_group=64, window=32, value_symmetric=True, sink=4),
}


@dataclass
class Codes:
    """Whole key blocks of keys and values [..., T, D] as codes: keys' scales (and int4
    zero points) [..., T / key_block, D], values' [..., T, groups]; int4 codes packed."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor | None
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor | None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if t is not None]


@dataclass
class QuantizedKV:
    """One head's (or a stack of heads') keys and values [..., T, D] in a format: the
    oldest `quantized` tokens as codes and scales, the rest float16."""

    fmt: KVFormat
    quantized: int
    codes: Codes | None  # None for float16, or with nothing old enough to code
    k_float: torch.Tensor
    v_float: torch.Tensor
    sink_k: torch.Tensor | None = None  # the first fmt.sink tokens, float16, once coded
    sink_v: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        parts = [self.k_float, self.v_float, *(self.codes.tensors if self.codes is not None else [])]
        parts += [t for t in (self.sink_k, self.sink_v) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)


def without_sink(k: torch.Tensor, sink: int) -> torch.Tensor:
    """Keys [..., T, D] of positions 0.. with the first `sink` replaced by the next one's,
    so that a block's scales are its other tokens' (the sink tokens are read float)."""
    if not sink or k.shape[-2] <= sink:
        return k
    out = k.clone()
    out[..., :sink, :] = k[..., sink : sink + 1, :]
    return out


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., D] -> two per byte [..., D/2] (low nibble first)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def _round(x: torch.Tensor) -> torch.Tensor:
    """To the nearest integer, halves up: what the CUDA kernels compute too (torch.round
    takes halves to even), so a code is the same whichever device wrote it."""
    return torch.floor(x + 0.5)


def _symmetric(x: torch.Tensor, dim: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax(dim=dim, keepdim=True) / qmax).to(SCALE_DTYPE)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    codes = torch.clamp(_round(x.float() / safe), -qmax, qmax).to(torch.int8)
    return codes, scale


def _symmetric4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes c = 1..15 standing for (c - 8) times the scale (absmax / 7): symmetric
    about zero, which is exact, with no zero point stored."""
    codes, scale = _symmetric(x, dim, 7)
    return (codes + SYM4_ZERO).to(torch.uint8), scale


def _asymmetric(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low = x.amin(dim=dim, keepdim=True).to(SCALE_DTYPE)
    scale = ((x.amax(dim=dim, keepdim=True) - low.float()) / (levels - 1)).to(SCALE_DTYPE)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    codes = torch.clamp(_round((x.float() - low.float()) / safe), 0, levels - 1).to(torch.uint8)
    return codes, scale, low


def code(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat, first_block: bool) -> Codes:
    """Code keys and values [..., T, D] (T a multiple of the key block) in `fmt`;
    `first_block`: they start at position 0, so the sink tokens are left out of the first
    block's scales."""
    *lead, n, dim = k.shape
    if first_block:
        k = without_sink(k, fmt.sink)
    blocks = k.float().reshape(*lead, n // fmt.key_block, fmt.key_block, dim)
    group = fmt.group(dim)
    groups = v.float().reshape(*lead, n, dim // group, group)
    k_zero = v_zero = None
    if fmt.dtype == "int8":
        kc, k_scale = _symmetric(blocks, -2, 127)
        vc, v_scale = _symmetric(groups, -1, 127)
        k_codes, v_codes = kc.reshape(k.shape), vc.reshape(v.shape)
    else:
        kc, k_scale, kz = _asymmetric(blocks, -2, 16)
        k_zero = kz.squeeze(-2)
        if fmt.value_symmetric:
            vc, v_scale = _symmetric4(groups, -1)
        else:
            vc, v_scale, vz = _asymmetric(groups, -1, 16)
            v_zero = vz.squeeze(-1)
        k_codes, v_codes = _pack4(kc.reshape(k.shape)), _pack4(vc.reshape(v.shape))
    return Codes(k_codes, k_scale.squeeze(-2), k_zero, v_codes, v_scale.squeeze(-1), v_zero)


def quantize(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat) -> QuantizedKV:
    """Keys and values [..., T, D] (any float dtype) of tokens 0..T-1 into `fmt`."""
    length, dim = k.shape[-2], k.shape[-1]
    if fmt.dtype != "float16" and dim % 2:
        raise ValueError(f"head size {dim} must be even for packed codes")
    if dim % fmt.group(dim):
        raise ValueError(f"head size {dim} is not a multiple of the value group {fmt.value_group}")
    old = length - fmt.float_tokens(length)
    coded = None if fmt.dtype == "float16" else code(k[..., :old, :], v[..., :old, :], fmt, first_block=True)
    sink = min(fmt.sink, old)
    return QuantizedKV(
        fmt,
        old,
        coded,
        k[..., old:, :].to(torch.float16),
        v[..., old:, :].to(torch.float16),
        k[..., :sink, :].to(torch.float16) if sink else None,
        v[..., :sink, :].to(torch.float16) if sink else None,
    )


def dequantize(q: QuantizedKV, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [..., T, D] back in `dtype` (the reference kernels are checked
    against; attention kernels read the codes themselves)."""
    fmt, old, codes = q.fmt, q.quantized, q.codes
    if old == 0 or codes is None:
        return q.k_float.to(dtype), q.v_float.to(dtype)
    dim = q.k_float.shape[-1]
    lead = q.k_float.shape[:-2]
    group = fmt.group(dim)
    if fmt.dtype == "int8":
        kc, vc = codes.k_codes.float(), codes.v_codes.float()
    else:
        kc, vc = _unpack4(codes.k_codes).float(), _unpack4(codes.v_codes).float()
    kb = kc.reshape(*lead, old // fmt.key_block, fmt.key_block, dim)
    vg = vc.reshape(*lead, old, dim // group, group)
    if fmt.dtype == "int4" and fmt.value_symmetric:
        vg = vg - SYM4_ZERO
    k = kb * codes.k_scale.float().unsqueeze(-2)
    v = vg * codes.v_scale.float().unsqueeze(-1)
    if codes.k_zero is not None:
        k = k + codes.k_zero.float().unsqueeze(-2)
    if codes.v_zero is not None:
        v = v + codes.v_zero.float().unsqueeze(-1)
    k, v = k.reshape(*lead, old, dim), v.reshape(*lead, old, dim)
    if q.sink_k is not None and q.sink_v is not None:
        sink = q.sink_k.shape[-2]
        k[..., :sink, :], v[..., :sink, :] = q.sink_k.float(), q.sink_v.float()
    k = torch.cat([k, q.k_float.float()], dim=-2)
    v = torch.cat([v, q.v_float.float()], dim=-2)
    return k.to(dtype), v.to(dtype)


def bytes_per_token(fmt: KVFormat, layers: int, kv_heads: int, head_dim: int) -> float:
    """Bytes a token past the window costs in `fmt`, scales included, all layers."""
    per_head = {
        "float16": 2 * 2 * head_dim,
        "int8": 2 * head_dim + 2 * head_dim / fmt.key_block + 2 * (head_dim // fmt.group(head_dim)),
        "int4": head_dim
        + 4 * head_dim / fmt.key_block
        + (2 if fmt.value_symmetric else 4) * (head_dim // fmt.group(head_dim)),
    }[fmt.dtype]
    return float(per_head * layers * kv_heads)
