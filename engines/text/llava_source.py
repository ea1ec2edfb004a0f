"""A LLaVA-style Hugging Face directory (transformers' LlavaForConditionalGeneration,
model_type llava, or LlavaNextForConditionalGeneration, llava_next): the language model
inside it, which engines/text/import_hf.py imports and quantizes like any text model, and
its image part (the CLIP or SigLIP tower, the projector, LLaVA-NeXT's image_newline, the
image preprocessing), written beside the language model's checkpoint as `vision.json` and
`vision.safetensors` for edge/vlm to serve.

Weight names come in three layouts, all read: the Hub's LLaVA checkpoints
(`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.vision_model.*`),
transformers 5's saves (the same without `vision_model.`) and transformers 4's later ones
(`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`). Config fields a saved
config leaves out are transformers' defaults (engines/text/hf_defaults.py).

Gemma 3 4B, 12B and 27B (Gemma3ForConditionalGeneration, model_type gemma3: a SigLIP tower
and a Gemma 3 text model) import their language model alone, as a Gemma 3 text model
(text_config, its weights under `language_model.model.*` or `model.language_model.*` as
the transformers version that saved it has them, the head tied): the tower is not
served (its image soft-token pooling and bidirectional attention over an image's tokens
are not implemented), the import says so, and a job's image is refused naming it.

Anything else that reads images is refused by its model_type, with why; within LLaVA,
anything we do not implement is refused naming the field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from edge.vision.vision_tower import ACTIVATIONS, TowerConfig
from edge.vlm.vision_language import ImagePart
from edge.vlm.vlm_config import CONFIG_FILE, FEATURE_SELECT, WEIGHTS_FILE, ImagePrep, VisionLanguageConfig
from engines.text.hf_defaults import (
    DEFAULT_VISION_CONFIG,
    GEMMA3_TEXT_DEFAULTS,
    LLAVA_DEFAULTS,
    LLAVA_NEXT_PINPOINTS,
    PROCESSOR_DEFAULTS,
    TEXT_DEFAULTS,
    VISION_DEFAULTS,
    with_defaults,
)
from engines.text.import_gguf import SourceModelError
from engines.text.safetensors_writer import SafetensorsWriter

logger = logging.getLogger(__name__)

FAMILIES = {"llava": "LLaVA-1.5", "llava_next": "LLaVA-NeXT (1.6)"}
TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
PREPROCESSOR = "preprocessor_config.json"
PROCESSOR = "processor_config.json"
# Vision-language models of other architectures, refused with what keeps each out.
OTHER_VLMS = {
    "idefics3": "SmolVLM / Idefics3: its pixel-shuffle connector and its image splitting into row and column "
    "tiles, each announced by tokens of its own, are not implemented",
    "smolvlm": "SmolVLM: its pixel-shuffle connector and its image splitting into row and column tiles, "
    "each announced by tokens of its own, are not implemented",
    "idefics2": "Idefics2: its perceiver resampler is not implemented",
    "qwen2_vl": "Qwen2-VL: its language model turns positions by M-RoPE (a temporal, a height and a width "
    "section per token), which the text branch's decoder does not serve",
    "qwen2_5_vl": "Qwen2.5-VL: its language model turns positions by M-RoPE (a temporal, a height and a width "
    "section per token), which the text branch's decoder does not serve",
    "qwen3_vl": "Qwen3-VL: its language model turns positions by interleaved M-RoPE and reads vision features "
    "into several layers (DeepStack), neither of which the text branch serves",
    "llava_onevision": "LLaVA-OneVision: its anyres_max tiling and feature pooling are not implemented",
    "llava_next_video": "LLaVA-NeXT-Video: video frames are not implemented",
    "vipllava": "VipLLaVA: its projector over several layers with its own norm is not implemented",
    "mllama": "Llama 3.2 Vision: its cross-attention layers are not in the text branch's decoder",
    "paligemma": "PaliGemma: its prefix attention over image and prompt is not implemented",
    "mistral3": "Mistral 3 / Pixtral: its Pixtral tower (2D RoPE, any image size) is not implemented",
    "llava_qwen": "the original LLaVA repository's format: convert it to transformers' llava or llava_next first",
}
SUPPORTED = "llava (LLaVA-1.5) and llava_next (LLaVA-NeXT, 1.6)"
# Vision-language models whose language model is imported alone, and why their image
# part is not served: what a job's image is refused with.
TEXT_ONLY = {
    "gemma3": "Gemma 3's vision tower is not served (its image soft-token pooling and bidirectional attention "
    "over an image's tokens are not implemented): this build is its language model alone, which takes text",
}


def is_llava(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in FAMILIES


def text_only(hf: dict[str, Any]) -> str | None:
    """Why the image part of a model whose language model is imported alone is not
    served (Gemma 3's); None for any other model."""
    kind = hf.get("model_type")
    return TEXT_ONLY.get(kind) if isinstance(kind, str) else None


def refuse_other_vlm(hf: dict[str, Any]) -> None:
    """A vision-language model we do not import, refused naming it and what keeps it out."""
    kind = hf.get("model_type")
    if isinstance(kind, str) and kind in OTHER_VLMS:
        raise SourceModelError(
            f"model_type {kind!r} is not supported: {OTHER_VLMS[kind]}; vision-language models import as {SUPPORTED}"
        )


def text_config(hf: dict[str, Any], name: str, files: list[Path]) -> dict[str, Any]:
    """The language model's config (text_config, transformers' defaults filled in, the
    head tied where the weights hold none), for import_hf to read as a text model's: a
    LLaVA model's, or Gemma 3's (its text model, gemma3_text)."""
    gemma = hf.get("model_type") == "gemma3"
    given = hf.get("text_config") or {"model_type": "gemma3_text" if gemma else "llama"}
    kind = given.get("model_type", "gemma3_text" if gemma else "llama")
    defaults = {"gemma3_text": GEMMA3_TEXT_DEFAULTS} if gemma else TEXT_DEFAULTS
    if kind not in defaults:
        raise SourceModelError(
            f"{name}: text_config.model_type {kind!r} is not supported in a {hf['model_type']} model "
            f"(supported: {', '.join(defaults)})"
        )
    merged = with_defaults({**given, "model_type": kind}, defaults[kind])
    if gemma and merged.get("final_logit_softcapping") is not None:
        # transformers' Gemma3ForConditionalGeneration caps no logits whatever its
        # text_config names (its Gemma3ForCausalLM would): served as it serves the model.
        # Gemma 3's released configs name none.
        logger.info(
            "%s: text_config.final_logit_softcapping is not applied, as transformers' %s does not",
            name,
            "Gemma3ForConditionalGeneration",
        )
        merged["final_logit_softcapping"] = None
    # Which field ties the head differs by class and version (LlavaConfig takes its
    # text_config's, LlavaNextConfig only its own), and a tied head is not saved: the
    # weights say which it is.
    merged["tie_word_embeddings"] = not any(split_name(n) == ("text", "lm_head.weight") for n in _names(files))
    return merged


def _names(files: list[Path]) -> list[str]:
    names: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            names += fh.keys()
    return names


def _tower(hf: dict[str, Any], problems: list[str]) -> TowerConfig | None:
    given = hf.get("vision_config") or DEFAULT_VISION_CONFIG
    kind = given.get("model_type", "clip_vision_model")
    if kind not in TOWERS:
        problems.append(f"vision_config.model_type {kind!r} (supported: {', '.join(TOWERS)})")
        return None
    vision = with_defaults(given, VISION_DEFAULTS[kind])
    if vision["hidden_act"] not in ACTIVATIONS:
        problems.append(f"vision_config.hidden_act {vision['hidden_act']!r} (supported: {', '.join(ACTIVATIONS)})")
    if int(vision["num_channels"]) != 3:
        problems.append(f"vision_config.num_channels {vision['num_channels']} (images are RGB: 3)")
    if int(vision["image_size"]) % int(vision["patch_size"]):
        problems.append(f"vision_config.image_size {vision['image_size']} is not a multiple of its patch_size")
    if problems:
        return None
    return TowerConfig(
        kind=TOWERS[kind],
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]),
        num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]),
        patch_size=int(vision["patch_size"]),
        layer_norm_eps=float(vision["layer_norm_eps"]),
        hidden_act=str(vision["hidden_act"]),
    )


def _size(value: Any, square: bool) -> dict[str, int]:
    """A processor's size or crop_size as a dict: a bare number is the shorter side, or
    for a processor that resizes to squares (SigLIP's) both sides, as transformers reads it."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    return {k: int(v) for k, v in (value or {}).items() if v is not None}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model directory's file (SourceModelError naming the file)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SourceModelError(f"{path.name} is not readable JSON: {err}") from err
    if not isinstance(doc, dict):
        raise SourceModelError(f"{path.name} does not hold a JSON object")
    return doc


def processor_settings(directory: Path) -> tuple[dict[str, Any], str] | None:
    """The image processor's settings and the file they are in: preprocessor_config.json
    (the Hub's LLaVA directories), or the `image_processor` of processor_config.json
    (transformers 5's saves); None where neither is."""
    if (directory / PREPROCESSOR).is_file():
        return read_json(directory / PREPROCESSOR), PREPROCESSOR
    if (directory / PROCESSOR).is_file():
        nested = read_json(directory / PROCESSOR).get("image_processor")
        return (nested, PROCESSOR) if isinstance(nested, dict) else None
    return None


def _prep(directory: Path, family: str, problems: list[str]) -> tuple[ImagePrep | None, list[list[int]] | None, str]:
    """The image preprocessing the processor's settings describe, its grid pinpoints and
    the file that says them."""
    found = processor_settings(directory)
    if found is None:
        problems.append(
            f"no {PREPROCESSOR} (nor an image_processor in {PROCESSOR}): how images are resized and "
            "normalised for the tower is not known"
        )
        return None, None, PREPROCESSOR
    given, source = found
    kind = str(given.get("image_processor_type") or given.get("feature_extractor_type") or "CLIPImageProcessor")
    kind = kind.replace("FeatureExtractor", "ImageProcessor").removesuffix("Fast").removesuffix("Pil")
    tiling = "LlavaNextImageProcessor"
    allowed = [tiling] if family == "llava_next" else [k for k in PROCESSOR_DEFAULTS if k != tiling]
    if kind not in allowed:
        problems.append(
            f"{source} image_processor_type {kind!r} for a {family} model (supported: {', '.join(allowed)})"
        )
        return None, None, source
    doc = with_defaults(given, PROCESSOR_DEFAULTS[kind])
    square = kind == "SiglipImageProcessor"
    size = _size(doc.get("size"), square)
    if "longest_edge" in size or not ("shortest_edge" in size or {"height", "width"} <= set(size)):
        problems.append(f"{source} size {doc.get('size')} (supported: shortest_edge, or height and width)")
    crop = _size(doc.get("crop_size"), True) if doc.get("do_center_crop") else {}
    if crop and not {"height", "width"} <= set(crop):
        problems.append(f"{source} crop_size {doc.get('crop_size')} (supported: height and width)")
    normalise = bool(doc.get("do_normalize"))
    if normalise and (len(doc.get("image_mean") or ()) != 3 or len(doc.get("image_std") or ()) != 3):
        problems.append(f"{source} image_mean and image_std: three channels each")
    if problems:
        return None, None, source
    prep = ImagePrep(
        resize=bool(doc.get("do_resize")),
        shortest_edge=size.get("shortest_edge", 0),
        height=size.get("height", 0),
        width=size.get("width", 0),
        resample=int(doc.get("resample", 3)),
        crop_height=crop.get("height", 0),
        crop_width=crop.get("width", 0),
        rescale=float(doc["rescale_factor"]) if doc.get("do_rescale") else 1.0,
        mean=tuple(float(m) for m in doc["image_mean"]) if normalise else None,
        std=tuple(float(s) for s in doc["image_std"]) if normalise else None,
        # LLaVA's do_pad pads to a square first; LLaVA-NeXT's pads a batch's tile counts.
        pad_to_square=kind == "LlavaImageProcessor" and bool(doc.get("do_pad")),
    )
    return prep, doc.get("image_grid_pinpoints"), source


def image_config(directory: Path, hf: dict[str, Any], text_hidden: int) -> VisionLanguageConfig:
    """The image part of the LLaVA directory `directory` (config.json read as `hf`);
    SourceModelError naming each field we do not serve."""
    family = str(hf["model_type"])
    doc = with_defaults(hf, LLAVA_DEFAULTS)
    problems: list[str] = []
    tower = _tower(hf, problems)
    select = doc["vision_feature_select_strategy"]
    if select not in FEATURE_SELECT:
        problems.append(f"vision_feature_select_strategy {select!r} (supported: {', '.join(FEATURE_SELECT)})")
    layer_field = doc["vision_feature_layer"]
    layers = tuple(int(v) for v in layer_field) if isinstance(layer_field, list) else (int(layer_field),)
    if tower is not None and any(not -tower.num_layers - 1 <= v <= tower.num_layers for v in layers):
        problems.append(f"vision_feature_layer {layer_field} (the tower has hidden states 0..{tower.num_layers})")
    act = doc["projector_hidden_act"]
    if act not in ACTIVATIONS:
        problems.append(f"projector_hidden_act {act!r} (supported: {', '.join(ACTIVATIONS)})")
    if doc.get("multimodal_patch_merge_type", "spatial_unpad") != "spatial_unpad":
        problems.append(
            f"multimodal_patch_merge_type {doc['multimodal_patch_merge_type']!r} (supported: spatial_unpad)"
        )
    prep, processor_pinpoints, source = _prep(directory, family, problems)
    pinpoints: list[list[int]] = []
    if family == "llava_next" and tower is not None:
        pinpoints = doc.get("image_grid_pinpoints") or LLAVA_NEXT_PINPOINTS
        if processor_pinpoints is not None and [list(p) for p in processor_pinpoints] != [list(p) for p in pinpoints]:
            problems.append(
                f"image_grid_pinpoints: {source} tiles at {processor_pinpoints}, config.json packs {pinpoints}"
            )
        side = tower.image_size
        if any(int(h) % side or int(w) % side for h, w in pinpoints):
            problems.append(f"image_grid_pinpoints {pinpoints}: each a multiple of the tower's {side} px")
        if prep is not None and prep.tile != side:
            problems.append(f"{source} tiles of {prep.tile} px for a tower that takes {side} px")
        # The tiles' features are laid out as the tower's patch grid: a class token kept
        # ("full" on CLIP) or a patch dropped ("default" on SigLIP) leaves no grid.
        if tower.class_token != (select == "default"):
            problems.append(
                f"vision_feature_select_strategy {select!r} with a {tower.kind} tower "
                "(LLaVA-NeXT's tiles need the patch tokens alone: 'default' drops CLIP's class token)"
            )
    if problems:
        raise SourceModelError(f"{family} model in {directory.name}: not supported: {'; '.join(problems)}")
    assert tower is not None and prep is not None
    return VisionLanguageConfig(
        family=family,
        tower=tower,
        feature_layers=layers,
        feature_select=select,
        projector_act=act,
        projector_bias=bool(doc["multimodal_projector_bias"]),
        text_hidden=text_hidden,
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", doc["image_token_index"]))),
        prep=prep,
        grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
    )


def split_name(name: str) -> tuple[str, str]:
    """Where a LLaVA directory's tensor goes: ("text", its name as a text model's
    checkpoint has it: `model.layers.0...`, `lm_head.weight`), ("image", its name in the
    image part) or ("unused", name): the towers' final norm and pooling head, which LLaVA
    never reads."""
    rest = name.removeprefix("model.")  # transformers 4's layout: the rest as the Hub's
    for prefix, kind, lead in (
        ("language_model.model.", "text", "model."),
        ("language_model.lm_head.", "text", "lm_head."),
        ("language_model.", "text", "model."),
        ("lm_head.", "text", "lm_head."),
        ("multi_modal_projector.", "image", "projector."),
    ):
        if rest.startswith(prefix):
            return kind, lead + rest[len(prefix) :]
    if rest == "image_newline":
        return "image", rest
    if rest.startswith("vision_tower."):
        tower = rest.removeprefix("vision_tower.").removeprefix("vision_model.")
        if tower.startswith(("post_layernorm.", "head.")) or tower == "embeddings.position_ids":
            return "unused", name
        return "image", "tower." + tower.removeprefix("embeddings.").removeprefix("encoder.")
    raise SourceModelError(f"unexpected tensor {name} in a vision-language model")


def _image_tensors(files: list[Path]) -> Iterator[tuple[Path, str, str]]:
    """(file, source name, our name) of each image-part tensor."""
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            names = list(fh.keys())
        for name in names:
            kind, ours = split_name(name)
            if kind == "image":
                yield path, name, ours


def write_image_part(directory: Path, files: list[Path], config: VisionLanguageConfig, out: Path) -> int:
    """The image part's config and weights (in their stored type) into `out`, a tensor
    at a time; returns the weights' bytes."""
    where = {ours: (path, name) for path, name, ours in _image_tensors(files)}
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in ImagePart(config).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(where)), sorted(set(where) - set(expected))
    if missing or unexpected:
        raise SourceModelError(
            f"{directory.name}: the image part does not match its config: missing {missing[:5]}, "
            f"unexpected {[where[u][1] for u in unexpected[:5]]}"
        )
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for ours, (path, name) in where.items():
        with safe_open(str(path), framework="pt") as fh:
            sliced = fh.get_slice(name)
            shape = tuple(int(d) for d in sliced.get_shape())
            dtype = _DTYPES.get(sliced.get_dtype())
        if dtype is None:
            raise SourceModelError(f"{directory.name}: {name} is stored as {sliced.get_dtype()}, not a float type")
        if shape != expected[ours]:
            raise SourceModelError(
                f"{directory.name}: {name} is {list(shape)}, its config makes it {list(expected[ours])}"
            )
        specs[ours] = (dtype, shape)
    (out / CONFIG_FILE).write_text(config.to_json() + "\n", encoding="utf-8")
    with SafetensorsWriter(out / WEIGHTS_FILE, specs) as writer:
        for ours, (path, name) in where.items():
            with safe_open(str(path), framework="pt") as fh:
                writer.write(ours, fh.get_tensor(name))
    logger.info("%s: image part written (%s tower, %d MiB)", directory.name, config.tower.kind, writer.nbytes >> 20)
    return writer.nbytes


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
