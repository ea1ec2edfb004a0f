"""The inspection student: a ViT-Tiny-class transformer (patch 16, 224 px; 5.53M
parameters in the shipped student, engines/vision/students/distilled-stream/manifest.json).

It reads one image and answers two things: the defect class of the part (a head on the
CLS token) and, per 16x16 patch, how likely the patch shows a defect (a head on the
patch tokens, trained on the generator's defect masks; the heat map of `inspect`).
During training a projection maps its tokens into the teacher's width so the teacher's
CLS and patch tokens can be distilled into it; that projection is not exported.

Attention goes through `scaled_dot_product_attention`, so CUDA runs a fused kernel and
the ONNX export is plain matmul/softmax.
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

IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    dim: int = 192
    depth: int = 12
    heads: int = 3
    mlp_ratio: int = 4
    num_classes: int = 5
    teacher_dim: int = 384  # width of the distillation projection (training only)

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: Path) -> ViTConfig:
        return cls(**json.loads(path.read_text(encoding="utf-8")))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # SDPA's own default, fixed here: exported graphs then hold a constant rather
        # than a square root of a shape, which a float16 conversion would leave in float32.
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=self.scale)
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(b, n, d))
        return projected


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class InspectViT(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(3, config.dim, config.patch_size, config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, config.grid**2 + 1, config.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(config.dim, config.heads, config.mlp_ratio) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim, eps=1e-6)
        # The class head reads the CLS token and the mean patch token: a defect is a local
        # feature, and the mean over patches carries it from the first steps of training.
        self.head = nn.Linear(2 * config.dim, config.num_classes)
        self.patch_head = nn.Linear(config.dim, 1)
        self.distill_proj = nn.Linear(config.dim, config.teacher_dim)  # training only
        self.apply(_init)

    def drop_distillation(self) -> None:
        """Remove the training-only projection (it is neither saved nor exported)."""
        self.distill_proj = nn.Identity()  # type: ignore[assignment]

    def serving_state(self) -> dict[str, torch.Tensor]:
        """The weights a student checkpoint carries: everything but the projection."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("distill_proj.")}

    def tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] normalised pixels -> [B, 1 + grid**2, dim] final tokens (CLS first)."""
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.norm(x)
        return out

    def heads(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(class logits [B, C], patch defect logits [B, grid, grid])."""
        g = self.config.grid
        logits = self.head(torch.cat([tokens[:, 0], tokens[:, 1:].mean(dim=1)], dim=-1))
        patch = self.patch_head(tokens[:, 1:]).view(-1, g, g)
        return logits, patch

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.tokens(pixels))


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class ExportWrapper(nn.Module):
    """What the engines carry: probabilities, not logits, so every backend returns the
    same thing and the runtime needs no softmax of its own."""

    def __init__(self, model: InspectViT) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, patch = self.model(pixels)
        return torch.softmax(logits, dim=-1), torch.sigmoid(patch)


def load_student(directory: Path, device: torch.device | str = "cpu") -> InspectViT:
    config = ViTConfig.from_json(directory / "config.json")
    model = InspectViT(config)
    state = torch.load(directory / "student.pt", map_location="cpu", weights_only=True)
    model.drop_distillation()
    model.load_state_dict(state)
    return model.to(device).eval()
