"""One decode step of an INT4 Llama-family model in a dozen kernels per layer: the
runtime's step where the model allows it (decode_step).

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

The families' options (LlamaConfig.family_options, all of IMPLEMENTED) are served in the
same step: Qwen3's and Gemma 3's q/k head norms (a norm over each q and k head of the qkv
product, before the rotary kernel); a sliding window (the attention kernels take it,
reading a sliding layer's own buffer of the float cache at the positions less the row's
offset, computed on the device as the per-op step does); Gemma 3's local layers' own
rotary table; Phi-4-mini's partial rotary (the rotary kernel turns the tables' width of a
head and passes the rest); Gemma's GeGLU (GELU in its tanh form times up, in torch after
the gate/up GEMV), its norms of each branch's output before the residual add (our norm
kernel), its query scale (the rotary kernel's pre-scale), its scaled embedding and its
soft-capped logits. Over a quantized cache a partial rotary is turned in torch and
written by the cache's own write kernel. Where an option is set the norms are not folded.

The residual stream stays in float32 between layers (the GEMVs accumulate in float32
and the next kernel reads that directly, so nothing is cast back and forth), and
attention reads the cache only up to each sequence's position, not the whole bucket.
Positions live in a device tensor, so the step captures into one CUDA graph per
KV-length bucket like the torch path does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edge.text.kv.float_cache import KVCache
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.llama import Attention, DecoderLayer, LlamaModel, apply_rope
from edge.text.ops import sparse24, step_ops
from edge.text.ops.cuda import cuda_int4
from edge.text.ops.int4 import GEMV_KERNELS, Int4Linear
from edge.text.ops.sparse24 import Sparse24Linear
from edge.text.ops.step_ops import add_rmsnorm, decode_attention, rope_kv_write, silu_mul
from edge.text.runtime import cpu_step

logger = logging.getLogger(__name__)

# The family options (LlamaConfig.family_options, by the first word of each name) the
# step implements on CUDA with either backend's kernels: every option of today's families.
IMPLEMENTED = (
    "qk_norm",
    "sliding_window",
    "rope_local_theta",
    "mlp_activation",
    "embedding_scale",
    "output_norms",
    "attention_scale",
    "final_logit_softcap",
    "rotary_dim",
)


def decode_step(
    model: LlamaModel, ids: torch.Tensor, cache: KVCache | QuantKVCache, pos: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """Logits [B, V] for one token per sequence at device-side positions `pos` [B]: the
    fused step where the model allows it (decided on first use, kept in
    model.fused_decode), else the model's own step, op by op."""
    if model.fused_decode is None:
        model.fused_decode = can_fuse(model)
    if model.fused_decode and model.device.type == "cpu":
        if isinstance(cache, KVCache):  # a quantized cache is read by the per-op step's kernel
            return cpu_step.decode_step(model, ids, cache, pos, kv_len)
    elif model.fused_decode and (isinstance(cache, KVCache) or step_ops.quantized_kv(model.device)):
        return fused_decode_step(model, ids, cache, pos, kv_len)
    return model.decode_step(ids, cache, pos, kv_len)


def steps_on_cpu(model: LlamaModel) -> bool:
    """Whether this model's decode steps run in the CPU's C step (over a float cache)."""
    if model.fused_decode is None:
        model.fused_decode = can_fuse(model)
    return bool(model.fused_decode) and model.device.type == "cpu"


def _gemv(linear: torch.nn.Module, x: torch.Tensor, norm: cuda_int4.NormInput | None = None) -> torch.Tensor:
    if isinstance(linear, Int4Linear):
        return linear.gemv(x, norm)
    assert norm is None
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return (x.to(weight.dtype) @ weight.T).float()


def refusal(model: LlamaModel) -> str | None:
    """Why the fused kernels cannot serve this model's graph, naming what they do not
    implement (a family option not in IMPLEMENTED, a GGUF file's block minimums or
    weights in halves); None where they can."""
    options = [name for name in model.config.family_options() if name.split()[0] not in IMPLEMENTED]
    if any(isinstance(m, Int4Linear) and m.minimums is not None for m in model.modules()):
        options.append("block minimums (a GGUF file's Q4_1 weights)")
    if any(isinstance(m, Sparse24Linear) for m in model.modules()):
        options.append(sparse24.REFUSED)
    if any(isinstance(m, Int4Linear) and m.halves for m in model.modules()):
        options.append("weights in two INT4 halves (a GGUF file's Q8_0 weights)")
    return f"they do not implement {', '.join(options)}" if options else None


def can_fuse(model: LlamaModel) -> bool:
    """True when every projection is a fused INT4 linear on a CUDA device whose step
    kernels (Triton's or our CUDA ones, ops/step_ops.py) take the model, or on the CPU
    where our C step takes it (runtime/cpu_step.py)."""
    if model.device.type == "cpu":
        return cpu_step.can_run(model)
    if model.device.type != "cuda":
        return False
    config = model.config
    refused = refusal(model) or step_ops.attention_refusal(
        model.device, config.head_dim, config.num_heads // config.num_kv_heads, model.dtype, config.hidden_size
    )
    if refused:
        # The per-op step (captured in CUDA graphs too) serves the model instead.
        logger.info("fused decode step and prefill refused: %s", refused)
        return False
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
    RMS, which float16's range would not always hold; and only for Llama's layer between
    the products (no output norms, SiLU)."""
    if not model.fold_norms or model.dtype != torch.bfloat16 or model.device.type != "cuda":
        return False, False
    config = model.config
    if config.output_norms or config.mlp_activation != "silu":
        # A branch's output is normalised before its add (the add is no longer the
        # product's epilogue), or the gate is no SiLU (no GEMV epilogue of ours computes it).
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


@dataclass(frozen=True)
class _Where:
    """A step's positions: each row's [B] on the device and the attended length; a float
    cache's sliding buffers' own (the positions less each row's offset, computed on the
    device so a captured graph follows the buffers' moves) and length."""

    pos: torch.Tensor
    kv_len: int
    local_pos: torch.Tensor | None = None
    local_len: int = 0


def _where(cache: KVCache | QuantKVCache, pos: torch.Tensor, kv_len: int) -> _Where:
    if isinstance(cache, KVCache) and cache.local_slots:
        return _Where(pos, kv_len, cache.local_positions(pos), min(kv_len, cache.local_slots))
    return _Where(pos, kv_len)


def _qk_norm(qkv: torch.Tensor, attn: Attention, n_heads: int, n_kv: int) -> torch.Tensor:
    """qkv [B, (NH + 2 NKV) HD] with each q and k head normalised (Qwen3, Gemma 3), in float32."""
    assert attn.q_norm is not None and attn.k_norm is not None
    bsz, hd = qkv.shape[0], attn.head_dim
    q, k, v = torch.split(qkv.float().view(bsz, -1, hd), [n_heads, n_kv, n_kv], dim=1)
    q = F.rms_norm(q, (hd,), attn.q_norm.weight.float(), attn.q_norm.eps)
    k = F.rms_norm(k, (hd,), attn.k_norm.weight.float(), attn.k_norm.eps)
    return torch.cat([q, k, v], dim=1).view(bsz, -1)


def _turned(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    n_heads: int,
    hd: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (turned by the rotary at pos over the tables' width) and v [B, heads, HD] in
    `dtype`, in torch: a partial rotary over a quantized cache, whose write kernels turn
    whole heads."""
    bsz = qkv.shape[0]
    heads = qkv.float().view(bsz, -1, hd)
    n_kv = (heads.shape[1] - n_heads) // 2
    c, s = cos.index_select(0, pos).unsqueeze(1), sin.index_select(0, pos).unsqueeze(1)
    qk = apply_rope(heads[:, : n_heads + n_kv], c, s)
    q, k = torch.split(qk, [n_heads, n_kv], dim=1)
    v = heads[:, n_heads + n_kv :]
    return q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()


def _attend(
    model: LlamaModel,
    layer: DecoderLayer,
    qkv: torch.Tensor,
    cache: KVCache | QuantKVCache,
    i: int,
    at: _Where,
    sms: int,
) -> torch.Tensor:
    """Layer i's q/k norms, rotary, cache write and attention for the step's rows: [B, NH * HD]."""
    config = model.config
    attn = layer.self_attn
    bsz = qkv.shape[0]
    n_heads, hd = config.num_heads, config.head_dim
    if attn.q_norm is not None:
        qkv = _qk_norm(qkv, attn, n_heads, config.num_kv_heads)
    cos, sin = model.rope_cos, model.rope_sin
    if layer.local_rope and model.rope_local is not None:
        cos, sin = model.rope_local  # Gemma 3's local layers' own table
    # The query scale: Llama's 1/sqrt(head_dim) where the model sets none (None below).
    scale = config.attention_scale or None
    if isinstance(cache, QuantKVCache):
        kv = cache.rows(0, bsz).layer(i)
        kernels = step_ops.kv_kernels(model.device)
        if config.rotated < hd:  # a partial rotary: turned here, written by the cache's kernel
            q, k, v = _turned(qkv, cos, sin, at.pos, n_heads, hd, kv.ring_k.dtype)
            kernels.write_tokens(kv, k, v, at.pos)
            return kernels.attention(kv, q, at.pos, at.kv_len, q_scale=attn.scale, window=attn.window)
        q = kernels.rope_write(qkv, cos, sin, at.pos, kv, n_heads)  # pre-scaled by 1/sqrt(head_dim)
        q_scale = 1.0 if scale is None else scale * hd**0.5
        return kernels.attention(kv, q, at.pos, at.kv_len, q_scale=q_scale, window=attn.window)
    k_cache, v_cache = (t[:bsz] for t in cache.layer(i))
    if cache.is_local[i]:  # a sliding layer's own buffer: slots from each row's offset
        assert at.local_pos is not None
        q = rope_kv_write(qkv, cos, sin, at.pos, k_cache, v_cache, n_heads, scale, at.local_pos)
        return decode_attention(q, k_cache, v_cache, at.local_pos, at.local_len, sms, attn.window)
    q = rope_kv_write(qkv, cos, sin, at.pos, k_cache, v_cache, n_heads, scale)
    return decode_attention(q, k_cache, v_cache, at.pos, at.kv_len, sms, attn.window)


def _gelu_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gelu(gate) * up [B, F] (GELU in its tanh form: Gemma's GeGLU) of a [gate; up]
    product [B, 2F] in float32, in `dtype`."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(dtype)


def _out_norm(delta: torch.Tensor, norm: torch.nn.Module | None, eps: float) -> torch.Tensor:
    """A branch's output [B, H] (float32) normalised before its residual add where the
    layer has an output norm (Gemma 3's), else as it is."""
    if norm is None:
        return delta
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    return add_rmsnorm(delta.float().contiguous(), None, weight, eps)


def fused_decode_step(
    model: LlamaModel, ids: torch.Tensor, cache: KVCache | QuantKVCache, pos: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """Logits [B, V] float32 for one token per sequence at device-side positions pos [B]."""
    config = model.config
    dtype = model.dtype
    bsz = ids.shape[0]
    sms = torch.cuda.get_device_properties(ids.device).multi_processor_count if ids.is_cuda else 4
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    fold, fold_head = folds_norm(model, bsz)
    eps = config.rms_norm_eps
    at = _where(cache, pos, kv_len)
    x = model._embed(ids.view(bsz)).float()  # the residual stream, float32 (Gemma's scaled embedding)
    h = add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps)
    norm_in: cuda_int4.NormInput | None = None  # h still to be divided by its RMS (folded norm)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
        qkv = _gemv(attn.qkv_proj, h, norm_in)
        attended = _attend(model, layer, qkv, cache, i, at, sms)
        gate_up = mlp.gate_up_proj
        if fold and attended.dtype == dtype:
            assert isinstance(attn.o_proj, Int4Linear) and isinstance(gate_up, Int4Linear)
            residual = cuda_int4.Residual(x, layer.post_attention_layernorm.weight)
            h, norm_in = attn.o_proj.gemv_residual(attended, residual, eps)
            act = gate_up.gemv_silu(h, norm_in)
            assert act is not None
        else:
            o = _out_norm(_gemv(attn.o_proj, attended), layer.attn_output_norm, eps)
            h, norm_in = add_rmsnorm(x, o, layer.post_attention_layernorm.weight, eps), None
            act = None
            if isinstance(gate_up, Int4Linear) and h.dtype == dtype and not mlp.gelu:
                act = gate_up.gemv_silu(h)  # the SiLU in the GEMV's epilogue (cuda-mma, paired)
            if act is None:
                act = _gelu_mul(_gemv(gate_up, h), dtype) if mlp.gelu else silu_mul(_gemv(gate_up, h), dtype)
        last = i + 1 == len(layers)
        next_norm = model.norm.weight if last else layers[i + 1].input_layernorm.weight
        if fold and (fold_head or not last):
            assert isinstance(mlp.down_proj, Int4Linear)
            h, norm_in = mlp.down_proj.gemv_residual(act, cuda_int4.Residual(x, next_norm), eps)
        else:
            down = _out_norm(_gemv(mlp.down_proj, act), layer.mlp_output_norm, eps)
            h, norm_in = add_rmsnorm(x, down, next_norm, eps), None
    logits = _gemv(model.lm_head, h, norm_in)
    cap = config.final_logit_softcap
    return torch.tanh(logits / cap) * cap if cap else logits
