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


@dataclass(frozen=True)
class KVFormat:
    dtype: KVDtype
    key_block: int = 64  # tokens sharing a key scale per channel
    value_group: int = 0  # channels sharing a value scale (0: the whole head)
    window: int = 0  # most recent tokens kept in float16

    def float_tokens(self, length: int) -> int:
        """Of a sequence's first `length` tokens, how many (the newest) are float16: the
        window, and the key block not yet full."""
        if self.dtype == "float16":
            return length
        old = max(0, length - self.window)
        return length - old // self.key_block * self.key_block


FORMATS: dict[KVDtype, KVFormat] = {
    "float16": KVFormat("float16"),
    "int8": KVFormat("int8", key_block=64),
    "int4": KVFormat("int4", key_block=32, value_group=32, window=128),
}


@dataclass
class QuantizedKV:
    """One head's (or a stack of heads') keys and values [..., T, D] in a format: the
    oldest `quantized` tokens as codes and scales, the rest float16."""

    fmt: KVFormat
    quantized: int
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor | None
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor | None
    k_float: torch.Tensor
    v_float: torch.Tensor

    @property
    def nbytes(self) -> int:
        parts = [self.k_codes, self.k_scale, self.v_codes, self.v_scale, self.k_float, self.v_float]
        parts += [z for z in (self.k_zero, self.v_zero) if z is not None]
        return sum(t.numel() * t.element_size() for t in parts)


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., D] -> two per byte [..., D/2] (low nibble first)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def _symmetric(x: torch.Tensor, dim: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax(dim=dim, keepdim=True) / qmax).to(SCALE_DTYPE)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    codes = torch.clamp(torch.round(x / safe), -qmax, qmax).to(torch.int8)
    return codes, scale


def _asymmetric(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low = x.amin(dim=dim, keepdim=True).to(SCALE_DTYPE)
    scale = ((x.amax(dim=dim, keepdim=True) - low.float()) / (levels - 1)).to(SCALE_DTYPE)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    codes = torch.clamp(torch.round((x - low.float()) / safe), 0, levels - 1).to(torch.uint8)
    return codes, scale, low


def quantize(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat) -> QuantizedKV:
    """Keys and values [..., T, D] (any float dtype) of tokens 0..T-1 into `fmt`."""
    length, dim = k.shape[-2], k.shape[-1]
    if fmt.dtype != "float16" and dim % 2:
        raise ValueError(f"head size {dim} must be even for packed codes")
    if fmt.value_group and dim % fmt.value_group:
        raise ValueError(f"head size {dim} is not a multiple of the value group {fmt.value_group}")
    old = length - fmt.float_tokens(length)
    kq, vq = k[..., :old, :].float(), v[..., :old, :].float()
    k_zero = v_zero = None
    empty = torch.empty(0, device=k.device)
    if fmt.dtype == "float16":
        k_codes = k_scale = v_codes = v_scale = empty
    else:
        # Keys: [..., blocks, block, D], one scale per channel of a block.
        blocks = kq.reshape(*kq.shape[:-2], old // fmt.key_block, fmt.key_block, dim)
        group = fmt.value_group or dim
        groups = vq.reshape(*vq.shape[:-1], dim // group, group)  # values: per token (and group)
        if fmt.dtype == "int8":
            k_codes, k_scale = _symmetric(blocks, -2, 127)
            v_codes, v_scale = _symmetric(groups, -1, 127)
            k_codes = k_codes.reshape(kq.shape)
            v_codes = v_codes.reshape(vq.shape)
        else:
            kc, k_scale, k_zero = _asymmetric(blocks, -2, 16)
            vc, v_scale, v_zero = _asymmetric(groups, -1, 16)
            k_codes = _pack4(kc.reshape(kq.shape))
            v_codes = _pack4(vc.reshape(vq.shape))
    return QuantizedKV(
        fmt,
        old,
        k_codes,
        k_scale,
        k_zero,
        v_codes,
        v_scale,
        v_zero,
        k[..., old:, :].to(torch.float16),
        v[..., old:, :].to(torch.float16),
    )


def dequantize(q: QuantizedKV, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [..., T, D] back in `dtype` (the reference kernels are checked
    against; attention kernels read the codes themselves)."""
    fmt, old = q.fmt, q.quantized
    if old == 0 or fmt.dtype == "float16":
        return q.k_float.to(dtype), q.v_float.to(dtype)
    dim = q.k_float.shape[-1]
    lead = q.k_float.shape[:-2]
    group = fmt.value_group or dim
    if fmt.dtype == "int8":
        kc, vc = q.k_codes.float(), q.v_codes.float()
    else:
        kc, vc = _unpack4(q.k_codes).float(), _unpack4(q.v_codes).float()
    kb = kc.reshape(*lead, old // fmt.key_block, fmt.key_block, dim)
    vg = vc.reshape(*lead, old, dim // group, group)
    if q.k_zero is None:
        k = kb * q.k_scale.float()
        v = vg * q.v_scale.float()
    else:
        assert q.v_zero is not None
        k = kb * q.k_scale.float() + q.k_zero.float()
        v = vg * q.v_scale.float() + q.v_zero.float()
    k = torch.cat([k.reshape(*lead, old, dim), q.k_float.float()], dim=-2)
    v = torch.cat([v.reshape(*lead, old, dim), q.v_float.float()], dim=-2)
    return k.to(dtype), v.to(dtype)


def bytes_per_token(fmt: KVFormat, layers: int, kv_heads: int, head_dim: int) -> float:
    """Bytes a token past the window costs in `fmt`, scales included, all layers."""
    per_head = {
        "float16": 2 * 2 * head_dim,
        "int8": 2 * head_dim + 2 * head_dim / fmt.key_block + 2 * (head_dim // (fmt.value_group or head_dim)),
        "int4": head_dim + 4 * head_dim / fmt.key_block + 4 * (head_dim // (fmt.value_group or head_dim)),
    }[fmt.dtype]
    return float(per_head * layers * kv_heads)


def capacity_tokens(fmt: KVFormat, pool_bytes: int, rows: int, layers: int, kv_heads: int, head_dim: int) -> int:
    """Tokens a KV pool of `pool_bytes` holds in `rows` rows: each row keeps its float
    tokens (the window and a key block) in float16, the rest in codes."""
    full = bytes_per_token(FORMATS["float16"], layers, kv_heads, head_dim)
    per_row = pool_bytes / rows
    float_part = fmt.window + fmt.key_block
    if fmt.dtype == "float16" or per_row <= float_part * full:
        return rows * int(per_row // full)
    coded = (per_row - float_part * full) / bytes_per_token(fmt, layers, kv_heads, head_dim)
    return rows * int(float_part + coded)
