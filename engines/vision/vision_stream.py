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

import functools
import logging
import multiprocessing as mp
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.pool import Pool
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge.vision.vit import IMAGE_MEAN, IMAGE_STD, InspectViT, ViTConfig
from engines.vision.distill import Targets, TrainRecipe, _lr_at, distill_losses, make_optimizer
from engines.vision.factory_data import make_sample, patch_targets
from engines.vision.vision_teacher import torch_teacher
from engines.vision.weight_select import init_from_teacher

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


def _sample(args: tuple[int, str, int, int]) -> tuple[np.ndarray, int, np.ndarray]:
    seed, split, index, grid = args
    s = make_sample(seed, split, index)
    return s.image, s.label, patch_targets(s.mask, grid)


def _pool(workers: int) -> Pool:
    return mp.get_context("spawn").Pool(workers or max(1, (mp.cpu_count() or 2) - 1), initializer=_one_thread)


def generate(seed: int, split: str, indices: range, grid: int, workers: int = 0) -> dict[str, np.ndarray]:
    """Images, labels and patch targets of a split's samples at `indices`, made by
    worker processes (as the stream's are)."""
    with _pool(workers) as pool:
        samples = pool.map(_sample, [(seed, split, i, grid) for i in indices], chunksize=16)
    return {
        "images": np.stack([s[0] for s in samples]),
        "labels": np.array([s[1] for s in samples], np.int64),
        "targets": np.stack([s[2] for s in samples]).astype(np.float32),
    }


def _batches(plan: StreamPlan, batch: int, grid: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    work = ((plan.seed, "train", plan.first_index + i, grid) for i in range(plan.steps * batch))
    with _pool(plan.workers) as pool:
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
        cls, pooled, features = _teacher_side(self.model, pixels.to(self.dtype), self.grid)
        return Targets(cls, pooled, self.probe(features), features)


def _teacher_side(
    model: InspectViT, pixels: torch.Tensor, grid: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's CLS token [B, D], its patch tokens pooled to the student's grid
    [B, grid*grid, D], and the probe's input [B, 2D], in float32."""
    tokens = model.tokens(pixels).float()
    b, n, d = tokens.shape
    side = round((n - 1) ** 0.5)
    grid_tokens = tokens[:, 1:].transpose(1, 2).reshape(b, d, side, side)
    pooled = F.adaptive_avg_pool2d(grid_tokens, grid).reshape(b, d, -1).transpose(1, 2).contiguous()
    cls = tokens[:, 0].contiguous()
    # What the probe is trained on (probe_features): the CLS token and the mean patch
    # token of the pooled grid.
    return cls, pooled, torch.cat([cls, pooled.mean(dim=1)], dim=1)


@functools.cache
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device, not copied to it again for every batch of a stream.
    mean = torch.tensor(IMAGE_MEAN, device=device).view(1, 3, 1, 1)
    return mean, torch.tensor(IMAGE_STD, device=device).view(1, 3, 1, 1)


def _pixels(images: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 images [B, H, W, 3] -> the normalised [B, 3, H, W] float32 input, on `device`."""
    raw = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 255.0
    mean, std = _mean_std(device)
    return (raw - mean) / std


class TeacherFeatures:
    """The linear probe's input (CLS token and mean pooled patch token) for uint8
    images, from the PyTorch teacher on `device`: a probe trained on streamed images
    is fitted and validated on features from this one implementation."""

    def __init__(self, grid: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = torch_teacher(self.device, self.dtype)
        self.grid = grid

    @torch.inference_mode()
    def __call__(self, images: np.ndarray, batch: int = 128) -> torch.Tensor:
        out = []
        for start in range(0, len(images), batch):
            pixels = _pixels(images[start : start + batch], self.device).to(self.dtype)
            out.append(_teacher_side(self.model, pixels, self.grid)[2].cpu())
        return torch.cat(out)

    def stream(self, plan: StreamPlan, batch: int, progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [N, 2D], labels [N]) of the plan's streamed images, unflipped."""
        feats, labels = [], []
        for images, y, _ in tqdm(
            _batches(plan, batch, self.grid), total=plan.steps, desc="teacher features (stream)", disable=not progress
        ):
            feats.append(self(images, batch))
            labels.append(torch.from_numpy(y))
        return torch.cat(feats), torch.cat(labels)


class StreamStudent:
    """One student on a stream: its model, optimiser and schedule, and its loss history."""

    def __init__(
        self,
        config: ViTConfig,
        recipe: TrainRecipe,
        steps: int,
        teacher_weights: dict[str, np.ndarray] | None,
        device: torch.device,
    ) -> None:
        torch.manual_seed(recipe.seed)
        model = InspectViT(config)
        if recipe.distill:
            if teacher_weights is None:
                raise ValueError("a distilled stream build needs the teacher's weights")
            init_from_teacher(model, teacher_weights)
        self.model = model.to(device).train()
        self.recipe = recipe
        self.steps = steps
        self.opt = make_optimizer(self.model, recipe)
        self.history: list[dict[str, float]] = []
        self._sums: dict[str, float] = {}
        self._since = 0
        self._report = max(1, steps // 20)

    def step(
        self, step: int, pixels: torch.Tensor, labels: torch.Tensor, patch: torch.Tensor, teacher: Targets | None
    ) -> float:
        """One optimiser step on a batch (teacher: its targets, used if the recipe distils);
        returns the loss."""
        for group in self.opt.param_groups:
            group["lr"] = _lr_at(step, self.steps, self.recipe) * group["lr_scale"]
        cuda = pixels.device.type == "cuda"
        with torch.autocast(pixels.device.type, dtype=torch.bfloat16, enabled=cuda):
            side = teacher if self.recipe.distill else None
            losses = distill_losses(self.model, pixels, labels, patch, side, self.recipe)
            loss = sum(losses.values(), torch.zeros((), device=pixels.device))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        for k, v in losses.items():
            self._sums[k] = self._sums.get(k, 0.0) + float(v.detach())
        self._since += 1
        if (step + 1) % self._report == 0 or step + 1 == self.steps:
            self.history.append({"step": step + 1, **{k: v / self._since for k, v in self._sums.items()}})
            logger.info("step %d: %s", step + 1, self.history[-1])
            self._sums, self._since = {}, 0
        return float(loss.detach())


def train_students_streaming(
    config: ViTConfig,
    recipes: list[TrainRecipe],
    plan: StreamPlan,
    probe: torch.nn.Linear | None,
    teacher_weights: dict[str, np.ndarray] | None,
    device: torch.device | str,
    progress: bool = True,
    probes: Sequence[torch.nn.Linear | None] | None = None,
) -> list[tuple[InspectViT, dict[str, Any]]]:
    """Several students on one stream: every batch is generated once, the teacher's
    targets made once (if any recipe distils), and each student takes its step on it,
    so they are compared on exactly the same images. The recipes share a batch size.
    `probes`, one per recipe, gives a distilling student soft labels from a teacher head
    of its own instead of `probe`."""
    if len({r.batch_size for r in recipes}) != 1:
        raise ValueError("students on one stream share a batch size")
    if probes is not None and len(probes) != len(recipes):
        raise ValueError("one probe per recipe, or none")
    device = torch.device(device)
    cuda = device.type == "cuda"
    distilled = any(r.distill for r in recipes)
    teacher: TeacherTargets | None = None
    if distilled:
        if probe is None:
            raise ValueError("a distilled stream build needs the teacher's probe")
        teacher = TeacherTargets(probe, config.grid, device, torch.bfloat16 if cuda else torch.float32)
    students = [StreamStudent(config, r, plan.steps, teacher_weights, device) for r in recipes]
    heads = [p.to(device) if p is not None else None for p in probes] if probes else [None] * len(recipes)
    gen = torch.Generator(device="cpu").manual_seed(recipes[0].seed)
    desc = "student (stream)" if distilled else "student, no distillation (stream)"
    desc = desc if len(recipes) == 1 else f"{len(recipes)} students (stream)"
    bar = tqdm(total=plan.steps, desc=desc, disable=not progress)
    for step, (images, labels, targets) in enumerate(_batches(plan, recipes[0].batch_size, config.grid)):
        pixels = _pixels(images, device)
        flip = (torch.rand(len(labels), generator=gen) < 0.5).to(device)
        pixels = torch.where(flip[:, None, None, None], pixels.flip(3), pixels)
        patch = torch.from_numpy(targets).to(device)
        patch = torch.where(flip[:, None, None], patch.flip(2), patch)
        y = torch.from_numpy(labels).to(device)
        # The teacher sees the flipped image too: its tokens are those of what the
        # student sees, no grid flipping needed.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            teacher_side = teacher(pixels) if teacher is not None else None
        losses = [
            s.step(step, pixels, y, patch, _soft_labels_from(head, teacher_side))
            for s, head in zip(students, heads, strict=True)
        ]
        bar.update(1)
        bar.set_postfix(loss=" ".join(f"{v:.3f}" for v in losses))
    bar.close()
    images_seen = plan.steps * recipes[0].batch_size
    return [
        (s.model.cpu().eval(), {"history": s.history, "steps": plan.steps, "images": images_seen}) for s in students
    ]


@torch.inference_mode()
def _soft_labels_from(head: torch.nn.Linear | None, targets: Targets | None) -> Targets | None:
    if head is None or targets is None or targets.features is None:
        return targets
    return replace(targets, logits=head(targets.features))


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
    return train_students_streaming(config, [recipe], plan, probe, teacher_weights, device, progress)[0]
