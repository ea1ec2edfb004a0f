"""The Triton kernels of a decode layer: residual add + RMSNorm, rotary + KV-cache
write, attention split over the cache and merged, SiLU * up. The fused decode step
(edge/text/runtime/fused_step.py) strings them between the INT4 products.

Each reads the cache only up to each sequence's position, not the whole bucket, and
positions live in a device tensor, so a step that uses them captures into one CUDA
graph per KV-length bucket.
"""

from __future__ import annotations

import logging

import torch

# Re-exported: the quantized cache's kernels (triton_kv.py) split the cache by the same rule.
from edge.text.ops.attention_splits import ATTN_BLOCK_T as ATTN_BLOCK_T
from edge.text.ops.attention_splits import ATTN_GROUP_ROWS as ATTN_GROUP_ROWS
from edge.text.ops.attention_splits import MAX_ATTN_SPLITS as MAX_ATTN_SPLITS
from edge.text.ops.attention_splits import attn_splits as attn_splits
from edge.text.ops.triton import triton_int4

logger = logging.getLogger(__name__)

TRITON_SUPPORT = triton_int4.TRITON_SUPPORT

if TRITON_SUPPORT:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, delta_ptr, w_ptr, h_ptr, H, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        """x += delta (the residual, float32, in place); h = RMSNorm(x) * w."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            x += tl.load(delta_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_ptr + row * H + offs, x, mask=mask)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * H + offs, (x * inv * w).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotate(src, cos_ptr, sin_ptr, pos, HD: tl.constexpr):
        """The rotary embedding of one head's HD values at `src`, at position `pos`:
        (first half, second half) in float32. The tables hold [freqs, freqs], so the
        first half of a row serves both halves."""
        HALF: tl.constexpr = HD // 2
        r = tl.arange(0, HALF)
        x1 = tl.load(src + r).to(tl.float32)
        x2 = tl.load(src + HALF + r).to(tl.float32)
        c = tl.load(cos_ptr + pos * HD + r)
        s = tl.load(sin_ptr + pos * HD + r)
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def store_halves(dst, o1, o2, HD: tl.constexpr):
        """A rotated head (rotate's two halves) stored at `dst`, in dst's element type."""
        HALF: tl.constexpr = HD // 2
        r = tl.arange(0, HALF)
        tl.store(dst + r, o1.to(dst.dtype.element_ty))
        tl.store(dst + HALF + r, o2.to(dst.dtype.element_ty))

    @triton.jit
    def rotate_part(src, dst, cos_ptr, sin_ptr, pos, scale, HD: tl.constexpr, ROT: tl.constexpr,
                    HALF_P: tl.constexpr, PASS_P: tl.constexpr):  # fmt: skip
        """A head of HD values at `src` turned by the rotary at position `pos` over its
        first ROT channels (tables [positions, ROT]; the rest pass unturned), times
        `scale`, stored at `dst` in dst's element type. HALF_P and PASS_P: ROT / 2 and
        HD - ROT rounded up to powers of two (Triton's blocks), the lanes past them masked."""
        RH: tl.constexpr = ROT // 2
        r = tl.arange(0, HALF_P)
        rm = r < RH
        x1 = tl.load(src + r, mask=rm, other=0.0).to(tl.float32)
        x2 = tl.load(src + RH + r, mask=rm, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * ROT + r, mask=rm, other=0.0)
        s = tl.load(sin_ptr + pos * ROT + r, mask=rm, other=0.0)
        tl.store(dst + r, ((x1 * c - x2 * s) * scale).to(dst.dtype.element_ty), mask=rm)
        tl.store(dst + RH + r, ((x2 * c + x1 * s) * scale).to(dst.dtype.element_ty), mask=rm)
        if ROT < HD:
            p = tl.arange(0, PASS_P)
            pm = p < HD - ROT
            x = tl.load(src + ROT + p, mask=pm, other=0.0).to(tl.float32)
            tl.store(dst + ROT + p, (x * scale).to(dst.dtype.element_ty), mask=pm)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        NH,
        NKV,
        max_len,
        q_scale,
        HD: tl.constexpr,
        ROT: tl.constexpr,
        HALF_P: tl.constexpr,
        PASS_P: tl.constexpr,
        HD_P: tl.constexpr,
    ):
        """One head of one sequence: rotate q (pre-scaled by q_scale) into the query
        buffer, rotate k into the cache at the row's slot, copy v into the cache. The
        rotary's position is pos[b], the cache's slot slot[b] (the same but in a sliding
        layer's own buffer: float_cache.py). A Llama head (every channel turned, a power
        of two wide) takes the plain path; a partial rotary (ROT < HD) or a head of
        another width the masked one."""
        b = tl.program_id(0)
        head = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        slot = tl.load(slot_ptr + b)
        row = qkv_ptr + b * (NH + 2 * NKV) * HD + head * HD
        if head < NH + NKV:
            if ROT == HD and HD_P == HD:
                o1, o2 = rotate(row, cos_ptr, sin_ptr, pos, HD)
                if head < NH:
                    store_halves(q_ptr + (b * NH + head) * HD, o1 * q_scale, o2 * q_scale, HD)
                else:
                    store_halves(k_cache_ptr + ((b * NKV + head - NH) * max_len + slot) * HD, o1, o2, HD)
            elif head < NH:
                dst = q_ptr + (b * NH + head) * HD
                rotate_part(row, dst, cos_ptr, sin_ptr, pos, q_scale, HD, ROT, HALF_P, PASS_P)
            else:
                dst = k_cache_ptr + ((b * NKV + head - NH) * max_len + slot) * HD
                rotate_part(row, dst, cos_ptr, sin_ptr, pos, 1.0, HD, ROT, HALF_P, PASS_P)
        else:
            rd = tl.arange(0, HD_P)
            dst = v_cache_ptr + ((b * NKV + head - NH - NKV) * max_len + slot) * HD
            if HD_P == HD:
                tl.store(dst + rd, tl.load(row + rd).to(v_cache_ptr.dtype.element_ty))
            else:
                rm = rd < HD
                tl.store(dst + rd, tl.load(row + rd, mask=rm).to(v_cache_ptr.dtype.element_ty), mask=rm)

    @triton.jit
    def _attn_split_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        pos_ptr,
        acc_ptr,
        ml_ptr,
        NH,
        NKV,
        max_len,
        chunk,
        window,
        SPLITS: tl.constexpr,
        GROUP: tl.constexpr,
        GP: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        F32_DOT: tl.constexpr,
        SLIDING: tl.constexpr,
        HD_P: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """The query heads of one KV head attend to one chunk of the cache (online
        softmax); the partial sums go to a scratch buffer for the merge kernel. A chunk
        beyond the sequence's position reads nothing and leaves m = -inf, l = 0.
        SLIDING: each query sees its last `window` positions only (a sliding layer); tiles
        wholly before them are skipped and the first one read holds the first position
        seen, so no tile has every score masked (whose -inf less -inf would be NaN). A
        chunk wholly before the window reads nothing, as one past the position.
        HD_P: the head's width rounded up to a power of two (Triton's blocks), the
        channels past HD masked. F32_DOT widens the operands first, for Triton's CPU
        interpreter, whose bf16 dot is wrong; on a GPU the products run on bf16 tensor
        cores. PREC: "ieee" for a float32 cache (its products in float32, not TF32)."""
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // NKV
        kh = bh % NKV
        pos = tl.load(pos_ptr + b)
        start = sp * chunk
        end = tl.minimum(start + chunk, pos + 1)
        if SLIDING:
            lo = tl.maximum(pos + 1 - window, 0)
            start = tl.maximum(start, lo // BLOCK_T * BLOCK_T)  # chunks are whole tiles
        rg = tl.arange(0, GP)
        g_mask = rg < GROUP
        rd = tl.arange(0, HD_P)
        d_mask = rd < HD
        q_at = q_ptr + (b * NH + kh * GROUP + rg)[:, None] * HD + rd[None, :]
        if HD_P == HD:
            q = tl.load(q_at, mask=g_mask[:, None], other=0.0)
        else:
            q = tl.load(q_at, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        m = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, HD_P), dtype=tl.float32)
        base = bh * max_len * HD
        for t0 in range(start, end, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T)
            t_mask = rt < end
            if SLIDING:
                t_mask = t_mask & (rt >= lo)
            kv_at = base + rt[:, None] * HD + rd[None, :]
            if HD_P == HD:
                k = tl.load(k_cache_ptr + kv_at, mask=t_mask[:, None], other=0.0)
            else:
                k = tl.load(k_cache_ptr + kv_at, mask=t_mask[:, None] & d_mask[None, :], other=0.0)
            if F32_DOT:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PREC)  # [GP, BLOCK_T], float32
            scores = tl.where(t_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if HD_P == HD:
                v = tl.load(v_cache_ptr + kv_at, mask=t_mask[:, None], other=0.0)
            else:
                v = tl.load(v_cache_ptr + kv_at, mask=t_mask[:, None] & d_mask[None, :], other=0.0)
            if F32_DOT:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        # Only the GROUP real query rows are stored (the merge reads no others): the
        # padded rows would be three quarters of the scratch traffic at GROUP 4.
        slot = (bh * SPLITS + sp) * GP + rg
        if HD_P == HD:
            tl.store(acc_ptr + slot[:, None] * HD + rd[None, :], acc, mask=g_mask[:, None])
        else:
            tl.store(acc_ptr + slot[:, None] * HD + rd[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(ml_ptr + slot * 2, m, mask=g_mask)
        tl.store(ml_ptr + slot * 2 + 1, l_sum, mask=g_mask)

    @triton.jit
    def _attn_merge_kernel(
        acc_ptr,
        ml_ptr,
        out_ptr,
        NH,
        NKV,
        SPLITS: tl.constexpr,
        GROUP: tl.constexpr,
        GP: tl.constexpr,
        HD: tl.constexpr,
        HD_P: tl.constexpr,
    ):
        """Combine the chunks of one query head: weights exp(m_s - max m), then divide by
        the weighted sum of the chunks' softmax denominators. The chunk holding the
        position always read something, so the max is finite; a chunk that read nothing
        (past the position, or before a sliding layer's window) weighs nothing."""
        bh = tl.program_id(0)
        g = tl.program_id(1)
        b = bh // NKV
        kh = bh % NKV
        rs = tl.arange(0, SPLITS)
        rd = tl.arange(0, HD_P)
        d_mask = rd < HD
        slot = (bh * SPLITS + rs) * GP + g
        m = tl.load(ml_ptr + slot * 2)
        l_sum = tl.load(ml_ptr + slot * 2 + 1)
        weight = tl.exp(m - tl.max(m, axis=0))
        if HD_P == HD:
            acc = tl.load(acc_ptr + slot[:, None] * HD + rd[None, :])
        else:
            acc = tl.load(acc_ptr + slot[:, None] * HD + rd[None, :], mask=d_mask[None, :], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_sum * weight, axis=0)
        at = out_ptr + (b * NH + kh * GROUP + g) * HD + rd
        if HD_P == HD:
            tl.store(at, out.to(out_ptr.dtype.element_ty))
        else:
            tl.store(at, out.to(out_ptr.dtype.element_ty), mask=d_mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, F, BLOCK: tl.constexpr):
        """gate/up [B, 2F] (float32 from the GEMV) -> silu(gate) * up [B, F]."""
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < F
        gate = tl.load(gu_ptr + row * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * F + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_paired_kernel(gu_ptr, out_ptr, F, BLOCK: tl.constexpr):
        """A paired gate/up product [T, 2F] (cuda_int4.pair_order: each 16 columns are 8
        gate then the same 8 up) -> silu(gate) * up [T, F] in the original order."""
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < F
        col = (offs // 8) * 16 + offs % 8
        gate = tl.load(gu_ptr + t * 2 * F + col, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + t * 2 * F + col + 8, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + t * F + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_prefill_kernel(
        qkv_ptr, cos_ptr, sin_ptr, row_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
        T, NH, NKV, max_len, q_scale, HD: tl.constexpr, HALF_P: tl.constexpr, HD_P: tl.constexpr,
    ):  # fmt: skip
        """Token t, one head: q rotated and pre-scaled into q [T, NH, HD]; k rotated and v
        copied into k/v [NKV, T, HD] (what attention reads) and into the cache's row. A
        head whose width is not a power of two takes rotate_part's masked lanes."""
        t = tl.program_id(0)
        head = tl.program_id(1)
        row = tl.load(row_ptr)
        src = qkv_ptr + t * (NH + 2 * NKV) * HD + head * HD
        if head < NH + NKV:
            if HD_P == HD:
                o1, o2 = rotate(src, cos_ptr, sin_ptr, t, HD)
                if head < NH:
                    store_halves(q_ptr + (t * NH + head) * HD, o1 * q_scale, o2 * q_scale, HD)
                else:
                    kv = head - NH
                    store_halves(k_ptr + (kv * T + t) * HD, o1, o2, HD)
                    store_halves(k_cache_ptr + ((row * NKV + kv) * max_len + t) * HD, o1, o2, HD)
            elif head < NH:
                rotate_part(src, q_ptr + (t * NH + head) * HD, cos_ptr, sin_ptr, t, q_scale, HD, HD, HALF_P, 1)
            else:
                kv = head - NH
                rotate_part(src, k_ptr + (kv * T + t) * HD, cos_ptr, sin_ptr, t, 1.0, HD, HD, HALF_P, 1)
                cached_k = k_cache_ptr + ((row * NKV + kv) * max_len + t) * HD
                rotate_part(src, cached_k, cos_ptr, sin_ptr, t, 1.0, HD, HD, HALF_P, 1)
        else:
            kv = head - NH - NKV
            rd = tl.arange(0, HD_P)
            rm = rd < HD
            val = tl.load(src + rd, mask=rm)
            tl.store(v_ptr + (kv * T + t) * HD + rd, val.to(v_ptr.dtype.element_ty), mask=rm)
            cached = v_cache_ptr + ((row * NKV + kv) * max_len + t) * HD
            tl.store(cached + rd, val.to(v_cache_ptr.dtype.element_ty), mask=rm)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, H] float32 (updated in place to x + delta); returns RMSNorm(x) in weight's dtype."""
    bsz, hidden = x.shape
    h = torch.empty(bsz, hidden, device=x.device, dtype=weight.dtype)
    block = triton.next_power_of_2(hidden)
    _add_rmsnorm_kernel[(bsz,)](
        x, x if delta is None else delta, weight, h, hidden, eps, delta is not None, block, num_warps=8
    )
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
    position less the row's offset), turned by the rotary at pos[b]. The tables' width is
    the channels of a head the rotary turns (a partial rotary: fewer than HD)."""
    bsz = qkv.shape[0]
    _, n_kv, max_len, hd = k_cache.shape
    rot = _rotated(cos, sin, hd)
    q = torch.empty(bsz, n_heads, hd, device=qkv.device, dtype=k_cache.dtype)
    _rope_kv_kernel[(bsz, n_heads + 2 * n_kv)](
        qkv, cos, sin, pos, pos if slots is None else slots, q, k_cache, v_cache, n_heads, n_kv, max_len,
        hd**-0.5 if q_scale is None else q_scale, hd, rot, _pow2(rot // 2), _pow2(hd - rot), _pow2(hd), num_warps=1,
    )  # fmt: skip
    return q


def _pow2(n: int) -> int:
    """n rounded up to a power of two (at least 1): a Triton block's width."""
    return 1 << max(0, n - 1).bit_length()


def _rotated(cos: torch.Tensor, sin: torch.Tensor, hd: int) -> int:
    """The channels of a head the rotary tables turn (their width): even, at most hd."""
    rot = cos.shape[-1]
    if sin.shape != cos.shape or rot % 2 or not 0 < rot <= hd:
        raise ValueError(f"rotary tables of width {rot} for heads of {hd} channels")
    return int(rot)


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
    bsz, n_heads, hd = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    if group > ATTN_GROUP_ROWS:
        raise ValueError(f"{group} query heads per KV head; the fused attention takes at most {ATTN_GROUP_ROWS}")
    splits, chunk = attn_splits(kv_len, n_kv, sms)
    rows = bsz * n_kv * splits * ATTN_GROUP_ROWS
    acc = torch.empty(rows, hd, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows, 2, device=q.device, dtype=torch.float32)
    max_len = k_cache.shape[2]
    hd_p = max(16, _pow2(hd))  # (tl.dot's operands are at least 16 wide)
    _attn_split_kernel[(bsz * n_kv, splits)](
        q, k_cache, v_cache, pos, acc, ml, n_heads, n_kv, max_len, chunk, window, splits, group, ATTN_GROUP_ROWS, hd,
        ATTN_BLOCK_T, not q.is_cuda, window > 0, hd_p, "ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    out = torch.empty(bsz, n_heads * hd, device=q.device, dtype=q.dtype)
    _attn_merge_kernel[(bsz * n_kv, group)](acc, ml, out, n_heads, n_kv, splits, group, ATTN_GROUP_ROWS, hd, hd_p)
    return out


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype, paired: bool = False) -> torch.Tensor:
    """silu(gate) * up [B, F] of a [gate; up] product [B, 2F], in the INT4 kernel's
    paired column order where `paired`."""
    bsz, width = gate_up.shape
    f = width // 2
    out = torch.empty(bsz, f, device=gate_up.device, dtype=dtype)
    block = 1024
    kernel = _silu_mul_paired_kernel if paired else _silu_mul_kernel
    kernel[(bsz, triton.cdiv(f, block))](gate_up, out, f, block)
    return out


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
    v [NKV, T, HD]; k and v also written into cache row `row` [1] of the layer's cache
    [rows, NKV, L, HD]."""
    tokens = qkv.shape[0]
    _, n_kv, max_len, hd = k_cache.shape
    dtype = k_cache.dtype
    q = torch.empty(tokens, n_heads, hd, device=qkv.device, dtype=dtype)
    k = torch.empty(n_kv, tokens, hd, device=qkv.device, dtype=dtype)
    v = torch.empty(n_kv, tokens, hd, device=qkv.device, dtype=dtype)
    _rope_prefill_kernel[(tokens, n_heads + 2 * n_kv)](
        qkv, cos, sin, row, q, k, v, k_cache, v_cache, tokens, n_heads, n_kv, max_len, hd**-0.5, hd,
        _pow2(hd // 2), _pow2(hd), num_warps=1,
    )  # fmt: skip
    return q, k, v
