"""The text branch's build: import, adapter merge, quantization (RTN or AWQ), the INT4
checkpoint written a decoder layer at a time (engines/text/layerwise.py)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from edge.text.model.checkpoint import load_checkpoint
from engines.cache import build_cached, cache_key, read_manifest, stop_on_sigterm, tag_serves
from engines.text.corpus import calibration_text, corpus_fingerprint
from engines.text.float_source import CheckpointSource, FloatSource
from engines.text.gguf_int4 import keep_stored
from engines.text.import_gguf import SourceModelError
from engines.text.int4_checkpoint import save_int4
from engines.text.layerwise import write_layerwise
from engines.text.peft_adapter import AdapterError
from engines.text.qat import QAT_VERSION, QATRecipe, write_qat
from engines.text.quantize import QuantRecipe, quantize_model

logger = logging.getLogger(__name__)

QUANTIZER_VERSION = 1


def write_quantized(src: Path, out: Path, recipe: QuantRecipe, progress: bool) -> dict[str, Any]:
    """The whole float checkpoint `src` loaded and quantized at once: the reference the
    layer-at-a-time build (engines/text/layerwise.py, what quantize_checkpoint and
    build_text_engine run) is held to, bit for bit (tests/test_build_memory.py). It holds
    the float model whole: four bytes a weight."""
    ckpt = load_checkpoint(src, dtype=torch.float32, fuse=False)
    calib_ids = None
    if recipe.calibrates:
        calib_ids = ckpt.tokenizer.encode(calibration_text(), add_special_tokens=False).ids
    with torch.inference_mode():
        packed, report = quantize_model(ckpt.model, recipe, calib_ids, progress)
    return save_int4(ckpt.model, packed, src, out, recipe.to_dict(), report.layers)


def quantize_target(src: Path, src_inputs: dict[str, Any], recipe: QuantRecipe) -> tuple[Path, dict[str, Any]]:
    """Where the quantization of the float model `src` (built from `src_inputs`) is cached,
    and its inputs; `src` need not be built: a build from the source model itself is the
    same build."""
    inputs = {
        "source": src_inputs,
        "recipe": recipe.to_dict(),
        # (calibrates: AWQ, or pruning that weighs weights by the calibration's activations;
        # for a dense round-to-nearest recipe None, as before)
        "calibration": corpus_fingerprint() if recipe.calibrates else None,
        "quantizer": QUANTIZER_VERSION,
    }
    return src.parent / f"{src.name}-{recipe.method}-g{recipe.group_size}-{cache_key(inputs)}", inputs


def quantize_checkpoint(src: Path, recipe: QuantRecipe, progress: bool = True) -> Path:
    """Cached by the source checkpoint's own inputs, the recipe and the calibration text."""
    source = read_manifest(src)
    if source is None:
        raise FileNotFoundError(f"{src} is not a built checkpoint (no manifest)")
    out, inputs = quantize_target(src, source["inputs"], recipe)
    return build_cached(out, inputs, lambda scratch: write_layerwise(CheckpointSource(src), scratch, recipe, progress))


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
    qat: dict[str, Any] | None = None,
) -> Path:
    """The whole text pipeline: import (the built-in SmolLM2, a Hugging Face model
    directory or a GGUF file), the adapter merged in (the shipped clinic adapter or a
    PEFT directory), AWQ INT4 (or, for a GGUF file whose block linears are all Q4_0 or
    Q4_1 and no adapter, the file's own INT4 weights: engines/text/gguf_int4.py).
    `qat` (models.qa.qat's settings but `enabled`): the pruned model fine-tuned with the
    INT4 rounding in the loop before AWQ packs it (engines/text/qat.py).

    An INT4 build runs all three a decoder layer at a time (engines/text/layerwise.py):
    it never holds the float model, and writes no float copy of it. Every build is
    cached by its inputs, so a second call returns at once; one stopped at any point
    leaves nothing a later one takes for built (engines/cache.py).
    """
    from edge.builds import source_id
    from engines.text.import_gguf import SMOLLM2_NAME, GgufSource, import_gguf, smollm2_gguf_path
    from engines.text.import_gguf import import_target as gguf_import_target
    from engines.text.import_hf import HfSource, import_hf
    from engines.text.import_hf import import_target as hf_import_target
    from engines.text.peft_adapter import MergedSource, merge_checkpoint, merge_target
    from engines.text.qlora import CLINIC_ADAPTER

    if quant not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quant!r}")
    if quant == "float" and layers:
        raise ValueError("layers need INT4 quantization")
    if quant == "float" and qat:
        raise ValueError("qat needs INT4 quantization")
    if adapter == "clinic" and source != SMOLLM2_SOURCE:
        raise ValueError(f"the clinic adapter was trained for {SMOLLM2_SOURCE}, not {source}")
    # The shipped clinic adapter (engines/text/adapters/clinic), trained once by engines/text/qlora.py.
    adapter_dir = CLINIC_ADAPTER if adapter == "clinic" else None if adapter == "none" else Path(adapter)
    gguf_path, name = None, ""
    if source == SMOLLM2_SOURCE:
        gguf_path, name = smollm2_gguf_path(), SMOLLM2_NAME
    elif source.endswith(".gguf"):
        gguf_path, name = Path(source), Path(source).stem
    if quant == "float":
        # The float model is what is served: imported (and merged) as a checkpoint.
        if gguf_path is not None:
            path = import_gguf(gguf_path, engine_dir, name, progress)
        else:
            path = import_hf(Path(source), engine_dir, progress)
        if adapter_dir is not None:
            path = merge_checkpoint(path, adapter_dir, progress)
    else:
        # INT4 straight from the source, a layer at a time: the float import and merge are
        # never written, only named (the INT4 build's cache key starts from their inputs,
        # as when each was a step of its own).
        if gguf_path is not None:
            imported, imported_inputs = gguf_import_target(gguf_path, engine_dir, name)
        else:
            imported, imported_inputs = hf_import_target(Path(source), engine_dir)
        # The source's tensor list and config, read once (a GGUF file's metadata is seconds
        # of parsing for a large vocabulary).
        float_source: FloatSource = GgufSource(gguf_path) if gguf_path else HfSource(Path(source).resolve())
        kept = None
        stored = adapter_dir is None and not layers and not qat  # nothing changes the file's INT4 weights
        if isinstance(float_source, GgufSource) and source != SMOLLM2_SOURCE and stored:
            # A file whose block linears are all Q4_0 or Q4_1 is served as stored: already
            # INT4 at group 32 (Q4_0's zero points 8, Q4_1's 0 with its block minimums).
            kept = keep_stored(float_source, imported, imported_inputs, progress, quant.endswith("-sym"))
        if kept is not None:
            path = kept
        else:
            src, src_inputs = imported, imported_inputs
            if adapter_dir is not None:
                src, src_inputs = merge_target(imported, imported_inputs, adapter_dir)
                float_source = MergedSource(float_source, adapter_dir)
            method = quant.split("-")[0]
            group = serving_group(float_source.config.parameter_count())
            recipe = layer_recipe(method, layers or [], group_size=group, symmetric=quant.endswith("-sym"))
            out, inputs = quantize_target(src, src_inputs, recipe)
            if qat:
                path = qat_build(out, inputs, float_source, recipe, QATRecipe(**qat), adapter == "clinic", progress)
            else:
                path = build_cached(
                    out, inputs, lambda scratch: write_layerwise(float_source, scratch, recipe, progress)
                )
    # What serving looks the checkpoint up by (edge/artifacts.py): the profile's words.
    selector = text_selector(source_id(source), source_id(adapter), quant)
    if layers:
        selector["layers"] = layers
    if qat:  # only then, as layers; recompute changes the memory and time, not the build
        selector["qat"] = {k: v for k, v in qat.items() if k != "recompute"}
    tag_serves(path, selector)
    return path


def qat_build(
    out: Path,
    inputs: dict[str, Any],
    source: FloatSource,
    recipe: QuantRecipe,
    qat: QATRecipe,
    adapter_data: bool,
    progress: bool,
) -> Path:
    """The QAT build beside the INT4 build at `out` (`inputs` its cache inputs): cached by
    those inputs and the training's recipe (engines/text/qat.py)."""
    inputs = {**inputs, "qat": {**qat.to_dict(), "adapter_data": adapter_data}, "qat_version": QAT_VERSION}
    target = out.with_name(f"{out.name}-qat-{cache_key(inputs)}")
    return build_cached(target, inputs, lambda scratch: write_qat(source, scratch, recipe, qat, adapter_data, progress))


def layer_recipe(
    method: str, layers: list[dict[str, Any]], group_size: int = SERVING_GROUP, symmetric: bool = False
) -> QuantRecipe:
    """The INT4 recipe with the profile's per-layer rules (models.qa.layers), in order,
    the first rule matching a layer deciding: float, or INT4 at its own group size, pruned
    to 2:4 by its method where it says so."""
    rules = tuple((r["match"], 0 if r["format"] == "float" else int(r.get("group_size") or group_size)) for r in layers)
    sparse = tuple(
        (r["match"], (r.get("pruning") or "sparsegpt") if r.get("sparsity", "dense") == "2:4" else "") for r in layers
    )
    if not any(method for _pattern, method in sparse):
        sparse = ()  # a dense build's recipe (and cache key) stays as it was
    return QuantRecipe(method=method, group_size=group_size, groups=rules, symmetric=symmetric, sparse=sparse)


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
    parser.add_argument("--qat", default="", help="quantization-aware training's settings as JSON (models.qa.qat)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    source = args.source if args.source == SMOLLM2_SOURCE else str(Path(args.source).resolve())
    adapter = args.adapter if args.adapter in ("clinic", "none") else str(Path(args.adapter).resolve())
    try:
        layers = json.loads(args.layers) if args.layers else None
        qat = json.loads(args.qat) if args.qat else None
        built = build_text_engine(
            args.engine_dir, adapter, args.quantization, not args.no_progress, source, layers, qat
        )
    except (SourceModelError, AdapterError, ValueError) as err:
        print(f"text build: {err}", file=sys.stderr)
        return 2
    print(built)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
