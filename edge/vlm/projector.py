"""LLaVA's multi-modal projector: the tower's features into the language model's width,
two linears with an activation between (transformers' LlavaMultiModalProjector)."""

from __future__ import annotations

import torch
from torch import nn

from edge.vision.vision_tower import activation


class Projector(nn.Module):
    def __init__(self, features: int, width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(features, width, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(width, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out
