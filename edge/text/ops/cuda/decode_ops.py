"""Our CUDA C kernels of a decode layer (decode_ops.cu): residual add + RMSNorm, rotary +
KV-cache write (decode and prefill), attention split over the cache and merged, SiLU *
up. The same functions as the Triton ones (edge/text/ops/triton/decode_ops.py), for
boxes without Triton; edge/text/ops/step_ops.py chooses between them.

Built on the box by nvcc like the INT4 GEMV (cuda_build.py) and launched through ctypes
on torch's current stream, so the fused step and prefill capture them in CUDA graphs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from edge.text.ops.attention_splits import ATTN_GROUP_ROWS
from edge.text.ops.cuda import cuda_build

SOURCE = Path(__file__).with_name("decode_ops.cu")
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
ATTN_DTYPES = (torch.bfloat16, torch.float16)  # the attention's 16-byte key loads
HEAD_DIMS = (64, 128, 256)
GROUP_PADS = (4, 8, 16)  # query rows per KV head the attention is built for
# Splits of the float cache (attention_splits): about ATTN_SPREAD blocks an SM over a
# sequence's KV heads, up to MAX_SPLITS (decode_ops.cu's); chunks of whole ATTN_TILEs
# (decode_ops.cu's and kv_ops.cu's pass of a block). The tensor-core kernel loads a tile
# while it computes the one before, so a block walking several tiles keeps the memory busy,
# and fewer splits leave the last block less to merge (a round of loads per batch of
# chunks): `python -m bench.attention_kernels --spreads 1 2 4 8` times the choice. The
# quantized cache's kernel has its own spread (kv_ops.KV_SPREAD).
ATTN_SPREAD = 1
MAX_SPLITS = 128
ATTN_TILE = 64
MAX_NORM_HIDDEN = 1024 * 8  # decode_ops.cu's NORM_THREADS x NORM_VALUES: a row's values held in registers


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    signatures = {
        "edge_add_rmsnorm": [p, p, i, p, p, i, i, i, f, p],
        "edge_rope_kv_write": [p, i, p, p, p, p, p, p, p, i, i, i, i, i, f, i, i, p],
        "edge_rope_prefill": [p, i, p, p, p, p, p, p, p, p, i, i, i, i, i, f, i, p],
        "edge_decode_attention": [p, p, p, p, p, p, p, p, i, i, i, i, i, i, i, i, i, i, p],
        "edge_silu_mul": [p, i, p, i, i, i, i, p],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = i
        fn.argtypes = argtypes


_LIBRARY = cuda_build.CudaLibrary(SOURCE, "the CUDA decode kernels", _declare)


def available(device: torch.device | str = "cuda") -> bool:
    """Whether the kernels build (building them now if needed) and load for `device`."""
    return _LIBRARY.available(device)


MMA_ROWS = 8  # query rows a KV head the tensor-core attention takes (attention_mma.cuh)
MMA_HEAD_DIMS = (64, 128)


def attention_kernel(head_dim: int, group: int) -> str:
    """Which of decode_ops.cu's attention kernels serves this shape (as its launch_split
    chooses): "mma" (the tensor cores) or "scalar", with the reason."""
    if head_dim not in MMA_HEAD_DIMS:
        return f"scalar: head_dim {head_dim} (the tensor-core kernel takes {MMA_HEAD_DIMS})"
    if group > MMA_ROWS:
        return f"scalar: {group} query heads per KV head (the tensor-core kernel takes at most {MMA_ROWS})"
    return "mma"


def refusal(head_dim: int, group: int, dtype: torch.dtype, hidden: int = 0) -> str | None:
    """Why these kernels cannot take a model of this shape and type (None: they can)."""
    if hidden > MAX_NORM_HIDDEN:
        return f"hidden size {hidden} (the CUDA RMSNorm takes at most {MAX_NORM_HIDDEN})"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the CUDA attention takes {HEAD_DIMS})"
    if group > GROUP_PADS[-1]:
        return f"{group} query heads per KV head (the CUDA attention takes at most {GROUP_PADS[-1]})"
    if dtype not in ATTN_DTYPES:
        return f"a {dtype} cache (the CUDA attention reads float16 or bfloat16)"
    return None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"the CUDA {what} kernel failed to launch (CUDA error {rc})")


def _dtype(t: torch.Tensor) -> int:
    if t.dtype not in DTYPES:
        raise ValueError(f"the CUDA decode kernels take bfloat16, float16 or float32, got {t.dtype}")
    return DTYPES[t.dtype]


def _contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("the CUDA decode kernels take contiguous tensors")


def _tables(cos: torch.Tensor, sin: torch.Tensor) -> None:
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("the rotary tables are float32")


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, H] float32 (updated in place to x + delta); returns RMSNorm(x) in weight's dtype."""
    if x.dtype != torch.float32:
        raise ValueError("the residual stream is float32")
    bsz, hidden = x.shape
    h = torch.empty(bsz, hidden, device=x.device, dtype=weight.dtype)
    _contiguous(x, weight, *(() if delta is None else (delta,)))
    lib = _LIBRARY.load(x.device)
    rc = lib.edge_add_rmsnorm(
        x.data_ptr(), None if delta is None else delta.data_ptr(), DTYPES[torch.float32] if delta is None
        else _dtype(delta), weight.data_ptr(), h.data_ptr(), _dtype(h), bsz, hidden, eps, cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "RMSNorm")
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
    [B', NKV, L, HD] at slots[b] (None: pos[b]; int64), turned by the rotary at pos[b].
    The tables' width is the channels of a head the rotary turns (a partial rotary:
    fewer than HD, the rest passed unturned)."""
    bsz = qkv.shape[0]
    _, n_kv, max_len, hd = k_cache.shape
    rot = cos.shape[-1]
    if sin.shape != cos.shape or rot % 2 or not 0 < rot <= hd:
        raise ValueError(f"rotary tables of width {rot} for heads of {hd} channels")
    q = torch.empty(bsz, n_heads, hd, device=qkv.device, dtype=k_cache.dtype)
    _contiguous(qkv, cos, sin, pos, k_cache, v_cache, *(() if slots is None else (slots,)))
    _tables(cos, sin)
    lib = _LIBRARY.load(qkv.device)
    pos = pos.to(torch.int64)
    slots = None if slots is None else slots.to(torch.int64)
    rc = lib.edge_rope_kv_write(
        qkv.data_ptr(), _dtype(qkv), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
        None if slots is None else slots.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        _dtype(k_cache), bsz, n_heads, n_kv, max_len, hd**-0.5 if q_scale is None else q_scale, hd, rot,
        cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "rotary")
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
    v [NKV, T, HD]; k and v also written into cache row `row` [1] (int64) of the layer's
    cache [rows, NKV, L, HD]."""
    tokens = qkv.shape[0]
    _, n_kv, max_len, hd = k_cache.shape
    dtype = k_cache.dtype
    q = torch.empty(tokens, n_heads, hd, device=qkv.device, dtype=dtype)
    k = torch.empty(n_kv, tokens, hd, device=qkv.device, dtype=dtype)
    v = torch.empty(n_kv, tokens, hd, device=qkv.device, dtype=dtype)
    _contiguous(qkv, cos, sin, row, k_cache, v_cache)
    _tables(cos, sin)
    lib = _LIBRARY.load(qkv.device)
    rc = lib.edge_rope_prefill(
        qkv.data_ptr(), _dtype(qkv), cos.data_ptr(), sin.data_ptr(), row.to(torch.int64).data_ptr(), q.data_ptr(),
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _dtype(k_cache), tokens, n_heads, n_kv,
        max_len, hd**-0.5, hd, cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "prefill rotary")
    return q, k, v


def attention_splits(kv_len: int, n_kv: int, sms: int, spread: int = ATTN_SPREAD) -> tuple[int, int]:
    """(splits, chunk) of a sequence's cache for our attention kernels: chunks of whole
    tiles, as many as give each SM about `spread` blocks, at most MAX_SPLITS, and
    none wholly past the cache. Not the Triton rule (attention_splits.attn_splits): its
    power-of-two splits of half-tiles, rounded up to our tile, left blocks with nothing to
    read (16 splits at 768 positions, four empty) or a tile and a half to walk (64 splits
    of 96 positions at 4K), where a block's latency is its whole cost. Our merge takes any
    number of splits. Per sequence, whatever the batch (batch invariance)."""
    want = max(1, min(MAX_SPLITS, (sms * spread) // max(1, n_kv)))
    chunk = max(ATTN_TILE, -(-kv_len // want))
    chunk = -(-chunk // ATTN_TILE) * ATTN_TILE
    return -(-kv_len // chunk), chunk


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    kv_len: int,
    sms: int,
    window: int = 0,
    spread: int = ATTN_SPREAD,
) -> torch.Tensor:
    """q [B, NH, HD] (pre-scaled) against cache positions 0..pos[b] (with `window` > 0, a
    sliding layer's, only the last `window` of them) -> [B, NH * HD], the cache split for
    `spread` blocks an SM (attention_splits; another only to time the rule)."""
    bsz, n_heads, hd = q.shape
    n_kv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    refused = refusal(hd, group, k_cache.dtype)
    if refused:
        raise ValueError(f"the CUDA attention does not take {refused}")
    if not q.dtype == k_cache.dtype == v_cache.dtype or k_cache.shape[3] != hd or v_cache.shape != k_cache.shape:
        raise ValueError(f"queries {q.dtype} [.., {hd}] against a {k_cache.dtype} cache {list(k_cache.shape)}")
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16 or pos.numel() < bsz:
        raise ValueError("the cache must be 16-byte aligned and hold a position for every row")
    if window < 0:
        raise ValueError(f"a window of {window} positions")
    _contiguous(q, k_cache, v_cache, pos)
    pad = next(p for p in GROUP_PADS if p >= group)
    splits, chunk = attention_splits(kv_len, n_kv, sms, spread)
    rows = bsz * n_kv * splits * pad
    acc = torch.empty(rows, hd, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(bsz, n_heads * hd, device=q.device, dtype=q.dtype)
    done = cuda_build.split_counters(q.device, bsz * n_kv)
    lib = _LIBRARY.load(q.device)
    rc = lib.edge_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pos.to(torch.int64).data_ptr(), acc.data_ptr(),
        ml.data_ptr(), done.data_ptr(), out.data_ptr(), _dtype(q), bsz, n_heads, n_kv, max_len, hd, pad, chunk, splits,
        window, cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "attention")
    return out


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype, paired: bool = False) -> torch.Tensor:
    """silu(gate) * up [B, F] of a [gate; up] product [B, 2F], in the INT4 kernel's
    paired column order where `paired`."""
    bsz, width = gate_up.shape
    f = width // 2
    out = torch.empty(bsz, f, device=gate_up.device, dtype=dtype)
    _contiguous(gate_up)
    lib = _LIBRARY.load(gate_up.device)
    rc = lib.edge_silu_mul(
        gate_up.data_ptr(), _dtype(gate_up), out.data_ptr(), _dtype(out), bsz, f, int(paired), cuda_build.stream()
    )
    _check(rc, "SiLU")
    return out


__all__ = ["ATTN_GROUP_ROWS", "add_rmsnorm", "decode_attention", "rope_kv_write", "rope_prefill", "silu_mul"]
