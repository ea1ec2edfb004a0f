"""Our float32 2:4 sparse INT4 kernel for the CPU (cpu_sparse24.c), called through ctypes.

Built on the box at first use as the dense kernel is (cpu_int4.build: the same kernel
cache, compiler flags and rebuild on a change to its source or to cpu_int4.c, which it
includes); without a C compiler it is unavailable and 2:4 layers are dequantized instead.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from edge.text.ops.cpu.cpu_int4 import LANES, CKernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_sparse24.c")

_ARGS: list[Any] = [
    ctypes.c_void_p,  # x [M, K] float32
    ctypes.c_int64,  # M
    ctypes.c_int64,  # K
    ctypes.c_void_p,  # codes24 [N, K/4] uint8
    ctypes.c_void_p,  # index24 [N, K/8] uint8
    ctypes.c_void_p,  # scales [N, K/G] float32
    ctypes.c_void_p,  # zeros [N, K/G] uint8
    ctypes.c_int64,  # N
    ctypes.c_int64,  # G
    ctypes.c_void_p,  # y [M, N] float32
    ctypes.c_int,  # threads
]
_KERNEL = CKernel(SOURCE, "edge_sparse24_linear", _ARGS, "the 2:4 sparse CPU INT4 kernel")


def supports(in_features: int, group_size: int) -> bool:
    """The dense float32 kernel's tiling: groups a multiple of 32 dividing K."""
    return group_size % (2 * LANES) == 0 and in_features % group_size == 0


def available() -> bool:
    """Whether the kernel is built (building it now if needed) and loadable here."""
    try:
        _KERNEL.function()
    except RuntimeError as exc:
        logger.warning("%s", exc)
        return False
    return True


def linear(
    x: torch.Tensor, codes: torch.Tensor, index: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] -> [M, N] float32 for a 2:4 weight in the checkpoint's layout (scales float32)."""
    m, k = x.shape
    n = codes.shape[0]
    if not supports(k, group):
        raise ValueError(f"the 2:4 CPU kernel takes groups of a multiple of {2 * LANES} dividing K ({group}, {k})")
    if tuple(codes.shape) != (n, k // 4) or tuple(index.shape) != (n, k // 8):
        raise ValueError(f"2:4 tensors {list(codes.shape)}, {list(index.shape)} do not fit inputs of {k}")
    for t in (codes, index, scales, zeros):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the 2:4 CPU kernel reads contiguous host tensors")
    if scales.dtype != torch.float32 or codes.dtype != torch.uint8 or index.dtype != torch.uint8:
        raise ValueError("the 2:4 CPU kernel takes uint8 codes and positions and float32 scales")
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    rc = _KERNEL.function()(
        x.data_ptr(), m, k, codes.data_ptr(), index.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, group,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the 2:4 CPU kernel failed (code {rc}) on [{m}, {k}] x [{n}, {k}] group {group}")
    return out
