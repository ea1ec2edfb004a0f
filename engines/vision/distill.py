"""Train the inspection student, with or without distillation from the teacher.

With distillation (DeiT-style soft labels plus feature distillation) the loss is:
  cross-entropy on the true class
  + KL(teacher probe's softened class distribution || student's), temperature T
  + (1 - cosine) between the student's projected CLS token and the teacher's
  + (1 - cosine) between each projected patch token and the teacher's token there
  + per-patch binary cross-entropy against the defect mask (the heat map head).
Without it, only the first and last terms: the baseline distillation must beat.
The distilled student starts from the teacher's weights (weight selection, see
weight_select.py); the baseline starts from random weights, so it owes nothing to the
teacher at all.
Horizontal flips double the data; the teacher's patch grid is flipped with the image.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge.vision.vit import InspectViT, ViTConfig
from engines.vision.vision_teacher import normalise
from engines.vision.weight_select import init_from_teacher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainRecipe:
    epochs: int = 8
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_fraction: float = 0.1
    head_lr_scale: float = 10.0
    temperature: float = 2.0
    kd_weight: float = 1.0
    feature_weight: float = 1.0
    patch_weight: float = 0.5
    distill: bool = True
    init: str = "teacher"  # "teacher": weight selection from the teacher; "random": from scratch
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainData:
    images: np.ndarray  # uint8 [N, H, W, 3]
    labels: np.ndarray  # int64 [N]
    patch_targets: np.ndarray  # float32 [N, g, g]
    teacher_cls: np.ndarray | None = None  # float32 [N, 384]
    teacher_patches: np.ndarray | None = None  # float16 [N, g*g, 384]
    teacher_logits: np.ndarray | None = None  # float32 [N, C]
    # Per image, how much its heat map target counts (0: a defect image without a mask);
    # None: every image's does.
    patch_weights: np.ndarray | None = None  # float32 [N]


def _flip_grid(tokens: torch.Tensor, grid: int) -> torch.Tensor:
    b, n, d = tokens.shape
    return tokens.view(b, grid, grid, d).flip(2).reshape(b, n, d)


def _lr_at(step: int, total: int, recipe: TrainRecipe) -> float:
    warm = max(1, int(total * recipe.warmup_fraction))
    if step < warm:
        return recipe.lr * (step + 1) / warm
    return recipe.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


@dataclass
class Targets:
    """The teacher's side of a batch: CLS [B, D], patch tokens on the student's grid
    [B, g*g, D] (already flipped with the image), probe logits [B, C], and, where the
    teacher runs alongside, the probe's input [B, 2D] (another head's logits come from it)."""

    cls: torch.Tensor
    patches: torch.Tensor
    logits: torch.Tensor
    features: torch.Tensor | None = None


def distill_losses(
    model: InspectViT,
    pixels: torch.Tensor,
    labels: torch.Tensor,
    patch_targets: torch.Tensor,
    teacher: Targets | None,
    recipe: TrainRecipe,
    patch_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The loss terms of one batch (see the module docstring); the teacher's terms only
    with `teacher`; the heat map's term weighted per image with `patch_weights`."""
    tokens = model.tokens(pixels)
    logits, patch_logits = model.heads(tokens)
    weight = None if patch_weights is None else patch_weights.view(-1, 1, 1).expand_as(patch_logits)
    losses = {
        "ce": F.cross_entropy(logits, labels),
        "patch": recipe.patch_weight * F.binary_cross_entropy_with_logits(patch_logits, patch_targets, weight=weight),
    }
    if teacher is not None:
        t = recipe.temperature
        losses["kd"] = (
            recipe.kd_weight
            * F.kl_div(
                F.log_softmax(logits / t, dim=-1), F.log_softmax(teacher.logits / t, dim=-1), log_target=True,
                reduction="batchmean",
            )
            * t * t
        )  # fmt: skip
        projected = model.distill_proj(tokens)
        cls_loss = (1 - F.cosine_similarity(projected[:, 0], teacher.cls, dim=-1)).mean()
        patch_loss = (1 - F.cosine_similarity(projected[:, 1:], teacher.patches, dim=-1)).mean()
        losses["feat"] = recipe.feature_weight * (cls_loss + patch_loss)
    return losses


def make_optimizer(model: InspectViT, recipe: TrainRecipe) -> torch.optim.AdamW:
    """AdamW with no decay on norms, biases and positions; each group carries the scale
    of the schedule's rate it takes (`lr_scale`)."""
    # Heads (new) learn at head_lr_scale x the rate of the body (selected from the teacher):
    # a large rate on a pretrained body in the first steps undoes what it brought.
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        is_head = name.split(".")[0] in ("head", "patch_head", "distill_proj")
        decays = p.ndim >= 2 and "pos_embed" not in name
        groups.setdefault((is_head, decays), []).append(p)
    return torch.optim.AdamW(
        [
            {
                "params": params,
                "weight_decay": recipe.weight_decay if decays else 0.0,
                "lr_scale": recipe.head_lr_scale if is_head else 1.0,
            }
            for (is_head, decays), params in groups.items()
        ],
        lr=recipe.lr,
    )


def train_student(
    data: TrainData,
    config: ViTConfig,
    recipe: TrainRecipe,
    progress: bool = True,
    teacher_weights: dict[str, np.ndarray] | None = None,
) -> tuple[InspectViT, dict[str, Any]]:
    if recipe.distill and (data.teacher_cls is None or data.teacher_patches is None or data.teacher_logits is None):
        raise ValueError("distillation needs the teacher's tokens and probe logits")
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    model = InspectViT(config).train()
    if recipe.init == "teacher":
        if teacher_weights is None:
            raise ValueError("init 'teacher' needs the teacher's weights")
        init_from_teacher(model, teacher_weights)
    elif recipe.init != "random":
        raise ValueError(f"unknown init {recipe.init!r}")
    opt = make_optimizer(model, recipe)
    n = len(data.labels)
    steps_per_epoch = math.ceil(n / recipe.batch_size)
    total = steps_per_epoch * recipe.epochs
    g = config.grid
    history: list[dict[str, float]] = []
    bar = tqdm(total=total, desc="student (distilled)" if recipe.distill else "student (plain)", disable=not progress)
    step = 0
    for epoch in range(recipe.epochs):
        order = rng.permutation(n)
        sums: dict[str, float] = {}
        for start in range(0, n, recipe.batch_size):
            idx = order[start : start + recipe.batch_size]
            flip = torch.from_numpy(rng.random(len(idx)) < 0.5)
            pixels = torch.from_numpy(normalise(data.images[idx]))
            pixels = torch.where(flip[:, None, None, None], pixels.flip(3), pixels)
            labels = torch.from_numpy(data.labels[idx])
            targets = torch.from_numpy(data.patch_targets[idx])
            targets = torch.where(flip[:, None, None], targets.flip(2), targets)
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, total, recipe) * group["lr_scale"]
            teacher = None
            if recipe.distill:
                assert data.teacher_cls is not None and data.teacher_patches is not None
                assert data.teacher_logits is not None
                t_patch = torch.from_numpy(data.teacher_patches[idx].astype(np.float32))
                teacher = Targets(
                    torch.from_numpy(data.teacher_cls[idx]),
                    torch.where(flip[:, None, None], _flip_grid(t_patch, g), t_patch),
                    torch.from_numpy(data.teacher_logits[idx]),
                )
            weights = None if data.patch_weights is None else torch.from_numpy(data.patch_weights[idx])
            losses = distill_losses(model, pixels, labels, targets, teacher, recipe, weights)
            loss = sum(losses.values(), torch.zeros((), device=pixels.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            for k, v in losses.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach()) * len(idx)
            step += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{float(loss.detach()):.3f}")
        history.append({k: v / n for k, v in sums.items()})
        logger.info("epoch %d: %s", epoch + 1, history[-1])
    bar.close()
    return model.eval(), {"history": history, "steps": total}


@torch.inference_mode()
def predict(model: InspectViT, images: np.ndarray, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(class probabilities [N, C], patch defect probabilities [N, g, g]), computed where
    the model's weights are."""
    device = next(model.parameters()).device
    probs, patches = [], []
    for start in range(0, len(images), batch):
        logits, patch = model(torch.from_numpy(normalise(images[start : start + batch])).to(device))
        probs.append(torch.softmax(logits, -1).float().cpu().numpy())
        patches.append(torch.sigmoid(patch).float().cpu().numpy())
    return np.concatenate(probs), np.concatenate(patches)
