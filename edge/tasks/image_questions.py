"""A `qa` job's image, where the text model's build has an image part (a LLaVA-style
model: edge/vlm): the image part loaded beside the language model, measured into the
ledger, and each job's image made into the prompt the text engine runs.

When the job is prepared, its image is checked from its header (the image limits, what
preprocessing would make of it) and its rows counted from the model's arithmetic: the
prompt then holds its image token once per row, so its length, the passages that fit
and the KV the job reserves all count them. The pixels are decoded and go through the
tower and the projector only once the job's KV row is granted (ImageQuestions says
why), on the text branch's thread between two decode steps, as a prefill does. The
rows stay with the sequence while it holds its row, on the engine's device: one row of
the language model's width per image token, a small share of the KV those tokens take
in every layer, which the ledger's headroom covers."""

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
from edge.text.model.splice import Splice
from edge.text.prompt import Prompter
from edge.vlm.image_prep import ImagePixels, PrepCost
from edge.vlm.vision_language import VisionLanguage, has_image_part, image_part_bytes

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


@dataclass(frozen=True)
class PlannedImage:
    """A job's image as far as it is known before the job is admitted: where it comes
    from and the prompt positions its rows will take (from its header, through the
    model's arithmetic). Nothing of its pixels is held."""

    ref: ImageRef
    field: str  # what an error about it names: image.data or image.path
    tokens: int


class ImageQuestions:
    """A job's image made into its prompt: planned when the job is prepared (its header
    read, its limits checked, its rows counted), its rows made only once the job's KV row
    is granted, with the job's share of the budget reserved while it is decoded and read.

    Why the rows wait for the KV grant: the text branch grants a job's memory at
    admission, all or nothing (its KV row, its prefill's activations: text_worker.py),
    and a queued job holds none of it, so any number of jobs may queue. Rows made before
    that would wait in the queue held by nothing the ledger counts, as many as jobs wait.
    Holding them in the ledger instead would take a reservation that outlives the
    admission, through the queue, pauses and every way a job can end there (its deadline,
    a cancel, a stop), which the ledger's reserve-before-run, give-back-after design has
    no owner for. Made at admission, they live only as long as the KV row they go with
    (a pause drops them with it; they are made again on resume, as the prefill is
    recomputed), so they are bounded as the KV rows are."""

    def __init__(self, manager: ModelManager, media: MediaLoader, name: str) -> None:
        self._manager = manager
        self._media = media
        self.name = name  # the image part's name in the ledger

    def _part(self) -> ImagePart:
        part: ImagePart = self._manager.get(self.name, keep={self.name})
        return part

    def _read(self, part: ImagePart, ref: ImageRef) -> tuple[bytes, str, int, int, PrepCost]:
        """The image's bytes, the field they came from, its width and height and what
        preprocessing makes of it, every limit checked on its header alone."""
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
        return raw, field, width, height, cost

    def plan(self, ref: ImageRef) -> PlannedImage:
        """The image `ref` checked and counted from its header: JobError naming its field
        where it cannot be read or is too large. Its bytes are not kept (a queued job
        holds nothing of its image; `rows` reads it again)."""
        part = self._part()
        _, field, width, height, _ = self._read(part, ref)
        return PlannedImage(ref, field, part.vlm.image_tokens((height, width)))

    def ids(
        self, planned: PlannedImage, prompter: Prompter, question: str, context: str | None
    ) -> tuple[list[int], int, int]:
        """The prompt's ids for `question` about the planned image, its image token
        made into one per row; how many lead it others may share; where its rows begin.
        ChatTemplateError where the template refuses."""
        ids, prefix = prompter.parts(question, context, images=1)
        out, (at,), prefix = self._part().vlm.expand(ids, [planned.tokens], prefix)
        return out, prefix, at

    def rows(self, owner: str, planned: PlannedImage, at: int, stages: dict[str, float]) -> tuple[Splice, ...]:
        """The image's rows at prompt position `at`: read again, decoded, preprocessed and
        through the tower and projector, with its memory reserved meanwhile (over_budget
        where it does not fit); JobError naming its field where it can no longer be read,
        or no longer takes the positions planned (a file changed while its job waited).
        Milliseconds go into `stages` (image_decode, image_encode), added to any from
        before a pause."""
        part = self._part()
        raw, field, width, height, cost = self._read(part, planned.ref)
        if part.vlm.image_tokens((height, width)) != planned.tokens:
            why = f"the image changed while its job was queued: it is now {width}x{height}, another number of tokens"
            raise JobError(ErrorCode.IMAGE_INVALID, why, field)
        # Decoding holds a second buffer of the image's size (MediaLoader.decode_extra_bytes);
        # then the RGB copy, what preprocessing makes and the tower's working memory.
        decoded = 3 * width * height
        host = len(raw) + decoded + max(decoded, cost.held_bytes + part.working.host)
        need = self._manager.counted(MemoryUse(host=host, device=part.working.device))
        res = self._manager.reserve(owner, "qa", need, {self.name}, self.name)
        try:
            t0 = time.perf_counter()
            rgb = np.ascontiguousarray(decode_image(raw, self._media.limits, field)[:, :, ::-1])  # decoded as BGR
            del raw
            t1 = time.perf_counter()
            made = part.vlm.features(rgb)
            t2 = time.perf_counter()
        finally:
            self._manager.release(res, {self.name})
        if int(made.shape[0]) != planned.tokens:  # the model's arithmetic and its tower disagree: a bug
            raise ValueError(f"the image made {made.shape[0]} rows where {planned.tokens} were counted")
        for stage, seconds in (("image_decode", t1 - t0), ("image_encode", t2 - t1)):
            stages[stage] = stages.get(stage, 0.0) + seconds * 1000.0
        logger.debug("job %s: image rows made at %d (%d rows)", owner, at, planned.tokens)
        return (Splice(at, made),)


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
