"""A Llama-architecture decoder with a preallocated KV cache, in plain torch.

This is the serving-time model: no transformers, weights from the project's own
checkpoint. Weight layout follows the usual Hugging Face convention (rotate-half RoPE),
so checkpoints from any Llama-family source load after one conversion.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from edge.text.architecture import LlamaConfig
from edge.text.kv import kv_attention
from edge.text.kv.float_cache import KVCache, SparseAttention
from edge.text.kv.kv_quant import KVFormat
from edge.text.kv.quant_cache import QuantKVCache, QuantLayer
from edge.text.model.embedding import QuantizedEmbedding
from edge.text.model.splice import Splice, apply_splices
from edge.text.ops import step_ops
from edge.text.ops.int4 import silu_gate_up

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeAt:
    """Where a graph-capturable decode step writes and reads: per-sequence positions in a
    device tensor, a fixed attention window, and the window's additive mask (0 up to each
    position, -inf beyond), built once per step rather than once per layer."""

    pos: torch.Tensor  # [B] long
    kv_len: int
    bias: torch.Tensor  # [B, 1, 1, kv_len] float32
    # The sliding layers' mask: -inf also at and before each position - window.
    window_bias: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A float32 residual stream under half-precision weights is normalised into the
        # weights' dtype: what the next product reads.
        out_dtype = self.weight.dtype if x.dtype == torch.float32 else x.dtype
        if x.dtype == torch.float16 or out_dtype != x.dtype:
            # fp16 overflows in x*x: normalise in float32.
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(out_dtype)
        # float32, and bf16 (whose range holds x*x; torch accumulates the mean in float32).
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rope_tables(
    config: LlamaConfig, max_len: int, device: torch.device, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin per position; `local`: the sliding layers' (rope_local_theta, unscaled)."""
    d = config.rotated
    # Built on the CPU explicitly, so a model constructed on the meta device still
    # gets real tables (they are derived, not loaded from the checkpoint).
    cpu = torch.device("cpu")
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=cpu) / d))
    if not local:
        inv_freq = scaled_frequencies(inv_freq, config.rope_scaling)
    t = torch.arange(max_len, dtype=torch.float64, device=cpu)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    scaling = config.rope_scaling or {}
    # LongRoPE's attention factor multiplies cos and sin (transformers' attention_scaling).
    longrope = not local and scaling.get("rope_type") == "longrope"
    mscale = float(scaling.get("attention_factor", 1.0)) if longrope else 1.0
    return (emb.cos() * mscale).float().to(device), (emb.sin() * mscale).float().to(device)


ROPE_TYPES = ("linear", "llama3", "freq_factors", "longrope")


def scaled_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    """RoPE frequencies under a checkpoint's scaling, as its model family defines it."""
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("freq_factors", "longrope"):
        # LongRoPE's short factors: the ones transformers uses up to its original context.
        key = "factors" if kind == "freq_factors" else "short_factor"
        factors = torch.tensor(scaling[key], dtype=inv_freq.dtype, device=inv_freq.device)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"RoPE {kind}: {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    between = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(between, blended, out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotated_dims = cos.shape[-1]
    if rotated_dims < x.shape[-1]:  # a partial rotary: the leading channels turned, the rest kept
        return torch.cat([apply_rope(x[..., :rotated_dims], cos, sin), x[..., rotated_dims:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def chunk_mask(seq: int, end: int, device: torch.device) -> torch.Tensor | CausalBias:
    """The mask of a chunk of `seq` queries ending at position `end`: causal within the
    chunk, every earlier position seen. On CUDA a lower-right causal bias, which flash
    attention runs as it is: a boolean mask would send attention to the math kernel,
    which materialises every score (32 heads x 512 x 4608 of them for an 8B model's
    last 512-token chunk of a 4K prompt: 0.3 GB in bfloat16) and the key and value
    heads repeated per query head."""
    if device.type == "cuda":
        # Imported here: torch.nn.attention.bias imports torch._dynamo (about 4 s of a
        # CPU box's start, for a mask only CUDA prefill uses).
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(seq, end)
    return torch.ones(seq, end, dtype=torch.bool, device=device).tril(diagonal=end - seq)


def window_mask(seq: int, end: int, window: int, device: torch.device) -> torch.Tensor:
    """A sliding layer's mask for `seq` queries ending at position `end`: each sees
    itself and the window - 1 positions before it (transformers' sliding_window_overlay
    on top of the causal mask)."""
    query = torch.arange(end - seq, end, device=device).view(-1, 1)
    key = torch.arange(end, device=device).view(1, -1)
    return (key <= query) & (key > query - window)


def decode_biases(config: LlamaConfig, pos: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step's additive masks [B, 1, 1, kv_len]: 0 up to each position and -inf
    beyond; and, for a model with sliding layers, theirs (-inf also at and before the
    position - window)."""
    keys = torch.arange(kv_len, device=pos.device)
    visible = keys <= pos.view(-1, 1)
    bias = torch.zeros(visible.shape, device=pos.device).masked_fill_(~visible, float("-inf"))
    window = config.window
    if not window:
        return bias.view(-1, 1, 1, kv_len), None
    seen = visible & (keys > pos.view(-1, 1) - window)
    local = torch.zeros(seen.shape, device=pos.device).masked_fill_(~seen, float("-inf"))
    return bias.view(-1, 1, 1, kv_len), local.view(-1, 1, 1, kv_len)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads = config.num_heads
        self.n_kv = config.num_kv_heads
        self.head_dim = hd
        self.window = config.layer_window(layer)
        self.scale = config.attention_scale or hd**-0.5
        # Qwen3 and Gemma 3 normalise each q and k head before RoPE.
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)
        # Set by fuse_projections(): one weight for q, k and v, read by one kernel.
        self.qkv_proj: nn.Module | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor | QuantLayer | None,
        v_cache: torch.Tensor | None,
        start: int | DecodeAt,
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        hd = self.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            if self.qkv_proj is not None:
                q_, k_, v_ = torch.split(self.qkv_proj(x), [self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
            else:
                q_, k_, v_ = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = apply_rope(self.q_norm(q_.view(bsz, seq, self.n_heads, hd)).transpose(1, 2), cos, sin)
            k = apply_rope(self.k_norm(k_.view(bsz, seq, self.n_kv, hd)).transpose(1, 2), cos, sin)
        elif self.qkv_proj is not None:
            # Rotate q and k together: one set of elementwise kernels instead of two.
            qkv: torch.Tensor = self.qkv_proj(x)
            qk_, v_ = torch.split(qkv, [(self.n_heads + self.n_kv) * hd, self.n_kv * hd], dim=-1)
            qk = apply_rope(qk_.view(bsz, seq, self.n_heads + self.n_kv, hd).transpose(1, 2), cos, sin)
            q, k = torch.split(qk, [self.n_heads, self.n_kv], dim=1)
        else:
            q = apply_rope(self.q_proj(x).view(bsz, seq, self.n_heads, hd).transpose(1, 2), cos, sin)
            k = apply_rope(self.k_proj(x).view(bsz, seq, self.n_kv, hd).transpose(1, 2), cos, sin)
            v_ = self.v_proj(x)
        v = v_.view(bsz, seq, self.n_kv, hd).transpose(1, 2)
        if isinstance(k_cache, QuantLayer):
            return self._quantized(q, k, v, k_cache, start)
        if k_cache is None or v_cache is None:
            # Training: the whole sequence at once, nothing cached, gradients flow.
            trained: torch.Tensor = self.o_proj(self._self_attend(q, k, v).transpose(1, 2).reshape(bsz, seq, -1))
            return trained
        gqa = self.n_kv != self.n_heads
        if isinstance(start, DecodeAt):
            return self._decode_at(q, k, v, k_cache, v_cache, start)
        end = start + seq
        k_cache[:bsz, :, start:end] = k
        v_cache[:bsz, :, start:end] = v
        keys = k_cache[:bsz, :, :end]
        values = v_cache[:bsz, :, :end]
        if self.window and end > self.window:
            # A sliding layer past its window: a token alone reads the window's keys only,
            # a chunk masks each query's own window.
            if seq == 1:
                keys, values = keys[:, :, end - self.window :], values[:, :, end - self.window :]
                out = F.scaled_dot_product_attention(q, keys, values, scale=self.scale, enable_gqa=gqa)
            else:
                mask = window_mask(seq, end, self.window, x.device)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        elif seq == 1 or start == 0:
            # Decode sees every cached position; a fresh prefill is plainly causal.
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=seq > 1, scale=self.scale, enable_gqa=gqa)
        else:
            # Chunked prefill after earlier tokens: causal within the chunk, full before it.
            mask = chunk_mask(seq, end, x.device)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        return projected

    def _self_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A fresh sequence attending to itself (training, or a prompt's first chunk):
        causal, and within the window in a sliding layer the sequence outgrows."""
        seq = q.shape[2]
        gqa = self.n_kv != self.n_heads
        if self.window and seq > self.window:
            mask = window_mask(seq, seq, self.window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, scale=self.scale, enable_gqa=gqa)

    def _quantized(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: QuantLayer, start: int | DecodeAt
    ) -> torch.Tensor:
        """Attention over a quantized cache (edge/text/kv/kv_attention.py): a decode step and
        a chunk after cached tokens read the codes in the kernel; a fresh prompt attends
        to itself in float, as with a float cache, and is coded as it is stored."""
        bsz, _, seq, hd = q.shape
        if isinstance(start, DecodeAt):
            out = kv_attention.decode(
                layer, q[:, :, 0], k[:, :, 0], v[:, :, 0], start.pos, start.kv_len, self.window, self.scale
            )
            out = out.unsqueeze(2)
        elif start == 0:
            out = self._self_attend(q, k, v)
            layer.store(k, v, 0)
        else:
            out = kv_attention.chunk(layer, q, k, v, start, self.window, self.scale)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(bsz, seq, self.n_heads * hd))
        return projected

    def _decode_at(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        at: DecodeAt,
    ) -> torch.Tensor:
        """One token per sequence at a position held in a device tensor.

        Nothing here depends on the position's value on the host, so the step can be
        captured once in a CUDA graph and replayed for every position below kv_len.
        The query heads of each KV group attend as one small matrix, so the cached keys
        and values are read once and never expanded per query head.
        """
        bsz = q.shape[0]
        slot = at.pos.view(bsz, 1, 1, 1).expand(bsz, self.n_kv, 1, self.head_dim)
        k_cache[:bsz].scatter_(2, slot, k)
        v_cache[:bsz].scatter_(2, slot, v)
        keys = k_cache[:bsz, :, : at.kv_len]
        values = v_cache[:bsz, :, : at.kv_len]
        group = self.n_heads // self.n_kv
        qg = q.reshape(bsz, self.n_kv, group, self.head_dim) * self.scale
        bias = at.window_bias if self.window and at.window_bias is not None else at.bias
        scores = (qg @ keys.transpose(-1, -2)).float() + bias
        out = torch.softmax(scores, dim=-1).to(values.dtype) @ values  # [B, n_kv, group, hd]
        projected: torch.Tensor = self.o_proj(out.reshape(bsz, 1, self.n_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections()
        self.gelu = config.mlp_activation == "gelu_tanh"

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None and x.is_cuda and step_ops.backend(x.device) and not self.gelu:
            # One kernel reads the [gate; up] product (in the INT4 kernel's paired order
            # where it has one): no reordering copy and no separate SiLU and product
            # tensors, which were a 512-token chunk's largest transients on an 8B model.
            flat = x.reshape(-1, x.shape[-1])
            act = silu_gate_up(self.gate_up_proj, flat, x.dtype)
            down: torch.Tensor = self.down_proj(act)
            return down.view(*x.shape[:-1], down.shape[-1])
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out: torch.Tensor = self.down_proj(self.act(gate) * up)
        return out


class DecoderLayer(nn.Module):
    """Norm, attention, residual add; norm, MLP, residual add. `post_attention_layernorm`
    is the norm before the MLP, as Llama names it (Gemma's pre_feedforward_layernorm);
    with `output_norms`, `attn_output_norm` and `mlp_output_norm` normalise each branch's
    output before its add (Gemma's post_attention_layernorm and post_feedforward_layernorm)."""

    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.output_norms else None
        self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.output_norms else None
        self.local_rope = config.layer_window(layer) > 0 and config.rope_local_theta > 0

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor | QuantLayer | None,
        v_cache: torch.Tensor | None,
        start: int | DecodeAt,
    ) -> torch.Tensor:
        attn_out: torch.Tensor = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, start)
        if self.attn_output_norm is not None:
            attn_out = self.attn_output_norm(attn_out)
        x = x + attn_out
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        if self.mlp_output_norm is not None:
            mlp_out = self.mlp_output_norm(mlp_out)
        return x + mlp_out


class LlamaModel(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # Serving may swap in a compact table (edge/text/model/embedding.py).
        # On the meta device (a checkpoint's load) the table is given, not drawn: a random
        # init there goes through torch's reference ops, which import torch._dynamo
        # (seconds of a CPU box's start).
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens: nn.Embedding | QuantizedEmbedding = (
            nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
            if table.is_meta
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(config, config.max_position, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The sliding layers' own tables, where their RoPE base differs (Gemma 3).
        self.rope_local: tuple[torch.Tensor, torch.Tensor] | None = None
        if any(layer.local_rope for layer in self.layers if isinstance(layer, DecoderLayer)):
            self.rope_local = rope_tables(config, config.max_position, torch.device("cpu"), local=True)
        # Whether the runtime's decode step is the fused one (runtime/fused_step.py):
        # decided there on first use (the projections are swapped for INT4 ones after
        # construction); set False to force this model's per-op decode_step.
        self.fused_decode: bool | None = None
        # Whether the fused step folds the RMSNorms into the CUDA GEMVs around them
        # (fused_step.folds_norm, where the layers allow it); False keeps the norm kernels.
        self.fold_norms = True

    def move_rope(self, device: torch.device) -> None:
        """The derived RoPE tables to `device` (a model built on the meta device has them
        on the CPU)."""
        self.rope_cos = self.rope_cos.to(device)
        self.rope_sin = self.rope_sin.to(device)
        if self.rope_local is not None:
            self.rope_local = (self.rope_local[0].to(device), self.rope_local[1].to(device))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed_tokens(ids)
        if self.config.embedding_scale:
            # By the scale rounded to the table's type, as Gemma's scaled embedding does; a
            # plain number, so a captured CUDA graph holds no host tensor.
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype).item()
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(x))
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _tables(
        self, cos: torch.Tensor, sin: torch.Tensor, rows: slice | torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin): the global tables' `rows`, or the sliding layers' own."""
        local = None
        if self.rope_local is not None:
            lc, ls = self.rope_local
            if isinstance(rows, slice):
                lc, ls = lc[rows], ls[rows]
            else:
                lc, ls = lc.index_select(0, rows), ls.index_select(0, rows)
            local = (lc.to(cos.dtype).view(cos.shape), ls.to(sin.dtype).view(sin.shape))
        return [
            local if local is not None and isinstance(layer, DecoderLayer) and layer.local_rope else (cos, sin)
            for layer in self.layers
        ]

    @property
    def dtype(self) -> torch.dtype:
        """The activations' type (the token table's, float or compact)."""
        table = self.embed_tokens
        return table.weight.dtype if isinstance(table, nn.Embedding) else table.dtype

    @property
    def device(self) -> torch.device:
        table = self.embed_tokens
        return table.weight.device if isinstance(table, nn.Embedding) else table.device

    @overload
    def new_cache(
        self,
        batch: int,
        max_len: int,
        kv_format: None = None,
        window_sized: bool = True,
        sparse: SparseAttention | None = None,
    ) -> KVCache: ...

    @overload
    def new_cache(
        self,
        batch: int,
        max_len: int,
        kv_format: KVFormat | None,
        window_sized: bool = True,
        sparse: SparseAttention | None = None,
    ) -> KVCache | QuantKVCache: ...

    def new_cache(
        self,
        batch: int,
        max_len: int,
        kv_format: KVFormat | None = None,
        window_sized: bool = True,
        sparse: SparseAttention | None = None,
    ) -> KVCache | QuantKVCache:
        """A KV cache of `batch` rows: float in the activations' type (the sliding layers
        in buffers sized from their window unless `window_sized` is off: float_cache.py),
        or int8/int4 codes (edge/text/kv/quant_cache.py) for a quantized format (the
        sliding layers' codes sized from their window where the kernels read them as a
        circle: step_ops.circular_kv). `sparse`: on the CPU, a float cache keeps the block
        summaries the CPU's decode step selects by (float_cache.py), a quantized one those
        its attention kernel selects by (quant_cache.py, ops/cpu/cpu_kv.c)."""
        length = min(max_len, self.config.max_position)
        quantized = kv_format is not None and kv_format.dtype != "float16"
        if kv_format is not None and quantized:
            if sparse is not None and self.device.type != "cpu":
                raise ValueError(
                    f"sparse attention over an {kv_format.dtype} cache runs on the CPU; "
                    "the CUDA and Triton kernels do not select blocks"
                )
            if self.device.type == "cuda":
                config = self.config
                group = config.num_heads // config.num_kv_heads
                refused = step_ops.kv_refusal(self.device, kv_format, config.head_dim, group, self.dtype)
                if refused:
                    raise ValueError(f"kv_dtype {kv_format.dtype} on CUDA: {refused}; serve with kv_dtype float16")
            circle = window_sized and step_ops.circular_kv(self.device)
            return QuantKVCache(self.config, batch, length, kv_format, self.dtype, self.device, circle, sparse)
        return KVCache(self.config, batch, length, self.dtype, self.device, window_sized, sparse=sparse)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | QuantKVCache,
        start: int,
        last_only: bool = True,
        splices: Sequence[Splice] = (),
    ) -> torch.Tensor:
        """Logits for `ids` [B, T] placed at positions start..start+T-1 of `cache`;
        `splices` (one sequence only): rows read in place of the token table's at the
        positions they cover (an image's features: splice.py), by absolute position, so
        a chunk takes the part of each that falls inside it."""
        seq = ids.shape[1]
        if start + seq > cache.max_len:
            raise ValueError(f"sequence of {start + seq} tokens exceeds the cache ({cache.max_len})")
        if isinstance(cache, KVCache) and cache.local_slots and seq > cache.room:
            # The sliding layers' buffers take a chunk this long at most (float_cache.py);
            # the output head runs once, on what is asked for.
            pieces = [
                self._layers(ids[:, at : at + cache.room], cache, start + at, splices)
                for at in range(0, seq, cache.room)
            ]
            x = pieces[-1] if last_only else torch.cat(pieces, dim=1)
        else:
            x = self._layers(ids, cache, start, splices)
        if last_only:
            x = x[:, -1:, :]
        return self._head(x).float()

    def _layers(
        self, ids: torch.Tensor, cache: KVCache | QuantKVCache, start: int, splices: Sequence[Splice] = ()
    ) -> torch.Tensor:
        """The residual stream after every layer for `ids` [B, T] at positions start..
        (with `splices`' rows where they cover them)."""
        seq = ids.shape[1]
        local_start = start
        if isinstance(cache, KVCache) and cache.local_slots:
            for row in range(ids.shape[0]):
                cache.make_room(row, start, start + seq)
            offsets = set(cache.offsets[: ids.shape[0]].tolist())
            if len(offsets) != 1:
                raise ValueError("a chunk written to several rows needs their sliding buffers at one offset")
            local_start = start - offsets.pop()
        if isinstance(cache, KVCache):
            cache.rewritten(start, ids.shape[0])
        cos = self.rope_cos[start : start + seq].to(self.dtype)
        sin = self.rope_sin[start : start + seq].to(self.dtype)
        # The residual stream stays in float32 between layers, as in the fused decode
        # step: added to in half precision it loses the small updates of late layers,
        # and a prompt's cached keys and values would not be those its decode expects.
        x = apply_splices(self._embed(ids).float(), splices, start)
        tables = self._tables(cos, sin, slice(start, start + seq))
        for i, layer in enumerate(self.layers):
            local = isinstance(cache, KVCache) and cache.is_local[i]
            x = layer(x, *tables[i], *_layer_kv(cache, i), local_start if local else start)
        return x

    def forward_train(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for whole sequences, with autograd and no KV cache."""
        seq = ids.shape[1]
        dtype = self.dtype
        cos = self.rope_cos[:seq].to(dtype)
        sin = self.rope_sin[:seq].to(dtype)
        x = self._embed(ids)
        tables = self._tables(cos, sin, slice(0, seq))
        for i, layer in enumerate(self.layers):
            x = layer(x, *tables[i], None, None, 0)
        return self._head(x)

    @torch.inference_mode()
    def decode_step(
        self, ids: torch.Tensor, cache: KVCache | QuantKVCache, pos: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """Logits [B, V] for one token per sequence at device-side positions `pos` [B],
        op by op (the runtime runs the fused step instead where it can: fused_step.decode_step).

        Attends over the first kv_len cache slots (masked beyond each position): a
        fixed shape, so one CUDA graph per kv_len bucket serves every step. A float
        cache's sliding buffers are given room by the caller first, where the positions
        are known on the host (KVCache.make_room_for_step, as the batcher does).
        """
        dtype = self.dtype
        cos = self.rope_cos.index_select(0, pos).to(dtype).unsqueeze(1).unsqueeze(1)
        sin = self.rope_sin.index_select(0, pos).to(dtype).unsqueeze(1).unsqueeze(1)
        bias, window_bias = decode_biases(self.config, pos, kv_len)
        at = local_at = DecodeAt(pos, kv_len, bias, window_bias)
        if isinstance(cache, KVCache) and cache.local_slots:
            # The sliding layers' own buffers: positions from each row's offset.
            local_pos = cache.local_positions(pos)
            local_len = min(kv_len, cache.local_slots)
            local_bias, local_window = decode_biases(self.config, local_pos, local_len)
            local_at = DecodeAt(local_pos, local_len, local_bias, local_window)
        if isinstance(cache, KVCache):
            cache.rewritten(pos, pos.shape[0])
        x = self._embed(ids).float()  # the residual stream, as in forward()
        tables = self._tables(cos, sin, pos)
        for i, layer in enumerate(self.layers):
            local = isinstance(cache, KVCache) and cache.is_local[i]
            x = layer(x, *tables[i], *_layer_kv(cache, i), local_at if local else at)
        return self._head(x)[:, -1].float()


def _layer_kv(cache: KVCache | QuantKVCache, i: int) -> tuple[torch.Tensor | QuantLayer, torch.Tensor | None]:
    """What layer i's attention reads and writes: its key and value tensors, or its share
    of a quantized cache."""
    if isinstance(cache, QuantKVCache):
        return cache.layer(i), None
    return cache.layer(i)


def fuse_projections(model: LlamaModel) -> None:
    """Replace q/k/v and gate/up float linears by one concatenated linear each.

    Fewer, larger matrix products: one weight read and one kernel launch instead of
    three (or two). INT4 checkpoints are fused at load time instead (see checkpoint.py).
    """
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        if (
            attn.qkv_proj is None
            and isinstance(attn.q_proj, nn.Linear)
            and isinstance(attn.k_proj, nn.Linear)
            and isinstance(attn.v_proj, nn.Linear)
        ):
            attn.qkv_proj = _cat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            del attn.q_proj, attn.k_proj, attn.v_proj
        if mlp.gate_up_proj is None and isinstance(mlp.gate_proj, nn.Linear) and isinstance(mlp.up_proj, nn.Linear):
            mlp.gate_up_proj = _cat_linears([mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj


def _cat_linears(parts: list[nn.Linear]) -> nn.Linear:
    weights = [p.weight for p in parts]
    biased = parts[0].bias is not None
    fused = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=biased, device="meta")
    fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
    if biased:
        biases = [p.bias.detach() for p in parts if p.bias is not None]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return fused
