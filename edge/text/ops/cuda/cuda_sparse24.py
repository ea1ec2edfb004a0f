"""Our CUDA kernels for 2:4 sparse INT4 weights (cuda_sparse24.cu): a decode GEMV over the
packed format and its dequantization for prefill, built on the box by nvcc
(cuda_build.py) and called through ctypes on torch's current stream."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from edge.text.ops.cuda import cuda_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cuda_sparse24.cu")
MAX_ROWS = 8  # activation rows the GEMV takes; more are a prefill (dequantize + cuBLAS)
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.edge_sparse24_gemv.restype = i
    lib.edge_sparse24_gemv.argtypes = [p, p, p, p, p, p, i, i, i, i, i, p]
    lib.edge_sparse24_dequant.restype = i
    lib.edge_sparse24_dequant.argtypes = [p, p, p, p, p, i, i, i, i, i, p]


_LIBRARY = cuda_build.CudaLibrary(SOURCE, "the CUDA 2:4 kernel", _declare)


def supports(in_features: int, group_size: int) -> bool:
    return in_features % 16 == 0 and group_size % 16 == 0 and in_features % group_size == 0


def available(device: torch.device | str = "cuda") -> bool:
    """Whether the kernels build (building them now if needed) and load for `device`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        _LIBRARY.load(device)
    except RuntimeError as exc:
        logger.warning("%s", exc)
        return False
    return True


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"the CUDA 2:4 {what} failed to launch (cudaError {rc})")


def gemv(
    x: torch.Tensor, codes: torch.Tensor, index: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M <= 8, K] (bfloat16, float16 or float32) -> [M, N] float32."""
    m, k = x.shape
    n = codes.shape[0]
    if m > MAX_ROWS or x.dtype not in DTYPES or not supports(k, group):
        raise ValueError(f"the CUDA 2:4 GEMV takes up to {MAX_ROWS} rows of K a multiple of 16 ({m}, {k}, {x.dtype})")
    x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=torch.float32)
    lib = _LIBRARY.load(x.device)
    rc = lib.edge_sparse24_gemv(
        codes.data_ptr(), index.data_ptr(), scales.data_ptr(), zeros.data_ptr(), x.data_ptr(), out.data_ptr(),
        m, n, k, group, DTYPES[x.dtype], cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "GEMV")
    return out


def dequant(
    codes: torch.Tensor,
    index: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    row0: int,
    rows: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Weight rows row0..row0+rows dequantized, [rows, K] in `dtype` (pruned weights 0)."""
    k = codes.shape[1] * 4
    out = torch.empty(rows, k, device=codes.device, dtype=dtype)
    lib = _LIBRARY.load(codes.device)
    rc = lib.edge_sparse24_dequant(
        codes.data_ptr(), index.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(), row0, rows, k, group,
        DTYPES[dtype], cuda_build.stream(),
    )  # fmt: skip
    _check(rc, "dequantization")
    return out
