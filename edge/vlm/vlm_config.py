"""What a vision-language checkpoint's image part is: its tower, which hidden states it
reads, its projector, the image token, LLaVA-NeXT's tiling and the image preprocessing,
as `vision.json` holds them beside the language model (engines/text/llava_source.py writes
it from a Hugging Face LLaVA directory)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge.text.model.checkpoint import IMAGE_PART
from edge.vision.vision_tower import TowerConfig, activation

CONFIG_FILE, WEIGHTS_FILE = IMAGE_PART
FAMILIES = ("llava", "llava_next")
# Which hidden states the projector reads: "default" drops each image's first token (CLIP's
# class token), "full" keeps every one (LLaVA's vision_feature_select_strategy).
FEATURE_SELECT = ("default", "full")


@dataclass(frozen=True)
class ImagePrep:
    """An image made into the tower's input, as transformers' image processors for these
    models do it (their PIL processing): optionally padded to a square of the mean colour,
    resized, centre-cropped, scaled to [0, 1] and normalised per channel."""

    resize: bool
    shortest_edge: int  # resized so its shorter side is this, keeping its aspect (0: to height x width)
    height: int
    width: int
    resample: int  # PIL's filter number (3: bicubic)
    crop_height: int  # centre crop (0: none)
    crop_width: int
    rescale: float  # 1/255 for uint8 pixels (1.0: none)
    mean: tuple[float, ...] | None  # None: not normalised
    std: tuple[float, ...] | None
    pad_to_square: bool = False  # LLaVA's do_pad: a square of the mean colour first

    @property
    def tile(self) -> int:
        """LLaVA-NeXT's tile side: the crop's, else the resize's."""
        return self.crop_height or self.height or self.shortest_edge

    @property
    def base_size(self) -> tuple[int, int]:
        """The (height, width) LLaVA-NeXT resizes the whole image to, for its base view."""
        if self.height and self.width:
            return self.height, self.width
        return self.shortest_edge, self.shortest_edge


@dataclass(frozen=True)
class VisionLanguageConfig:
    family: str  # "llava" (1.5) or "llava_next" (1.6)
    tower: TowerConfig
    feature_layers: tuple[int, ...]  # the tower's hidden states read, concatenated in this order
    feature_select: str
    projector_act: str
    projector_bias: bool
    text_hidden: int  # the language model's width: the projector's output
    image_token_id: int
    prep: ImagePrep
    # LLaVA-NeXT's resolutions, (height, width) each, an image is tiled at (the best fit).
    grid_pinpoints: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r}: expected one of {', '.join(FAMILIES)}")
        if self.feature_select not in FEATURE_SELECT:
            raise ValueError(f"feature_select {self.feature_select!r}: expected one of {', '.join(FEATURE_SELECT)}")
        if not self.feature_layers:
            raise ValueError("feature_layers names no hidden state")
        activation(self.projector_act)
        if self.family == "llava_next":
            if not self.grid_pinpoints:
                raise ValueError("a llava_next model tiles by its grid_pinpoints, and names none")
            if self.prep.tile != self.tower.image_size:
                raise ValueError(f"tiles of {self.prep.tile} px for a tower that takes {self.tower.image_size} px")

    @property
    def tokens_per_view(self) -> int:
        """Features per view the tower sees (the whole image, or a tile)."""
        return self.tower.tokens - int(self.feature_select == "default")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> VisionLanguageConfig:
        prep = dict(doc["prep"])
        for key in ("mean", "std"):
            prep[key] = tuple(prep[key]) if prep.get(key) is not None else None
        return cls(
            **{
                **doc,
                "tower": TowerConfig(**doc["tower"]),
                "prep": ImagePrep(**prep),
                "feature_layers": tuple(doc["feature_layers"]),
                "grid_pinpoints": tuple((int(h), int(w)) for h, w in doc.get("grid_pinpoints") or ()),
            }
        )

    @classmethod
    def from_json(cls, path: Path) -> VisionLanguageConfig:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
