"""One decode step of an INT4 Llama in a dozen Triton kernels per layer.

Written op by op in torch, a decode step is about forty kernels per layer (the norm
alone is five, rotary six, attention eight, each INT4 product three), and on a big GPU
each costs more than its work: for an 8B model they added 1.45 ms per token to the
2.9 ms spent reading weights. Here each layer is:

    residual add + RMSNorm -> qkv GEMV -> rotary + KV-cache write -> attention
    (split over the cache, then merged) -> o GEMV -> residual add + RMSNorm ->
    gate/up GEMV -> SiLU * up -> down GEMV

On the CUDA GEMV with bfloat16 activations the norms and the SiLU fold into the products
(folds_norm): o GEMV + residual -> gate/up GEMV + SiLU -> down GEMV + residual -> the
next layer's qkv GEMV, with no kernel between them.

The residual stream stays in float32 between layers (the GEMVs accumulate in float32
and the next kernel reads that directly, so nothing is cast back and forth), and
attention reads the cache only up to each sequence's position, not the whole bucket.
Positions live in a device tensor, so the step captures into one CUDA graph per
KV-length bucket like the torch path does.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from edge.text import cuda_int4, triton_int4
from edge.text.int4 import GEMV_KERNELS, Int4Linear

if TYPE_CHECKING:
    from edge.text.llama import KVCache, LlamaModel
    from edge.text.quant_cache import QuantKVCache

logger = logging.getLogger(__name__)

TRITON_SUPPORT = triton_int4.TRITON_SUPPORT
ATTN_BLOCK_T = 32  # cache positions per attention tile
ATTN_GROUP_ROWS = 16  # query rows per KV head, padded up to the smallest tensor-core tile
MAX_ATTN_SPLITS = 64

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
    def _rope_kv_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        NH,
        NKV,
        max_len,
        q_scale,
        HD: tl.constexpr,
    ):
        """One head of one sequence: rotate q (pre-scaled by 1/sqrt(head_dim)) into the
        query buffer, rotate k into the cache at the position, copy v into the cache."""
        b = tl.program_id(0)
        head = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        row = qkv_ptr + b * (NH + 2 * NKV) * HD + head * HD
        if head < NH + NKV:
            o1, o2 = rotate(row, cos_ptr, sin_ptr, pos, HD)
            if head < NH:
                store_halves(q_ptr + (b * NH + head) * HD, o1 * q_scale, o2 * q_scale, HD)
            else:
                store_halves(k_cache_ptr + ((b * NKV + head - NH) * max_len + pos) * HD, o1, o2, HD)
        else:
            rd = tl.arange(0, HD)
            dst = v_cache_ptr + ((b * NKV + head - NH - NKV) * max_len + pos) * HD
            tl.store(dst + rd, tl.load(row + rd).to(v_cache_ptr.dtype.element_ty))

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
        SPLITS: tl.constexpr,
        GROUP: tl.constexpr,
        GP: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        F32_DOT: tl.constexpr,
    ):
        """The query heads of one KV head attend to one chunk of the cache (online
        softmax); the partial sums go to a scratch buffer for the merge kernel. A chunk
        beyond the sequence's position reads nothing and leaves m = -inf, l = 0.
        F32_DOT widens the operands first, for Triton's CPU interpreter, whose bf16 dot
        is wrong; on a GPU the products run on bf16 tensor cores."""
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // NKV
        kh = bh % NKV
        pos = tl.load(pos_ptr + b)
        start = sp * chunk
        end = tl.minimum(start + chunk, pos + 1)
        rg = tl.arange(0, GP)
        g_mask = rg < GROUP
        rd = tl.arange(0, HD)
        q = tl.load(q_ptr + (b * NH + kh * GROUP + rg)[:, None] * HD + rd[None, :], mask=g_mask[:, None], other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        m = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, HD), dtype=tl.float32)
        base = bh * max_len * HD
        for t0 in range(start, end, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T)
            t_mask = rt < end
            k = tl.load(k_cache_ptr + base + rt[:, None] * HD + rd[None, :], mask=t_mask[:, None], other=0.0)
            if F32_DOT:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k))  # [GP, BLOCK_T], float32
            scores = tl.where(t_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + base + rt[:, None] * HD + rd[None, :], mask=t_mask[:, None], other=0.0)
            if F32_DOT:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # Only the GROUP real query rows are stored (the merge reads no others): the
        # padded rows would be three quarters of the scratch traffic at GROUP 4.
        slot = (bh * SPLITS + sp) * GP + rg
        tl.store(acc_ptr + slot[:, None] * HD + rd[None, :], acc, mask=g_mask[:, None])
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
    ):
        """Combine the chunks of one query head: weights exp(m_s - max m), then divide by
        the weighted sum of the chunks' softmax denominators."""
        bh = tl.program_id(0)
        g = tl.program_id(1)
        b = bh // NKV
        kh = bh % NKV
        rs = tl.arange(0, SPLITS)
        rd = tl.arange(0, HD)
        slot = (bh * SPLITS + rs) * GP + g
        m = tl.load(ml_ptr + slot * 2)
        l_sum = tl.load(ml_ptr + slot * 2 + 1)
        weight = tl.exp(m - tl.max(m, axis=0))  # chunk 0 always holds position 0: the max is finite
        acc = tl.load(acc_ptr + slot[:, None] * HD + rd[None, :])
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_sum * weight, axis=0)
        tl.store(out_ptr + (b * NH + kh * GROUP + g) * HD + rd, out.to(out_ptr.dtype.element_ty))

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
) -> torch.Tensor:
    """qkv [B, (NH + 2 NKV) * HD] -> rotated, pre-scaled queries [B, NH, HD]; k and v of
    each sequence written into the layer's cache [B', NKV, L, HD] at pos[b]."""
    bsz = qkv.shape[0]
    _, n_kv, max_len, hd = k_cache.shape
    q = torch.empty(bsz, n_heads, hd, device=qkv.device, dtype=k_cache.dtype)
    _rope_kv_kernel[(bsz, n_heads + 2 * n_kv)](
        qkv, cos, sin, pos, q, k_cache, v_cache, n_heads, n_kv, max_len, hd**-0.5, hd, num_warps=1
    )
    return q


def attn_splits(kv_len: int, n_kv: int, sms: int, max_splits: int = MAX_ATTN_SPLITS) -> tuple[int, int]:
    """(splits, chunk): enough chunks of the cache to give every SM work, each at least
    one tile long; a power of two so the merge kernel can reduce over them. Chosen as
    for one sequence whatever the batch, so that a sequence's attention is summed in the
    same order alone or batched (batch invariance)."""
    want = max(1, (2 * sms) // max(1, n_kv))
    splits = 1
    while splits < min(want, max_splits) and kv_len // (splits * 2) >= ATTN_BLOCK_T:
        splits *= 2
    chunk = triton.cdiv(triton.cdiv(kv_len, splits), ATTN_BLOCK_T) * ATTN_BLOCK_T
    return splits, chunk


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, kv_len: int, sms: int
) -> torch.Tensor:
    """q [B, NH, HD] (pre-scaled) against cache positions 0..pos[b] -> [B, NH * HD]."""
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
    _attn_split_kernel[(bsz * n_kv, splits)](
        q, k_cache, v_cache, pos, acc, ml, n_heads, n_kv, max_len, chunk, splits, group, ATTN_GROUP_ROWS, hd,
        ATTN_BLOCK_T, not q.is_cuda, num_warps=4,
    )  # fmt: skip
    out = torch.empty(bsz, n_heads * hd, device=q.device, dtype=q.dtype)
    _attn_merge_kernel[(bsz * n_kv, group)](acc, ml, out, n_heads, n_kv, splits, group, ATTN_GROUP_ROWS, hd)
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


def silu_gate_up(linear: torch.nn.Module, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up [T, F] of a gated unit's [gate; up] product on h [T, K]."""
    if isinstance(linear, Int4Linear):
        out, paired = linear.forward_paired(h)
    else:
        out, paired = linear(h), False
    return silu_mul(out, dtype, paired)


def _gemv(linear: torch.nn.Module, x: torch.Tensor, norm: cuda_int4.NormInput | None = None) -> torch.Tensor:
    if isinstance(linear, Int4Linear):
        return linear.gemv(x, norm)
    assert norm is None
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return (x.to(weight.dtype) @ weight.T).float()


def can_fuse(model: LlamaModel) -> bool:
    """True when every projection is a fused Triton INT4 linear on a CUDA device."""
    if not TRITON_SUPPORT or model.device.type != "cuda":
        return False
    if model.config.num_heads // model.config.num_kv_heads > ATTN_GROUP_ROWS:
        return False
    from edge.text.llama import DecoderLayer  # llama imports this module

    for layer in model.layers:
        if not isinstance(layer, DecoderLayer):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, Int4Linear) and p.kernel in GEMV_KERNELS and p.bias is None for p in parts):
            return False  # biased projections (Qwen2) take the per-op path
    return True


def folds_norm(model: LlamaModel, bsz: int) -> tuple[bool, bool]:
    """(layers, head): whether the step folds each layer's two RMSNorms into the CUDA
    GEMVs around them (cuda_int4.cu's header), and the final one into the head. Only for
    bfloat16: the norm's input is the residual times its weight, not yet divided by the
    RMS, which float16's range would not always hold."""
    from edge.text.llama import DecoderLayer  # llama imports this module

    if not model.fold_norms or model.dtype != torch.bfloat16 or model.device.type != "cuda":
        return False, False
    for layer in model.layers:
        if not isinstance(layer, DecoderLayer):
            return False, False
        attn, mlp = layer.self_attn, layer.mlp
        consumers = (attn.qkv_proj, mlp.gate_up_proj)
        producers = (attn.o_proj, mlp.down_proj)
        if not all(isinstance(p, Int4Linear) and p.folds_norm(bsz, model.dtype, producer=False) for p in consumers):
            return False, False
        if not all(isinstance(p, Int4Linear) and p.folds_norm(bsz, model.dtype, producer=True) for p in producers):
            return False, False
        if not (isinstance(mlp.gate_up_proj, Int4Linear) and mlp.gate_up_proj.paired):
            return False, False
    head = model.lm_head
    return True, isinstance(head, Int4Linear) and head.folds_norm(bsz, model.dtype, producer=False)


# Prefetch a small product's weight into L2 ahead of it only where L2 holds it with room
# to spare (Hopper's 50-60 MB, an A100's 40 MB; not the Orin's 4 MB).
PREFETCH_MIN_L2 = 32 * 2**20
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


class _Prefetcher:
    """Reads a coming product's weight into L2 on a side stream while the step's
    latency-bound kernels (rotary, attention, norms) leave the memory idle, and joins
    the side stream back before that product (a fork and join a CUDA graph captures).
    Only with model.l2_prefetch (off by default: measured no faster on the H200), the
    cuda-mma kernel and a large L2."""

    def __init__(self, model: LlamaModel, device: torch.device) -> None:
        self.side: torch.cuda.Stream | None = None
        if model.l2_prefetch and device.type == "cuda":
            if cuda_int4.l2_bytes(device) >= PREFETCH_MIN_L2:
                if device not in _side_streams:
                    _side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                self.side = _side_streams[device]
        self.pending = False

    def start(self, linear: torch.nn.Module | None) -> None:
        """After what the main stream has queued so far, ask L2 for `linear`'s weight."""
        if self.side is None or not (isinstance(linear, Int4Linear) and linear.kernel == "cuda-mma"):
            return
        if linear.weight_bytes * 2 > cuda_int4.l2_bytes(linear.codes.device):
            return
        self.join()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            cuda_int4.prefetch(linear.tiled)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            assert self.side is not None
            torch.cuda.current_stream().wait_stream(self.side)
            self.pending = False


def _attend(
    model: LlamaModel,
    qkv: torch.Tensor,
    cache: KVCache | QuantKVCache,
    i: int,
    pos: torch.Tensor,
    kv_len: int,
    sms: int,
) -> torch.Tensor:
    """Layer i's rotary, cache write and attention for the step's rows: [B, NH * HD]."""
    from edge.text import triton_kv  # it builds on this module's kernels
    from edge.text.quant_cache import QuantKVCache

    bsz = qkv.shape[0]
    n_heads = model.config.num_heads
    if isinstance(cache, QuantKVCache):
        layer = cache.rows(0, bsz).layer(i)
        q = triton_kv.rope_write(qkv, model.rope_cos, model.rope_sin, pos, layer, n_heads)
        return triton_kv.attention(layer, q, pos, kv_len, q_scale=1.0)
    k_cache, v_cache = cache.k[i, :bsz], cache.v[i, :bsz]
    q = rope_kv_write(qkv, model.rope_cos, model.rope_sin, pos, k_cache, v_cache, n_heads)
    return decode_attention(q, k_cache, v_cache, pos, kv_len, sms)


def fused_decode_step(
    model: LlamaModel, ids: torch.Tensor, cache: KVCache | QuantKVCache, pos: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """Logits [B, V] float32 for one token per sequence at device-side positions pos [B]."""
    from edge.text.llama import DecoderLayer  # llama imports this module

    config = model.config
    dtype = model.dtype
    bsz = ids.shape[0]
    sms = torch.cuda.get_device_properties(ids.device).multi_processor_count if ids.is_cuda else 4
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    ahead = _Prefetcher(model, ids.device)
    fold, fold_head = folds_norm(model, bsz)
    eps = config.rms_norm_eps
    ahead.start(layers[0].self_attn.qkv_proj)
    x = model.embed_tokens(ids.view(bsz)).float()  # the residual stream, float32
    h = add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps)
    norm_in: cuda_int4.NormInput | None = None  # h still to be divided by its RMS (folded norm)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
        ahead.join()
        qkv = _gemv(attn.qkv_proj, h, norm_in)
        ahead.start(attn.o_proj)  # beside the rotary, KV write and attention kernels
        attended = _attend(model, qkv, cache, i, pos, kv_len, sms)
        ahead.join()
        gate_up = mlp.gate_up_proj
        if fold and attended.dtype == dtype:
            assert isinstance(attn.o_proj, Int4Linear) and isinstance(gate_up, Int4Linear)
            residual = cuda_int4.Residual(x, layer.post_attention_layernorm.weight)
            h, norm_in = attn.o_proj.gemv_residual(attended, residual, eps)
            act = gate_up.gemv_silu(h, norm_in)
            assert act is not None
        else:
            o = _gemv(attn.o_proj, attended)
            h, norm_in = add_rmsnorm(x, o, layer.post_attention_layernorm.weight, eps), None
            act = gate_up.gemv_silu(h) if isinstance(gate_up, Int4Linear) and h.dtype == dtype else None
            if act is None:
                act = silu_mul(_gemv(gate_up, h), dtype)
        if i + 1 < len(layers):  # the next layer's q/k/v, beside the down product and the norm
            ahead.start(layers[i + 1].self_attn.qkv_proj)
        last = i + 1 == len(layers)
        next_norm = model.norm.weight if last else layers[i + 1].input_layernorm.weight
        if fold and (fold_head or not last):
            assert isinstance(mlp.down_proj, Int4Linear)
            h, norm_in = mlp.down_proj.gemv_residual(act, cuda_int4.Residual(x, next_norm), eps)
        else:
            down = _gemv(mlp.down_proj, act)
            h, norm_in = add_rmsnorm(x, down, next_norm, eps), None
    ahead.join()
    return _gemv(model.lm_head, h, norm_in)
