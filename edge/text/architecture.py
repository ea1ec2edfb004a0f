"""A decoder's architecture: its sizes, rotary settings and options, as a checkpoint's
config.json holds them. The one thing every wing of edge/text reads.

One config and one decoder serve every family: Llama is the config with every option at
its default, and a family is the options it sets (Qwen2: attention biases; Qwen3: q/k
norms; Gemma 3: sliding-window layers, q/k norms, GeGLU, a scaled embedding, output
norms, its own attention scale and soft-capped logits; Phi-4-mini: a partial rotary). A fast path that does not
implement an option reads `family_options()` and refuses the model naming it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")


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
    # one divisor per frequency, which is how llama.cpp stores Llama 3's scaling; or Phi-3's
    # {"rope_type": "longrope", "short_factor": [...], "attention_factor": a,
    # "original_max_position_embeddings": n}: a divisor per frequency and cos and sin
    # times a, as transformers has them up to n positions (the model's max_position).
    rope_scaling: dict[str, Any] | None = None
    # The leading channels of each q and k head the rotary turns (Phi-4-mini's partial
    # rotary: three quarters); the rest pass unturned (0: every channel).
    rotary_dim: int = 0
    # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Keys a sliding layer's query sees: itself and the window - 1 before it (0: no window).
    sliding_window: int = 0
    # Each layer's attention, "full" or "sliding" (empty: every layer full).
    layer_types: tuple[str, ...] = ()
    # RoPE base of the sliding layers, which take no RoPE scaling (0: rope_theta, scaled).
    rope_local_theta: float = 0.0
    # The MLP gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    mlp_activation: str = "silu"
    # The token embedding is multiplied by this before the first layer (0: not; Gemma:
    # sqrt(hidden_size)). Not folded into the table, which a tied head also reads.
    embedding_scale: float = 0.0
    # An RMSNorm on the attention's and on the MLP's output before each residual add
    # (Gemma 3's post-attention and post-feedforward norms).
    output_norms: bool = False
    # Attention scores are multiplied by this (0: head_dim ** -0.5).
    attention_scale: float = 0.0
    # Final logits squashed into (-cap, cap) as cap * tanh(logits / cap) (0: not).
    final_logit_softcap: float = 0.0

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

    @property
    def window(self) -> int:
        """The sliding layers' window (0: no layer slides)."""
        return next((w for i in range(self.num_layers) if (w := self.layer_window(i))), 0)

    def layer_window(self, layer: int) -> int:
        """The attention window of layer `layer` (0: it sees every earlier position)."""
        if self.sliding_window and self.layer_types and self.layer_types[layer] == "sliding":
            return self.sliding_window
        return 0

    def family_options(self) -> list[str]:
        """The options this model sets beyond a Llama's, by name: what a fast path that
        implements only Llama's graph (and Qwen2's biases, which it checks itself) must
        refuse."""
        named = {
            "qk_norm": self.qk_norm,
            f"sliding_window {self.sliding_window}": bool(self.window),
            f"rope_local_theta {self.rope_local_theta:g}": bool(self.rope_local_theta),
            f"mlp_activation {self.mlp_activation}": self.mlp_activation != "silu",
            f"embedding_scale {self.embedding_scale:g}": bool(self.embedding_scale),
            "output_norms": self.output_norms,
            f"attention_scale {self.attention_scale:g}": bool(self.attention_scale),
            f"final_logit_softcap {self.final_logit_softcap:g}": bool(self.final_logit_softcap),
            f"rotary_dim {self.rotary_dim}": 0 < self.rotary_dim < self.head_dim,
        }
        return [name for name, on in named.items() if on]

    def __post_init__(self) -> None:
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation {self.mlp_activation!r}: expected one of {', '.join(MLP_ACTIVATIONS)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers of {self.num_layers}")
        if any(kind not in LAYER_TYPES for kind in self.layer_types):
            raise ValueError(f"layer_types {self.layer_types}: each one of {', '.join(LAYER_TYPES)}")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim}: an even number of a head's {self.head_dim} channels")

    @property
    def rotated(self) -> int:
        """The channels of a head the rotary turns (its tables' width)."""
        return self.rotary_dim or self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: Path) -> LlamaConfig:
        fields = json.loads(path.read_text(encoding="utf-8"))
        fields["layer_types"] = tuple(fields.get("layer_types") or ())  # a list in JSON
        return cls(**fields)
