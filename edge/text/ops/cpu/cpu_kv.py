"""Attention over a quantized KV cache on the CPU (cpu_kv.c): built on the box like the
CPU INT4 kernel (cpu_int4.build, the same kernel cache), called through ctypes."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from edge.text.ops.cpu import cpu_int4

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kv.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [
    _P, _I, _I,  # q [Q, NH, D] float32, Q, NH
    _P, _P, _P, _P, _P,  # rows, pos, coded, frows, fbase [Q] int64
    _I, _I, _I, _I, _I, ctypes.c_int,  # NKV, D, code length, key block, value group, int4
    _P, _P, _P, _P, _P, _P,  # k codes, k scales, k zeros, v codes, v scales, v zeros
    _P, _P, _I, _I,  # float keys, float values [frows, NKV, falloc, D], falloc, fmod
    _P, _P, _I,  # sink keys, sink values [rows, NKV, sink, D] float32, sink
    _I, ctypes.c_float,  # window (0: every position), query scale (0: 1/sqrt(D))
    _P, _I, _I, _P,  # block summaries [rows, NKV, blocks, 2, D] float32 (0: dense), blocks, block tokens, top k [Q]
    _P, ctypes.c_int,  # out [Q, NH, D] float32, threads
]  # fmt: skip
_KERNEL = cpu_int4.CKernel(SOURCE, "edge_kv_attention", _ARGTYPES, "the CPU quantized-KV attention kernel")
_SELECT = cpu_int4.CKernel(
    SOURCE,
    "edge_kv_select",
    [_P, _I, _I, _P, _I, _I, _I, _I, _P],  # q [group, D], group, D, summary [blocks, 2, D], pos, coded, block, k, spans
    "the CPU quantized-KV attention's block selection",
)


@dataclass(frozen=True)
class Selection:
    """Sparse attention's part of a call: the layer's block summaries [rows, NKV, blocks,
    2, D] float32 (per-channel key min and max of each block of `block_tokens` positions)
    and each query's k: the blocks it selects besides those always kept, or -1 to attend
    densely (a token before min_context)."""

    summary: torch.Tensor
    block_tokens: int
    top_k: list[int]


def available() -> bool:
    return _KERNEL.available()


def attention(
    q: torch.Tensor,
    layer_codes: tuple[torch.Tensor, ...],
    *,
    kv_format: tuple[int, int, bool],
    rows: list[int],
    pos: list[int],
    coded: list[int],
    frows: list[int],
    fbase: list[int],
    float_kv: tuple[torch.Tensor, torch.Tensor],
    fmod: int,
    sink_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,
    scale: float | None = None,
    selection: Selection | None = None,
) -> torch.Tensor:
    """q [Q, NH, D] (unscaled) -> [Q, NH, D] float32. Query i attends to positions
    0..pos[i] of cache row rows[i]: below coded[i] from the layer's codes (k codes, k
    scales, k zeros, v codes, v scales, v zeros, each [rows, NKV, ...]), the rest from
    float_kv [frows, NKV, slots, D] at slot (t - fbase[i]) % fmod of row frows[i].
    kv_format: (key block, value group, int4). sink_kv: the first positions of each row,
    float [rows, NKV, sink, D], read in place of their codes. window: a sliding layer's
    (each query sees its last `window` positions; 0: all); scale: the queries' (None:
    1/sqrt(D)). selection: sparse attention (None: dense), in a layer that sees every
    position: query i with top_k[i] >= 0 attends to the blocks it selects and every
    position from coded[i] on."""
    fn = _KERNEL.function()
    nq, nh, dim = q.shape
    kc, ks, kz, vc, vs, vz = layer_codes
    kf, vf = (t.to(torch.float32).contiguous() for t in float_kv)
    sk, sv = (t.to(torch.float32).contiguous() for t in sink_kv) if sink_kv is not None else (kf, vf)
    sink = sk.shape[2] if sink_kv is not None else 0
    nkv, code_len = kc.shape[1], kc.shape[2]
    for t in (kc, ks, vc, vs):
        if not t.is_contiguous():
            raise ValueError("the cache's codes and scales must be contiguous rows")
    key_block, value_group, int4 = kv_format
    q32 = q.detach().to(torch.float32).contiguous()
    index = torch.tensor([rows, pos, coded, frows, fbase], dtype=torch.int64)
    out = torch.empty(nq, nh, dim, dtype=torch.float32)
    sparse: tuple[int | None, int, int, int | None] = (None, 0, 0, None)
    if selection is not None:
        summary = selection.summary
        if (
            summary.dtype != torch.float32
            or not summary.is_contiguous()
            or summary.shape[:2] != kc.shape[:2]
            or summary.shape[3:] != (2, dim)
            or len(selection.top_k) != nq
        ):
            raise ValueError(f"block summaries {list(summary.shape)} for {nq} queries over codes {list(kc.shape)}")
        top_k = torch.tensor(selection.top_k, dtype=torch.int64)
        sparse = (summary.data_ptr(), summary.shape[2], selection.block_tokens, top_k.data_ptr())
    rc = fn(
        q32.data_ptr(), nq, nh,
        index[0].data_ptr(), index[1].data_ptr(), index[2].data_ptr(), index[3].data_ptr(), index[4].data_ptr(),
        nkv, dim, code_len, key_block, value_group, int(int4),
        kc.data_ptr(), ks.data_ptr(), kz.data_ptr() if kz.numel() else None,
        vc.data_ptr(), vs.data_ptr(), vz.data_ptr() if vz.numel() else None,
        kf.data_ptr(), vf.data_ptr(), kf.shape[2], fmod, sk.data_ptr(), sv.data_ptr(), sink,
        window, scale or 0.0, *sparse, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CPU quantized-KV attention failed (code {rc}) on {nq} queries of {nh} heads")
    return out


def select(
    q: torch.Tensor, summary: torch.Tensor, pos: int, coded: int, block_tokens: int, k: int
) -> list[tuple[int, int]]:
    """The positions (first, last) span by span a query at `pos` attends to, as
    `attention` chooses them: q [group, D] its KV group's heads (unscaled), summary
    [blocks, 2, D] the (row, KV head)'s, the row's positions below `coded` codes (the rest
    float, always attended); k < 0 dense. For the tests to hold against the float step's
    selection (ops/cpu/cpu_step.select)."""
    q, summary = q.to(torch.float32).contiguous(), summary.to(torch.float32).contiguous()
    blocks = pos // block_tokens + 1
    if q.dim() != 2 or summary.dim() != 3 or summary.shape[0] < blocks or summary.shape[1:] != (2, q.shape[1]):
        raise ValueError(f"queries {list(q.shape)} and summaries {list(summary.shape)} up to position {pos}")
    spans = torch.zeros(2 * (blocks + 1), dtype=torch.int64)
    n = _SELECT.function()(
        q.data_ptr(), q.shape[0], q.shape[1], summary.data_ptr(), pos, coded, block_tokens, k, spans.data_ptr()
    )
    if n < 0:
        raise RuntimeError(f"the quantized-KV attention's block selection failed (code {n})")
    pairs: list[int] = spans[: 2 * n].tolist()
    return list(zip(pairs[::2], pairs[1::2], strict=True))
