"""A vision-language model's image side, beside its language model: an image and a
prompt in, the prompt the text engine runs out (token ids, with the image's features
spliced in at its image token's positions: edge/text/model/splice.py).

The language model is the text branch's own (imported and quantized by the text build,
served by TextEngine); what is here is the rest of a LLaVA-style model, read from the
checkpoint's image part (`vision.json`, `vision.safetensors`): the CLIP or SigLIP tower
(edge/vision/vision_tower.py), the projector, and LLaVA-NeXT's tiling and image_newline.
They run in torch on the language model's device, in its activations' type.

    vlm = VisionLanguage.load(checkpoint_dir, device, dtype)
    prompt = vlm.prompt(engine.prompter, question, context, [image])
    engine.generate(prompt.ids, params, prefix=prompt.prefix, splices=prompt.splices)
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from torch import nn

from edge.text.model.splice import Splice
from edge.text.prompt import Prompter
from edge.vision.vision_tower import VisionTower
from edge.vlm.anyres import pack, packed_tokens
from edge.vlm.image_prep import ImagePixels, PrepCost, prepare, prepare_cost
from edge.vlm.projector import Projector
from edge.vlm.vlm_config import CONFIG_FILE, WEIGHTS_FILE, VisionLanguageConfig

logger = logging.getLogger(__name__)

ImageLike = Image.Image | np.ndarray | ImagePixels


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its images: what TextEngine.generate and TextEngine.sequence take."""

    ids: list[int]  # each image token expanded to one per row of the image's features
    splices: tuple[Splice, ...]  # the images' rows, at their tokens' positions
    prefix: int  # leading tokens others may share: never past the first image

    @property
    def image_tokens(self) -> int:
        return sum(int(s.rows.shape[0]) for s in self.splices)


class ImagePart(nn.Module):
    """The weights of vision.safetensors: `tower.*`, `projector.*` and LLaVA-NeXT's
    `image_newline`."""

    def __init__(self, config: VisionLanguageConfig) -> None:
        super().__init__()
        self.tower = VisionTower(config.tower)
        features = config.tower.hidden_size * len(config.feature_layers)
        self.projector = Projector(features, config.text_hidden, config.projector_act, config.projector_bias)
        tiled = config.family == "llava_next"
        self.image_newline = nn.Parameter(torch.zeros(config.text_hidden)) if tiled else None


def has_image_part(checkpoint: Path) -> bool:
    return (checkpoint / CONFIG_FILE).is_file() and (checkpoint / WEIGHTS_FILE).is_file()


def unserved_image_part(checkpoint: Path) -> str | None:
    """Why the image part of a vision-language model whose language model alone was
    imported is not served (Gemma 3's: its import writes it into generation.json, which
    every build step carries); None for any other checkpoint."""
    path = checkpoint / "generation.json"
    if not path.is_file():
        return None
    why = json.loads(path.read_text(encoding="utf-8")).get("image_refusal")
    return why if isinstance(why, str) else None


def image_part_bytes(checkpoint: Path, dtype: torch.dtype) -> int:
    """What the image part's weights take loaded in `dtype` (VisionLanguage.nbytes),
    read from the file's header alone."""
    size = torch.tensor([], dtype=dtype).element_size()
    with safe_open(str(checkpoint / WEIGHTS_FILE), framework="pt", device="cpu") as fh:
        return sum(math.prod(fh.get_slice(name).get_shape()) * size for name in fh.keys())


class VisionLanguage:
    def __init__(self, config: VisionLanguageConfig, part: ImagePart) -> None:
        self.config = config
        self.part = part.eval()

    @classmethod
    def load(
        cls, checkpoint: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> VisionLanguage:
        """The image part of the checkpoint at `checkpoint`, on `device` in `dtype`."""
        if not has_image_part(checkpoint):
            raise FileNotFoundError(f"{checkpoint} has no image part ({CONFIG_FILE}, {WEIGHTS_FILE}): not a VLM build")
        config = VisionLanguageConfig.from_json(checkpoint / CONFIG_FILE)
        with torch.device("meta"):
            part = ImagePart(config)
        with safe_open(str(checkpoint / WEIGHTS_FILE), framework="pt", device="cpu") as fh:
            state = {name: fh.get_tensor(name).to(device=device, dtype=dtype) for name in fh.keys()}
        missing, unexpected = part.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"{checkpoint / WEIGHTS_FILE} does not match {CONFIG_FILE}: missing {missing}, unexpected {unexpected}"
            )
        logger.info(
            "image part: %s tower of %d layers, %d MiB",
            config.tower.kind,
            config.tower.num_layers,
            cls.bytes_of(part) >> 20,
        )
        return cls(config, part)

    @staticmethod
    def bytes_of(part: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in part.parameters())

    @property
    def nbytes(self) -> int:
        """The tower's, projector's and newline's weights, as loaded."""
        return self.bytes_of(self.part)

    @property
    def device(self) -> torch.device:
        return self.part.projector.linear_1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.part.projector.linear_1.weight.dtype

    def pixels(self, image: Image.Image | np.ndarray) -> ImagePixels:
        """The views the tower sees of `image` (a PIL image, or RGB uint8 [H, W, 3])."""
        return prepare(image, self.config.prep, self.config.grid_pinpoints)

    def prepare_cost(self, size: tuple[int, int]) -> PrepCost:
        """What making the views of an image of `size` (height, width) takes (`pixels`)."""
        return prepare_cost(size, self.config.prep, self.config.grid_pinpoints)

    def most_views(self) -> ImagePixels:
        """The views of a blank image of the size that makes the most of them (LLaVA-NeXT:
        its largest resolution, tiled whole): what the tower's working memory is
        measured with."""
        pinpoints = self.config.grid_pinpoints
        side = self.config.tower.image_size
        height, width = max(pinpoints, key=lambda hw: hw[0] * hw[1]) if pinpoints else (side, side)
        return self.pixels(np.zeros((height, width, 3), dtype=np.uint8))

    @torch.inference_mode()
    def features(self, image: ImageLike) -> torch.Tensor:
        """The rows one image takes in the prompt [N, text hidden]: its views' selected
        hidden states projected (and for LLaVA-NeXT laid out as one grid with its
        newlines, after the base view's)."""
        config, part = self.config, self.part
        pixels = image if isinstance(image, ImagePixels) else self.pixels(image)
        views = pixels.views.to(device=self.device, dtype=self.dtype)
        states = part.tower.hidden_states(views, config.feature_layers)
        if config.feature_select == "default":
            states = [s[:, 1:] for s in states]  # the first token: CLIP's class token
        projected: torch.Tensor = part.projector(torch.cat(states, dim=-1))
        if part.image_newline is None:
            return projected.reshape(-1, projected.shape[-1])
        tower = config.tower
        return pack(projected, pixels.size, config.grid_pinpoints, tower.image_size, tower.grid, part.image_newline)

    def image_tokens(self, size: tuple[int, int]) -> int:
        """The rows `features` makes of an image of `size` (height, width), counted from
        the model's arithmetic without running the tower: what a prompt's image token
        becomes, known before the image is decoded."""
        config = self.config
        if self.part.image_newline is None:
            return config.tokens_per_view  # one view, the image padded or cropped to it
        tower = config.tower
        return packed_tokens(size, config.grid_pinpoints, tower.image_size, tower.grid, config.tokens_per_view)

    def expand(self, ids: list[int], counts: Sequence[int], prefix: int = 0) -> tuple[list[int], list[int], int]:
        """`ids` holding one image token per image, in order, each made into as many as
        `counts` says its image has rows: the ids, where each image's rows begin, and
        `prefix` cut back to the first image (a prefix is shared by its ids, which do
        not say what an image was)."""
        token = self.config.image_token_id
        places = [i for i, t in enumerate(ids) if t == token]
        if len(places) != len(counts):
            raise ValueError(f"the prompt holds {len(places)} image tokens (id {token}) for {len(counts)} images")
        out: list[int] = []
        starts: list[int] = []
        after = 0
        for place, count in zip(places, counts, strict=True):
            out += ids[after:place]
            starts.append(len(out))
            out += [token] * count
            after = place + 1
        out += ids[after:]
        if places:
            prefix = min(prefix, places[0])
        return out, starts, prefix

    def splice(self, ids: list[int], images: Sequence[ImageLike], prefix: int = 0) -> ImagePrompt:
        """`ids` holding one image token per image, in order: each token made into as
        many as its image has rows, the rows spliced there (`expand`)."""
        rows = [self.features(image) for image in images]
        out, starts, prefix = self.expand(ids, [int(r.shape[0]) for r in rows], prefix)
        return ImagePrompt(out, tuple(Splice(at, r) for at, r in zip(starts, rows, strict=True)), prefix)

    def prompt(
        self, prompter: Prompter, question: str, context: str | None, images: Sequence[ImageLike]
    ) -> ImagePrompt:
        """The model's chat prompt for a question about `images` (and documents in
        `context`), its template writing each image's token before the question."""
        ids, prefix = prompter.parts(question, context, images=len(images))
        return self.splice(ids, images, prefix)
