"""Llama-shaped models with random weights, for speed and memory work at real scale.

Decode speed and memory depend on shapes and formats, not on weight values, so an 8B
model can be measured without 8B of real weights. Never use these for quality figures.
INT4 models are generated directly in packed form on the target device (no float copy).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge.text.architecture import LlamaConfig
from edge.text.model.llama import DecoderLayer, LlamaModel, RMSNorm
from edge.text.ops.int4 import Int4Linear, QuantizedWeight

logger = logging.getLogger(__name__)

LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=14336,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position=8192,
    tie_embeddings=False,
)

SHAPES = {"llama3-8b": LLAMA3_8B}


def random_quantized(n: int, k: int, group: int, device: torch.device, gen: torch.Generator) -> QuantizedWeight:
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    # Codes centred on zero point 8 with these scales give weights of std ~0.02,
    # like a trained model's, so activations stay in range through 32 layers.
    scales = torch.empty(n, k // group, dtype=torch.float16, device=device).uniform_(0.002, 0.006, generator=gen)
    zeros = torch.randint(7, 10, (n, k // group), dtype=torch.uint8, device=device, generator=gen)
    return QuantizedWeight(qweight, scales, zeros, group)


def _random_matrix(
    rows: int, cols: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """N(0, 0.02) drawn in float32 (so models of different dtypes share weights), in
    chunks so the float32 copy of a 128k-row embedding never exists whole."""
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    for start in range(0, rows, 8192):
        end = min(rows, start + 8192)
        out[start:end] = torch.randn(end - start, cols, device=device, generator=gen) * 0.02
    return out


def random_int4_llama(
    config: LlamaConfig,
    device: torch.device | str,
    kernel: str,
    group: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    quantize_lm_head: bool = True,
) -> LlamaModel:
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = LlamaModel(config)
    h, hd = config.hidden_size, config.head_dim
    q_out = config.num_heads * hd
    kv_out = config.num_kv_heads * hd
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Int4Linear(random_quantized(q_out + 2 * kv_out, h, group, device, gen), kernel)
        attn.o_proj = Int4Linear(random_quantized(h, q_out, group, device, gen), kernel)  # type: ignore[assignment]
        mlp.gate_up_proj = Int4Linear(
            random_quantized(2 * config.intermediate_size, h, group, device, gen), kernel, gated=True
        )
        mlp.down_proj = Int4Linear(  # type: ignore[assignment]
            random_quantized(h, config.intermediate_size, group, device, gen), kernel
        )
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        layer.input_layernorm.weight = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        layer.post_attention_layernorm.weight = nn.Parameter(
            torch.ones(h, dtype=dtype, device=device), requires_grad=False
        )
    embed = _random_matrix(config.vocab_size, h, dtype, device, gen)
    model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    model.norm.weight = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
    for norm in model.modules():  # a family's other norms (q/k heads, branch outputs): ones too
        if isinstance(norm, RMSNorm) and norm.weight.is_meta:
            norm.weight = nn.Parameter(torch.ones(norm.weight.shape, dtype=dtype, device=device), requires_grad=False)
    if quantize_lm_head:
        model.lm_head = Int4Linear(random_quantized(config.vocab_size, h, group, device, gen), kernel)  # type: ignore[assignment]
    else:
        head = _random_matrix(config.vocab_size, h, dtype, device, gen)
        model.lm_head.weight = nn.Parameter(head, requires_grad=False)
    model.move_rope(device)
    return model.eval()


def int4_weight_bytes(model: LlamaModel) -> int:
    return sum(m.weight_bytes for m in model.modules() if isinstance(m, Int4Linear))


def word_tokenizer(vocab_size: int) -> Any:
    """A real tokenizer for a random-weight model: word i is token i ("t0", "t1", ...),
    split on whitespace, decoded with spaces. It makes prompts of a chosen length and
    turns generated ids into text; it carries no language."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return tok


def write_random_checkpoint(
    out_dir: Path, config: LlamaConfig, device: torch.device | str = "cpu", group: int = 128, seed: int = 0
) -> Path:
    """An INT4 text checkpoint of `config`'s shape with random weights, in the serving
    format (what edge/text/model/checkpoint.py loads), with a manifest that says it is random:
    for speed and memory figures of a real-size model through the whole daemon. The
    weights are drawn on `device` (fast on a GPU) and written once."""
    from safetensors.torch import save_file

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    h, hd = config.hidden_size, config.head_dim
    shapes = {
        "self_attn.q_proj": (config.num_heads * hd, h),
        "self_attn.k_proj": (config.num_kv_heads * hd, h),
        "self_attn.v_proj": (config.num_kv_heads * hd, h),
        "self_attn.o_proj": (h, config.num_heads * hd),
        "mlp.gate_proj": (config.intermediate_size, h),
        "mlp.up_proj": (config.intermediate_size, h),
        "mlp.down_proj": (h, config.intermediate_size),
    }
    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, dict[str, int]] = {}

    def add(name: str, n: int, k: int) -> None:
        q = random_quantized(n, k, group, device, gen)
        tensors.update({key: t.cpu() for key, t in q.stored(name).items()})
        linears[name] = {"group_size": group, "bits": 4}

    ones = torch.ones(h, dtype=torch.float16)
    for i in range(config.num_layers):
        for part, (n, k) in shapes.items():
            add(f"layers.{i}.{part}", n, k)
        tensors[f"layers.{i}.input_layernorm.weight"] = ones.clone()
        tensors[f"layers.{i}.post_attention_layernorm.weight"] = ones.clone()
    tensors["embed_tokens.weight"] = _random_matrix(config.vocab_size, h, torch.float16, device, gen).cpu()
    tensors["norm.weight"] = ones.clone()
    add("lm_head", config.vocab_size, h)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(config.to_json() + "\n", encoding="utf-8")
    (out_dir / "quant.json").write_text(json.dumps({"linears": linears}) + "\n", encoding="utf-8")
    word_tokenizer(config.vocab_size).save(str(out_dir / "tokenizer.json"))
    eos = config.vocab_size - 1
    (out_dir / "generation.json").write_text(json.dumps({"eos_token_id": eos}) + "\n", encoding="utf-8")
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    manifest = {
        "kind": "llama-int4",
        "random_weights": True,
        "shape": asdict(config),
        "group_size": group,
        "seed": seed,
        "weight_bytes": weight_bytes,
        "serves": [{"task": "qa", "source": "random", "adapter": "none", "quantization": "rtn-int4"}],
        "built_at": time.time(),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return out_dir
