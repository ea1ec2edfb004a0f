"""Text-branch build steps after import: quantize (RTN or AWQ) and write the checkpoint."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from edge.text.architecture import LlamaConfig
from edge.text.model.checkpoint import load_checkpoint
from engines.cache import build_cached, cache_key, read_manifest, stop_on_sigterm, tag_serves
from engines.text.corpus import calibration_text, corpus_fingerprint
from engines.text.gguf_int4 import keep_q4_0
from engines.text.import_gguf import SourceModelError
from engines.text.int4_checkpoint import save_int4
from engines.text.peft_adapter import AdapterError
from engines.text.quantize import QuantRecipe, quantize_model

logger = logging.getLogger(__name__)

QUANTIZER_VERSION = 1


def write_quantized(src: Path, out: Path, recipe: QuantRecipe, progress: bool) -> dict[str, Any]:
    ckpt = load_checkpoint(src, dtype=torch.float32, fuse=False)
    calib_ids = None
    if recipe.method == "awq":
        calib_ids = ckpt.tokenizer.encode(calibration_text(), add_special_tokens=False).ids
    with torch.inference_mode():
        packed, report = quantize_model(ckpt.model, recipe, calib_ids, progress)
    return save_int4(ckpt.model, packed, src, out, recipe.to_dict(), report.layers)


def quantize_checkpoint(src: Path, recipe: QuantRecipe, progress: bool = True) -> Path:
    """Cached by the source checkpoint's own inputs, the recipe and the calibration text."""
    source = read_manifest(src)
    if source is None:
        raise FileNotFoundError(f"{src} is not a built checkpoint (no manifest)")
    inputs = {
        "source": source["inputs"],
        "recipe": recipe.to_dict(),
        "calibration": corpus_fingerprint() if recipe.method == "awq" else None,
        "quantizer": QUANTIZER_VERSION,
    }
    out = src.parent / f"{src.name}-{recipe.method}-g{recipe.group_size}-{cache_key(inputs)}"
    return build_cached(out, inputs, lambda scratch: write_quantized(src, scratch, recipe, progress))


# The build's group size, by the model's size (docs/models.md states the rule):
# - small models get 32. SmolLM2-135M's merged clinic adapter is a small change to small
#   weights: at group 64 or 128 the rounding noise erases most of it, at 32 it survives
#   (bench/eval_text_quality.py measures this);
# - 7B-class models and larger get 128, where the INT4 literature measures its cost
#   (AWQ's and GPTQ's Llama results are at 128) and where decode is bound by streaming
#   the weights: group 32 costs 3 bytes per 32 weights where 128 costs 3 per 128
#   (bench/text.py's g32 row measures what that costs).
SERVING_GROUP = 32
LARGE_MODEL_GROUP = 128
LARGE_MODEL_PARAMETERS = 6_000_000_000


def serving_group(parameters: int) -> int:
    """The group size `edgectl build` quantizes a model of this many weights at."""
    return LARGE_MODEL_GROUP if parameters >= LARGE_MODEL_PARAMETERS else SERVING_GROUP


def build_text_engine(
    engine_dir: Path,
    adapter: str = "clinic",
    quant: str = "awq-int4",
    progress: bool = True,
    source: str = "smollm2-135m-instruct",
    layers: list[dict[str, Any]] | None = None,
) -> Path:
    """The whole text pipeline: import (the built-in SmolLM2, a Hugging Face model
    directory or a GGUF file), the adapter merged in (the shipped clinic adapter or a
    PEFT directory), AWQ INT4 (or, for a GGUF file whose block linears are all Q4_0 and
    no adapter, the file's own INT4 weights: engines/text/gguf_int4.py).

    Every step is cached by its inputs, so a second call returns at once.
    """
    from edge.builds import source_id
    from engines.text.import_gguf import import_gguf, import_smollm2
    from engines.text.import_hf import import_hf
    from engines.text.peft_adapter import merge_checkpoint
    from engines.text.qlora import CLINIC_ADAPTER

    if source == SMOLLM2_SOURCE:
        path = import_smollm2(engine_dir, progress)
    elif source.endswith(".gguf"):
        path = import_gguf(Path(source), engine_dir, Path(source).stem, progress)
    else:
        path = import_hf(Path(source), engine_dir, progress)
    if adapter == "clinic":
        if source != SMOLLM2_SOURCE:
            raise ValueError(f"the clinic adapter was trained for {SMOLLM2_SOURCE}, not {source}")
        # The shipped adapter (engines/text/adapters/clinic), trained once by engines/text/qlora.py.
        path = merge_checkpoint(path, CLINIC_ADAPTER)
    elif adapter != "none":
        path = merge_checkpoint(path, Path(adapter))
    kept = None
    if source.endswith(".gguf") and adapter == "none" and quant in INT4_QUANTIZATIONS and not layers:
        # A file whose block linears are all Q4_0 is served as stored: already INT4 at
        # group 32 with zero points 8, both our layout and a symmetric one.
        kept = keep_q4_0(Path(source), path)
    if kept is not None:
        path = kept
    elif quant in INT4_QUANTIZATIONS:
        method = quant.split("-")[0]
        group = serving_group(LlamaConfig.from_json(path / "config.json").parameter_count())
        recipe = layer_recipe(method, layers or [], group_size=group, symmetric=quant.endswith("-sym"))
        path = quantize_checkpoint(path, recipe, progress)
    elif quant != "float" or layers:
        raise ValueError(f"unknown quantization {quant!r}" if quant != "float" else "layers need INT4 quantization")
    # What serving looks the checkpoint up by (edge/artifacts.py): the profile's words.
    selector = text_selector(source_id(source), source_id(adapter), quant)
    if layers:
        selector["layers"] = layers
    tag_serves(path, selector)
    return path


def layer_recipe(
    method: str, layers: list[dict[str, Any]], group_size: int = SERVING_GROUP, symmetric: bool = False
) -> QuantRecipe:
    """The INT4 recipe with the profile's per-layer rules (models.qa.layers), in order,
    the first rule matching a layer deciding: float, or INT4 at its own group size."""
    rules = tuple((r["match"], 0 if r["format"] == "float" else int(r.get("group_size") or group_size)) for r in layers)
    return QuantRecipe(method=method, group_size=group_size, groups=rules, symmetric=symmetric)


# "-sym": zero points fixed at 8, the form TensorRT's weight-only INT4 takes.
INT4_QUANTIZATIONS = ("awq-int4", "rtn-int4", "awq-int4-sym", "rtn-int4-sym")
QUANTIZATIONS = (*INT4_QUANTIZATIONS, "float")


SMOLLM2_SOURCE = "smollm2-135m-instruct"


def text_selector(source: str, adapter: str, quant: str) -> dict[str, Any]:
    return {"task": "qa", "source": source, "adapter": adapter, "quantization": quant}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import logging

    parser = argparse.ArgumentParser(description="Build the text engine (cached by its inputs).")
    parser.add_argument("--engine-dir", type=Path, default=Path(".edge/engines"))
    parser.add_argument(
        "--source", default=SMOLLM2_SOURCE, help="the built-in model, a Hugging Face model directory or a .gguf file"
    )
    parser.add_argument("--adapter", default="clinic", help="'clinic', 'none' or a PEFT LoRA adapter directory")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="awq-int4")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, services)")
    parser.add_argument("--layers", default="", help="per-layer rules as JSON (models.qa.layers)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    source = args.source if args.source == SMOLLM2_SOURCE else str(Path(args.source).resolve())
    adapter = args.adapter if args.adapter in ("clinic", "none") else str(Path(args.adapter).resolve())
    try:
        layers = json.loads(args.layers) if args.layers else None
        built = build_text_engine(args.engine_dir, adapter, args.quantization, not args.no_progress, source, layers)
    except (SourceModelError, AdapterError, ValueError) as err:
        print(f"text build: {err}", file=sys.stderr)
        return 2
    print(built)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
