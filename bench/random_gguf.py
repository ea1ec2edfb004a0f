"""Random-weight GGUF files of a Llama shape, as the benchmarks write them.

- `write_q4_0_gguf`: every matrix Q4_0 (the token table and output projection too, as
  llama.cpp's Q4_0 files of Llama 3 8B have them), norms in F32, written tensor by
  tensor. The llama.cpp peer of `bench/text.py` runs llama-bench on it; `bench/profile_8b.py`
  builds it with `edgectl build` (its Q4_0 weights kept as stored) and profiles it.
- `add_llama3_vocabulary`: a byte-level BPE vocabulary of the model's size with Llama 3's
  special tokens and a chat template, so text tokenizes in tokens of two or three bytes as
  a real model's would (bench/build_memory.py's F16 file carries it too).

Speed and memory figures only: the weights are random, never a quality figure.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from edge.text.architecture import LlamaConfig

Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # 32 weights: an fp16 scale and 16 bytes of 4-bit codes
# Llama 3's: 256 special tokens after the byte-level vocabulary, these named.
SPECIALS = 256
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
VOCABULARIES = ("placeholder", "llama3")


def vocabulary(size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of `size` tokens: the 256 byte symbols, every pair of
    them, then triples (a pair and a byte), each new token one merge; then the special
    tokens. Tokens by id, and the merges by rank."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    regular = size - SPECIALS
    tokens: list[str] = list(alphabet)
    merges: list[tuple[str, str]] = []
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in itertools.chain(pairs, triples):
        if len(tokens) >= regular:
            break
        tokens.append(left + right)
        merges.append((left, right))
    named = {0: BOS, 1: EOS, 9: EOT}
    tokens += [named.get(i, f"<|reserved_special_token_{i}|>") for i in range(SPECIALS)]
    return tokens, merges


def add_llama3_vocabulary(writer: Any, size: int) -> None:
    """`vocabulary(size)` as a Llama 3 file holds it: gpt2 BPE, the llama-bpe
    pre-tokenizer, its begin, end and end-of-turn tokens and its chat template."""
    tokens, merges = vocabulary(size)
    regular = len(tokens) - SPECIALS
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * regular + [3] * SPECIALS)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_bos_token_id(regular)
    writer.add_eos_token_id(regular + 1)
    writer.add_eot_token_id(regular + 9)
    writer.add_chat_template(TEMPLATE)


def add_placeholder_vocabulary(writer: Any, size: int) -> None:
    """A SentencePiece vocabulary of placeholder tokens (`t3`, `t4`...): enough for
    llama-bench, which feeds token ids and never tokenizes text."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list([b"<unk>", b"<s>", b"</s>", *[f"t{i}".encode() for i in range(3, size)]])
    writer.add_token_scores([0.0] * size)
    writer.add_token_types([2, 3, 3, *[1] * (size - 3)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def add_llama_shape(writer: Any, config: LlamaConfig) -> None:
    """A Llama config's hyperparameters as GGUF metadata."""
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)


def llama_matrices(config: LlamaConfig) -> list[tuple[str, int, int]]:
    """Every matrix of a Llama file by its GGUF name, with its rows and columns, in
    llama.cpp's order (the norms, 1-D, are not listed)."""
    h, ffn, vocab, hd = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    out = [("token_embd.weight", vocab, h), ("output.weight", vocab, h)]
    for i in range(config.num_layers):
        p = f"blk.{i}"
        out += [
            (f"{p}.attn_q.weight", config.num_heads * hd, h),
            (f"{p}.attn_k.weight", config.num_kv_heads * hd, h),
            (f"{p}.attn_v.weight", config.num_kv_heads * hd, h),
            (f"{p}.attn_output.weight", h, config.num_heads * hd),
            (f"{p}.ffn_gate.weight", ffn, h),
            (f"{p}.ffn_up.weight", ffn, h),
            (f"{p}.ffn_down.weight", h, ffn),
        ]
    return out


def norms(config: LlamaConfig) -> list[str]:
    """The 1-D tensors (RMSNorm weights) of a Llama file, by their GGUF names."""
    return ["output_norm.weight"] + [
        f"blk.{i}.{part}.weight" for i in range(config.num_layers) for part in ("attn_norm", "ffn_norm")
    ]


def q4_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A Q4_0 matrix's bytes, [rows, cols / 32 * 18]: random codes, every scale 0.01."""
    blocks = rows * cols // Q4_0_BLOCK
    raw = rng.integers(0, 256, size=(blocks, Q4_0_BYTES), dtype=np.uint8)
    raw[:, :2] = np.array([0.01], np.float16).view(np.uint8)  # a scale that keeps activations finite
    return raw.reshape(rows, cols // Q4_0_BLOCK * Q4_0_BYTES)


def write_q4_0_gguf(path: Path, config: LlamaConfig, seed: int = 0, vocabulary: str = "placeholder") -> int:
    """A random-weight Q4_0 GGUF of a Llama config's shape (hidden, layers, heads, FFN,
    vocabulary), streamed a tensor at a time (an 8B file's 4.7 GB never held whole), into
    a temporary name renamed at the end, so a file at `path` is always whole. `vocabulary`:
    "placeholder" (add_placeholder_vocabulary) or "llama3" (add_llama3_vocabulary).
    Returns the file's bytes."""
    import gguf

    if vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary {vocabulary!r}: one of {', '.join(VOCABULARIES)}")
    rng = np.random.default_rng(seed)
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(partial), "llama")
    add_llama_shape(writer, config)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    if vocabulary == "llama3":
        add_llama3_vocabulary(writer, config.vocab_size)
    else:
        add_placeholder_vocabulary(writer, config.vocab_size)
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    matrices = llama_matrices(config)
    f32 = np.dtype(np.float32)
    for name in norms(config):
        writer.add_tensor_info(name, (config.hidden_size,), f32, config.hidden_size * f32.itemsize)
    for name, rows, cols in matrices:
        # The byte shape: gguf-py derives the weights' [rows, cols] from it.
        writer.add_tensor_info(name, (rows, cols // Q4_0_BLOCK * Q4_0_BYTES), np.dtype(np.uint8),
                               rows * cols // Q4_0_BLOCK * Q4_0_BYTES, raw_dtype=q4_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    ones = np.ones(config.hidden_size, np.float32)
    for _ in norms(config):
        writer.write_tensor_data(ones)
    for _name, rows, cols in matrices:
        writer.write_tensor_data(q4_0_blocks(rows, cols, rng))
    writer.close()
    partial.replace(path)
    return path.stat().st_size


def q4_0_bytes(config: LlamaConfig, embedding: bool = True) -> int:
    """Bytes of the GGUF's Q4_0 matrices (write_q4_0_gguf's): each layer's, the output's
    and, with `embedding`, the token table's (llama.cpp keeps that one in host memory)."""
    h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    layer = h * (config.num_heads * hd) * 2 + h * (config.num_kv_heads * hd) * 2 + 3 * h * ffn
    weights = config.num_layers * layer + config.vocab_size * h * (2 if embedding else 1)
    return int(weights) // Q4_0_BLOCK * Q4_0_BYTES
