"""An image made into a vision-language model's tower input: the views its tower sees
(the image itself; for LLaVA-NeXT a base view and its tiles), resized with PIL and
normalised, step for step as transformers' PIL image processors for LLaVA and LLaVA-NeXT
do it (which is what a model was evaluated with, where torchvision is absent), so the
pixels and the number of image tokens are theirs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from edge.vlm.anyres import best_resolution, fitted_size
from edge.vlm.vlm_config import ImagePrep


@dataclass(frozen=True)
class ImagePixels:
    views: torch.Tensor  # [n, C, S, S] float32, normalised: what the tower reads
    size: tuple[int, int]  # (height, width) of the image as given: what LLaVA-NeXT unpads to


def as_rgb(image: Image.Image | np.ndarray) -> Image.Image:
    """A PIL image, or an RGB uint8 array [H, W, 3] (as the daemon decodes images), as
    an RGB PIL image."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"an image array must be RGB uint8 [H, W, 3], not {image.dtype} {list(image.shape)}")
        return Image.fromarray(image)
    return image if image.mode == "RGB" else image.convert("RGB")


def _resized_size(height: int, width: int, prep: ImagePrep) -> tuple[int, int]:
    """The (height, width) the processor's `size` makes of an image: the shorter side to
    shortest_edge (the longer one truncated), or height x width."""
    if not prep.shortest_edge:
        return prep.height, prep.width
    short, long = sorted((width, height))
    new_long = int(prep.shortest_edge * long / short)
    return (new_long, prep.shortest_edge) if width <= height else (prep.shortest_edge, new_long)


def _resized(image: Image.Image, prep: ImagePrep) -> Image.Image:
    return _to(image, *_resized_size(image.height, image.width, prep), prep.resample)


def _to(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    return image.resize((width, height), resample=Image.Resampling(resample))


def _centre_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """pixels [H, W, C] cut to height x width about the centre; where the image is smaller,
    it is first centred on zeros."""
    rows, cols = pixels.shape[:2]
    top, left = (rows - height) // 2, (cols - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + height, left : left + width]
    grown_h, grown_w = max(height, rows), max(width, cols)
    pad_top, pad_left = math.ceil((grown_h - rows) / 2), math.ceil((grown_w - cols) / 2)
    grown = np.zeros((grown_h, grown_w, pixels.shape[2]), dtype=pixels.dtype)
    grown[pad_top : pad_top + rows, pad_left : pad_left + cols] = pixels
    top, left = top + pad_top, left + pad_left
    return grown[max(top, 0) : max(top, 0) + height, max(left, 0) : max(left, 0) + width]


def _padded_square(image: Image.Image, prep: ImagePrep) -> Image.Image:
    """LLaVA's pad to a square, the image centred on the mean colour."""
    side = max(image.width, image.height)
    if image.width == image.height:
        return image
    colour = tuple(int(m * 255) for m in prep.mean) if prep.mean else (0, 0, 0)
    square = Image.new("RGB", (side, side), colour)
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return square


def _tensor(image: Image.Image, prep: ImagePrep) -> np.ndarray:
    """A view resized, cropped, scaled and normalised: [C, S, S] float32."""
    if prep.resize:
        image = _resized(image, prep)
    pixels = np.asarray(image)
    if prep.crop_height and prep.crop_width:
        pixels = _centre_crop(pixels, prep.crop_height, prep.crop_width)
    # Scaled in float64 and normalised in float32, as transformers' rescale and normalize do.
    scaled: np.ndarray = (pixels.astype(np.float64) * prep.rescale).astype(np.float32)
    if prep.mean is not None and prep.std is not None:
        scaled = (scaled - np.array(prep.mean, dtype=np.float32)) / np.array(prep.std, dtype=np.float32)
    return np.ascontiguousarray(scaled.transpose(2, 0, 1))


def _tiles(image: Image.Image, pinpoints: Sequence[tuple[int, int]], tile: int, resample: int) -> list[Image.Image]:
    """LLaVA-NeXT's tiles: the image fitted inside the best of the resolutions, its aspect
    kept, centred on black, and cut into tiles row by row."""
    target_h, target_w = best_resolution((image.height, image.width), pinpoints)
    fit_h, fit_w = fitted_size((image.height, image.width), (target_h, target_w))
    canvas = Image.new("RGB", (target_w, target_h), (0, 0, 0))
    pad_y, pad_x = (target_h - fit_h) // 2, (target_w - fit_w) // 2
    canvas.paste(_to(image, fit_h, fit_w, resample), (pad_x, pad_y))
    return [
        canvas.crop((left, top, left + tile, top + tile))
        for top in range(0, target_h, tile)
        for left in range(0, target_w, tile)
    ]


def prepare(image: Image.Image | np.ndarray, prep: ImagePrep, pinpoints: Sequence[tuple[int, int]] = ()) -> ImagePixels:
    """The tower's views of `image`: the image alone (LLaVA), or with `pinpoints`
    (LLaVA-NeXT) the whole image squeezed to the base size first, then its tiles."""
    rgb = as_rgb(image)
    if pinpoints:
        base_h, base_w = prep.base_size
        views = [_to(rgb, base_h, base_w, prep.resample), *_tiles(rgb, pinpoints, prep.tile, prep.resample)]
    else:
        views = [_padded_square(rgb, prep) if prep.pad_to_square else rgb]
    stacked = np.stack([_tensor(view, prep) for view in views])
    return ImagePixels(torch.from_numpy(stacked), (rgb.height, rgb.width))


# Bytes a pixel takes on the way: PIL keeps RGB padded to 32 bits. A view is copied out as
# uint8 and cropped (onto zeros where it is smaller), scaled in float64 (the cast and the
# product both held) and cast to float32 (_tensor), per channel; its normalised float32
# array and the stack of all views stay.
_PIL_PIXEL = 4
_VIEW_PIXEL = 3 * (1 + 1 + 8 + 8 + 4)
_KEPT_PIXEL = 3 * (4 + 4)


@dataclass(frozen=True)
class PrepCost:
    """What prepare() makes of an image of a given size, counted from its steps."""

    largest_pixels: int  # the largest image it makes on the way (a padded square, a resize, a canvas)
    held_bytes: int  # at most held at once beyond the array given


def _resize(made: list[int], src: tuple[int, int], dst: tuple[int, int]) -> None:
    """A resize's result, and PIL's image between its horizontal and vertical passes
    (at most the larger side of each)."""
    made += [dst[0] * dst[1], max(src[0], dst[0]) * max(src[1], dst[1])]


def prepare_cost(size: tuple[int, int], prep: ImagePrep, pinpoints: Sequence[tuple[int, int]] = ()) -> PrepCost:
    """The cost of `prepare` for an image of `size` (height, width), step for step as it
    runs, without running it: what a job reserves before its image is decoded, and what
    refuses an image whose preprocessing alone would make a larger one (a long strip
    padded to a square, or resized by its shorter side). Every image made is counted as
    if all were held together: an upper bound."""
    height, width = size
    made = [height * width]  # the given array as a PIL image
    if pinpoints:
        target = best_resolution(size, pinpoints)
        _resize(made, size, prep.base_size)
        _resize(made, size, fitted_size(size, target))
        made.append(target[0] * target[1])  # the canvas the tiles are cut from
        tiles = (target[0] // prep.tile) * (target[1] // prep.tile)
        made += [prep.tile * prep.tile] * tiles
        views = [prep.base_size, *[(prep.tile, prep.tile)] * tiles]
    elif prep.pad_to_square and height != width:
        side = max(height, width)
        made.append(side * side)
        views = [(side, side)]
    else:
        views = [size]
    held = 0
    for view in views:
        out = view
        if prep.resize:
            out = _resized_size(view[0], view[1], prep)
            _resize(made, view, out)
        crop = prep.crop_height * prep.crop_width if prep.crop_height and prep.crop_width else out[0] * out[1]
        held += max(crop, out[0] * out[1]) * _VIEW_PIXEL + crop * _KEPT_PIXEL
    return PrepCost(max(made), held + _PIL_PIXEL * sum(made))
