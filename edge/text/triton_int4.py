"""Triton kernels for INT4 weight-only linears on CUDA (our storage layout, no repacking).

Decode multiplies one (or a few) activation rows by the whole weight, so it is bound by
reading the weight: the GEMV kernel streams the packed codes once as 32-bit words,
turns them into floats with bit operations (no conversions), applies each group's scale
and zero point to the partial sums (not to every weight), and splits K across programs
so that even narrow layers fill the GPU. Prefill (many rows) dequantizes to bf16 once
and lets cuBLAS do the matrix product.
"""

from __future__ import annotations

import inspect
import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
    import triton.testing

    TRITON_SUPPORT = True
except ImportError:  # CPU-only boxes: the kernel is simply not offered
    TRITON_SUPPORT = False

GEMV_MAX_ROWS = 8
# The largest partial-product tile (rows x BLOCK_N x BLOCK_W floats) a program of four
# warps keeps in registers: the one-row kernel's largest (64 x 64).
MAX_TILE_ELEMENTS = 4096

if TRITON_SUPPORT:

    @triton.jit
    def _code_floats(v, hi, J: tl.constexpr):
        """Code J of every word as a float, times the power of 16 its bits sit at, and
        the unit that undoes that power (folded into the activation by the caller).
        OR-ing the masked code into the bits of 2**23 gives 2**23 + code * 16**s exactly;
        one subtraction leaves code * 16**s. Codes 5..7 come from `hi` (the word >> 12),
        so every code's bits stay inside the 23-bit mantissa."""
        if J < 5:
            bits = (v & (15 << (4 * J))) | 0x4B000000
            unit = 1.0 / (1 << (4 * J))
        else:
            bits = (hi & (15 << (4 * (J - 3)))) | 0x4B000000
            unit = 1.0 / (1 << (4 * (J - 3)))
        return bits.to(tl.float32, bitcast=True) - 8388608.0, unit

    @triton.jit
    def _int4_gemv_bits_kernel(
        x_ptr,
        qw_ptr,
        scales_ptr,
        zeros_ptr,
        out_ptr,
        M,
        N,
        K,
        words,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_W: tl.constexpr,
    ):
        """The packed bytes read as int32 words of eight codes each (k order, lowest
        nibble first). A code becomes a float without an int-to-float conversion: OR-ing
        the masked nibble into the bits of 2**23 gives 2**23 + code * 16**j exactly, and
        one subtraction leaves code * 16**j. The 16**-j is folded into the activation,
        which is loaded once per tile, so each weight costs one logic op, one add and
        one FMA. With several activation rows (continuous batching) the codes are
        decoded once per tile and shared by the rows. `words` (K/8) is passed rather
        than computed so that Triton sees its divisibility and issues 16-byte loads."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        WG: tl.constexpr = G // 8  # words per group
        NG: tl.constexpr = BLOCK_W // WG  # groups per tile
        groups = K // G
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rw = tl.arange(0, BLOCK_W)
        rg = tl.arange(0, NG)
        tiles = tl.cdiv(words, BLOCK_W)
        per_split = tl.cdiv(tiles, SPLIT_K)
        t_start = pid_k * per_split
        t_end = tl.minimum(t_start + per_split, tiles)
        rm = tl.arange(0, BLOCK_M)
        m_mask = rm < M
        if BLOCK_M == 1:
            acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(t_start, t_end):
            w_idx = tl.max_contiguous(tl.multiple_of(t * BLOCK_W + rw, BLOCK_W), BLOCK_W)
            if EVEN_W:
                w_mask = rw < BLOCK_W
                v = tl.load(qw_ptr + rn[:, None] * words + w_idx[None, :], mask=n_mask[:, None], other=0)
            else:
                w_mask = w_idx < words
                v = tl.load(
                    qw_ptr + rn[:, None] * words + w_idx[None, :], mask=n_mask[:, None] & w_mask[None, :], other=0
                )
            hi = v >> 12  # codes 5..7 into the low 20 bits (the shifted-in sign bits are masked off)
            g_idx = t * NG + rg
            g_mask = n_mask[:, None] & (g_idx < groups)[None, :]
            sc = tl.load(scales_ptr + rn[:, None] * groups + g_idx[None, :], mask=g_mask, other=0.0).to(tl.float32)
            zp = tl.load(zeros_ptr + rn[:, None] * groups + g_idx[None, :], mask=g_mask, other=0).to(tl.float32)
            if BLOCK_M == 1:
                # One activation row (batch-1 decode): plain 2-D tiles.
                part1 = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
                xsum_w1 = tl.zeros((BLOCK_W,), dtype=tl.float32)
                for j in tl.static_range(8):
                    wj, unit = _code_floats(v, hi, j)
                    xj = tl.load(x_ptr + 8 * w_idx + j, mask=w_mask, other=0.0).to(tl.float32)
                    xsum_w1 += xj
                    part1 += wj * (xj * unit)[None, :]
                dot1 = tl.sum(tl.reshape(part1, (BLOCK_N, NG, WG)), axis=2)
                xsum1 = tl.sum(tl.reshape(xsum_w1, (NG, WG)), axis=1)
                acc1 += tl.sum(sc * (dot1 - zp * xsum1[None, :]), axis=1)
            else:
                x_rows = x_ptr + rm[:, None] * K + 8 * w_idx[None, :]
                x_mask = m_mask[:, None] & w_mask[None, :]
                part = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)
                xsum_w = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
                for j in tl.static_range(8):
                    wj, unit = _code_floats(v, hi, j)
                    xj = tl.load(x_rows + j, mask=x_mask, other=0.0).to(tl.float32)
                    xsum_w += xj
                    part += wj[None, :, :] * (xj * unit)[:, None, :]
                dot = tl.sum(tl.reshape(part, (BLOCK_M, BLOCK_N, NG, WG)), axis=3)
                xsum = tl.sum(tl.reshape(xsum_w, (BLOCK_M, NG, WG)), axis=2)
                acc += tl.sum(sc[None, :, :] * (dot - zp[None, :, :] * xsum[:, None, :]), axis=2)
        if BLOCK_M == 1:
            if SPLIT_K == 1:
                tl.store(out_ptr + rn, acc1, mask=n_mask)
            else:
                tl.atomic_add(out_ptr + rn, acc1, mask=n_mask)
        else:
            ptrs = out_ptr + rm[:, None] * N + rn[None, :]
            mask = m_mask[:, None] & n_mask[None, :]
            if SPLIT_K == 1:
                tl.store(ptrs, acc, mask=mask)
            else:
                tl.atomic_add(ptrs, acc, mask=mask)

    def _fits_registers(
        configs: list[triton.Config], named_args: dict[str, object], **kwargs: object
    ) -> list[triton.Config]:
        """Drop tiles that cannot live in registers with several activation rows: the
        M x N x W partial products of a program, spread over its 128 threads. A tile
        that spills is slow (the tuner would not pick it), and merely compiling and
        running it once makes the driver reserve local memory for every thread the GPU
        can hold, which it keeps: gigabytes, outside any allocator, on a large GPU."""
        rows = int(named_args.get("BLOCK_M", 1))  # type: ignore[call-overload]
        if rows == 1:
            return configs
        return [c for c in configs if rows * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_W"] <= MAX_TILE_ELEMENTS]

    # Where this Triton can keep the tuner's choices on disk (beside its compiled
    # kernels), a restart neither recompiles nor re-times them.
    _cache_kw = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

    # Tuned per weight shape on first use (a few dozen launches), then cached.
    _int4_gemv_bits_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": sk}, num_warps=4)
            for bn in (8, 16, 32, 64)
            for bw in (32, 64)
            for sk in (1, 2, 4, 8, 16)
        ],
        # Keyed by the row count's power-of-two bucket (the kernel is compiled per
        # BLOCK_M anyway): four tunings per weight shape cover every decode batch, so
        # tune_gemv can run them all at load.
        key=["N", "K", "BLOCK_M"],
        prune_configs_by={"early_config_prune": _fits_registers},
        reset_to_zero=["out_ptr"],
        # Timed inside a CUDA graph, as decode runs it: launch overhead would otherwise
        # dominate a 10-40 us kernel and the choice would swing from run to run.
        do_bench=lambda kernel_call, quantiles: triton.testing.do_bench_cudagraph(
            kernel_call, rep=20, quantiles=quantiles
        ),
        **_cache_kw,
    )(triton.heuristics({"EVEN_W": lambda a: a["words"] % a["BLOCK_W"] == 0})(_int4_gemv_bits_kernel))

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
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) times the INT4 weight [N, K] -> [M, N] float32.

    `config` ({"BLOCK_N", "BLOCK_W", "SPLIT_K"}) skips autotuning (tests, the interpreter).
    """
    m, k = x.shape
    n = qweight.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"the INT4 GEMV takes at most {GEMV_MAX_ROWS} rows, got {m}")
    out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    x = x.contiguous()
    if config is None and not x.is_cuda:
        # CPU tensors only reach a Triton kernel in its interpreter, which cannot time
        # configurations: take a fixed one with few, wide programs (each one is a
        # Python-level loop there).
        config = {"BLOCK_N": 128, "BLOCK_W": 32, "SPLIT_K": 1}

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    words = qweight.view(torch.int32)  # [N, K/8]: eight codes per word, k order
    args = (x, words, scales, zeros, out, m, n, k, k // 8, group, triton.next_power_of_2(m))
    if config is None:
        _int4_gemv_bits_tuned[grid](*args)
    else:
        even = (k // 8) % config["BLOCK_W"] == 0
        _int4_gemv_bits_kernel[grid](*args, **config, EVEN_W=even)
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
