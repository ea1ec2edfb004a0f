"""Triton kernels for INT4 weight-only linears on CUDA (our storage layout, no repacking).

Decode multiplies one (or a few) activation rows by the whole weight, so it is bound by
reading the weight: the GEMV kernel streams the packed codes as 32-bit words,
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
SPLITS = (1, 2, 4, 8, 16)
MIN_BLOCK_N = 8
# Outputs wider than this fill the GPU with their own tiles: no split-K.
SPLIT_MAX_N = 8192


def max_split(n: int) -> int:
    return SPLITS[-1] if n <= SPLIT_MAX_N else 1


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
        part_ptr,
        count_ptr,
        M,
        N,
        K,
        words,
        G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_W: tl.constexpr,
    ):
        """One activation row by BLOCK_N weight rows over 1/SPLIT_K of K.

        The packed bytes are read as int32 words of eight codes each (k order, lowest
        nibble first). A code becomes a float without an int-to-float conversion: OR-ing
        the masked nibble into the bits of 2**23 gives 2**23 + code * 16**j exactly, and
        one subtraction leaves code * 16**j. The 16**-j is folded into the activation,
        which is loaded once per tile, so each weight costs one logic op, one add and
        one FMA. `words` (K/8) is passed rather than computed so that Triton sees its
        divisibility and issues 16-byte loads.

        Batch invariance: every row is its own program (rows vary fastest in the launch
        order, so the programs reading one weight tile run close together and the later
        ones can find it in L2), running the same code with the same tiles whatever the
        number of rows. A row's result is
        therefore bit for bit the same alone or in a batch: a sequence's answer does not
        depend on what else the box is decoding. Split-K partial sums are added in split
        order by the tile's last program (a counter per tile), not by float atomics,
        whose order changes from run to run."""
        row = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
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
        x_row = x_ptr + row * K
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
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
            part = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
            xsum_w = tl.zeros((BLOCK_W,), dtype=tl.float32)
            for j in tl.static_range(8):
                wj, unit = _code_floats(v, hi, j)
                xj = tl.load(x_row + 8 * w_idx + j, mask=w_mask, other=0.0).to(tl.float32)
                xsum_w += xj
                part += wj * (xj * unit)[None, :]
            dot = tl.sum(tl.reshape(part, (BLOCK_N, NG, WG)), axis=2)
            xsum = tl.sum(tl.reshape(xsum_w, (NG, WG)), axis=1)
            acc += tl.sum(sc * (dot - zp * xsum[None, :]), axis=1)
        if SPLIT_K == 1:
            tl.store(out_ptr + row * N + rn, acc, mask=n_mask)
        else:
            # Written through to L2 before the counter moves; the last program reads
            # every split's part from there (volatile loads, no stale L1 lines).
            tl.store(part_ptr + (pid_k * M + row) * N + rn, acc, mask=n_mask, cache_modifier=".wt")
            tl.debug_barrier()
            counter = count_ptr + row * tl.num_programs(1) + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(part_ptr + (s * M + row) * N + rn, mask=n_mask, other=0.0, cache_modifier=".cv")
                tl.store(out_ptr + row * N + rn, total, mask=n_mask)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (CUDA graph replays reuse it)

    def _split_fits(
        configs: list[triton.Config], named_args: dict[str, object], **kwargs: object
    ) -> list[triton.Config]:
        """Split K only where the output is narrow enough to need it (and its partial
        sums small: SPLIT_K x rows x N floats)."""
        n = int(named_args["N"])  # type: ignore[call-overload]
        return [c for c in configs if c.kwargs["SPLIT_K"] <= max_split(n)]

    # Where this Triton can keep the tuner's choices on disk (beside its compiled
    # kernels), a restart neither recompiles nor re-times them.
    _cache_kw = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

    # Tuned per weight shape on first use (a few dozen launches), then cached. One
    # choice per shape, whatever the number of rows: that is what keeps rows
    # batch-invariant.
    _int4_gemv_bits_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": sk}, num_warps=4)
            for bn in (8, 16, 32, 64)
            for bw in (32, 64, 128)
            for sk in SPLITS
        ],
        key=["N", "K"],
        prune_configs_by={"early_config_prune": _split_fits},
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


def _pow2_at_least(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, n - 1).bit_length())


def counter_size(rows: int, n: int) -> int:
    """Split-K tile counters a GEMV of up to `rows` rows and N outputs may use."""
    return rows * -(-n // MIN_BLOCK_N)


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    config: dict[str, int] | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) times the INT4 weight [N, K] -> [M, N] float32.
    Each row's result is the same whatever M is (batch-invariant).

    `config` ({"BLOCK_N", "BLOCK_W", "SPLIT_K"}, optionally "num_warps" and "num_stages")
    skips autotuning (tests, the interpreter, sweeps of the configuration space).

    `counters`: int32 zeros, at least counter_size(M, N) of them, that the caller keeps
    between calls (the kernel leaves them zeroed: each tile's last program resets its
    own). Without them a zeroed buffer is made per call, which inside a captured decode
    step is one more kernel per product.
    """
    m, k = x.shape
    n = qweight.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"the INT4 GEMV takes at most {GEMV_MAX_ROWS} rows, got {m}")
    out = torch.empty(m, n, device=x.device, dtype=torch.float32)
    x = x.contiguous()
    if config is None and not x.is_cuda:
        # CPU tensors only reach a Triton kernel in its interpreter, which cannot time
        # configurations: take a fixed one with few, wide programs (each one is a
        # Python-level loop there): a row's whole output and K in one tile where they fit.
        config = {"BLOCK_N": _pow2_at_least(n, 1024), "BLOCK_W": _pow2_at_least(k // 8, 128), "SPLIT_K": 1}
    # Room for the largest split this width may be tuned to, and a zeroed counter per
    # (row, tile) at the narrowest tile (the last program of a tile resets its own).
    splits = max_split(n) if config is None else config["SPLIT_K"]
    parts = torch.empty(splits if splits > 1 else 0, m, n, device=x.device, dtype=torch.float32)
    if splits <= 1:
        # Never read without a split; empty, not zeros: no fill kernel for it.
        counts = torch.empty(1, device=x.device, dtype=torch.int32)
    elif counters is not None:
        if counters.numel() < counter_size(m, n):
            raise ValueError(f"{counters.numel()} split-K counters for {counter_size(m, n)} tiles")
        counts = counters
    else:
        counts = torch.zeros(counter_size(m, n), device=x.device, dtype=torch.int32)

    def grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (m, triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    words = qweight.view(torch.int32)  # [N, K/8]: eight codes per word, k order
    args = (x, words, scales, zeros, out, parts, counts, m, n, k, k // 8, group)
    if config is None:
        _int4_gemv_bits_tuned[grid](*args)
    else:
        even = (k // 8) % config["BLOCK_W"] == 0
        _int4_gemv_bits_kernel[grid](*args, **config, EVEN_W=even)  # num_warps/num_stages: launch options
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
