"""Attention over a quantized KV cache on the CPU (cpu_kv.c): built on the box like the
CPU INT4 kernel (cpu_int4.build, the same kernel cache), called through ctypes."""

from __future__ import annotations

import ctypes
import logging
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
    _P, ctypes.c_int,  # out [Q, NH, D] float32, threads
]  # fmt: skip
_KERNEL = cpu_int4.CKernel(SOURCE, "edge_kv_attention", _ARGTYPES, "the CPU quantized-KV attention kernel")


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
) -> torch.Tensor:
    """q [Q, NH, D] (unscaled) -> [Q, NH, D] float32. Query i attends to positions
    0..pos[i] of cache row rows[i]: below coded[i] from the layer's codes (k codes, k
    scales, k zeros, v codes, v scales, v zeros, each [rows, NKV, ...]), the rest from
    float_kv [frows, NKV, slots, D] at slot (t - fbase[i]) % fmod of row frows[i].
    kv_format: (key block, value group, int4). sink_kv: the first positions of each row,
    float [rows, NKV, sink, D], read in place of their codes. window: a sliding layer's
    (each query sees its last `window` positions; 0: all); scale: the queries' (None:
    1/sqrt(D))."""
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
    rc = fn(
        q32.data_ptr(), nq, nh,
        index[0].data_ptr(), index[1].data_ptr(), index[2].data_ptr(), index[3].data_ptr(), index[4].data_ptr(),
        nkv, dim, code_len, key_block, value_group, int(int4),
        kc.data_ptr(), ks.data_ptr(), kz.data_ptr() if kz.numel() else None,
        vc.data_ptr(), vs.data_ptr(), vz.data_ptr() if vz.numel() else None,
        kf.data_ptr(), vf.data_ptr(), kf.shape[2], fmod, sk.data_ptr(), sv.data_ptr(), sink,
        window, scale or 0.0, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CPU quantized-KV attention failed (code {rc}) on {nq} queries of {nh} heads")
    return out
