"""One-shot pruning of linear layers to 2:4 along the input dimension, from calibration
activations: two of every four consecutive input weights of each row set to zero.

Three methods, chosen per layer by the profile's rules (models.qa.layers, `pruning`):

- "magnitude": keep the two largest |W| of each four. The baseline the others are
  measured against.
- "wanda" (Sun et al., 2023, https://arxiv.org/abs/2306.11695): keep the two largest
  |W_ij| * ||X_j||_2, the weight's size times its input channel's activation norm over the
  calibration tokens. No weight is changed beyond the mask.
- "sparsegpt" (Frantar and Alistarh, 2023, https://arxiv.org/abs/2301.00774): the mask
  chosen four by four by the optimal-brain-surgeon saliency w^2 / [H^-1]_jj^2 over the
  calibration Hessian H = X^T X, and each pruned weight's error spread over the row's
  later weights through H^-1 (its Cholesky factor), so the layer's outputs on the
  calibration inputs change as little as the mask allows. Columns go in blocks of 128
  (the paper's lazy updates) and rows in blocks (each row's update is its own), so the
  working copies stay a block of rows.

And "given", no profile's choice: the weight already 2:4 (pruned and then trained with its
mask fixed: engines/text/qat.py), kept as it is, its mask its zeros.

Written here rather than taken from a library: the reference implementations (the
papers' repositories, llm-compressor) run on Hugging Face models with their own
calibration loops, while the build calibrates on its own layer-at-a-time activations
(engines/text/layerwise.py); the algorithms are a few dozen lines of torch each.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from edge.text.ops.sparse24 import kept_mask

logger = logging.getLogger(__name__)

Method = Literal["magnitude", "wanda", "sparsegpt", "given"]
METHODS: tuple[Method, ...] = ("magnitude", "wanda", "sparsegpt", "given")
FOUR, PRUNED = 4, 2
SPARSEGPT_BLOCK = 128  # columns per lazy update (the paper's)
SPARSEGPT_ROWS = 1024  # rows per pass: a pass's working copies are this many rows
DAMP = 0.01  # of the Hessian's mean diagonal, added to it (the paper's dampening)


def mask_by_scores(scores: torch.Tensor) -> torch.Tensor:
    """bool [N, K]: True where a weight is pruned, the two lowest scores of each four along
    the input (the lower position kept first among equals)."""
    n, k = scores.shape
    if k % FOUR:
        raise ValueError(f"2:4 pruning needs an input width that is a multiple of {FOUR}, not {k}")
    fours = scores.reshape(n, k // FOUR, FOUR)
    # Sorting descending with a stable sort keeps the lower position first among ties.
    order = torch.sort(-fours, dim=-1, stable=True).indices[..., FOUR - PRUNED :]
    return torch.zeros_like(fours, dtype=torch.bool).scatter_(-1, order, True).reshape(n, k)


def prune_magnitude(weight: torch.Tensor) -> torch.Tensor:
    """The weight with the two smallest |w| of each four set to 0."""
    return weight.masked_fill(mask_by_scores(weight.abs().float()), 0)


def prune_wanda(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """The weight with the two smallest |w| * ||x_j|| of each four set to 0; `input_norm`
    [K] is each input channel's L2 norm over the calibration tokens."""
    scores = weight.abs().float() * input_norm.float().unsqueeze(0)
    return weight.masked_fill(mask_by_scores(scores), 0)


def _inverse_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 (float64), H dampened: SparseGPT's Hinv."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0  # an input never active: its weights prune for free
    h[dead, dead] = 1.0
    h += torch.eye(h.shape[0], dtype=h.dtype) * (damp * float(torch.diag(h).mean()))
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    factor: torch.Tensor = torch.linalg.cholesky(inverse, upper=True)
    return factor


def prune_sparsegpt(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    damp: float = DAMP,
    block: int = SPARSEGPT_BLOCK,
    rows: int = SPARSEGPT_ROWS,
) -> torch.Tensor:
    """The weight pruned to 2:4 with SparseGPT's reconstruction; `hessian` [K, K] is the
    calibration inputs' X^T X (any positive multiple: the update does not depend on it)."""
    n, k = weight.shape
    if k % FOUR or block % FOUR:
        raise ValueError(f"2:4 pruning needs an input width that is a multiple of {FOUR}, not {k}")
    hinv = _inverse_factor(hessian, damp)
    dead = torch.diag(hessian) == 0
    out = torch.empty(n, k, dtype=weight.dtype)
    for r0 in range(0, n, rows):
        w = weight[r0 : r0 + rows].double().clone()
        w[:, dead] = 0
        for c0 in range(0, k, block):
            c1 = min(c0 + block, k)
            w1 = w[:, c0:c1].clone()
            err1 = torch.zeros_like(w1)
            h1 = hinv[c0:c1, c0:c1]
            diag = torch.diag(h1)
            for i in range(c1 - c0):
                if i % FOUR == 0:
                    # Optimal brain surgeon's saliency of each of the four, on the weights as
                    # the earlier columns' updates left them.
                    saliency = w1[:, i : i + FOUR] ** 2 / diag[i : i + FOUR].unsqueeze(0) ** 2
                    pruned = mask_by_scores(saliency)  # the two smallest saliencies
                col = w1[:, i]
                q = col.masked_fill(pruned[:, i % FOUR], 0)
                err = (col - q) / diag[i]
                w1[:, i:] -= err.unsqueeze(1) * h1[i, i:].unsqueeze(0)
                w1[:, i] = q
                err1[:, i] = err
            w[:, c0:c1] = w1
            w[:, c1:] -= err1 @ hinv[c0:c1, c1:]
        out[r0 : r0 + rows] = w.to(weight.dtype)
    return out


def prune(
    method: Method,
    weight: torch.Tensor,
    input_norm: torch.Tensor | None = None,
    hessian: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight pruned to 2:4 by `method` (wanda needs `input_norm`, sparsegpt `hessian`)."""
    if method == "magnitude":
        return prune_magnitude(weight)
    if method == "given":
        kept_mask(weight)  # raises where the weight is not 2:4
        return weight
    if method == "wanda":
        if input_norm is None:
            raise ValueError("wanda pruning needs the calibration inputs' channel norms")
        return prune_wanda(weight, input_norm)
    if method == "sparsegpt":
        if hessian is None:
            raise ValueError("sparsegpt pruning needs the calibration inputs' Hessian")
        return prune_sparsegpt(weight, hessian)
    raise ValueError(f"unknown pruning method {method!r}")
