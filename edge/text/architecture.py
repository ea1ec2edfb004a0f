"""A Llama-family model's architecture: its sizes, rotary settings and options, as a
checkpoint's config.json holds them. The one thing every wing of edge/text reads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


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
    # q, k and v projections with biases (the Qwen2 family).
    attention_bias: bool = False
    # Per-head width where it is not hidden_size / num_heads (0: it is).
    head_size: int = 0
    # RoPE frequency scaling: None, {"rope_type": "linear", "factor": f} or Llama 3's
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, or {"rope_type": "freq_factors", "factors": [...]}:
    # one divisor per frequency, which is how llama.cpp stores Llama 3's scaling.
    rope_scaling: dict[str, Any] | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    def parameter_count(self) -> int:
        """Weights of the architecture (norms aside): what a build's choices scale with."""
        attention = 2 * self.hidden_size * self.num_heads * self.head_dim
        attention += 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        tables = (1 if self.tie_embeddings else 2) * self.vocab_size * self.hidden_size
        return self.num_layers * (attention + mlp) + tables

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: Path) -> LlamaConfig:
        return cls(**json.loads(path.read_text(encoding="utf-8")))
