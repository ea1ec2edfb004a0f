"""Our CUDA C kernels for the quantized KV cache (kv_ops.cu): a decode step's token written
into the ring (rotated, in the fused step) with the key block leaving the window coded,
and attention over the codes and the ring, for decode and for a chunk after cached
tokens. The same functions as edge/text/ops/triton/triton_kv.py, for boxes without
Triton; edge/text/ops/step_ops.py chooses between them.

Built on the box by nvcc (cuda_build.py) and launched through ctypes on torch's current
stream, so the fused step captures them in CUDA graphs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edge.text.ops.cuda import cuda_build, decode_ops
from edge.text.ops.cuda.decode_ops import DTYPES, GROUP_PADS

if TYPE_CHECKING:  # the cache's layer, read by attribute: ops sit below kv
    from edge.text.kv.kv_quant import KVFormat
    from edge.text.kv.quant_cache import QuantLayer

SOURCE = Path(__file__).with_name("kv_ops.cu")
CACHE_DTYPES = (torch.bfloat16, torch.float16)
# Head sizes built (each a set of kernel instances: build time on the box): those of the
# families most served (Llama, Qwen, Mistral, Phi-3: 64 and 128). Gemma 3's 256 is
# refused by name at load (refusal), float16 KV serving it here; Triton's kernels take it.
HEAD_DIMS = (64, 128)
TILE = 64  # positions a pass of the attention (kv_ops.cu's KV_TILE): key blocks are whole tiles
# Blocks an SM the quantized cache's attention is split for: more than the float cache's
# (decode_ops.ATTN_SPREAD), as its kernel walks a chunk's tiles one after the other,
# each tile's loads waited for: with the float cache's spread its decode at 4K was slower.
KV_SPREAD = 8


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    signatures = {
        "edge_kv_rope_write": [p, i, p, p, p, p, p, p, i, i, i, i, i, i, f, i, p],
        "edge_kv_write": [p, p, i, p, p, p, i, i, i, i, i, i, p],
        "edge_kv_attention": [p, p, p, p, p, p, p, p, p, p, i, i, i, i, i, i, i, i, i, f, i, i, i, i, p],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = i
        fn.argtypes = argtypes


_LIBRARY = cuda_build.CudaLibrary(SOURCE, "the CUDA quantized-KV kernels", _declare)


def available(device: torch.device | str = "cuda") -> bool:
    """Whether the kernels build (building them now if needed) and load for `device`."""
    return _LIBRARY.available(device)


def refusal(fmt: KVFormat, head_dim: int, group: int, dtype: torch.dtype) -> str | None:
    """Why these kernels cannot serve a cache of this format for a model of this shape and
    activations' type (None: they can)."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (they take {HEAD_DIMS})"
    if group > GROUP_PADS[-1]:
        return f"{group} query heads per KV head (they take at most {GROUP_PADS[-1]})"
    if dtype not in CACHE_DTYPES:
        return f"{dtype} activations (they take float16 or bfloat16)"
    if fmt.key_block % TILE:
        return f"key blocks of {fmt.key_block} positions (they take multiples of {TILE})"
    lanes = fmt.group(head_dim) // (head_dim // 32)  # a value group's lanes in the coder's warp
    if fmt.group(head_dim) % (head_dim // 32) or lanes < 1 or lanes > 32 or lanes & (lanes - 1):
        return f"value groups of {fmt.group(head_dim)} channels in heads of {head_dim}"
    return None


def attention_kernel(fmt: KVFormat, head_dim: int, group: int) -> str:
    """Which of kv_ops.cu's attention kernels serves this format and shape (as its
    split_for chooses): "mma" (the tensor cores), or "scalar" with the reason."""
    chosen = decode_ops.attention_kernel(head_dim, group)
    lane = head_dim // 8  # a lane's channels of a value, which share one scale there
    if chosen == "mma" and fmt.group(head_dim) < lane:
        return f"scalar: value groups of {fmt.group(head_dim)} channels (the tensor-core kernel takes {lane} or more)"
    return chosen


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"the CUDA quantized-KV {what} kernel failed to launch (CUDA error {rc})")


def _dtype(t: torch.Tensor) -> int:
    if t.dtype not in DTYPES:
        raise ValueError(f"the CUDA quantized-KV kernels take bfloat16, float16 or float32, got {t.dtype}")
    return DTYPES[t.dtype]


def _layer(layer: QuantLayer, window: int = 0) -> tuple[ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_int]]:
    """The layer's ten tensors (a tensor its format lacks stood in for by one never read
    then) and its format's nine ints (the last: the attention's sliding window, 0 for
    none), as kv_ops.cu's entries take them."""
    fmt, dim = layer.fmt, layer.ring_k.shape[-1]
    refused = refusal(fmt, dim, 1, layer.ring_k.dtype)
    if refused:
        raise ValueError(f"the CUDA quantized-KV kernels do not take {refused}")
    k_zero = layer.k_zero if layer.k_zero.numel() else layer.k_scale
    v_zero = layer.v_zero if layer.v_zero.numel() else layer.v_scale
    sink_k, sink_v = (layer.sink_k, layer.sink_v) if layer.sink_k.numel() else (layer.ring_k, layer.ring_v)
    tensors = (layer.ring_k, layer.ring_v, layer.k_codes, layer.k_scale, k_zero, layer.v_codes, layer.v_scale, v_zero)
    for t in (*tensors, sink_k, sink_v):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("the CUDA quantized-KV kernels take contiguous, 16-byte aligned tensors")
    ptrs = (ctypes.c_void_p * 10)(*(t.data_ptr() for t in (*tensors, sink_k, sink_v)))
    ints = (fmt.key_block, fmt.group(dim), fmt.window, fmt.ring, fmt.sink, int(fmt.value_symmetric))
    sizes = (layer.code_len, layer.k_scale.shape[2])
    return ptrs, (ctypes.c_int * 9)(*ints, *sizes, window)


def write_tokens(layer: QuantLayer, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """k, v [B, NKV, HD] (rotated) of one new token per row at pos [B] into the layer."""
    bsz, n_kv, hd = k.shape
    ptrs, ints = _layer(layer)
    k, v = k.contiguous(), v.to(k.dtype).contiguous()
    lib = _LIBRARY.load(k.device)
    rc = lib.edge_kv_write(
        k.data_ptr(), v.data_ptr(), _dtype(k), pos.to(torch.int64).data_ptr(), ptrs, ints, _dtype(layer.ring_k),
        int(layer.fmt.dtype == "int4"), bsz, n_kv, layer.max_len, hd, cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "write")


def rope_write(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, layer: QuantLayer, n_heads: int
) -> torch.Tensor:
    """decode_ops.rope_kv_write for a quantized cache: rotated, pre-scaled queries
    [B, NH, HD]; each row's k and v written into the layer at pos[b]."""
    bsz = qkv.shape[0]
    n_kv, hd = layer.ring_k.shape[1], layer.ring_k.shape[-1]
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not qkv.is_contiguous():
        raise ValueError("float32 rotary tables and a contiguous qkv")
    ptrs, ints = _layer(layer)
    q = torch.empty(bsz, n_heads, hd, device=qkv.device, dtype=layer.ring_k.dtype)
    lib = _LIBRARY.load(qkv.device)
    rc = lib.edge_kv_rope_write(
        qkv.data_ptr(), _dtype(qkv), cos.data_ptr(), sin.data_ptr(), pos.to(torch.int64).data_ptr(), q.data_ptr(),
        ptrs, ints, _dtype(layer.ring_k), int(layer.fmt.dtype == "int4"), bsz, n_heads, n_kv, layer.max_len,
        hd**-0.5, hd, cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "rotary")
    return q


def _attend(
    layer: QuantLayer,
    q: torch.Tensor,
    float_kv: tuple[torch.Tensor, torch.Tensor],
    pos: torch.Tensor | None,
    start: int,
    coded: int,
    splits: int,
    chunk: int,
    q_scale: float,
    window: int,
) -> torch.Tensor:
    nq, n_heads, hd = q.shape
    n_kv = layer.ring_k.shape[1]
    group = n_heads // n_kv
    refused = refusal(layer.fmt, hd, group, layer.ring_k.dtype)
    if refused:
        raise ValueError(f"the CUDA quantized-KV attention does not take {refused}")
    kf, vf = float_kv
    if q.dtype != kf.dtype or not (q.is_contiguous() and kf.is_contiguous() and vf.is_contiguous()):
        raise ValueError(f"contiguous queries and float tokens of the cache's type, got {q.dtype} and {kf.dtype}")
    ptrs, ints = _layer(layer, window)
    pad = next(p for p in GROUP_PADS if p >= group)
    rows = nq * n_kv * splits * pad
    acc = torch.empty(rows, hd, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(nq, n_heads * hd, device=q.device, dtype=kf.dtype)
    falloc = kf.shape[2]
    fmod = layer.fmt.ring if pos is not None else falloc
    done = cuda_build.split_counters(q.device, nq * n_kv)
    lib = _LIBRARY.load(q.device)
    rc = lib.edge_kv_attention(
        q.data_ptr(), ptrs, ints, kf.data_ptr(), vf.data_ptr(), None if pos is None else pos.data_ptr(),
        acc.data_ptr(), ml.data_ptr(), done.data_ptr(), out.data_ptr(), _dtype(kf), int(layer.fmt.dtype == "int4"),
        nq, n_heads, n_kv, falloc, fmod, start, coded, q_scale, hd, pad, chunk, splits, cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "attention")
    return out


def attention_splits(kv_len: int, n_kv: int, sms: int, spread: int = KV_SPREAD) -> tuple[int, int]:
    """(splits, chunk) of a sequence's quantized cache for attention: the float cache's
    rule (decode_ops.attention_splits) at `spread` blocks an SM, the chunk rounded up to
    whole tiles (splits start on a key block)."""
    splits, chunk = decode_ops.attention_splits(kv_len, n_kv, sms, spread)
    return splits, -(-chunk // TILE) * TILE


def attention(
    layer: QuantLayer,
    q: torch.Tensor,
    pos: torch.Tensor,
    kv_len: int,
    q_scale: float,
    window: int = 0,
    spread: int = KV_SPREAD,
) -> torch.Tensor:
    """q [B, NH, HD] (times q_scale) of each row's token at pos[b] against its cache
    positions 0..pos[b] (in a sliding layer, `window` > 0, its last `window` of them)
    -> [B, NH * HD] in the cache's float type, the cache split for `spread` blocks an SM
    (another only to time the rule)."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits, chunk = attention_splits(kv_len, layer.ring_k.shape[1], sms, spread)
    positions = pos.to(torch.int64).contiguous()
    return _attend(layer, q.contiguous(), (layer.ring_k, layer.ring_v), positions, 0, 0, splits, chunk, q_scale, window)


def chunk_attention(
    layer: QuantLayer,
    q: torch.Tensor,
    float_k: torch.Tensor,
    float_v: torch.Tensor,
    start: int,
    coded: int,
    q_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [T, NH, HD] of positions start.. of the layer's row 0 against its codes below
    `coded` and the float tokens from `coded` on (float_k, float_v [1, NKV, F, HD]),
    each within its last `window` positions where window > 0 -> [T, NH, HD]. One split
    per query: the chunk's queries fill the GPU."""
    end = start + q.shape[0]
    chunk = -(-end // TILE) * TILE
    out = _attend(
        layer, q.contiguous(), (float_k.contiguous(), float_v.contiguous()), None, start, coded, 1, chunk, q_scale,
        window,
    )  # fmt: skip
    return out.view(q.shape[0], q.shape[1], q.shape[2])
