"""A `qa` job's image, where the text model's build has an image part (a LLaVA-style
model: edge/vlm): the image part loaded beside the language model, measured into the
ledger, and each job's image decoded, within the image limits and the budget, into the
prompt the text engine runs.

The image is read on the text branch's thread while its job is admitted, as its prompt
is tokenized: the tower and the projector run once per image between two decode steps,
as a prefill does. The prompt then goes into the same batcher as any qa job's; its image
tokens are prompt tokens, which its KV row counts. The image's projected rows stay with
the sequence until it ends, on the engine's device: one row of the language model's
width per image token, a small share of the KV those tokens take in every layer, which
the ledger's headroom covers."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from edge.memory import MemoryUse, device_working_bytes, host_working_bytes
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.images import decode_image, header_checked
from edge.protocol.jobs import ImageRef
from edge.scheduler.models import ModelManager
from edge.tasks.media import MediaLoader
from edge.text.engine import TextEngine
from edge.text.prompt import Prompter
from edge.vlm.image_prep import ImagePixels
from edge.vlm.vision_language import ImagePrompt, VisionLanguage, has_image_part, image_part_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImagePart:
    """The loaded image part, as the model manager holds it."""

    vlm: VisionLanguage
    # The tower and projector over the most views one image makes, measured at load.
    working: MemoryUse
    # Its weights where they are on a GPU: the manager counts it at least this (on the
    # CPU the registered floor does the same).
    device_floor_bytes: int


def load_image_part(checkpoint: Path, engine: TextEngine) -> ImagePart:
    """The image part on the engine's device, in its activations' type, run once before
    its working memory is measured (allocators plan at the first run of a shape)."""
    vlm = VisionLanguage.load(checkpoint, engine.device, engine.dtype)
    # A question about a small blank image first: a chat template that writes no image
    # token fails the load here, not a job later.
    vlm.prompt(engine.prompter, "Describe the image.", None, [np.zeros((8, 8, 3), dtype=np.uint8)])
    views = vlm.most_views()
    vlm.features(views)
    return ImagePart(vlm, _working(vlm, views), vlm.nbytes if vlm.device.type == "cuda" else 0)


def _working(vlm: VisionLanguage, views: ImagePixels) -> MemoryUse:
    run = partial(vlm.features, views)
    if vlm.device.type == "cuda":
        return MemoryUse(device=device_working_bytes(run, vlm.device.index or 0))
    return MemoryUse(host=host_working_bytes(run))


class ImageQuestions:
    """A job's image made into its prompt, with the job's share of the budget reserved
    while it is decoded and read."""

    def __init__(self, manager: ModelManager, media: MediaLoader, name: str) -> None:
        self._manager = manager
        self._media = media
        self.name = name  # the image part's name in the ledger

    def prompt(
        self, owner: str, ref: ImageRef, prompter: Prompter, question: str, context: str | None
    ) -> tuple[ImagePrompt, dict[str, float]]:
        """The prompt for `question` about the image `ref`, and milliseconds by stage
        (image_decode, tokenize, image_encode). JobError naming the image's field for an
        image that cannot be read or is too large, over_budget where its memory does not
        fit; the chat template's refusal as ChatTemplateError."""
        part: ImagePart = self._manager.get(self.name, keep={self.name})
        limits = self._media.limits
        raw, field = self._media.read(ref)
        width, height = header_checked(raw, limits, field)
        cost = part.vlm.prepare_cost((height, width))
        if cost.largest_pixels > limits.max_pixels:
            why = (
                f"this model's preprocessing makes a {width}x{height} image into one of {cost.largest_pixels} "
                f"pixels (padded to a square or resized by its shorter side), limit {limits.max_pixels}"
            )
            raise JobError(ErrorCode.IMAGE_TOO_LARGE, why, field)
        # Decoding holds a second buffer of the image's size (MediaLoader.decode_extra_bytes);
        # then the RGB copy, what preprocessing makes and the tower's working memory.
        decoded = 3 * width * height
        host = len(raw) + decoded + max(decoded, cost.held_bytes + part.working.host)
        need = self._manager.counted(MemoryUse(host=host, device=part.working.device))
        res = self._manager.reserve(owner, "qa", need, {self.name}, self.name)
        try:
            t0 = time.perf_counter()
            rgb = np.ascontiguousarray(decode_image(raw, limits, field)[:, :, ::-1])  # decoded as BGR
            t1 = time.perf_counter()
            ids, prefix = prompter.parts(question, context, images=1)
            t2 = time.perf_counter()
            prompt = part.vlm.splice(ids, [rgb], prefix)
            t3 = time.perf_counter()
        finally:
            self._manager.release(res, {self.name})
        ms = {"image_decode": t1 - t0, "tokenize": t2 - t1, "image_encode": t3 - t2}
        return prompt, {stage: s * 1000.0 for stage, s in ms.items()}


def start_image_questions(
    checkpoint: Path, engine: TextEngine, manager: ModelManager, media: MediaLoader, model: str
) -> ImageQuestions | None:
    """The image part of the text model `model` loaded through the model manager and
    measured into its ledger (counted at least at its weights' size); None where the
    checkpoint has none."""
    if not has_image_part(checkpoint):
        return None
    name = f"{model}-image"
    device = engine.device.type
    floor = image_part_bytes(checkpoint, engine.dtype)
    load = partial(load_image_part, checkpoint, engine)
    manager.register(name, "text", f"torch-{device}", load, float("inf"), device, host_floor_bytes=floor)
    part: ImagePart = manager.load(name)
    manager.set_working(name, manager.counted(part.working))
    logger.info(
        "image part %s: %s tower, %.1f MiB of weights, %.1f MiB working memory per image",
        name,
        part.vlm.config.tower.kind,
        part.vlm.nbytes / 2**20,
        manager.counted(part.working) / 2**20,
    )
    return ImageQuestions(manager, media, name)
