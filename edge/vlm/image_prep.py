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


def _resized(image: Image.Image, prep: ImagePrep) -> Image.Image:
    """Resized as the processor's `size` says: the shorter side to shortest_edge (the
    longer one truncated), or to height x width."""
    if prep.shortest_edge:
        short, long = sorted((image.width, image.height))
        new_long = int(prep.shortest_edge * long / short)
        if image.width <= image.height:
            height, width = new_long, prep.shortest_edge
        else:
            height, width = prep.shortest_edge, new_long
    else:
        height, width = prep.height, prep.width
    return _to(image, height, width, prep.resample)


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
