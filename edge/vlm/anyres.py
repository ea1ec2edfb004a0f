"""LLaVA-NeXT's "anyres" tiling: an image is seen twice by the tower, as a base view (the
whole image squeezed to one tile) and as tiles of the resolution among the model's grid
pinpoints that keeps most of it; the tiles' features are laid out again as one grid, the
padding the resize added cut away, and an `image_newline` row ends each row of it.

Arithmetic as transformers' LLaVA-NeXT has it (select_best_resolution,
get_anyres_image_grid_shape, unpad_image, pack_image_features), including its
rounding, since the number of image tokens a prompt holds follows from it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def best_resolution(size: tuple[int, int], pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that shows most of an image of `size`
    (height, width) once fitted inside it, the least wasted area breaking ties."""
    height, width = size
    best = pinpoints[0]
    most, least_waste = 0, math.inf
    for target_h, target_w in pinpoints:
        scale = min(target_w / width, target_h / height)
        shown = min(int(width * scale) * int(height * scale), width * height)
        waste = target_w * target_h - shown
        if shown > most or (shown == most and waste < least_waste):
            most, least_waste, best = shown, waste, (target_h, target_w)
    return best


def fitted_size(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) an image of `size` is resized to inside `target`, its aspect
    kept (the rest is padding)."""
    height, width = size
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def tile_grid(size: tuple[int, int], pinpoints: Sequence[tuple[int, int]], tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles an image of `size` is cut into."""
    height, width = best_resolution(size, pinpoints)
    return height // tile, width // tile


def unpadded(rows: int, cols: int, size: tuple[int, int]) -> tuple[int, int, int]:
    """Of a grid of rows x cols features laid out over the padded image, what covers an
    image of `size` (height, width): (the rows or columns cut from each side, the rows
    kept, the columns kept); `unpad` cuts them, `packed_tokens` counts them."""
    height, width = size
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return pad, rows - 2 * pad, cols
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return pad, rows, cols - 2 * pad


def unpad(features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """features [D, H, W] laid out over the padded image, less the rows or columns that
    cover the padding around an image of `size` (height, width)."""
    rows, cols = features.shape[1:]
    pad, kept_rows, kept_cols = unpadded(rows, cols, size)
    if kept_rows < rows:
        return features[:, pad : pad + kept_rows, :]
    return features[:, :, pad : pad + kept_cols]


def packed_tokens(
    size: tuple[int, int], pinpoints: Sequence[tuple[int, int]], tile: int, grid: int, base_tokens: int
) -> int:
    """The rows `pack` makes of an image of `size`, counted without running the tower:
    the base view's `base_tokens`, then the unpadded grid's rows, each with its newline."""
    rows, cols = tile_grid(size, pinpoints, tile)
    _, kept_rows, kept_cols = unpadded(rows * grid, cols * grid, size)
    return base_tokens + kept_rows * (kept_cols + 1)


def pack(
    views: torch.Tensor,
    size: tuple[int, int],
    pinpoints: Sequence[tuple[int, int]],
    tile: int,
    grid: int,
    newline: torch.Tensor,
) -> torch.Tensor:
    """One image's features in prompt order: views [1 + tiles, grid * grid, D] (the base
    view first, projected), `tile` the tower's image side and `grid` its patches per side
    -> [N, D]: the base view's features, then the tiles' as one unpadded grid, row by row,
    each row ended by `newline` [D]."""
    base, tiles = views[0], views[1:]
    rows, cols = tile_grid(size, pinpoints, tile)
    if tiles.shape[0] != rows * cols or tiles.shape[1] != grid * grid:
        raise ValueError(
            f"{tiles.shape[0]} tiles of {tiles.shape[1]} features for a {rows}x{cols} grid of {grid}x{grid}"
        )
    width = tiles.shape[-1]
    laid = tiles.view(rows, cols, grid, grid, width).permute(4, 0, 2, 1, 3).reshape(width, rows * grid, cols * grid)
    laid = unpad(laid, size)
    ends = newline.to(laid.dtype)[:, None, None].expand(width, laid.shape[1], 1)
    laid = torch.cat([laid, ends], dim=-1)
    return torch.cat([base, laid.flatten(1, 2).transpose(0, 1)], dim=0)
