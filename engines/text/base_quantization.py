"""The 4-bit base a QLoRA adapter was trained against, and its dequantized weights.

A QLoRA adapter learns its update on top of the rounded base, not the float one, so it is
merged into the same rounding. `base_quantization.json` beside the adapter says which:

- `{"format": "edge-int4", "group_size": 64}`: our own INT4 groups, the format
  `engines/text/qlora.py` trains against;
- `{"format": "bnb-nf4", "dtype": "bfloat16", "double_quant": true}` (or `bnb-fp4`): a
  bitsandbytes 4-bit base, as transformers' `BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
  bnb_4bit_compute_dtype=torch.bfloat16)` makes it from a model loaded in `dtype`.
  Optional: `compute_dtype` (default: `dtype`) and `block_size` (default 64, bitsandbytes'
  own). The rounding is bitsandbytes' itself, so the build needs that package
  (`pip install bitsandbytes`); serving never does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edge.text.ops.int4 import dequantize, group_size_for, pack

logger = logging.getLogger(__name__)

FILE = "base_quantization.json"
FORMATS = ("edge-int4", "bnb-nf4", "bnb-fp4")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BNB_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
BNB_FIELDS = {"format", "block_size", "double_quant", "dtype", "compute_dtype"}


class BaseQuantizationError(ValueError):
    """A base_quantization.json that cannot be applied, with what is wrong."""


@dataclass(frozen=True)
class BaseQuantization:
    format: str
    group_size: int = 0  # edge-int4
    block_size: int = 64  # bitsandbytes
    double_quant: bool = False
    dtype: str = "float32"
    compute_dtype: str = "float32"

    def to_dict(self) -> dict[str, Any]:
        if self.format == "edge-int4":
            return {"format": self.format, "group_size": self.group_size}
        return {
            "format": self.format,
            "block_size": self.block_size,
            "double_quant": self.double_quant,
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype,
        }

    def dequantized(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight the adapter was trained against, in float32."""
        if self.format == "edge-int4":
            return dequantize(pack(weight.float(), group_size_for(weight.shape[1], self.group_size)))
        functional = _bitsandbytes()
        # As bitsandbytes' Linear4bit does it: the loaded weight in its dtype, rounded
        # in blocks of the flattened tensor, dequantized to that dtype, then computed in
        # the compute dtype.
        source = weight.detach().to(DTYPES[self.dtype]).contiguous()
        packed, state = functional.quantize_4bit(
            source,
            blocksize=self.block_size,
            compress_statistics=self.double_quant,
            quant_type=self.format.removeprefix("bnb-"),
        )
        restored: torch.Tensor = functional.dequantize_4bit(packed, state)
        return restored.to(DTYPES[self.compute_dtype]).float().reshape(weight.shape)


def _bitsandbytes() -> Any:
    try:
        import bitsandbytes.functional as functional
    except ImportError as err:
        raise BaseQuantizationError(
            "an adapter trained on a bitsandbytes 4-bit base is merged into that base's own rounding: "
            "the build needs the bitsandbytes package (pip install bitsandbytes)"
        ) from err
    return functional


def read_base_quantization(directory: Path) -> BaseQuantization | None:
    """The adapter's base quantization, None for a float base; errors name the field."""
    path = directory / FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise BaseQuantizationError(f"{FILE} is not JSON: {err}") from err
    if not isinstance(doc, dict):
        raise BaseQuantizationError(f"{FILE} does not hold a JSON object")
    fmt = doc.get("format")
    if fmt not in FORMATS:
        raise BaseQuantizationError(f"{FILE}: format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
    known = {"format", "group_size"} if fmt == "edge-int4" else BNB_FIELDS
    unknown = sorted(set(doc) - known)
    if unknown:
        raise BaseQuantizationError(f"{FILE}: field {unknown[0]!r} is not a {fmt} setting")
    if fmt == "edge-int4":
        group = doc.get("group_size")
        if not isinstance(group, int) or group <= 0:
            raise BaseQuantizationError(f"{FILE}: group_size must be a positive integer, got {group!r}")
        return BaseQuantization(format=fmt, group_size=group)
    dtype = doc.get("dtype")
    if dtype not in DTYPES:
        raise BaseQuantizationError(
            f"{FILE}: dtype (what the base was loaded in before it was quantized) must be one of "
            f"{', '.join(DTYPES)}, got {dtype!r}"
        )
    compute = doc.get("compute_dtype", dtype)
    if compute not in DTYPES:
        raise BaseQuantizationError(f"{FILE}: compute_dtype must be one of {', '.join(DTYPES)}, got {compute!r}")
    double = doc.get("double_quant")
    if not isinstance(double, bool):
        raise BaseQuantizationError(f"{FILE}: double_quant must be true or false (bnb_4bit_use_double_quant)")
    block = doc.get("block_size", 64)
    if block not in BNB_BLOCK_SIZES:
        raise BaseQuantizationError(f"{FILE}: block_size must be one of {BNB_BLOCK_SIZES}, got {block!r}")
    return BaseQuantization(format=fmt, block_size=int(block), double_quant=double, dtype=dtype, compute_dtype=compute)
