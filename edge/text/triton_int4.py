"""Triton kernels for INT4 weight-only linears on CUDA (our storage layout, no repacking).

Decode multiplies one (or a few) activation rows by the whole weight, so it is bound by
reading the weight: the GEMV kernel streams the packed bytes once, unpacks both nibbles
in registers, applies each group's scale and zero point to the partial sums (not to
every weight), and splits K across programs so that even narrow layers fill the GPU.
Prefill (many rows) dequantizes to bf16 once and lets cuBLAS do the matrix product.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    TRITON_SUPPORT = True
except ImportError:  # CPU-only boxes: the kernel is simply not offered
    TRITON_SUPPORT = False

GEMV_MAX_ROWS = 8
DEFAULT_GEMV = "wide"

if TRITON_SUPPORT:

    @triton.jit
    def _int4_gemv_kernel(
        x_ptr,
        qw_ptr,
        scales_ptr,
        zeros_ptr,
        out_ptr,
        M: tl.constexpr,
        N,
        K,
        G: tl.constexpr,
        HALF_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rb = tl.arange(0, HALF_G)
        groups = K // G
        per_split = tl.cdiv(groups, SPLIT_K)
        g_start = pid_k * per_split
        g_end = tl.minimum(g_start + per_split, groups)
        for m in tl.static_range(M):
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for g in range(g_start, g_end):
                k0 = g * G
                byte_ptrs = qw_ptr + rn[:, None] * (K // 2) + (k0 // 2 + rb)[None, :]
                packed = tl.load(byte_ptrs, mask=n_mask[:, None], other=0)
                lo = (packed & 0x0F).to(tl.float32)
                hi = (packed >> 4).to(tl.float32)
                x_even = tl.load(x_ptr + m * K + k0 + 2 * rb).to(tl.float32)
                x_odd = tl.load(x_ptr + m * K + k0 + 2 * rb + 1).to(tl.float32)
                dot = tl.sum(lo * x_even[None, :] + hi * x_odd[None, :], axis=1)
                xsum = tl.sum(x_even + x_odd, axis=0)
                scale = tl.load(scales_ptr + rn * groups + g, mask=n_mask, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + rn * groups + g, mask=n_mask, other=0).to(tl.float32)
                acc += scale * (dot - zero * xsum)
            if SPLIT_K == 1:
                tl.store(out_ptr + m * N + rn, acc, mask=n_mask)
            else:
                tl.atomic_add(out_ptr + m * N + rn, acc, mask=n_mask)

    @triton.jit
    def _int4_gemv_wide_kernel(
        x_ptr,
        qw_ptr,
        scales_ptr,
        zeros_ptr,
        out_ptr,
        M: tl.constexpr,
        N,
        K,
        G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        """Several groups per iteration: BLOCK_K/2 contiguous bytes per row per load,
        both nibbles interleaved back into k order so x is read contiguously."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        NG: tl.constexpr = BLOCK_K // G
        HALF_K: tl.constexpr = BLOCK_K // 2
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rb = tl.arange(0, HALF_K)
        rk = tl.arange(0, BLOCK_K)
        rg = tl.arange(0, NG)
        groups = K // G
        tiles = K // BLOCK_K
        per_split = tl.cdiv(tiles, SPLIT_K)
        t_start = pid_k * per_split
        t_end = tl.minimum(t_start + per_split, tiles)
        for m in tl.static_range(M):
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for t in range(t_start, t_end):
                k0 = t * BLOCK_K
                packed = tl.load(
                    qw_ptr + rn[:, None] * (K // 2) + (k0 // 2 + rb)[None, :], mask=n_mask[:, None], other=0
                )
                w = tl.interleave(packed & 0x0F, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K]
                x = tl.load(x_ptr + m * K + k0 + rk).to(tl.float32)
                prod = tl.reshape(w * x[None, :], (BLOCK_N, NG, G))
                dot = tl.sum(prod, axis=2)  # [BLOCK_N, NG]
                xsum = tl.sum(tl.reshape(x, (NG, G)), axis=1)  # [NG]
                g_idx = k0 // G + rg
                sc = tl.load(scales_ptr + rn[:, None] * groups + g_idx[None, :], mask=n_mask[:, None], other=0.0)
                zp = tl.load(zeros_ptr + rn[:, None] * groups + g_idx[None, :], mask=n_mask[:, None], other=0)
                acc += tl.sum(sc.to(tl.float32) * (dot - zp.to(tl.float32) * xsum[None, :]), axis=1)
            if SPLIT_K == 1:
                tl.store(out_ptr + m * N + rn, acc, mask=n_mask)
            else:
                tl.atomic_add(out_ptr + m * N + rn, acc, mask=n_mask)

    @triton.jit
    def _int4_gemv_dot_kernel(
        x_ptr,
        qw_ptr,
        scales_ptr,
        zeros_ptr,
        out_ptr,
        M,
        N,
        K,
        G: tl.constexpr,
        HALF_G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        """Tensor-core variant: raw 4-bit codes (exact in bf16) go through tl.dot with
        the activation rows padded to BLOCK_M; scale and zero point are applied once per
        group to the [M, N] partial sums. Far fewer instructions per weight than
        unpacking into float FMAs, which is what limits the plain GEMV."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        m_mask = rm < M
        rb = tl.arange(0, HALF_G)
        rk = tl.arange(0, G)
        groups = K // G
        per_split = tl.cdiv(groups, SPLIT_K)
        g_start = pid_k * per_split
        g_end = tl.minimum(g_start + per_split, groups)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(g_start, g_end):
            k0 = g * G
            x = tl.load(x_ptr + rm[:, None] * K + k0 + rk[None, :], mask=m_mask[:, None], other=0.0).to(tl.bfloat16)
            packed = tl.load(qw_ptr + rn[:, None] * (K // 2) + (k0 // 2 + rb)[None, :], mask=n_mask[:, None], other=0)
            codes = tl.interleave(packed & 0x0F, packed >> 4).to(tl.float32).to(tl.bfloat16)  # [BLOCK_N, G]
            part = tl.dot(x, tl.trans(codes))  # [BLOCK_M, BLOCK_N], fp32 accumulate
            xsum = tl.sum(x.to(tl.float32), axis=1)
            sc = tl.load(scales_ptr + rn * groups + g, mask=n_mask, other=0.0).to(tl.float32)
            zp = tl.load(zeros_ptr + rn * groups + g, mask=n_mask, other=0).to(tl.float32)
            acc += (part - xsum[:, None] * zp[None, :]) * sc[None, :]
        ptrs = out_ptr + rm[:, None] * N + rn[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, acc, mask=mask)
        else:
            tl.atomic_add(ptrs, acc, mask=mask)

    _int4_gemv_dot_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "SPLIT_K": sk}, num_warps=nw, num_stages=ns)
            for bn in (32, 64, 128)
            for sk in (1, 2, 4, 8)
            for nw in (4,)
            for ns in (2, 4)
        ],
        key=["N", "K", "M"],
        reset_to_zero=["out_ptr"],
    )(_int4_gemv_dot_kernel)

    _int4_gemv_wide_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=nw)
            for bn in (8, 16, 32)
            for bk in (256, 512)
            for sk in (1, 2, 4, 8)
            for nw in (4,)
        ],
        key=["N", "K", "M"],
        reset_to_zero=["out_ptr"],
    )(_int4_gemv_wide_kernel)

    # Tuned per weight shape on first use (a few dozen launches), then cached.
    _int4_gemv_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "SPLIT_K": sk}, num_warps=nw)
            for bn in (16, 32, 64)
            for sk in (1, 2, 4, 8)
            for nw in (2, 4)
        ],
        key=["N", "K", "M"],
        reset_to_zero=["out_ptr"],
    )(_int4_gemv_kernel)

    @triton.jit
    def _int4_dequant_kernel(
        qw_ptr, scales_ptr, zeros_ptr, w_ptr, N, K, G: tl.constexpr, HALF_G: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        pid_n = tl.program_id(0)
        g = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        half = HALF_G
        rb = tl.arange(0, HALF_G)
        groups = K // G
        packed = tl.load(qw_ptr + rn[:, None] * (K // 2) + (g * half + rb)[None, :], mask=n_mask[:, None], other=0)
        scale = tl.load(scales_ptr + rn * groups + g, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + rn * groups + g, mask=n_mask, other=0).to(tl.float32)
        codes = tl.interleave(packed & 0x0F, packed >> 4).to(tl.float32)  # k order
        w = (codes - zero[:, None]) * scale[:, None]
        rk = tl.arange(0, G)
        tl.store(w_ptr + rn[:, None] * K + g * G + rk[None, :], w.to(w_ptr.dtype.element_ty), mask=n_mask[:, None])


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    config: dict[str, int] | None = None,
    variant: str = DEFAULT_GEMV,
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) times the INT4 weight [N, K] -> [M, N] float32.

    `config` ({"BLOCK_N", "SPLIT_K", "num_warps"}) skips autotuning (tests, interpreter).
    """
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.zeros(m, n, device=x.device, dtype=torch.float32)

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if variant == "dot":
        args_dot = (x.contiguous(), qweight, scales, zeros, out, m, n, k, group, group // 2, 16)
        if config is None:
            _int4_gemv_dot_tuned[grid](*args_dot)
        else:
            _int4_gemv_dot_kernel[grid](*args_dot, **{k_: v for k_, v in config.items() if k_ != "BLOCK_K"})
        return out
    if variant == "wide" and k % 256 == 0:
        args = (x.contiguous(), qweight, scales, zeros, out, m, n, k, group)
        if config is None:
            _int4_gemv_wide_tuned[grid](*args)
        else:
            _int4_gemv_wide_kernel[grid](*args, **config)
        return out
    args_narrow = (x.contiguous(), qweight, scales, zeros, out, m, n, k, group, group // 2)
    if config is None:
        _int4_gemv_tuned[grid](*args_narrow)
    else:
        _int4_gemv_kernel[grid](*args_narrow, **{k_: v for k_, v in config.items() if k_ != "BLOCK_K"})
    return out


def int4_dequant(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    n = qweight.shape[0]
    k = qweight.shape[1] * 2
    w = torch.empty(n, k, device=qweight.device, dtype=dtype)
    block_n = 32
    _int4_dequant_kernel[(triton.cdiv(n, block_n), k // group)](
        qweight, scales, zeros, w, n, k, group, group // 2, block_n
    )
    return w
