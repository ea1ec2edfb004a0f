"""Phi-3's fused weights and LongRoPE as our checkpoint keeps them, for both importers: a
Hugging Face directory (engines/text/import_hf.py) and a GGUF file that llama.cpp's
converter wrote (engines/text/import_gguf.py) make the same checkpoint from them.

Phi-3 and Phi-4-mini keep q, k and v as one projection (q's rows, then k's, then v's) and
the MLP's gate and up as one (the gate's rows first: transformers' Phi3MLP chunks it so,
and llama.cpp's SwiGLU over a fused `ffn_up` takes its first half as the gate). Our
checkpoint keeps separate linears (the loader fuses them again for serving, in its own
order), so each fused weight is read as row ranges of the stored one.

This module imports neither importer: each imports it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from edge.text.architecture import LlamaConfig

logger = logging.getLogger(__name__)

QKV = "self_attn.qkv_proj.weight"
GATE_UP = "mlp.gate_up_proj.weight"


def fused_rows(name: str, config: LlamaConfig) -> list[tuple[str, int, int]] | None:
    """Our tensors a fused Phi-3 weight `name` (our module names) holds, each as (its
    name, its first row, its rows); None for a weight that is not fused."""
    if name.endswith(QKV):
        base = name.removesuffix(QKV)
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [
            (f"{base}self_attn.q_proj.weight", 0, q),
            (f"{base}self_attn.k_proj.weight", q, kv),
            (f"{base}self_attn.v_proj.weight", q + kv, kv),
        ]
    if name.endswith(GATE_UP):
        base = name.removesuffix(GATE_UP)
        inner = config.intermediate_size
        return [(f"{base}mlp.gate_proj.weight", 0, inner), (f"{base}mlp.up_proj.weight", inner, inner)]
    return None


def fused_parts(name: str, config: LlamaConfig) -> list[str]:
    """Our tensors a source tensor holds: a fused one's parts, or itself."""
    rows = fused_rows(name, config)
    return [name] if rows is None else [part for part, _, _ in rows]


def split_fused(name: str, tensor: torch.Tensor, config: LlamaConfig) -> list[tuple[str, torch.Tensor]]:
    """A fused weight as our separate linears; any other as it is."""
    rows = fused_rows(name, config)
    if rows is None:
        return [(name, tensor)]
    if sum(count for _, _, count in rows) != tensor.shape[0]:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, its config makes {sum(c for _, _, c in rows)}")
    return [(part, tensor.narrow(0, first, count).contiguous()) for part, first, count in rows]


def longrope(
    scaling: dict[str, Any], hf: dict[str, Any], positions: int, frequencies: int, problems: list[str], name: str
) -> tuple[dict[str, Any], int]:
    """Phi-3's LongRoPE as ours, and the positions it is served for. transformers turns
    the frequencies by the short factors while a sequence stays within the model's
    original context and by the long ones, for the whole sequence, once it grows past it
    (llama.cpp picks one set for a whole context the same way): a table per position
    cannot be both, so the model is served up to its original context, where the short
    factors hold, with transformers' attention factor (cos and sin scaled by it; from the
    ratio of the two contexts where the source gives none). `scaling` holds the
    short_factor list, and original_max_position_embeddings, factor and attention_factor
    where the source names them (else `hf`'s original_max_position_embeddings, or the
    model's positions). A short factor per frequency, or the problem goes into `problems`."""
    short = [float(f) for f in scaling.get("short_factor") or ()]
    if len(short) != frequencies:
        problems.append(f"longrope short_factor: {len(short)} factors for {frequencies} frequencies")
    original = int(
        scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or positions
    )
    factor = float(scaling.get("factor") or positions / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if positions > original:
        logger.info(
            "%s: served up to its original %d positions of %d, where LongRoPE's short factors hold",
            name,
            original,
            positions,
        )
    ours = {
        "rope_type": "longrope",
        "short_factor": short,
        "attention_factor": float(attention),
        "original_max_position_embeddings": original,
    }
    return ours, min(positions, original)
