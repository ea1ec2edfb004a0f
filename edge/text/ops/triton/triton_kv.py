"""Triton kernels for a quantized KV cache on CUDA (edge/text/kv/quant_cache.py's layout).

- writing a decode step's token: into the ring slot of its position, and, when a key
  block leaves the window with this step, that block coded from the ring in the same
  program (the block's tokens are all older than the step's, so no other program of the
  launch writes them). The fused decode step does this in its rotary kernel
  (`rope_write`); the per-op step through `write_tokens`;
- attention split over the cache like decode_ops', each tile read from the codes
  (below the row's coded length) or from the float ring, then merged by decode_ops'
  merge kernel. int4 codes hold the even channel in the low nibble, so every tile is
  taken as its even and its odd channels: two products per tile, no interleaving.

Codes are computed as quant_cache computes them in torch (float32, IEEE division,
halves rounded up), so a cache coded here equals one coded there, code for code.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from edge.text.ops.triton import decode_ops

if TYPE_CHECKING:  # the cache's layer, read by attribute: ops sit below kv
    from edge.text.kv.quant_cache import QuantLayer

# The int8 attention program: warps, software-pipeline stages, cache positions per tile
# (at most a key block, so that a tile has one set of key scales), how many times the
# float kernel's splits of the cache it takes, and a register cap.
# - Twice the splits: at 4K on an 8B-shaped layer each program then takes one tile of
#   64 positions rather than two in series. On the H200 that measured 9.2 us a layer
#   against 10.4 with the float kernel's splits (float16 KV: 9.5), and at 16K 23.1
#   against the float kernel's 24.7.
# - The cap keeps it at 128 registers a thread, 4 programs an SM; with the value tile
#   loaded before the key product it took 152 (3 programs an SM) and was 30% slower at 16K.
ATTN8_WARPS = 4
ATTN8_STAGES = 1
ATTN8_SPREAD = 2.0
ATTN8_BLOCK_T = 64
ATTN8_MAXNREG = 128
# The window the attention kernels take for a layer without one: every position is seen
# (a branch-free bound; a ternary on a runtime value would compile to two typed branches).
NO_WINDOW = 1 << 30
ROPE_WRITE_WARPS = 2  # warps of the fused step's rotary-and-write program
BLOCK_CODERS = 8  # programs a KV head sharing a leaving key block's coding (a power of two)

if decode_ops.TRITON_SUPPORT:
    import triton
    import triton.language as tl

    @triton.jit
    def _ring_slot(pos, max_len, RING: tl.constexpr):
        """The ring slot of a position: the scratch slot past the ring for the row's last."""
        return tl.where(pos == max_len - 1, RING, pos % RING)

    @triton.jit
    def _block_due(pos, max_len, KB: tl.constexpr, W: tl.constexpr):
        """Whether the token at `pos` is the one with which a key block leaves the window
        (quant_cache's fmt.coded grows by KB there); the block is pos - W - KB ..."""
        return (pos != max_len - 1) & (pos - W >= KB) & ((pos - W) % KB == 0)

    @triton.jit
    def _code_keys(
        pos,
        head,
        ring_ptr,
        codes_ptr,
        scale_ptr,
        zero_ptr,
        code_len,
        blocks,
        HD: tl.constexpr,
        KB: tl.constexpr,
        W: tl.constexpr,
        RING: tl.constexpr,
        INT4: tl.constexpr,
        SINK: tl.constexpr,
        part=0,
        PARTS: tl.constexpr = 1,
    ):
        """Code the key block leaving the window with the token at `pos`, from the ring
        (scales per channel): its tokens are older than that one, written by earlier
        launches. The sink tokens (read float) count as the one after them. Channels are
        independent here, so the block may be coded in PARTS programs, `part` of them
        taking its share of the channel pairs."""
        HALF: tl.constexpr = HD // 2
        r = part * (HALF // PARTS) + tl.arange(0, HALF // PARTS)
        b0 = pos - W - KB
        rt = b0 + tl.arange(0, KB)
        src = ring_ptr + ((head * (RING + 1) + tl.maximum(rt, SINK) % RING) * HD)[:, None]
        ke = tl.load(src + 2 * r[None, :]).to(tl.float32)
        ko = tl.load(src + 2 * r[None, :] + 1).to(tl.float32)
        # Slots t % code_len and b % blocks: a sliding layer's codes are a circle of its
        # window's blocks (quant_cache.py); a block never wraps (code_len is whole blocks).
        at = (head * blocks + (b0 // KB) % blocks) * HD
        code_at = ((head * code_len + b0 % code_len + tl.arange(0, KB)) * (HALF if INT4 else HD))[:, None]
        if INT4:
            lo_e = tl.min(ke, axis=0).to(tl.float16).to(tl.float32)
            lo_o = tl.min(ko, axis=0).to(tl.float16).to(tl.float32)
            s_e = ((tl.max(ke, axis=0) - lo_e) / 15.0).to(tl.float16).to(tl.float32)
            s_o = ((tl.max(ko, axis=0) - lo_o) / 15.0).to(tl.float16).to(tl.float32)
            c_e = tl.math.div_rn(ke - lo_e[None, :], tl.where(s_e > 0, s_e, 1.0)[None, :])
            c_o = tl.math.div_rn(ko - lo_o[None, :], tl.where(s_o > 0, s_o, 1.0)[None, :])
            c_e = tl.minimum(tl.maximum(tl.floor(c_e + 0.5), 0.0), 15.0).to(tl.uint8)
            c_o = tl.minimum(tl.maximum(tl.floor(c_o + 0.5), 0.0), 15.0).to(tl.uint8)
            tl.store(codes_ptr + code_at + r[None, :], c_e | (c_o << 4))
            tl.store(zero_ptr + at + 2 * r, lo_e.to(tl.float16))
            tl.store(zero_ptr + at + 2 * r + 1, lo_o.to(tl.float16))
        else:
            s_e = (tl.max(tl.abs(ke), axis=0) / 127.0).to(tl.float16).to(tl.float32)
            s_o = (tl.max(tl.abs(ko), axis=0) / 127.0).to(tl.float16).to(tl.float32)
            c_e = tl.math.div_rn(ke, tl.where(s_e > 0, s_e, 1.0)[None, :])
            c_o = tl.math.div_rn(ko, tl.where(s_o > 0, s_o, 1.0)[None, :])
            c_e = tl.minimum(tl.maximum(tl.floor(c_e + 0.5), -127.0), 127.0).to(tl.int8)
            c_o = tl.minimum(tl.maximum(tl.floor(c_o + 0.5), -127.0), 127.0).to(tl.int8)
            tl.store(codes_ptr + code_at + 2 * r[None, :], c_e)
            tl.store(codes_ptr + code_at + 2 * r[None, :] + 1, c_o)
        tl.store(scale_ptr + at + 2 * r, s_e.to(tl.float16))
        tl.store(scale_ptr + at + 2 * r + 1, s_o.to(tl.float16))

    @triton.jit
    def _code_values(
        pos,
        head,
        ring_ptr,
        codes_ptr,
        scale_ptr,
        zero_ptr,
        code_len,
        HD: tl.constexpr,
        KB: tl.constexpr,
        VG: tl.constexpr,
        W: tl.constexpr,
        RING: tl.constexpr,
        INT4: tl.constexpr,
        VSYM: tl.constexpr,
        part=0,
        PARTS: tl.constexpr = 1,
    ):
        """Code the values of the block leaving the window with the token at `pos`
        (scales per token and group of VG channels); tokens are independent, so PARTS
        programs may share the block, `part` of them taking its share of the tokens."""
        HALF: tl.constexpr = HD // 2
        NG: tl.constexpr = HD // VG
        GH: tl.constexpr = VG // 2
        KT: tl.constexpr = KB // PARTS
        r = tl.arange(0, HALF)
        b0 = pos - W - KB
        rt = b0 + part * KT + tl.arange(0, KT)
        src = ring_ptr + ((head * (RING + 1) + rt % RING) * HD)[:, None]
        ve = tl.reshape(tl.load(src + 2 * r[None, :]).to(tl.float32), (KT, NG, GH))
        vo = tl.reshape(tl.load(src + 2 * r[None, :] + 1).to(tl.float32), (KT, NG, GH))
        slot = head * code_len + b0 % code_len + part * KT + tl.arange(0, KT)  # as _code_keys's
        g_at = slot[:, None] * NG + tl.arange(0, NG)[None, :]
        code_at = (slot * (HALF if INT4 else HD))[:, None]
        if INT4 and VSYM:
            amax = tl.maximum(tl.max(tl.abs(ve), axis=2), tl.max(tl.abs(vo), axis=2))
            s = (amax / 7.0).to(tl.float16).to(tl.float32)
            safe = tl.where(s > 0, s, 1.0)[:, :, None]
            c_e = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(ve, safe) + 0.5), -7.0), 7.0) + 8.0
            c_o = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(vo, safe) + 0.5), -7.0), 7.0) + 8.0
            c_e = c_e.to(tl.uint8)
            c_o = c_o.to(tl.uint8)
            tl.store(codes_ptr + code_at + r[None, :], tl.reshape(c_e | (c_o << 4), (KT, HALF)))
        elif INT4:
            lo = tl.minimum(tl.min(ve, axis=2), tl.min(vo, axis=2)).to(tl.float16).to(tl.float32)
            hi = tl.maximum(tl.max(ve, axis=2), tl.max(vo, axis=2))
            s = ((hi - lo) / 15.0).to(tl.float16).to(tl.float32)
            safe = tl.where(s > 0, s, 1.0)[:, :, None]
            c_e = tl.math.div_rn(ve - lo[:, :, None], safe)
            c_o = tl.math.div_rn(vo - lo[:, :, None], safe)
            c_e = tl.minimum(tl.maximum(tl.floor(c_e + 0.5), 0.0), 15.0).to(tl.uint8)
            c_o = tl.minimum(tl.maximum(tl.floor(c_o + 0.5), 0.0), 15.0).to(tl.uint8)
            tl.store(codes_ptr + code_at + r[None, :], tl.reshape(c_e | (c_o << 4), (KT, HALF)))
            tl.store(zero_ptr + g_at, lo.to(tl.float16))
        else:
            amax = tl.maximum(tl.max(tl.abs(ve), axis=2), tl.max(tl.abs(vo), axis=2))
            s = (amax / 127.0).to(tl.float16).to(tl.float32)
            safe = tl.where(s > 0, s, 1.0)[:, :, None]
            c_e = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(ve, safe) + 0.5), -127.0), 127.0)
            c_o = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(vo, safe) + 0.5), -127.0), 127.0)
            tl.store(codes_ptr + code_at + 2 * r[None, :], tl.reshape(c_e, (KT, HALF)).to(tl.int8))
            tl.store(codes_ptr + code_at + 2 * r[None, :] + 1, tl.reshape(c_o, (KT, HALF)).to(tl.int8))
        tl.store(scale_ptr + g_at, s.to(tl.float16))

    @triton.jit
    def _write_kernel(
        k_ptr,
        v_ptr,
        pos_ptr,
        ring_k,
        ring_v,
        kc,
        ks,
        kz,
        vc,
        vs,
        vz,
        sink_k,
        sink_v,
        NKV,
        max_len,
        code_len,
        blocks,
        HD: tl.constexpr,
        KB: tl.constexpr,
        VG: tl.constexpr,
        W: tl.constexpr,
        RING: tl.constexpr,
        INT4: tl.constexpr,
        VSYM: tl.constexpr,
        SINK: tl.constexpr,
    ):
        """One KV head's key or value of one row's new token (k, v [B, NKV, HD]) into the
        ring, and the block leaving the window with it coded."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        rd = tl.arange(0, HD)
        pos = tl.load(pos_ptr + b)
        slot = _ring_slot(pos, max_len, RING)
        due = _block_due(pos, max_len, KB, W)
        if h < NKV:
            head = b * NKV + h
            x = tl.load(k_ptr + head * HD + rd)
            tl.store(ring_k + (head * (RING + 1) + slot) * HD + rd, x.to(ring_k.dtype.element_ty))
            if pos < SINK:
                tl.store(sink_k + (head * SINK + pos) * HD + rd, x.to(sink_k.dtype.element_ty))
            if due:
                _code_keys(pos, head, ring_k, kc, ks, kz, code_len, blocks, HD, KB, W, RING, INT4, SINK)
        else:
            head = b * NKV + h - NKV
            x = tl.load(v_ptr + head * HD + rd)
            tl.store(ring_v + (head * (RING + 1) + slot) * HD + rd, x.to(ring_v.dtype.element_ty))
            if pos < SINK:
                tl.store(sink_v + (head * SINK + pos) * HD + rd, x.to(sink_v.dtype.element_ty))
            if due:
                _code_values(pos, head, ring_v, vc, vs, vz, code_len, HD, KB, VG, W, RING, INT4, VSYM)

    @triton.jit
    def _rope_write_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_ptr,
        ring_k,
        ring_v,
        kc,
        ks,
        kz,
        vc,
        vs,
        vz,
        sink_k,
        sink_v,
        NH,
        NKV,
        max_len,
        code_len,
        blocks,
        q_scale,
        HD: tl.constexpr,
        KB: tl.constexpr,
        VG: tl.constexpr,
        W: tl.constexpr,
        RING: tl.constexpr,
        INT4: tl.constexpr,
        VSYM: tl.constexpr,
        SINK: tl.constexpr,
        CODERS: tl.constexpr,
    ):
        """decode_ops' rotary kernel for a quantized cache: q rotated and pre-scaled
        into the query buffer; k rotated and v written as _write_kernel writes them.

        On the step a key block leaves the window it is coded here too. With CODERS > 0
        the launch has CODERS more programs a KV head that share that coding (each its
        share of the keys' channel pairs and of the values' tokens), beside the rotary
        programs and at the same time: the block's tokens are older than the step's, so
        no rotary program writes them. One program coding a whole block took about 16
        times the launch's usual time on the H200 (23.8 us), every 64th step of every
        layer; shared by 8 coders a KV head the launch took 8.3 us on that step. With
        CODERS 0 (a head size or key block that does not split) the KV head's key program
        codes its keys and its value program its values."""
        b = tl.program_id(0)
        head = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        due = _block_due(pos, max_len, KB, W)
        row = qkv_ptr + b * (NH + 2 * NKV) * HD + head * HD
        slot = _ring_slot(pos, max_len, RING)
        if head >= NH + 2 * NKV:
            # Launched only with coders; the constant test keeps the compiler from
            # building a coder with no parts (the interpreter never reaches it).
            if CODERS > 0:
                if due:
                    coder = head - NH - 2 * NKV
                    kv = b * NKV + coder // CODERS
                    part = coder % CODERS
                    _code_keys(pos, kv, ring_k, kc, ks, kz, code_len, blocks, HD, KB, W, RING, INT4, SINK, part, CODERS)
                    _code_values(pos, kv, ring_v, vc, vs, vz, code_len, HD, KB, VG, W, RING, INT4, VSYM, part, CODERS)
        elif head < NH + NKV:
            o1, o2 = decode_ops.rotate(row, cos_ptr, sin_ptr, pos, HD)
            if head < NH:
                decode_ops.store_halves(q_ptr + (b * NH + head) * HD, o1 * q_scale, o2 * q_scale, HD)
            else:
                kv = b * NKV + head - NH
                decode_ops.store_halves(ring_k + (kv * (RING + 1) + slot) * HD, o1, o2, HD)
                if pos < SINK:
                    decode_ops.store_halves(sink_k + (kv * SINK + pos) * HD, o1, o2, HD)
                if CODERS == 0:
                    if due:
                        _code_keys(pos, kv, ring_k, kc, ks, kz, code_len, blocks, HD, KB, W, RING, INT4, SINK)
        else:
            kv = b * NKV + head - NH - NKV
            rd = tl.arange(0, HD)
            dst = ring_v + (kv * (RING + 1) + slot) * HD
            x = tl.load(row + rd)
            tl.store(dst + rd, x.to(ring_v.dtype.element_ty))
            if pos < SINK:
                tl.store(sink_v + (kv * SINK + pos) * HD + rd, x.to(sink_v.dtype.element_ty))
            if CODERS == 0:
                if due:
                    _code_values(pos, kv, ring_v, vc, vs, vz, code_len, HD, KB, VG, W, RING, INT4, VSYM)

    @triton.jit
    def _softmax_step(scores, t_mask, m, l_sum):
        """One tile's step of the online softmax: (weights, the old sums' rescale, the new
        running max, the new running sum); positions outside t_mask weigh nothing."""
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        return p, alpha, m_new, l_sum * alpha + tl.sum(p, axis=1)

    @triton.jit
    def _span(qh, sp, pos_ptr, start_in, coded_in, NKV, chunk, window, KB: tl.constexpr, W: tl.constexpr,
              DECODE: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
        """Where attention program (qh, sp) works: its query qi and KV head kh, the cache
        row and head it reads, where that row's float tokens start (fbase), and its chunk
        of positions: coded tiles start..below, float tiles below..end, the first position
        the query sees (lo: in a sliding layer its last `window` positions; tiles wholly
        before it skipped). DECODE: query qi is row qi's token at pos[qi],
        coded up to fmt.coded(pos+1); else position start_in + qi of row 0, coded up to
        coded_in."""
        qi = qh // NKV
        kh = qh % NKV
        if DECODE:
            pos = tl.load(pos_ptr + qi)
            row = qi
            coded = tl.maximum(pos - W, 0) // KB * KB
            fbase = 0
        else:
            pos = start_in + qi
            row = 0
            coded = coded_in
            fbase = coded_in
        start = sp * chunk
        end = tl.minimum(start + chunk, pos + 1)
        lo = tl.maximum(pos + 1 - window, 0)  # (no window: _attend passes NO_WINDOW)
        start = tl.maximum(start, lo // BLOCK_T * BLOCK_T)  # still on a tile, so in one key block
        below = tl.maximum(tl.minimum(end, coded), start)
        return qi, kh, row, row * NKV + kh, fbase, start, below, end, lo

    @triton.jit
    def _attn_kernel(
        q_ptr,
        kc,
        ks,
        kz,
        vc,
        vs,
        vz,
        kf_ptr,
        vf_ptr,
        sink_k,
        sink_v,
        pos_ptr,
        acc_ptr,
        ml_ptr,
        start_in,
        coded_in,
        q_scale,
        window,
        NH,
        NKV,
        code_len,
        blocks,
        falloc,
        fmod,
        chunk,
        SPLITS: tl.constexpr,
        GROUP: tl.constexpr,
        GP: tl.constexpr,
        HD: tl.constexpr,
        KB: tl.constexpr,
        VG: tl.constexpr,
        W: tl.constexpr,
        INT4: tl.constexpr,
        VSYM: tl.constexpr,
        SINK: tl.constexpr,
        DECODE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        F32_DOT: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """The query heads of one KV head of query i attend to one chunk of the cache
        (online softmax, partial sums to the merge kernel, as decode_ops' split
        kernel). DECODE: query i is row i's token at pos[i], coded up to fmt.coded(pos+1),
        its float tokens in the row's ring; else query i is position start_in + i of row
        0, coded up to coded_in, its float tokens from position coded_in on in a run of
        float tokens of one row (kf, vf [1, NKV, falloc, HD]). A tile lies wholly below
        or above the coded length (key blocks are whole tiles). int4 codes only: int8
        goes to _attn8_kernel."""
        HALF: tl.constexpr = HD // 2
        NG: tl.constexpr = HD // VG
        qh = tl.program_id(0)
        sp = tl.program_id(1)
        qi, kh, row, head, fbase, start, below, end, lo = _span(
            qh, sp, pos_ptr, start_in, coded_in, NKV, chunk, window, KB, W, DECODE, BLOCK_T
        )
        rg = tl.arange(0, GP)
        g_mask = rg < GROUP
        rh = tl.arange(0, HALF)
        q_at = ((qi * NH + kh * GROUP + rg) * HD)[:, None]
        q_e32 = tl.load(q_ptr + q_at + 2 * rh[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32) * q_scale
        q_o32 = tl.load(q_ptr + q_at + 2 * rh[None, :] + 1, mask=g_mask[:, None], other=0.0).to(tl.float32) * q_scale
        dt = tl.float32 if F32_DOT else kf_ptr.dtype.element_ty
        q_e = q_e32.to(dt)
        q_o = q_o32.to(dt)
        rd = tl.arange(0, HD)
        m = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros((GP,), dtype=tl.float32)
        acc_e = tl.zeros((GP, HALF), dtype=tl.float32)
        acc_o = tl.zeros((GP, HALF), dtype=tl.float32)
        for t0 in range(start, below, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T)
            t_mask = (rt < end) & (rt >= lo)
            # Packed codes read whole and split into even and odd channels. The keys' scales
            # (and zero points) are folded into the query, once a tile; the values'
            # scales, one per token and group, multiply the codes.
            # Slots t % code_len and b % blocks (a tile lies in one block: never wraps).
            blk = (t0 // KB) % blocks
            s_at = (head * blocks + blk) * HD + 2 * rh
            q_ks_e = (q_e32 * tl.load(ks + s_at).to(tl.float32)[None, :]).to(dt)
            q_ks_o = (q_o32 * tl.load(ks + s_at + 1).to(tl.float32)[None, :]).to(dt)
            tok = head * code_len + t0 % code_len + tl.arange(0, BLOCK_T)
            g_at = tok[:, None] * NG + tl.arange(0, NG)[None, :]
            vs_t = tl.load(vs + g_at, mask=t_mask[:, None], other=0.0).to(tl.float32)[:, :, None]
            c_at = (tok * HALF)[:, None] + rh[None, :]
            kp = tl.load(kc + c_at, mask=t_mask[:, None], other=0)
            vp = tl.load(vc + c_at, mask=t_mask[:, None], other=0)
            ck_e, ck_o = (kp & 15).to(dt), (kp >> 4).to(dt)
            cv_e, cv_o = (vp & 15).to(tl.float32), (vp >> 4).to(tl.float32)
            if VSYM:
                cv_e, cv_o = cv_e - 8.0, cv_o - 8.0
            scores = tl.dot(q_ks_e, tl.trans(ck_e), input_precision=PREC) + tl.dot(
                q_ks_o, tl.trans(ck_o), input_precision=PREC
            )
            v_e = tl.reshape(tl.reshape(cv_e, (BLOCK_T, NG, HALF // NG)) * vs_t, (BLOCK_T, HALF))
            v_o = tl.reshape(tl.reshape(cv_o, (BLOCK_T, NG, HALF // NG)) * vs_t, (BLOCK_T, HALF))
            z_e = tl.load(kz + s_at).to(tl.float32)
            z_o = tl.load(kz + s_at + 1).to(tl.float32)
            q_z = tl.sum(q_e32 * z_e[None, :], axis=1) + tl.sum(q_o32 * z_o[None, :], axis=1)
            scores += q_z[:, None]
            if not VSYM:
                vz_t = tl.load(vz + g_at, mask=t_mask[:, None], other=0.0).to(tl.float32)[:, :, None]
                v_e += tl.reshape(tl.broadcast_to(vz_t, (BLOCK_T, NG, HALF // NG)), (BLOCK_T, HALF))
                v_o += tl.reshape(tl.broadcast_to(vz_t, (BLOCK_T, NG, HALF // NG)), (BLOCK_T, HALF))
            if SINK > 0:
                if t0 < SINK:  # the first tokens: float, in place of their codes
                    sunk = rt < SINK
                    sk_at = ((head * SINK + rt) * HD)[:, None] + rd[None, :]
                    sk_e, sk_o = tl.split(
                        tl.reshape(tl.load(sink_k + sk_at, mask=sunk[:, None], other=0.0), (BLOCK_T, HALF, 2))
                    )
                    sv_e, sv_o = tl.split(
                        tl.reshape(tl.load(sink_v + sk_at, mask=sunk[:, None], other=0.0), (BLOCK_T, HALF, 2))
                    )
                    sunk_scores = tl.dot(q_e, tl.trans(sk_e.to(dt)), input_precision=PREC) + tl.dot(
                        q_o, tl.trans(sk_o.to(dt)), input_precision=PREC
                    )
                    scores = tl.where(sunk[None, :], sunk_scores, scores)
                    v_e = tl.where(sunk[:, None], sv_e.to(tl.float32), v_e)
                    v_o = tl.where(sunk[:, None], sv_o.to(tl.float32), v_o)
            v_e, v_o = v_e.to(dt), v_o.to(dt)
            p, alpha, m, l_sum = _softmax_step(scores, t_mask, m, l_sum)
            acc_e = acc_e * alpha[:, None] + tl.dot(p.to(dt), v_e, input_precision=PREC)
            acc_o = acc_o * alpha[:, None] + tl.dot(p.to(dt), v_o, input_precision=PREC)
        for t0 in range(below, end, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T)
            t_mask = (rt < end) & (rt >= lo)
            slot = (rt - fbase) % fmod
            f_at = (((row * NKV + kh) * falloc + slot) * HD)[:, None] + rd[None, :]
            k_e, k_o = tl.split(tl.reshape(tl.load(kf_ptr + f_at, mask=t_mask[:, None], other=0.0), (BLOCK_T, HALF, 2)))
            v_e, v_o = tl.split(tl.reshape(tl.load(vf_ptr + f_at, mask=t_mask[:, None], other=0.0), (BLOCK_T, HALF, 2)))
            scores = tl.dot(q_e, tl.trans(k_e.to(dt)), input_precision=PREC) + tl.dot(
                q_o, tl.trans(k_o.to(dt)), input_precision=PREC
            )
            v_e, v_o = v_e.to(dt), v_o.to(dt)
            p, alpha, m, l_sum = _softmax_step(scores, t_mask, m, l_sum)
            acc_e = acc_e * alpha[:, None] + tl.dot(p.to(dt), v_e, input_precision=PREC)
            acc_o = acc_o * alpha[:, None] + tl.dot(p.to(dt), v_o, input_precision=PREC)
        slot_out = (qh * SPLITS + sp) * GP + rg  # the real query rows only, as decode_ops'
        tl.store(acc_ptr + (slot_out * HD)[:, None] + 2 * rh[None, :], acc_e, mask=g_mask[:, None])
        tl.store(acc_ptr + (slot_out * HD)[:, None] + 2 * rh[None, :] + 1, acc_o, mask=g_mask[:, None])
        tl.store(ml_ptr + slot_out * 2, m, mask=g_mask)
        tl.store(ml_ptr + slot_out * 2 + 1, l_sum, mask=g_mask)


if decode_ops.TRITON_SUPPORT:

    @triton.jit
    def _attn8_kernel(
        q_ptr,
        kc,
        ks,
        vc,
        vs,
        kf_ptr,
        vf_ptr,
        sink_k,
        sink_v,
        pos_ptr,
        acc_ptr,
        ml_ptr,
        start_in,
        coded_in,
        q_scale,
        window,
        NH,
        NKV,
        code_len,
        blocks,
        falloc,
        fmod,
        chunk,
        SPLITS: tl.constexpr,
        GROUP: tl.constexpr,
        GP: tl.constexpr,
        HD: tl.constexpr,
        KB: tl.constexpr,
        VG: tl.constexpr,
        W: tl.constexpr,
        SINK: tl.constexpr,
        DECODE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        F32_DOT: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """_attn_kernel for int8 codes, whose channels are not packed: tiles are read whole,
        as decode_ops' float kernel reads them. The keys' scales are folded into the
        query (one product a tile); a value's scale, one per token, into the softmax
        weights, so the codes go to the tensor cores as they are (integers to 127 are
        exact in bf16). The coded tiles and the float ones run as two loops without a
        branch inside, which Triton can pipeline as it does the float kernel's."""
        NG: tl.constexpr = HD // VG
        qh = tl.program_id(0)
        sp = tl.program_id(1)
        qi, kh, row, head, fbase, start, below, end, lo = _span(
            qh, sp, pos_ptr, start_in, coded_in, NKV, chunk, window, KB, W, DECODE, BLOCK_T
        )
        rg = tl.arange(0, GP)
        g_mask = rg < GROUP
        rd = tl.arange(0, HD)
        q_at = ((qi * NH + kh * GROUP + rg) * HD)[:, None] + rd[None, :]
        q32 = tl.load(q_ptr + q_at, mask=g_mask[:, None], other=0.0).to(tl.float32) * q_scale
        dt = tl.float32 if F32_DOT else kf_ptr.dtype.element_ty
        q = q32.to(dt)
        m = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, HD), dtype=tl.float32)
        for t0 in range(start, below, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T)
            t_mask = (rt < end) & (rt >= lo)
            # Slots t % code_len and b % blocks (a tile lies in one block: never wraps).
            q_ks = (q32 * tl.load(ks + (head * blocks + (t0 // KB) % blocks) * HD + rd).to(tl.float32)[None, :]).to(dt)
            tok = head * code_len + t0 % code_len + tl.arange(0, BLOCK_T)
            c_at = (tok * HD)[:, None] + rd[None, :]
            ck = tl.load(kc + c_at, mask=t_mask[:, None], other=0).to(dt)
            scores = tl.dot(q_ks, tl.trans(ck), input_precision=PREC)
            # The value tile is loaded after the key product: issued before it (one trip to
            # memory for a one-tile program), it is held in registers across the product
            # (see ATTN8_MAXNREG).
            cv = tl.load(vc + c_at, mask=t_mask[:, None], other=0).to(dt)
            if NG == 1:
                v_w = tl.load(vs + tok, mask=t_mask, other=0.0).to(tl.float32)  # per token: onto p
                v = cv
            else:
                g_at = tok[:, None] * NG + tl.arange(0, NG)[None, :]
                vs_t = tl.load(vs + g_at, mask=t_mask[:, None], other=0.0).to(tl.float32)[:, :, None]
                v = tl.reshape(tl.reshape(cv.to(tl.float32), (BLOCK_T, NG, VG)) * vs_t, (BLOCK_T, HD)).to(dt)
                v_w = tl.full((BLOCK_T,), 1.0, dtype=tl.float32)
            if SINK > 0:
                if t0 < SINK:  # the first tokens: float, in place of their codes
                    sunk = rt < SINK
                    sk_at = ((head * SINK + rt) * HD)[:, None] + rd[None, :]
                    sk = tl.load(sink_k + sk_at, mask=sunk[:, None], other=0.0).to(dt)
                    sv = tl.load(sink_v + sk_at, mask=sunk[:, None], other=0.0).to(dt)
                    scores = tl.where(sunk[None, :], tl.dot(q, tl.trans(sk), input_precision=PREC), scores)
                    v = tl.where(sunk[:, None], sv, v)
                    v_w = tl.where(sunk, 1.0, v_w)
            p, alpha, m, l_sum = _softmax_step(scores, t_mask, m, l_sum)
            acc = acc * alpha[:, None] + tl.dot((p * v_w[None, :]).to(dt), v, input_precision=PREC)
        for t0 in range(below, end, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T)
            t_mask = (rt < end) & (rt >= lo)
            slot = (rt - fbase) % fmod
            f_at = (((row * NKV + kh) * falloc + slot) * HD)[:, None] + rd[None, :]
            k = tl.load(kf_ptr + f_at, mask=t_mask[:, None], other=0.0).to(dt)
            v = tl.load(vf_ptr + f_at, mask=t_mask[:, None], other=0.0).to(dt)
            scores = tl.dot(q, tl.trans(k), input_precision=PREC)
            p, alpha, m, l_sum = _softmax_step(scores, t_mask, m, l_sum)
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=PREC)
        slot_out = (qh * SPLITS + sp) * GP + rg  # the real query rows only, as decode_ops'
        tl.store(acc_ptr + (slot_out * HD)[:, None] + rd[None, :], acc, mask=g_mask[:, None])
        tl.store(ml_ptr + slot_out * 2, m, mask=g_mask)
        tl.store(ml_ptr + slot_out * 2 + 1, l_sum, mask=g_mask)


def _layout(layer: QuantLayer) -> dict[str, int | bool]:
    """The format's constants the kernels are specialised on."""
    fmt, dim = layer.fmt, layer.ring_k.shape[-1]
    return {
        "HD": dim,
        "KB": fmt.key_block,
        "VG": fmt.group(dim),
        "W": fmt.window,
        "INT4": fmt.dtype == "int4",
        "VSYM": fmt.value_symmetric,
        "SINK": fmt.sink,
    }


def _zeros(layer: QuantLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The zero-point tensors (int4), or the scales standing in where a kernel never reads them."""
    return (
        layer.k_zero if layer.k_zero.numel() else layer.k_scale,
        layer.v_zero if layer.v_zero.numel() else layer.v_scale,
    )


def _sink(layer: QuantLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink tensors, or the ring standing in where a kernel never reads them."""
    if layer.sink_k.numel():
        return layer.sink_k, layer.sink_v
    return layer.ring_k, layer.ring_v


def write_tokens(layer: QuantLayer, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """k, v [B, NKV, HD] (rotated) of one new token per row at pos [B] into the layer."""
    bsz, n_kv, _ = k.shape
    kz, vz = _zeros(layer)
    _write_kernel[(bsz, 2 * n_kv)](
        k.contiguous(), v.contiguous(), pos, layer.ring_k, layer.ring_v, layer.k_codes, layer.k_scale, kz,
        layer.v_codes, layer.v_scale, vz, *_sink(layer), n_kv, layer.max_len, layer.code_len, layer.k_scale.shape[2],
        RING=layer.fmt.ring, num_warps=2, **_layout(layer),
    )  # fmt: skip


def rope_write(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, layer: QuantLayer, n_heads: int
) -> torch.Tensor:
    """decode_ops.rope_kv_write for a quantized cache: rotated, pre-scaled queries
    [B, NH, HD]; each row's k and v written into the layer at pos[b]."""
    bsz = qkv.shape[0]
    n_kv, hd = layer.ring_k.shape[1], layer.ring_k.shape[-1]
    coders = _block_coders(hd, layer.fmt.key_block)
    q = torch.empty(bsz, n_heads, hd, device=qkv.device, dtype=layer.ring_k.dtype)
    kz, vz = _zeros(layer)
    _rope_write_kernel[(bsz, n_heads + 2 * n_kv + n_kv * coders)](
        qkv, cos, sin, pos, q, layer.ring_k, layer.ring_v, layer.k_codes, layer.k_scale, kz, layer.v_codes,
        layer.v_scale, vz, *_sink(layer), n_heads, n_kv, layer.max_len, layer.code_len, layer.k_scale.shape[2],
        hd**-0.5, RING=layer.fmt.ring, CODERS=coders, num_warps=ROPE_WRITE_WARPS, **_layout(layer),
    )  # fmt: skip
    return q


def _block_coders(head_dim: int, key_block: int) -> int:
    """Programs a KV head that _rope_write_kernel adds to code a block leaving the window:
    BLOCK_CODERS where that many split the head's channel pairs and the block's tokens
    evenly, else 0 (the key and value programs code it)."""
    n = BLOCK_CODERS
    return n if n > 0 and (head_dim // 2) % n == 0 and key_block % n == 0 else 0


def _attend(
    layer: QuantLayer,
    q: torch.Tensor,
    float_kv: tuple[torch.Tensor, torch.Tensor],
    fmod: int,
    pos: torch.Tensor | None,
    start: int,
    coded: int,
    kv_len: int,
    splits: int,
    chunk: int,
    q_scale: float,
    window: int,
) -> torch.Tensor:
    nq, n_heads, hd = q.shape
    n_kv = layer.ring_k.shape[1]
    group = n_heads // n_kv
    if group > decode_ops.ATTN_GROUP_ROWS:
        raise ValueError(f"{group} query heads per KV head; the attention takes at most {decode_ops.ATTN_GROUP_ROWS}")
    rows = nq * n_kv * splits * decode_ops.ATTN_GROUP_ROWS
    acc = torch.empty(rows, hd, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows, 2, device=q.device, dtype=torch.float32)
    kz, vz = _zeros(layer)
    kf, vf = float_kv
    seen = window or NO_WINDOW
    prec = "ieee" if kf.dtype == torch.float32 else "tf32"  # a float32 float part: no TF32
    if layer.fmt.dtype == "int8":
        layout = _layout(layer)
        block_t = math.gcd(ATTN8_BLOCK_T, layer.fmt.key_block)  # tiles never straddle a key block
        chunk = triton.cdiv(chunk, block_t) * block_t  # splits start on a tile (and so a block)
        _attn8_kernel[(nq * n_kv, splits)](
            q, layer.k_codes, layer.k_scale, layer.v_codes, layer.v_scale, kf, vf, *_sink(layer),
            pos if pos is not None else q, acc, ml, start, coded, q_scale, seen, n_heads, n_kv, layer.code_len,
            layer.k_scale.shape[2], kf.shape[2], fmod, chunk, splits, group, decode_ops.ATTN_GROUP_ROWS,
            HD=hd, KB=layout["KB"], VG=layout["VG"], W=layout["W"], SINK=layout["SINK"],
            DECODE=pos is not None, BLOCK_T=block_t, F32_DOT=not q.is_cuda, PREC=prec,
            num_warps=ATTN8_WARPS, num_stages=ATTN8_STAGES,
            **({"maxnreg": ATTN8_MAXNREG} if ATTN8_MAXNREG and q.is_cuda else {}),
        )  # fmt: skip
    else:
        _attn_kernel[(nq * n_kv, splits)](
            q, layer.k_codes, layer.k_scale, kz, layer.v_codes, layer.v_scale, vz, kf, vf, *_sink(layer),
            pos if pos is not None else q, acc, ml, start, coded, q_scale, seen, n_heads, n_kv, layer.code_len,
            layer.k_scale.shape[2], kf.shape[2], fmod, chunk, splits, group, decode_ops.ATTN_GROUP_ROWS,
            DECODE=pos is not None, BLOCK_T=decode_ops.ATTN_BLOCK_T, F32_DOT=not q.is_cuda, PREC=prec,
            num_warps=4, **_layout(layer),
        )  # fmt: skip
    out = torch.empty(nq, n_heads * hd, device=q.device, dtype=kf.dtype)
    decode_ops._attn_merge_kernel[(nq * n_kv, group)](
        acc, ml, out, n_heads, n_kv, splits, group, decode_ops.ATTN_GROUP_ROWS, hd, hd
    )
    return out


def attention(
    layer: QuantLayer, q: torch.Tensor, pos: torch.Tensor, kv_len: int, q_scale: float, window: int = 0
) -> torch.Tensor:
    """q [B, NH, HD] (times q_scale) of each row's token at pos[b] against its cache
    positions 0..pos[b] (in a sliding layer, `window` > 0, its last `window` of them)
    -> [B, NH * HD] in the cache's float type."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    spread = ATTN8_SPREAD if layer.fmt.dtype == "int8" else 1.0
    splits, chunk = decode_ops.attn_splits(
        kv_len, layer.ring_k.shape[1], int(sms * spread), int(decode_ops.MAX_ATTN_SPLITS * spread)
    )
    ring = (layer.ring_k, layer.ring_v)
    return _attend(layer, q, ring, layer.fmt.ring, pos, 0, 0, kv_len, splits, chunk, q_scale, window)


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
    chunk = triton.cdiv(end, decode_ops.ATTN_BLOCK_T) * decode_ops.ATTN_BLOCK_T
    out = _attend(
        layer, q.contiguous(), (float_k.contiguous(), float_v.contiguous()), float_k.shape[2], None, start, coded,
        end, 1, chunk, q_scale, window,
    )  # fmt: skip
    return out.view(q.shape[0], q.shape[1], q.shape[2])
