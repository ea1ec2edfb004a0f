"""Write a float model as a checkpoint directory beside its source's side files: what a
build step that changes weights (an adapter merged) writes out."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from edge.text.model.checkpoint import SIDE_FILES
from edge.text.model.llama import LlamaModel


def write_float_checkpoint(model: LlamaModel, src: Path, out: Path) -> dict[str, Any]:
    """model.safetensors (float32; a tied head is the embedding, not stored twice) and
    the side files copied from `src`; returns the manifest's size fields."""
    tensors = {
        k: v.detach().float().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith("rope_") and not (k == "lm_head.weight" and model.config.tie_embeddings)
    }
    save_file(tensors, str(out / "model.safetensors"))
    for name in SIDE_FILES:
        shutil.copy2(src / name, out / name)
    return {
        "kind": "llama-checkpoint",
        "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "kv_bytes_per_token_fp32": model.config.kv_bytes_per_token(torch.float32),
    }
