"""Import a Hugging Face model directory (Llama or Qwen2 family) as the project's own
text checkpoint.

A source directory holds `config.json`, the weights as `*.safetensors` (one file or
shards), `tokenizer.json`, and `tokenizer_config.json` with the chat template and the
special tokens. Supported: the Llama family (Llama 2/3.x with its RoPE scaling, SmolLM,
TinyLlama, Mistral-style models without a sliding window) and the Qwen2 family (q/k/v
biases, tied embeddings). Anything else is refused with an error naming what is not
supported. The output is the layout `edge.text.model.checkpoint` loads: float32 weights under
our module names, our config, the tokenizer, and generation.json with the chat template,
the special tokens and the end-of-turn ids.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from edge.text.architecture import LlamaConfig
from engines.cache import build_cached, cache_key, file_sha256
from engines.text.import_gguf import MAX_POSITIONS, SourceModelError, expected_tensors

logger = logging.getLogger(__name__)

IMPORTER_VERSION = 1
FAMILIES = {"llama": "Llama", "mistral": "Llama", "qwen2": "Qwen2"}
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")
HF_ROPE_TYPES = ("linear", "llama3")  # what a Hugging Face config.json may name that we serve


def _load_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SourceModelError(f"{path.name} is not readable JSON: {err}") from err
    if not isinstance(doc, dict):
        raise SourceModelError(f"{path.name} does not hold a JSON object")
    return doc


def read_hf_config(directory: Path) -> LlamaConfig:
    """Our config for a source directory; SourceModelError naming what is unsupported."""
    missing = [name for name in REQUIRED if not (directory / name).is_file()]
    if missing:
        raise SourceModelError(f"{directory} is not a Hugging Face model directory: no {', '.join(missing)}")
    if not weight_files(directory):
        raise SourceModelError(f"{directory} holds no *.safetensors weights")
    hf = _load_json(directory / "config.json")
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        archs = ", ".join(hf.get("architectures") or []) or "none given"
        raise SourceModelError(
            f"model_type {kind!r} (architectures: {archs}) is not supported; supported: "
            "llama, mistral (without a sliding window), qwen2"
        )
    problems: list[str] = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (only silu)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias")
    if kind == "mistral" and hf.get("sliding_window") is not None:
        problems.append(f"sliding_window {hf['sliding_window']}")
    if kind == "qwen2" and hf.get("use_sliding_window"):
        problems.append("use_sliding_window")
    if kind == "llama" and hf.get("attention_bias"):
        problems.append("attention_bias on a Llama model")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        problems.append("sliding-window layers")
    # transformers 5 writes RoPE as rope_parameters (theta included); older configs as
    # rope_theta and rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(hf.get("rope_theta") or rope.pop("rope_theta", 10000.0))
    rope.pop("rope_theta", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = rope if rope_type != "default" else None
    if scaling is not None and rope_type not in HF_ROPE_TYPES:
        problems.append(f"rope_scaling {rope_type!r} (supported: {', '.join(HF_ROPE_TYPES)})")
    if problems:
        raise SourceModelError(f"{kind} model in {directory.name}: not supported: {'; '.join(problems)}")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    positions = int(hf.get("max_position_embeddings", 8192))
    if positions > MAX_POSITIONS:
        logger.info("%s: positions capped at %d of the model's %d", directory.name, MAX_POSITIONS, positions)
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        intermediate_size=int(hf["intermediate_size"]),
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=min(positions, MAX_POSITIONS),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=kind == "qwen2",
        head_size=head_dim if head_dim != hidden // heads else 0,
        rope_scaling=scaling,
    )


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _our_name(name: str) -> str:
    return name.removeprefix("model.")


def generation_settings(directory: Path) -> dict[str, Any]:
    """The chat template, special tokens and end-of-turn ids, from the tokenizer's
    config and the generation config where there is one."""
    tok_cfg = _load_json(directory / "tokenizer_config.json")
    tokenizer = _load_json(directory / "tokenizer.json")
    vocab = {t["content"]: int(t["id"]) for t in tokenizer.get("added_tokens", [])}
    model_vocab = tokenizer.get("model", {}).get("vocab", {})

    def token(key: str) -> str | None:
        value = tok_cfg.get(key)
        if isinstance(value, dict):  # AddedToken written out in full
            value = value.get("content")
        return value if isinstance(value, str) else None

    def token_id(text: str | None) -> int | None:
        if text is None:
            return None
        found = vocab.get(text, model_vocab.get(text) if isinstance(model_vocab, dict) else None)
        return int(found) if found is not None else None

    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if not isinstance(template, str):
        raise SourceModelError(f"{directory.name}: tokenizer_config.json has no chat_template")
    eos: set[int] = set()
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        value = _load_json(gen_path).get("eos_token_id")
        eos.update(value if isinstance(value, list) else [value] if value is not None else [])
    eos_text = token("eos_token")
    if token_id(eos_text) is not None:
        eos.add(int(token_id(eos_text)))  # type: ignore[arg-type]
    if not eos:
        raise SourceModelError(f"{directory.name}: no end-of-sequence token in its tokenizer or generation config")
    bos_text = token("bos_token")
    return {
        "bos_token_id": token_id(bos_text),
        "eos_token_id": min(eos),
        "eos_token_ids": sorted(int(e) for e in eos),
        "bos_token": bos_text,
        "eos_token": eos_text,
        "chat_template": template,
    }


def convert(directory: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    config = read_hf_config(directory)
    expected = expected_tensors(config)
    tensors: dict[str, torch.Tensor] = {}
    files = weight_files(directory)
    for path in tqdm(files, desc=f"import {directory.name}", unit="file", disable=not progress):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                ours = _our_name(name)
                if ours == "lm_head.weight" and config.tie_embeddings:
                    continue  # tied: the embedding is the head
                if ours not in expected:
                    raise SourceModelError(f"{directory.name}: unexpected tensor {name} for a {config_kind(config)}")
                tensors[ours] = fh.get_tensor(name).to(torch.float32).contiguous()
    missing = sorted(expected - set(tensors))
    if missing:
        raise SourceModelError(f"{directory.name}: missing tensors {', '.join(missing[:5])}")
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(config.to_json() + "\n", encoding="utf-8")
    (out_dir / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    generation = generation_settings(directory)
    (out_dir / "generation.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return {
        "kind": "llama-checkpoint",
        "family": config_kind(config),
        "config": json.loads(config.to_json()),
        "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "kv_bytes_per_token_fp32": config.kv_bytes_per_token(torch.float32),
        "tensors": len(tensors),
    }


def config_kind(config: LlamaConfig) -> str:
    return "Qwen2 model" if config.attention_bias else "Llama model"


def source_inputs(directory: Path) -> dict[str, Any]:
    """What an import depends on: every file it reads, by content."""
    files = [directory / n for n in REQUIRED] + weight_files(directory)
    for optional in ("generation_config.json", "chat_template.jinja"):
        if (directory / optional).is_file():
            files.append(directory / optional)
    return {"files": {f.name: file_sha256(f) for f in files}, "importer": IMPORTER_VERSION}


def import_hf(directory: Path, engine_dir: Path, progress: bool = True) -> Path:
    """Convert once; later calls with the same files return the cached directory."""
    directory = directory.resolve()
    read_hf_config(directory)  # refuse an unsupported model before hashing its weights
    inputs = source_inputs(directory)
    out_dir = engine_dir / "text" / f"{_safe_name(directory.name)}-{cache_key(inputs)}"
    return build_cached(out_dir, inputs, lambda scratch: convert(directory, scratch, progress))


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:64] or "model"
