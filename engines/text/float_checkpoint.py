"""Write a float model as a checkpoint directory beside its source's side files, read from
its source a layer at a time: what a build step that keeps the weights in float writes out
(an import, an adapter merged), never holding the model whole."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from edge.text.architecture import LlamaConfig
from edge.text.model.llama import LlamaModel
from engines.text.float_source import FloatSource
from engines.text.safetensors_writer import SafetensorsWriter

logger = logging.getLogger(__name__)


def model_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, from a model on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = LlamaModel(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if not name.startswith("rope_")}


def write_float_streamed(source: FloatSource, out: Path, progress: bool) -> dict[str, Any]:
    """`source` as a float32 checkpoint in `out`, read and written a layer at a time (the
    float model is never held whole); returns the manifest's size fields."""
    config = source.config
    shapes = model_shapes(config)
    names = source.names()
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        raise ValueError(f"{source.label}: tensors {', '.join(unknown[:5])} are not the model's")
    source.write_side_files(out)
    groups = [source.top_names(), *(source.layer_names(i) for i in range(config.num_layers))]
    started = time.monotonic()
    with SafetensorsWriter(out / "model.safetensors", {n: (torch.float32, shapes[n]) for n in names}) as writer:
        for i, group in enumerate(tqdm(groups, desc=f"write {source.label}", unit="layer", disable=not progress)):
            for name, tensor in source.read(group).items():
                writer.write(name, tensor.contiguous())
            if i:
                logger.info("%s: layer %d/%d written", source.label, i, config.num_layers)
    logger.info("%s: float32 checkpoint written in %.0f s", source.label, time.monotonic() - started)
    return {
        "kind": "llama-checkpoint",
        "weight_bytes": writer.nbytes,
        "kv_bytes_per_token_fp32": config.kv_bytes_per_token(torch.float32),
    }
