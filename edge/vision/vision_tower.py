"""The image encoders vision-language models read images with: CLIP's and SigLIP's
vision transformers, in plain torch (no transformers at serving time), as their
Hugging Face checkpoints define them.

Both are pre-norm ViTs over square patches with learned absolute positions; CLIP adds a
class token and a LayerNorm before the first layer, and its patch convolution has no bias.
A vision-language model reads the hidden states of one or more layers (LLaVA: the one
before last), never the pooled output: `hidden_states` runs the layers up to the last
one asked for and no further, and neither tower's final norm or pooling head is kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

TOWERS = ("clip", "siglip")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Activations by their transformers names (CLIP: quick_gelu; SigLIP: gelu_pytorch_tanh;
# LLaVA's projector: gelu).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


@dataclass(frozen=True)
class TowerConfig:
    kind: str  # "clip" or "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    num_channels: int = 3

    def __post_init__(self) -> None:
        if self.kind not in TOWERS:
            raise ValueError(f"vision tower {self.kind!r}: expected one of {', '.join(TOWERS)}")
        activation(self.hidden_act)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} does not split into {self.num_heads} heads")

    @property
    def grid(self) -> int:
        """Patches along each side of an image."""
        return self.image_size // self.patch_size

    @property
    def class_token(self) -> bool:
        return self.kind == "clip"

    @property
    def tokens(self) -> int:
        """Hidden states per image: a patch each, and CLIP's class token first."""
        return self.grid**2 + int(self.class_token)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, path: Path) -> TowerConfig:
        return cls(**json.loads(path.read_text(encoding="utf-8")))


class Attention(nn.Module):
    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        projected: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(b, n, d))
        return projected


class MLP(nn.Module):
    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class EncoderLayer(nn.Module):
    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class VisionTower(nn.Module):
    """CLIP's or SigLIP's vision transformer. Weight names are transformers' under
    `vision_model.` with `embeddings.` and `encoder.` dropped (and CLIP's `pre_layrnorm`
    as it is spelt there)."""

    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, width, config.patch_size, config.patch_size, bias=config.kind == "siglip"
        )
        self.class_embedding = nn.Parameter(torch.zeros(width)) if config.class_token else None
        self.position_embedding = nn.Embedding(config.tokens, width)
        self.pre_layrnorm = nn.LayerNorm(width, eps=config.layer_norm_eps) if config.kind == "clip" else None
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))

    def layer_index(self, layer: int) -> int:
        """A hidden state's index among the num_layers + 1 (the embeddings' first), as
        transformers' `hidden_states` counts them; negative from the end."""
        count = self.config.num_layers + 1
        if not -count <= layer < count:
            raise ValueError(f"vision feature layer {layer}: the tower has hidden states 0..{count - 1}")
        return layer % count

    def hidden_states(self, pixels: torch.Tensor, layers: Sequence[int]) -> list[torch.Tensor]:
        """[B, C, S, S] normalised pixels -> the hidden states [B, tokens, width] of
        `layers` (transformers' indexes: 0 the embeddings, i after layer i; negative from
        the end), in that order."""
        size = self.config.image_size
        if pixels.shape[-2:] != (size, size):
            raise ValueError(f"the tower takes {size}x{size} images, not {pixels.shape[-2]}x{pixels.shape[-1]}")
        wanted = [self.layer_index(layer) for layer in layers]
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.position_embedding.weight
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers[: max(wanted)], start=1):
            x = layer(x)
            if i in wanted:
                states[i] = x
        return [states[i] for i in wanted]
