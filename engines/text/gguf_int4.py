"""A GGUF file's Q4_0, Q4_1 and Q8_0 weights served as they are, with no second rounding.

Q4_0 is llama.cpp's block of 32 weights: one float16 scale d and 32 four-bit codes q,
each weight (q - 8) * d. That is our INT4 layout at group 32 with every zero point 8
(edge/text/ops/int4.py: (code - zero) * scale, float16 scales), so a Q4_0 linear is
repacked code for code: the served weights are the file's, bit for bit, the ones
llama.cpp serves from it. Q4_1 adds a float16 minimum m per block, each weight q * d + m:
our layout with zero points 0 and the minimums kept beside it (QuantizedWeight.minimums,
added after the product by our kernels, in the offsets of torch's). Only the order
differs: a block keeps weights 0..15 in the low nibbles of its 16 bytes and 16..31 in
the high ones, where ours pairs neighbours (even k low, odd k high); and a Llama file's
q and k rows are in llama.cpp's rotary order, undone here by the row permutation the
float import applies.

A file is kept only when every linear of its blocks is Q4_0 or Q4_1 and no adapter is
merged (merging changes the weights, which must then be rounded again). The output
projection and other tensors are what the float import makes of them; a kept build
rounds the output projection to INT4 as every build does, unless the file's own is Q4_0
(kept too). Q8_0's blocks (a float16 scale and 32 signed 8-bit codes) are kept as two
INT4 weights of our layout stacked in one (QuantizedWeight.halves, q8_halves), whose sum
is the file's weight for weight; any other kind is dequantized and quantized again by
the build's recipe, and the build says why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.text.model.llama import LlamaModel
from edge.text.ops.int4 import QuantizedWeight
from engines.cache import build_cached, cache_key
from engines.text.import_gguf import _BLOCK, _LAYER_NAMES, GgufSource, SourceModelError, _unpermute_qk
from engines.text.layerwise import write_layerwise
from engines.text.quantize import QuantRecipe, linear_names

logger = logging.getLogger(__name__)

GROUP = 32  # weights per Q4_0 or Q4_1 block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # a float16 scale (Q4_1: and minimum), then 16 bytes of codes
ZERO = 8
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
KEPT_VERSION = 3


def q4_weight(raw: np.ndarray, rows: int, columns: int, kind: str = "Q4_0") -> QuantizedWeight:
    """A Q4_0 or Q4_1 tensor's bytes ([rows, columns / 32 * 18 or 20]) in our INT4 layout
    at group 32 (Q4_1: zero points 0 and its block minimums)."""
    if columns % GROUP:
        raise SourceModelError(f"a {kind} row of {columns} weights is not whole blocks of {GROUP}")
    head = BLOCK_BYTES[kind] - 16
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, columns // GROUP, BLOCK_BYTES[kind])
    halves = blocks[..., :head].copy().view(np.float16)  # [rows, blocks, 1 or 2], little-endian as x86 and arm64
    packed = blocks[..., head:]
    codes = np.concatenate([packed & 15, packed >> 4], axis=-1).reshape(rows, columns)  # block order
    ours = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    minimums = torch.from_numpy(np.ascontiguousarray(halves[..., 1])) if kind == "Q4_1" else None
    return QuantizedWeight(
        qweight=torch.from_numpy(ours),
        scales=torch.from_numpy(np.ascontiguousarray(halves[..., 0])),
        zeros=torch.full((rows, columns // GROUP), 0 if kind == "Q4_1" else ZERO, dtype=torch.uint8),
        group_size=GROUP,
        minimums=minimums,
    )


# Q8_0: a float16 scale d and 32 signed 8-bit codes q, each weight q * d.
Q8_BLOCK_BYTES = 34


def q8_halves(raw: np.ndarray, rows: int, columns: int) -> QuantizedWeight:
    """A Q8_0 tensor's bytes ([rows, columns / 32 * 34]) as two weights of our INT4 layout at
    group 32, stacked [high; low] (QuantizedWeight.halves), whose sum is the file's weight
    for weight: each code q = 16 h + l with l in 0..15 and h in -8..7, so q * d = (h + 8 -
    8) * 16 d + (l - 0) * d: the high half codes h + 8 with zero points 8 and scales 16 d
    (exact: a power of two), the low half codes l with zero points 0 and scales d. Summed
    in float32, every weight is the file's exactly (no second rounding), and our INT4
    kernels serve both halves as they are."""
    if columns % GROUP:
        raise SourceModelError(f"a Q8_0 row of {columns} weights is not whole blocks of {GROUP}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, columns // GROUP, Q8_BLOCK_BYTES)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]  # [rows, blocks]
    if not (np.abs(scales.astype(np.float32)) * 16 <= 65504).all():
        raise SourceModelError("a Q8_0 block's scale times 16 does not fit float16")
    codes = blocks[..., 2:].copy().view(np.int8).astype(np.int16).reshape(rows, columns)
    high, low = (codes >> 4) + ZERO, codes & 15  # arithmetic shift: floor(q / 16)
    stacked = np.concatenate([high, low]).astype(np.uint8)
    half_scales = torch.from_numpy(np.ascontiguousarray(scales))
    return QuantizedWeight(
        qweight=torch.from_numpy(np.ascontiguousarray(stacked[:, 0::2] | (stacked[:, 1::2] << 4))),
        scales=torch.cat([(half_scales.float() * 16).to(torch.float16), half_scales]),
        zeros=torch.cat(
            [torch.full(scales.shape, ZERO, dtype=torch.uint8), torch.zeros(scales.shape, dtype=torch.uint8)]
        ),
        group_size=GROUP,
        halves=True,
    )


def _rows(weight: QuantizedWeight, order: np.ndarray) -> QuantizedWeight:
    """The weight's rows in `order` (of a weight in halves: each half's)."""
    index = torch.from_numpy(order)
    if weight.halves:
        index = torch.cat([index, index + len(order)])
    minimums = None if weight.minimums is None else weight.minimums[index].contiguous()
    return QuantizedWeight(
        weight.qweight[index].contiguous(),
        weight.scales[index].contiguous(),
        weight.zeros[index].contiguous(),
        GROUP,
        minimums,
        weight.halves,
    )


@dataclass(frozen=True)
class _Stored:
    offset: int
    byte_shape: tuple[int, ...]  # [rows, columns / 32 * bytes a block]
    rows: int
    columns: int
    heads: int  # a Llama file's q or k: its rows unpermuted for this many heads; else 0
    kind: str = "Q4_0"  # or "Q4_1", "Q8_0"


class KeptWeights(Mapping[str, QuantizedWeight]):
    """A file's Q4_0, Q4_1 and Q8_0 linears by our module names, each read from the file
    when asked for, so that a build holds one layer's at a time (an 8B file's are 4.5 GB)."""

    def __init__(self, path: Path, stored: dict[str, _Stored]) -> None:
        self.path = path
        self._stored = stored

    def __getitem__(self, name: str) -> QuantizedWeight:
        s = self._stored[name]
        with self.path.open("rb") as fh:
            fh.seek(s.offset)
            raw = np.fromfile(fh, dtype=np.uint8, count=int(np.prod(s.byte_shape))).reshape(s.byte_shape)
        weight = q8_halves(raw, s.rows, s.columns) if s.kind == "Q8_0" else q4_weight(raw, s.rows, s.columns, s.kind)
        if s.heads:
            weight = _rows(weight, _unpermute_qk(np.arange(s.rows)[:, None], s.heads)[:, 0])
        return weight

    def header(self, name: str) -> tuple[tuple[int, int], int]:
        """A weight's shape and group size, from the file's tensor list (not read)."""
        s = self._stored[name]
        return (s.rows, s.columns), GROUP

    def has_minimums(self, name: str) -> bool:
        """Whether a weight carries block minimums (Q4_1), from the file's tensor list."""
        return self._stored[name].kind == "Q4_1"

    def has_halves(self, name: str) -> bool:
        """Whether a weight is kept as two INT4 halves (Q8_0), from the file's tensor list."""
        return self._stored[name].kind == "Q8_0"

    def kind(self, name: str) -> str:
        return self._stored[name].kind

    def __contains__(self, name: object) -> bool:
        return name in self._stored  # without reading it

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


def kept_linears(source: GgufSource) -> tuple[Mapping[str, QuantizedWeight], str | None]:
    """Every block linear of the file as it is stored, in our layout and module names,
    when all of them are Q4_0, Q4_1 or Q8_0 (and the output projection, when it is Q4_0); else
    ({}, why not). Only the file's tensor list is read here (the source's): each weight when
    asked for."""
    import gguf  # build-time only dependency

    heads = {"attn_q": source.config.num_heads, "attn_k": source.config.num_kv_heads}
    kept: dict[str, _Stored] = {}
    kinds = {
        gguf.GGMLQuantizationType.Q4_0: "Q4_0",
        gguf.GGMLQuantizationType.Q4_1: "Q4_1",
        gguf.GGMLQuantizationType.Q8_0: "Q8_0",
    }
    # By our names: a Phi-3 file's fused q/k/v and gate/up are row ranges of one stored
    # tensor each (whole blocks per row), kept as the separate linears they hold.
    linears = {_LAYER_NAMES[part] for part in LINEAR_PARTS}
    for ours, t in source.stored().items():
        match = _BLOCK.match(t.name)
        module = ours.removesuffix(".weight")
        is_output = ours == "lm_head.weight"
        if not (is_output or (match and ours.endswith(".weight") and module.split(".", 2)[-1] in linears)):
            continue
        kind = kinds.get(t.kind)
        if kind is None or (is_output and kind != "Q4_0"):
            if is_output:
                # Rounded to INT4 by the build like any output projection (a Q4_1 one too:
                # the output layer's exact top reads codes without minimums).
                continue
            return {}, f"{t.name} is {t.kind.name}, not Q4_0, Q4_1 or Q8_0"
        rows, columns = t.dims[0], t.dims[1]
        if columns % GROUP:
            raise SourceModelError(f"a {kind} row of {columns} weights is not whole blocks of {GROUP}")
        if is_output:
            kept["lm_head"] = _Stored(t.offset, t.shape, rows, columns, 0)
            continue
        assert match is not None
        part = match.group(2)
        unpermute = heads[part] if source.permuted and part in heads else 0
        kept[module] = _Stored(t.offset, t.shape, rows, columns, unpermute, kind)
    if not kept:
        return {}, "the file has no Q4_0, Q4_1 or Q8_0 linears"
    return KeptWeights(source.path, kept), None


def write_kept(source: GgufSource, out: Path, kept: KeptWeights, progress: bool) -> dict[str, Any]:
    """An INT4 checkpoint (as a build writes one, a layer at a time: engines/text/layerwise.py)
    whose block linears are the file's Q4_0 weights; norms and the token table from the
    file's float tensors, the output projection the file's where it is Q4_0, else rounded
    to INT4."""
    gguf_path = source.path
    with torch.device("meta"):
        names = set(linear_names(LlamaModel(source.config)))
    missing = sorted(names - set(kept))
    if missing:
        raise SourceModelError(f"{gguf_path.name}: no Q4_0, Q4_1 or Q8_0 weight for {', '.join(missing[:5])}")
    # Every block linear stays out of the recipe (kept); only the output projection, when
    # the file's is not Q4_0, is rounded (to the nearest, at group 32, as a build does).
    recipe = QuantRecipe(method="rtn", group_size=GROUP, keep=tuple(sorted(names)), lm_head="lm_head" not in kept)
    recorded = {"method": stored_method(kept), "group_size": GROUP, "kept_version": KEPT_VERSION}
    try:
        details = write_layerwise(source, out, recipe, progress, prepacked=kept, recorded=recorded)
    except ValueError as err:  # a stored weight of another shape than the config's
        raise SourceModelError(f"{gguf_path.name}: {err}") from err
    for name in kept:
        bits = 8 if kept.has_halves(name) else 4
        details["layers"][name] = {
            "bits": bits,
            "group_size": GROUP,
            "clipped": False,
            "from": f"gguf {kept.kind(name)}, as stored",
        }
    return details


def stored_method(kept: KeptWeights) -> str:
    """The recipe a kept build's manifest names: gguf- and the block linears' kinds (q4_0,
    q4_1, q8_0) joined by +."""
    kinds = sorted({kept.kind(n).lower() for n in kept if n != "lm_head"})
    return "gguf-" + "+".join(kinds)


def keep_stored(
    source: GgufSource,
    imported: Path,
    imported_inputs: dict[str, Any],
    progress: bool = False,
    symmetric: bool = False,
) -> Path | None:
    """The INT4 build of `source` that keeps the file's Q4_0, Q4_1 and Q8_0 weights, cached
    beside its float import `imported` (named, not built) by the import's inputs; None,
    saying why, where its block linears are not all of those kinds, or where a symmetric
    build (zero points 8: TensorRT's INT4) is asked for and Q4_1's minimums or Q8_0's low
    halves (zero points 0) are not that."""
    kept, why = kept_linears(source)
    if isinstance(kept, KeptWeights) and symmetric and ("q4_1" in stored_method(kept) or "q8_0" in stored_method(kept)):
        why = "its Q4_1 or Q8_0 weights are not the symmetric INT4 asked for"
    if why is not None:
        logger.info("%s: %s; its weights are dequantized and quantized again", source.path.name, why)
        return None
    assert isinstance(kept, KeptWeights)
    method = stored_method(kept)
    inputs = {"source": imported_inputs, "kept": method, "version": KEPT_VERSION}
    out = imported.parent / f"{imported.name}-{method.removeprefix('gguf-').replace('+', '-')}-{cache_key(inputs)}"
    logger.info("%s: every block linear is %s, served as stored (no second rounding)", source.path.name, method)
    return build_cached(out, inputs, lambda scratch: write_kept(source, scratch, kept, progress))
