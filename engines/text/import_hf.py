"""Import a Hugging Face model directory (Llama, Qwen2, Qwen3 or Gemma 3 text) as the
project's own text checkpoint.

A source directory holds `config.json`, the weights as `*.safetensors` (one file or
shards), `tokenizer.json`, and `tokenizer_config.json` with the chat template and the
special tokens. Supported: the Llama family (Llama 2/3.x with its RoPE scaling, SmolLM,
TinyLlama, Mistral with its sliding window), the Qwen2 family (q/k/v
biases, tied embeddings), Qwen3 (q/k norms) and Gemma 3 text models (sliding-window and
global layers, q/k norms, GeGLU, the scaled embedding, output norms) and Phi-3 and
Phi-4-mini (their fused q/k/v and gate/up weights split, the sliding window, LongRoPE up
to the original context, Phi-4-mini's partial rotary). A LLaVA-1.5 or LLaVA-NeXT directory
imports its language model (of the Llama, Mistral or Qwen2 family) as any of these, and
carries its image part beside it (engines/text/llava_source.py); a Gemma 3 4B, 12B or 27B
directory (gemma3) imports its Gemma 3 text model alone, its vision tower not served
(said in the log, and in generation.json's image_refusal, which a job's image is refused
with). Anything else is
refused with an error naming what is not supported. The output is the layout `edge.text.model.checkpoint` loads: float32
weights under our module names, our config, the tokenizer, and generation.json with the
chat template, the special tokens and the end-of-turn ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from edge.text.architecture import LlamaConfig
from edge.vlm.vlm_config import VisionLanguageConfig
from engines.cache import build_cached, cache_key, file_sha256
from engines.text.float_checkpoint import write_float_streamed
from engines.text.float_source import FloatSource
from engines.text.import_gguf import MAX_POSITIONS, SourceModelError, expected_tensors
from engines.text.llava_source import (
    PREPROCESSOR,
    PROCESSOR,
    image_config,
    is_llava,
    read_json,
    refuse_other_vlm,
    split_name,
    text_config,
    text_only,
    write_image_part,
)
from engines.text.phi3_parts import fused_parts, longrope, split_fused

logger = logging.getLogger(__name__)

# Not bumped for Qwen3, Gemma 3, Phi-3 or Mistral's window: a model an earlier version
# imported is imported the same (the new options default to off), so cached builds stay valid.
IMPORTER_VERSION = 1
FAMILIES = {
    "llama": "Llama",
    "mistral": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3",
    "phi3": "Phi-3",
}
GEMMA = "gemma3_text"
# Gemma's names for its norms where ours differ: its pre-feedforward norm is the norm
# before the MLP (Llama's post_attention_layernorm), and its post-attention and
# post-feedforward norms are our output norms.
GEMMA_NAMES = {
    "post_attention_layernorm": "attn_output_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_norm",
}
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")
HF_ROPE_TYPES = ("linear", "llama3", "longrope")  # what a Hugging Face config.json may name that we serve


def read_hf_config(directory: Path) -> LlamaConfig:
    """Our config for a source directory's (language) model; SourceModelError naming
    what is unsupported."""
    return read_source(directory)[0]


def read_source(directory: Path) -> tuple[LlamaConfig, VisionLanguageConfig | None]:
    """Our config for a source directory's language model, and for a LLaVA model's its
    image part (engines/text/llava_source.py); SourceModelError naming what is unsupported."""
    missing = [name for name in REQUIRED if not (directory / name).is_file()]
    if missing:
        raise SourceModelError(f"{directory} is not a Hugging Face model directory: no {', '.join(missing)}")
    if not weight_files(directory):
        raise SourceModelError(f"{directory} holds no *.safetensors weights")
    hf = read_json(directory / "config.json")
    refuse_other_vlm(hf)
    if text_only(hf) is not None:
        # Gemma 3 4B and up: its language model alone (engines/text/llava_source.py).
        return _text_model_config(text_config(hf, directory.name, weight_files(directory)), directory), None
    if not is_llava(hf):
        return _text_model_config(hf, directory), None
    config = _text_model_config(text_config(hf, directory.name, weight_files(directory)), directory)
    return config, image_config(directory, hf, config.hidden_size)


def _text_model_config(hf: dict[str, Any], directory: Path) -> LlamaConfig:
    """Our config for a text model's config.json (or a LLaVA model's text_config)."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        archs = ", ".join(hf.get("architectures") or []) or "none given"
        raise SourceModelError(
            f"model_type {kind!r} (architectures: {archs}) is not supported; supported: "
            "llama, mistral, qwen2, qwen3, gemma3_text, phi3, and the vision-language llava and llava_next"
        )
    problems: list[str] = []
    expected_act = "gelu_pytorch_tanh" if kind == GEMMA else "silu"
    act = hf.get("hidden_activation" if kind == GEMMA else "hidden_act") or expected_act
    if act != expected_act:
        problems.append(f"hidden_act {act!r} (only {expected_act})")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias")
    if kind in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        problems.append("use_sliding_window")
    if kind != "qwen2" and hf.get("attention_bias"):
        problems.append(f"attention_bias on a {FAMILIES[kind]} model")
    layer_types = tuple(hf.get("layer_types") or ())
    if kind != GEMMA and any(t != "full_attention" for t in layer_types):
        problems.append("sliding-window layers")
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        problems.append(f"layer_types {sorted(set(layer_types))}")
    options: dict[str, Any] = {}
    rope_parameters = hf.get("rope_parameters") or {}
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    if kind == GEMMA:
        options, rope_parameters = _gemma_options(hf, problems)
    elif kind == "phi3":
        # Phi-4-mini rotates the leading three quarters of each head.
        partial = float(rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        rotary = int(head_dim * partial)
        if partial != 1.0:
            if rotary % 2 or not 0 < rotary <= head_dim:
                problems.append(f"partial_rotary_factor {partial} ({rotary} of {head_dim} channels)")
            options["rotary_dim"] = rotary
        rope_parameters = {k: v for k, v in rope_parameters.items() if k != "partial_rotary_factor"}
    if kind in ("mistral", "phi3") and hf.get("sliding_window") is not None:
        # Mistral 7B v0.1's and Phi-3's window: every layer slides (as transformers masks them).
        window = int(hf["sliding_window"])
        options |= {"sliding_window": window, "layer_types": ("sliding",) * int(hf["num_hidden_layers"])}
    # transformers 5 writes RoPE as rope_parameters (theta included); older configs as
    # rope_theta and rope_scaling.
    rope = dict(rope_parameters or hf.get("rope_scaling") or {})
    theta = float(hf.get("rope_theta") or rope.pop("rope_theta", 10000.0))
    rope.pop("rope_theta", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = rope if rope_type != "default" else None
    if scaling is not None and rope_type not in HF_ROPE_TYPES:
        problems.append(f"rope_scaling {rope_type!r} (supported: {', '.join(HF_ROPE_TYPES)})")
    positions = int(hf.get("max_position_embeddings", 8192))
    if scaling is not None and rope_type == "longrope":
        rotated = int(options.get("rotary_dim") or head_dim)
        scaling, positions = longrope(scaling, hf, positions, rotated // 2, problems, directory.name)
    if problems:
        raise SourceModelError(f"{kind} model in {directory.name}: not supported: {'; '.join(problems)}")
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
        qk_norm=kind in ("qwen3", GEMMA),
        **options,
    )


def _gemma_options(hf: dict[str, Any], problems: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Gemma 3 text config's options as ours, and the global layers' RoPE parameters;
    what we do not serve goes into `problems`."""
    hidden = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if not types:  # older configs: every sliding_window_pattern-th layer global
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if hf.get("attn_logit_softcapping") is not None:
        problems.append(f"attn_logit_softcapping {hf['attn_logit_softcapping']}")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention")
    params = hf.get("rope_parameters") or {}
    global_rope = dict(params.get("full_attention") or {})
    local_rope = dict(params.get("sliding_attention") or {})
    if "rope_theta" not in global_rope:
        global_rope["rope_theta"] = float(hf.get("rope_theta", 1_000_000.0))
    if hf.get("rope_scaling") and not params:
        global_rope.update(hf["rope_scaling"])
    local_type = local_rope.get("rope_type", "default")
    if local_type != "default":
        problems.append(f"rope_scaling {local_type!r} on the sliding layers")
    local_theta = float(local_rope.get("rope_theta") or hf.get("rope_local_base_freq", 10_000.0))
    softcap = hf.get("final_logit_softcapping")
    options = {
        "sliding_window": int(hf.get("sliding_window") or 0),
        "layer_types": tuple("sliding" if t == "sliding_attention" else "full" for t in types),
        "rope_local_theta": local_theta,
        "mlp_activation": "gelu_tanh",
        "embedding_scale": hidden**0.5,
        "output_norms": True,
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcap": float(softcap) if softcap else 0.0,
    }
    return options, global_rope


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _our_name(name: str, gemma: bool) -> str:
    name = name.removeprefix("model.")
    if gemma:
        head, _, tail = name.rpartition(".weight")[0].rpartition(".")
        if tail in GEMMA_NAMES:
            return f"{head}.{GEMMA_NAMES[tail]}.weight"
    return name


def generation_settings(directory: Path) -> dict[str, Any]:
    """The chat template, special tokens and end-of-turn ids, from the tokenizer's
    config and the generation config where there is one."""
    tok_cfg = read_json(directory / "tokenizer_config.json")
    tokenizer = read_json(directory / "tokenizer.json")
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
    processor = directory / "chat_template.json"  # a multimodal processor's, in older saves
    if template is None and processor.is_file():
        template = read_json(processor).get("chat_template")
    if not isinstance(template, str):
        raise SourceModelError(f"{directory.name}: tokenizer_config.json has no chat_template")
    eos: set[int] = set()
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        value = read_json(gen_path).get("eos_token_id")
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


class HfSource(FloatSource):
    """A Hugging Face directory's weights under our names, read from its safetensors
    shards a few tensors at a time; what is not supported is refused before any is read."""

    def __init__(self, directory: Path) -> None:
        config, self.image = read_source(directory)
        super().__init__(config, directory.name)
        self.directory = directory
        hf = read_json(directory / "config.json")
        # A vision-language model whose language model is imported alone (Gemma 3's): why
        # its image part is not served, kept with the generation settings so that a job's
        # image is refused naming it.
        self.unserved_images = text_only(hf)
        if self.unserved_images is not None:
            logger.info("%s: %s", directory.name, self.unserved_images)
        self.gemma = hf.get("model_type") == GEMMA or (hf.get("text_config") or {}).get("model_type") == GEMMA
        self.generation = generation_settings(directory)
        if self.unserved_images is not None:
            self.generation["image_refusal"] = self.unserved_images
        expected = expected_tensors(config)
        # Where each of our tensors is: (shard, the source's name for it).
        self._where: dict[str, tuple[Path, str]] = {}
        for path in weight_files(directory):
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    text_name = self._text_name(name)
                    if text_name is None:
                        continue  # a LLaVA model's image part: written by write_side_files
                    ours = _our_name(text_name, self.gemma)
                    if ours == "lm_head.weight" and config.tie_embeddings:
                        continue  # tied: the embedding is the head
                    for part in fused_parts(ours, config):
                        if part not in expected:
                            kind = config_kind(config)
                            raise SourceModelError(f"{directory.name}: unexpected tensor {name} for a {kind}")
                        self._where[part] = (path, name)
        missing = sorted(expected - set(self._where))
        if missing:
            raise SourceModelError(f"{directory.name}: missing tensors {', '.join(missing[:5])}")

    def _text_name(self, name: str) -> str | None:
        """A tensor's name as a text model's directory has it; None for a LLaVA model's
        (or Gemma 3's) tensors outside its language model."""
        if self.image is None and self.unserved_images is None:
            return name
        kind, text_name = split_name(name)
        return text_name if kind == "text" else None

    def names(self) -> list[str]:
        return list(self._where)

    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        wanted: dict[Path, dict[str, set[str]]] = {}
        for part in names:
            path, name = self._where[part]
            wanted.setdefault(path, {}).setdefault(name, set()).add(part)
        out: dict[str, torch.Tensor] = {}
        for path, sources in wanted.items():
            with safe_open(str(path), framework="pt") as fh:
                for name, parts in sources.items():
                    ours = _our_name(self._text_name(name) or name, self.gemma)
                    tensor = fh.get_tensor(name).to(torch.float32)
                    if self.gemma and ours.endswith("norm.weight"):
                        # Gemma's RMSNorm multiplies by (1 + weight): stored as that sum, as
                        # llama.cpp's converter stores it, so one RMSNorm (and AWQ's folding
                        # of scales into it) serves every family.
                        tensor = tensor + 1.0
                    for part, value in split_fused(ours, tensor, self.config):
                        if part in parts:
                            out[part] = value.contiguous()
                    del tensor  # before the next one is read
        return out

    def write_side_files(self, out: Path) -> None:
        (out / "config.json").write_text(self.config.to_json() + "\n", encoding="utf-8")
        (out / "tokenizer.json").write_bytes((self.directory / "tokenizer.json").read_bytes())
        (out / "generation.json").write_text(json.dumps(self.generation, indent=2) + "\n", encoding="utf-8")
        if self.image is not None:
            write_image_part(self.directory, weight_files(self.directory), self.image, out)


def convert(directory: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    source = HfSource(directory)
    written = write_float_streamed(source, out_dir, progress)
    return {
        **written,
        "family": config_kind(source.config),
        **({"image_part": source.image.family} if source.image is not None else {}),
        "config": json.loads(source.config.to_json()),
        "tensors": len(source.names()),
    }


def config_kind(config: LlamaConfig) -> str:
    if config.output_norms:
        return "Gemma 3 model"
    if config.qk_norm:
        return "Qwen3 model"
    return "Qwen2 model" if config.attention_bias else "Llama model"


def source_inputs(directory: Path) -> dict[str, Any]:
    """What an import depends on: every file it reads, by content."""
    files = [directory / n for n in REQUIRED] + weight_files(directory)
    for optional in ("generation_config.json", "chat_template.jinja", "chat_template.json", PREPROCESSOR, PROCESSOR):
        if (directory / optional).is_file():
            files.append(directory / optional)
    return {"files": {f.name: file_sha256(f) for f in files}, "importer": IMPORTER_VERSION}


def import_target(directory: Path, engine_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Where the import of `directory` is cached, and its inputs (the later steps' cache
    keys start from them, whether or not the float import itself is written)."""
    directory = directory.resolve()
    read_hf_config(directory)  # refuse an unsupported model before hashing its weights
    inputs = source_inputs(directory)
    return engine_dir / "text" / f"{_safe_name(directory.name)}-{cache_key(inputs)}", inputs


def import_hf(directory: Path, engine_dir: Path, progress: bool = True) -> Path:
    """Convert once; later calls with the same files return the cached directory."""
    directory = directory.resolve()
    out_dir, inputs = import_target(directory, engine_dir)
    return build_cached(out_dir, inputs, lambda scratch: convert(directory, scratch, progress))


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:64] or "model"
