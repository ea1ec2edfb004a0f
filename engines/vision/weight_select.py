"""Initialise the student from the teacher by weight selection (Xu et al., "Initializing
Models with Larger Ones", ICLR 2024): every student weight is a consistent slice of the
teacher's, so the student starts as a half-width copy of the teacher instead of noise.

The residual stream keeps 192 of the teacher's 384 channels (the same ones in every
layer), attention keeps 3 of the 6 heads whole (head size 64 in both), the MLP keeps
768 of 1536 hidden units. DINOv2's per-channel LayerScale is folded into the output
projections. The 14-pixel patch kernels are resized to 16 pixels, and the teacher's
37x37 position table to the student's 14x14 grid. A ViT-Tiny trained from scratch needs
far more steps than a CPU gives in minutes; started this way it needs few.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from edge.vision.vit import Block, InspectViT

logger = logging.getLogger(__name__)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32))  # a writable copy


def teacher_layers(depth: int, teacher_depth: int) -> list[int]:
    """Which teacher layer each student block starts from: the first `depth` ones."""
    if depth > teacher_depth:
        raise ValueError(f"a {depth}-block student cannot be selected from a {teacher_depth}-layer teacher")
    return list(range(depth))


@torch.no_grad()
def init_from_teacher(student: InspectViT, weights: dict[str, np.ndarray]) -> None:
    cfg = student.config
    t_dim = weights["backbone.embeddings.cls_token"].shape[-1]
    t_hidden = weights["backbone.encoder.layer.0.mlp.fc1.bias"].shape[0]
    if cfg.dim > t_dim or cfg.dim % (t_dim // (t_dim // 64)) != 0:
        raise ValueError(f"cannot select a width-{cfg.dim} student from a width-{t_dim} teacher")
    res = torch.arange(cfg.dim)  # residual channels kept
    head = torch.arange(cfg.dim)  # attention channels kept: the first dim/64 heads, whole
    hidden = torch.arange(cfg.dim * cfg.mlp_ratio) * (t_hidden // (cfg.dim * cfg.mlp_ratio))
    pre = "backbone.embeddings."
    patch_w = _t(weights[pre + "patch_embeddings.projection.weight"])[res]  # [dim, 3, 14, 14]
    k = cfg.patch_size
    scale = (patch_w.shape[-1] / k) ** 2  # same response to a smooth image from a bigger kernel
    student.patch_embed.weight.copy_(F.interpolate(patch_w, size=(k, k), mode="bilinear", align_corners=False) * scale)
    assert student.patch_embed.bias is not None
    student.patch_embed.bias.copy_(_t(weights[pre + "patch_embeddings.projection.bias"])[res])
    student.cls_token.copy_(_t(weights[pre + "cls_token"])[..., res])
    table = _t(weights[pre + "patch_position_embeddings"])[0]  # [side*side, t_dim]
    side = round(table.shape[0] ** 0.5)
    grid = table.T.reshape(1, t_dim, side, side)
    grid = F.interpolate(grid, size=(cfg.grid, cfg.grid), mode="bicubic", align_corners=False)
    patch_pos = grid.reshape(t_dim, cfg.grid * cfg.grid).T[:, res]
    cls_pos = _t(weights[pre + "cls_position_embeddings"])[0, :, res]
    student.pos_embed.copy_(torch.cat([cls_pos, patch_pos])[None])
    t_depth = 1 + max(int(k.split(".")[3]) for k in weights if k.startswith("backbone.encoder.layer."))
    sources = teacher_layers(cfg.depth, t_depth)
    for src, module in zip(sources, student.blocks, strict=True):
        assert isinstance(module, Block)
        block = module
        p = f"backbone.encoder.layer.{src}."

        def w(name: str, p: str = p) -> torch.Tensor:
            return _t(weights[p + name])

        ls1, ls2 = w("layer_scale1.lambda1")[res], w("layer_scale2.lambda1")[res]
        block.norm1.weight.copy_(w("norm1.weight")[res])
        block.norm1.bias.copy_(w("norm1.bias")[res])
        qkv = [w(f"attention.attention.{n}.weight_in_out")[res][:, head].T for n in ("query", "key", "value")]
        block.attn.qkv.weight.copy_(torch.cat(qkv))
        block.attn.qkv.bias.copy_(
            torch.cat([w(f"attention.attention.{n}.bias")[head] for n in ("query", "key", "value")])
        )
        block.attn.proj.weight.copy_(w("attention.output.dense.weight_in_out")[head][:, res].T * ls1[:, None])
        block.attn.proj.bias.copy_(w("attention.output.dense.bias")[res] * ls1)
        block.norm2.weight.copy_(w("norm2.weight")[res])
        block.norm2.bias.copy_(w("norm2.bias")[res])
        fc1, fc2 = block.mlp[0], block.mlp[2]
        assert isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear)
        fc1.weight.copy_(w("mlp.fc1.weight_in_out")[res][:, hidden].T)
        fc1.bias.copy_(w("mlp.fc1.bias")[hidden])
        fc2.weight.copy_(w("mlp.fc2.weight_in_out")[hidden][:, res].T * ls2[:, None])
        fc2.bias.copy_(w("mlp.fc2.bias")[res] * ls2)
    student.norm.weight.copy_(_t(weights["backbone.layernorm.weight"])[res])
    student.norm.bias.copy_(_t(weights["backbone.layernorm.bias"])[res])
    logger.info("student initialised from the teacher by weight selection")
