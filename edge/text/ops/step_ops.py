"""The kernels between the INT4 products in the fused decode step and prefill (residual
add + RMSNorm, rotary + cache write, attention, SiLU * up), from one of two backends:

- `triton` (edge/text/ops/triton/decode_ops.py, and triton_kv.py for the quantized KV
  caches) where Triton is installed: the default;
- `cuda` (edge/text/ops/cuda/decode_ops.cu and kv_ops.cu, built by nvcc on the box)
  where it is not: a Jetson, whose JetPack has nvcc and no Triton.

The choice is made once per process and device (`backend`), with the reason each
refused backend was refused (`refusals`), like the INT4 kernels' (ops/int4.py). The
probes are module functions, so the choice is tested without a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from edge.text.ops.attention_splits import ATTN_GROUP_ROWS as ATTN_GROUP_ROWS
from edge.text.ops.cuda import decode_ops as cuda_ops
from edge.text.ops.cuda import kv_ops as cuda_kv
from edge.text.ops.triton import decode_ops as triton_ops
from edge.text.ops.triton import triton_kv

if TYPE_CHECKING:
    from edge.text.kv.kv_quant import KVFormat
    from edge.text.kv.quant_cache import QuantLayer

logger = logging.getLogger(__name__)

BACKENDS = ("triton", "cuda")


class KVKernels(Protocol):
    """What serves a quantized KV cache on CUDA: triton_kv, or our kv_ops (same functions)."""

    def write_tokens(self, layer: QuantLayer, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None: ...

    def rope_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: torch.Tensor,
        layer: QuantLayer,
        n_heads: int,
    ) -> torch.Tensor: ...

    def attention(
        self, layer: QuantLayer, q: torch.Tensor, pos: torch.Tensor, kv_len: int, q_scale: float, window: int = 0
    ) -> torch.Tensor: ...

    def chunk_attention(
        self,
        layer: QuantLayer,
        q: torch.Tensor,
        float_k: torch.Tensor,
        float_v: torch.Tensor,
        start: int,
        coded: int,
        q_scale: float,
        window: int = 0,
    ) -> torch.Tensor: ...


_chosen: dict[str, str | None] = {}


def triton_present() -> bool:
    return bool(triton_ops.TRITON_SUPPORT)


def cuda_present(device: torch.device) -> bool:
    return device.type == "cuda" and cuda_ops.available(device)


def refusals(device: torch.device | str) -> dict[str, str]:
    """Why each backend that cannot serve `device` cannot (empty: both can)."""
    device = torch.device(device)
    out: dict[str, str] = {}
    if not triton_present():
        out["triton"] = "Triton is not installed"
    if device.type != "cuda":
        out["cuda"] = f"a {device.type} device"
    elif not cuda_present(device):
        out["cuda"] = "the CUDA decode kernels did not build (nvcc missing or failed; see the log)"
    return out


def backend(device: torch.device | str) -> str | None:
    """The backend that serves `device`: Triton where present (on a CPU tensor, its
    interpreter, which the tests use), else our CUDA kernels; None: neither."""
    device = torch.device(device)
    key = str(device)
    if key not in _chosen:
        if triton_present():
            choice: str | None = "triton"  # nothing else probed: no nvcc build where Triton serves
        else:
            refused = refusals(device)
            choice = next((b for b in BACKENDS if b not in refused), None)
            if device.type == "cuda":
                reasons = "; ".join(f"{b}: {why}" for b, why in refused.items())
                logger.info("decode step kernels on %s: %s (%s)", key, choice or "none, op by op", reasons)
        _chosen[key] = choice
    return _chosen[key]


def _ops(t: torch.Tensor) -> Any:
    chosen = backend(t.device)
    if chosen is None:
        raise RuntimeError(f"no decode step kernels for {t.device}: {refusals(t.device)}")
    return triton_ops if chosen == "triton" else cuda_ops


def quantized_kv(device: torch.device | str) -> bool:
    """Whether kernels that write and read the quantized KV caches serve `device`:
    Triton's (triton_kv.py), or ours where they build (kv_ops.cu)."""
    chosen = backend(device)
    return chosen == "triton" or (chosen == "cuda" and cuda_kv.available(torch.device(device)))


def kv_refusal(device: torch.device | str, fmt: KVFormat, head_dim: int, group: int, dtype: torch.dtype) -> str | None:
    """Why the quantized-KV kernels here cannot serve this format for a model of this
    shape and type (None: they can)."""
    if not quantized_kv(device):
        return "no quantized-KV kernels here (Triton is not installed and ours did not build: see the log)"
    if backend(device) == "cuda":
        return cuda_kv.refusal(fmt, head_dim, group, dtype)
    width = fmt.group(head_dim)
    if head_dim & (head_dim - 1) or width & (width - 1):  # Triton's block shapes are powers of two
        return f"head_dim {head_dim}, value groups of {width} (Triton's kernels take powers of two)"
    return None


def circular_kv(device: torch.device | str) -> bool:
    """Whether the quantized-KV kernels serving `device` read a sliding layer's codes kept
    in a circle of its window's key blocks (quant_cache.py): the CPU's, Triton's and ours
    on CUDA (kv_ops.cu) all do."""
    return torch.device(device).type == "cpu" or backend(device) in ("triton", "cuda")


def kv_kernels(device: torch.device | str) -> KVKernels:
    """The module whose write_tokens, rope_write, attention and chunk_attention serve a
    quantized KV cache on `device` (triton_kv, or our kv_ops)."""
    if not quantized_kv(device):
        raise RuntimeError(f"no quantized-KV kernels for {device}: {refusals(device)}")
    return triton_kv if backend(device) == "triton" else cuda_kv


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, H] float32 (updated in place to x + delta); returns RMSNorm(x) in weight's dtype."""
    h: torch.Tensor = _ops(x).add_rmsnorm(x, delta, weight, eps)
    return h


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_heads: int,
    q_scale: float | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [B, (NH + 2 NKV) * HD] -> rotated queries [B, NH, HD] pre-scaled by q_scale
    (None: 1/sqrt(HD)); k and v of each sequence written into the layer's cache
    [B', NKV, L, HD] at slots[b] (None: pos[b]; a sliding layer's own buffer: the
    position less the row's offset), turned by the rotary at pos[b] over the tables'
    width (a partial rotary: fewer channels than HD, the rest passed unturned)."""
    q: torch.Tensor = _ops(qkv).rope_kv_write(qkv, cos, sin, pos, k_cache, v_cache, n_heads, q_scale, slots)
    return q


def rope_prefill(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    row: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (NH + 2 NKV) HD] of positions 0..T-1 -> q [T, NH, HD] (pre-scaled), k and
    v [NKV, T, HD]; k and v also written into cache row `row` [1]."""
    q, k, v = _ops(qkv).rope_prefill(qkv, cos, sin, row, k_cache, v_cache, n_heads)
    return q, k, v


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    kv_len: int,
    sms: int,
    window: int = 0,
) -> torch.Tensor:
    """q [B, NH, HD] (pre-scaled) against cache positions 0..pos[b] (with `window` > 0, a
    sliding layer's, only the last `window` of them) -> [B, NH * HD]."""
    out: torch.Tensor = _ops(q).decode_attention(q, k_cache, v_cache, pos, kv_len, sms, window)
    return out


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype, paired: bool = False) -> torch.Tensor:
    """silu(gate) * up [B, F] of a [gate; up] product [B, 2F], in the INT4 kernel's
    paired column order where `paired`."""
    out: torch.Tensor = _ops(gate_up).silu_mul(gate_up, dtype, paired)
    return out


def attention_refusal(
    device: torch.device | str, head_dim: int, group: int, dtype: torch.dtype, hidden: int = 0
) -> str | None:
    """Why the chosen backend's step kernels (attention, RMSNorm) cannot take this model
    (None: they can)."""
    chosen = backend(device)
    if chosen is None:
        return "no decode step kernels here"
    if group > ATTN_GROUP_ROWS:
        return f"{group} query heads per KV head (at most {ATTN_GROUP_ROWS})"
    return cuda_ops.refusal(head_dim, group, dtype, hidden) if chosen == "cuda" else None
