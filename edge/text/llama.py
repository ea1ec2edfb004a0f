"""A Llama-architecture decoder with a preallocated KV cache, in plain torch.

This is the serving-time model: no transformers, weights from the project's own
checkpoint. Weight layout follows the usual Hugging Face convention (rotate-half RoPE),
so checkpoints from any Llama-family source load after one conversion.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 8192
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: Path) -> LlamaConfig:
        return cls(**json.loads(path.read_text(encoding="utf-8")))


class KVCache:
    """Keys and values for `batch` sequences of up to `max_len` tokens, allocated once."""

    def __init__(self, config: LlamaConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activation dtype: fp16 overflows in x*x.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(config: LlamaConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    d = config.head_dim
    # Built on the CPU explicitly, so a model constructed on the meta device still
    # gets real tables (they are derived, not loaded from the checkpoint).
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=cpu) / d))
    t = torch.arange(max_len, dtype=torch.float64, device=cpu)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads = config.num_heads
        self.n_kv = config.num_kv_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.n_kv, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        end = start + seq
        k_cache[:bsz, :, start:end] = k
        v_cache[:bsz, :, start:end] = v
        keys = k_cache[:bsz, :, :end]
        values = v_cache[:bsz, :, :end]
        if seq == 1 or start == 0:
            # Decode sees every cached position; a fresh prefill is plainly causal.
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=seq > 1, enable_gqa=self.n_kv != self.n_heads
            )
        else:
            # Chunked prefill after earlier tokens: causal within the chunk, full before it.
            mask = torch.ones(seq, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        return projected


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, start)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp_out


class LlamaModel(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(config, config.max_position, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        weight = self.embed_tokens.weight
        return KVCache(self.config, batch, min(max_len, self.config.max_position), weight.dtype, weight.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, start: int, last_only: bool = True) -> torch.Tensor:
        """Logits for `ids` [B, T] placed at positions start..start+T-1 of `cache`."""
        seq = ids.shape[1]
        if start + seq > cache.max_len:
            raise ValueError(f"sequence of {start + seq} tokens exceeds the cache ({cache.max_len})")
        cos = self.rope_cos[start : start + seq].to(self.embed_tokens.weight.dtype)
        sin = self.rope_sin[start : start + seq].to(self.embed_tokens.weight.dtype)
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], start)
        if last_only:
            x = x[:, -1:, :]
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits.float()
