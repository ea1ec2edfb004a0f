"""Writing an INT4 checkpoint: the packed linears, the float tensors in float16, quant.json
and the side files (tokenizer, config, generation settings) of the checkpoint it came from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from edge.text.model.checkpoint import carried_files
from edge.text.model.llama import LlamaModel
from edge.text.ops.sparse24 import SPARSITY, PackedLinear, Sparse24Weight


def save_int4(
    model: LlamaModel,
    packed: dict[str, PackedLinear],
    src: Path,
    out: Path,
    recipe: dict[str, Any],
    layers: dict[str, Any],
) -> dict[str, Any]:
    """`model`'s float tensors (norms, embeddings, biases) beside the `packed` linears, into
    `out`; returns the manifest's description of the checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, kind = name.rpartition(".")
        if (module in packed and kind == "weight") or (name == "lm_head.weight" and model.config.tie_embeddings):
            continue  # a packed layer's bias (Qwen2's q/k/v) stays float beside its codes
        if name.startswith("rope_"):
            continue
        # Norms and embeddings stay float; fp16 halves their bytes at no cost in accuracy.
        tensors[name] = tensor.detach().to(torch.float16).contiguous()
    for name, q in packed.items():
        tensors.update(q.stored(name))
    save_file(tensors, str(out / "model.safetensors"))
    linears: dict[str, dict[str, Any]] = {}
    for name, q in packed.items():
        linears[name] = {"group_size": q.group_size, "bits": 4}
        if isinstance(q, Sparse24Weight):
            linears[name]["sparsity"] = SPARSITY
    quant = {"linears": linears}
    (out / "quant.json").write_text(json.dumps(quant, indent=1) + "\n", encoding="utf-8")
    for name in carried_files(src):
        shutil.copy2(src / name, out / name)
    return {
        "kind": "llama-int4",
        "recipe": recipe,
        "layers": layers,
        "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "kv_bytes_per_token_fp16": model.config.kv_bytes_per_token(torch.float16),
    }
