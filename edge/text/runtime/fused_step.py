"""One decode step of an INT4 Llama in a dozen kernels per layer: the runtime's step
where the model allows it (decode_step).

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

import torch

from edge.text.kv.float_cache import KVCache
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.llama import DecoderLayer, LlamaModel
from edge.text.ops import sparse24, step_ops
from edge.text.ops.cuda import cuda_int4
from edge.text.ops.int4 import GEMV_KERNELS, Int4Linear
from edge.text.ops.sparse24 import Sparse24Linear
from edge.text.ops.step_ops import add_rmsnorm, decode_attention, rope_kv_write, silu_mul
from edge.text.runtime import cpu_step

logger = logging.getLogger(__name__)


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
    """Why the fused kernels cannot serve this model's graph, naming the options they do
    not implement (they are Llama's graph: SiLU, one RoPE table, no q/k norms, no window,
    no output norms); None where they can."""
    options = model.config.family_options()
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
    RMS, which float16's range would not always hold."""
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
    bsz = qkv.shape[0]
    n_heads = model.config.num_heads
    if isinstance(cache, QuantKVCache):
        layer = cache.rows(0, bsz).layer(i)
        kernels = step_ops.kv_kernels(model.device)
        q = kernels.rope_write(qkv, model.rope_cos, model.rope_sin, pos, layer, n_heads)
        return kernels.attention(layer, q, pos, kv_len, q_scale=1.0)
    k_cache, v_cache = (t[:bsz] for t in cache.layer(i))
    q = rope_kv_write(qkv, model.rope_cos, model.rope_sin, pos, k_cache, v_cache, n_heads)
    return decode_attention(q, k_cache, v_cache, pos, kv_len, sms)


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
    x = model.embed_tokens(ids.view(bsz)).float()  # the residual stream, float32
    h = add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps)
    norm_in: cuda_int4.NormInput | None = None  # h still to be divided by its RMS (folded norm)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
        qkv = _gemv(attn.qkv_proj, h, norm_in)
        attended = _attend(model, qkv, cache, i, pos, kv_len, sms)
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
        last = i + 1 == len(layers)
        next_norm = model.norm.weight if last else layers[i + 1].input_layernorm.weight
        if fold and (fold_head or not last):
            assert isinstance(mlp.down_proj, Int4Linear)
            h, norm_in = mlp.down_proj.gemv_residual(act, cuda_int4.Residual(x, next_norm), eps)
        else:
            down = _gemv(mlp.down_proj, act)
            h, norm_in = add_rmsnorm(x, down, next_norm, eps), None
    return _gemv(model.lm_head, h, norm_in)
