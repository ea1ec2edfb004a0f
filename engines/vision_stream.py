"""Distillation on a stream of freshly generated images, for a machine with a GPU.

The CPU build trains on a fixed set of a few hundred images whose teacher tokens were
computed once (the teacher on onnxruntime makes ~10 images/s on two cores). With the
teacher rebuilt in PyTorch (vision_teacher.torch_teacher) its tokens are made on the
GPU for every batch, so the student never sees an image twice: worker processes draw
new training images from the generator (indices past the stored training split, so
validation and test stay unseen), the teacher gives tokens and probe logits for them,
and the student takes one step on the same loss as the CPU build (distill_losses).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge.vision.vit import IMAGE_MEAN, IMAGE_STD, InspectViT, ViTConfig
from engines.distill import Targets, TrainRecipe, _lr_at, distill_losses, make_optimizer
from engines.factory_data import make_sample, patch_targets
from engines.vision_teacher import torch_teacher
from engines.weight_select import init_from_teacher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamPlan:
    steps: int
    first_index: int  # generator indices from here on (past the stored training split)
    seed: int = 0
    workers: int = 0  # generator processes; 0: all cores but one


def _one_thread() -> None:
    # Each generator process is one core's worth of work; OpenCV's own thread pool in
    # every one of them oversubscribed a 16-core machine fourfold and halved the rate.
    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def _sample(args: tuple[int, int, int]) -> tuple[np.ndarray, int, np.ndarray]:
    seed, index, grid = args
    s = make_sample(seed, "train", index)
    return s.image, s.label, patch_targets(s.mask, grid)


def _batches(plan: StreamPlan, batch: int, grid: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    work = ((plan.seed, plan.first_index + i, grid) for i in range(plan.steps * batch))
    workers = plan.workers or max(1, (mp.cpu_count() or 2) - 1)
    with mp.get_context("spawn").Pool(workers, initializer=_one_thread) as pool:
        items = pool.imap(_sample, work, chunksize=16)
        for _ in range(plan.steps):
            chunk = [next(items) for _ in range(batch)]
            yield (
                np.stack([c[0] for c in chunk]),
                np.array([c[1] for c in chunk], np.int64),
                np.stack([c[2] for c in chunk]).astype(np.float32),
            )


class TeacherTargets:
    """Teacher tokens and probe logits for a batch, computed on the training device."""

    def __init__(self, probe: torch.nn.Linear, grid: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = torch_teacher(device, dtype)
        self.probe = probe.to(device)
        self.grid = grid
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> Targets:
        tokens = self.model.tokens(pixels.to(self.dtype)).float()
        b, n, d = tokens.shape
        side = round((n - 1) ** 0.5)
        grid_tokens = tokens[:, 1:].transpose(1, 2).reshape(b, d, side, side)
        pooled = F.adaptive_avg_pool2d(grid_tokens, self.grid).reshape(b, d, -1).transpose(1, 2)
        # What the probe was trained on (probe_features): the CLS token and the mean patch
        # token of the pooled grid.
        logits = self.probe(torch.cat([tokens[:, 0], pooled.mean(dim=1)], dim=1))
        return Targets(tokens[:, 0].clone(), pooled.contiguous(), logits)


def train_student_streaming(
    config: ViTConfig,
    recipe: TrainRecipe,
    plan: StreamPlan,
    probe: torch.nn.Linear | None,
    teacher_weights: dict[str, np.ndarray] | None,
    device: torch.device | str,
    progress: bool = True,
) -> tuple[InspectViT, dict[str, Any]]:
    """The student, trained for plan.steps steps of recipe.batch_size new images each,
    on `device` (bfloat16 autocast on CUDA). Returns it on the CPU. With
    recipe.distill the teacher (`probe` and `teacher_weights`) gives targets for every
    batch and the student starts from its weights; without, this is the baseline: the
    same images, true labels only, random initial weights."""
    device = torch.device(device)
    torch.manual_seed(recipe.seed)
    model = InspectViT(config)
    cuda = device.type == "cuda"
    teacher: TeacherTargets | None = None
    if recipe.distill:
        if probe is None or teacher_weights is None:
            raise ValueError("a distilled stream build needs the teacher's probe and weights")
        init_from_teacher(model, teacher_weights)
        teacher = TeacherTargets(probe, config.grid, device, torch.bfloat16 if cuda else torch.float32)
    model = model.to(device).train()
    opt = make_optimizer(model, recipe)
    mean = torch.tensor(IMAGE_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD, device=device).view(1, 3, 1, 1)
    gen = torch.Generator(device="cpu").manual_seed(recipe.seed)
    sums: dict[str, float] = {}
    since = 0
    history: list[dict[str, float]] = []
    report = max(1, plan.steps // 20)
    desc = "student (stream)" if recipe.distill else "student, no distillation (stream)"
    bar = tqdm(total=plan.steps, desc=desc, disable=not progress)
    for step, (images, labels, targets) in enumerate(_batches(plan, recipe.batch_size, config.grid)):
        raw = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 255.0
        pixels = (raw - mean) / std
        flip = (torch.rand(len(labels), generator=gen) < 0.5).to(device)
        pixels = torch.where(flip[:, None, None, None], pixels.flip(3), pixels)
        patch = torch.from_numpy(targets).to(device)
        patch = torch.where(flip[:, None, None], patch.flip(2), patch)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, plan.steps, recipe) * group["lr_scale"]
        # The teacher sees the flipped image too: its tokens are those of what the
        # student sees, no grid flipping needed.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            teacher_side = teacher(pixels) if teacher is not None else None
            losses = distill_losses(model, pixels, torch.from_numpy(labels).to(device), patch, teacher_side, recipe)
            loss = sum(losses.values(), torch.zeros((), device=device))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for k, v in losses.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach())
        since += 1
        if (step + 1) % report == 0 or step + 1 == plan.steps:
            history.append({"step": step + 1, **{k: v / since for k, v in sums.items()}})
            logger.info("step %d: %s", step + 1, history[-1])
            sums, since = {}, 0
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    bar.close()
    return model.cpu().eval(), {"history": history, "steps": plan.steps, "images": plan.steps * recipe.batch_size}
