"""Random-weight Qwen3, Gemma 3, Mistral and Phi-3 text models built with transformers, as
the tests and bench.models compare our decoder against them: saved as Hugging Face
directories with a byte-level tokenizer and the family's chat template, and the Qwen3,
Mistral and Phi-3 ones written as llama.cpp's converter writes their GGUF files. Random
weights: never a quality figure."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIALS = [
    "<bos>",
    "<eos>",
    "<|im_start|>",
    "<|im_end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<think>",
    "</think>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CORPUS = [
    "The patient reports a mild fever and a cough since Monday.",
    "Measure the resting heart rate before and after the walk.",
    "Insulin lowers blood glucose; check it before each meal.",
    "Serial SN-2041 passed inspection on line three at 14:05.",
] * 20
# Qwen3's template in its essentials: ChatML, and the thinking switch that writes an
# empty reasoning block when thinking is off.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Gemma 3's template as its tokenizer_config.json carries it.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    '{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}'
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"
)
# Mistral's [INST] turns, the system prompt before the first user message.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{% set ns.system = '' %}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Phi-3's turns.
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Answer briefly. Température: 38,5 °C."},
    {"role": "user", "content": "  Is 38.5 a fever?  "},
]
WINDOW = 24  # the Gemma model's sliding window: far shorter than the positions compared
LONGROPE_ORIGINAL = 256  # the Phi model's original context: half its 512 positions, past the 200 compared


def bpe_tokenizer(corpus: list[str], specials: list[str], bos: str, eos: str) -> Any:
    """A real byte-level BPE tokenizer of 360 tokens trained on `corpus` (the test
    models' vocabulary: small, so their token tables are too), as transformers' fast one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast_tokenizer: Any = PreTrainedTokenizerFast  # untyped in transformers
    return fast_tokenizer(tokenizer_object=tok, bos_token=bos, eos_token=eos)


def _tokenizer(directory: Path, template: str, eos: str) -> Any:
    fast = bpe_tokenizer(CORPUS, SPECIALS, "<bos>", eos)
    fast.chat_template = template
    fast.save_pretrained(directory)
    return fast


def randomise(model: Any) -> None:
    """Weights wide enough that greedy choices are clear (the default init makes every
    logit nearly equal), biases included (transformers starts them at zero)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))


def random_family_model(family: str, tokenizer: Any) -> Any:
    """A small random transformers model: Qwen3 (q/k norms, a head width other than
    hidden / heads, tied embeddings), or Gemma 3 text with every option it has set to a
    value that shows when it is ignored (a sliding window shorter than the text, a local
    RoPE base, a query_pre_attn_scalar other than the head width, soft-capped logits), or
    Mistral or Phi-4-mini (fused q/k/v and gate/up weights, LongRoPE, a partial rotary)
    with a sliding window on every layer, or ("phi3-plain") a Phi-3 with neither LongRoPE
    nor a partial rotary nor a window."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    shape: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<bos>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        "pad_token_id": None,
    }
    if family == "qwen3":
        config: Any = Qwen3Config(
            **shape, num_hidden_layers=2, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True
        )
        model: Any = Qwen3ForCausalLM(config)
    elif family == "mistral":  # every layer slides
        mistral: Any = MistralConfig
        config = mistral(**shape, num_hidden_layers=2, num_key_value_heads=2, sliding_window=WINDOW)
        model = MistralForCausalLM(config)
    elif family == "phi3":
        # Phi-4-mini's: fused q/k/v and gate/up weights, LongRoPE (its short factors and its
        # attention factor at a context twice the original) and a partial rotary (three
        # quarters of a head); every layer slides, as Phi-3-mini's do.
        phi3: Any = Phi3Config
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
            "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 8.0],
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
        }
        config = phi3(
            **shape,
            num_hidden_layers=2,
            num_key_value_heads=2,
            sliding_window=WINDOW,
            original_max_position_embeddings=LONGROPE_ORIGINAL,
            rope_parameters=rope,
        )
        model = Phi3ForCausalLM(config)
    elif family == "phi3-plain":
        # Phi-3-mini's shape otherwise: every channel of a head turned, no RoPE scaling,
        # and no window (which llama.cpp writes as a window of 0).
        plain: Any = Phi3Config
        config = plain(**shape, num_hidden_layers=2, num_key_value_heads=2, sliding_window=None)
        model = Phi3ForCausalLM(config)
    else:
        gemma: Any = Gemma3TextConfig  # its typed signature does not list every field
        config = gemma(
            **shape,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            query_pre_attn_scalar=20,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        )
        model = Gemma3ForCausalLM(config)
    randomise(model)
    model.eval()
    return model


def make_model(directory: Path, family: str) -> tuple[Any, Any]:
    """A small random model of `family` saved as a Hugging Face directory."""
    directory.mkdir(parents=True)
    template, eos = {
        "qwen3": (QWEN3_TEMPLATE, "<|im_end|>"),
        "gemma3": (GEMMA3_TEMPLATE, "<end_of_turn>"),
        "mistral": (MISTRAL_TEMPLATE, "<eos>"),
        "phi3": (PHI3_TEMPLATE, "<|end|>"),
        "phi3-plain": (PHI3_TEMPLATE, "<|end|>"),
    }[family]
    tokenizer = _tokenizer(directory, template, eos)
    model = random_family_model(family, tokenizer)
    model.save_pretrained(directory)
    return model, tokenizer


def make_gemma3_vlm(directory: Path) -> tuple[Any, Any]:
    """A small random Gemma3ForConditionalGeneration (what Gemma 3 4B, 12B and 27B are: a
    SigLIP tower of one layer on 28-pixel images here, and the Gemma 3 text model of
    random_family_model's options) saved as a Hugging Face directory as transformers
    saves it, with Gemma 3's tokenizer and template."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    directory.mkdir(parents=True)
    tokenizer = _tokenizer(directory, GEMMA3_TEMPLATE, "<end_of_turn>")
    text = random_family_model("gemma3", tokenizer).config.to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    gemma: Any = Gemma3Config  # its typed signature does not list every field
    config = gemma(text_config=text, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=True)
    model: Any = Gemma3ForConditionalGeneration(config)
    randomise(model)
    model.eval()
    model.save_pretrained(directory)
    return model, tokenizer


def served_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of `ids` [1, T] as serving computes them: a fresh prefill, a chunk
    after it, then one token at a time through the graph-capturable decode step."""
    cache = model.new_cache(1, 256)
    first, second = 90, 150
    rows = [
        model(ids[:, :first], cache, 0, last_only=False)[0],
        model(ids[:, first:second], cache, first, last_only=False)[0],
    ]
    for p in range(second, ids.shape[1]):
        cache.make_room_for_step([p])  # as the batcher does before each step
        rows.append(model.decode_step(ids[:, p : p + 1], cache, torch.tensor([p], device=ids.device), 256))
    return torch.cat(rows)


# Our names' parts as llama.cpp's converter names them in a block.
GGUF_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused q/k/v
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused gate and up: llama.cpp's SwiGLU takes the first half as the gate
    "mlp.down_proj": "ffn_down",
}
GGUF_ARCH = {"qwen3": "qwen3", "mistral": "llama", "phi3": "phi3"}


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves a Llama file's rotary halves per head."""
    return np.asarray(
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_family_gguf(model: Any, tokenizer: Any, path: Path, quant: str | None = None) -> Path:
    """The model as llama.cpp's converter writes its family's file (float32 tensors, or
    with `quant`, "Q4_0" or "Q8_0", its block linears quantized as llama-quantize does): a
    Qwen3 file (`qwen3`: rotate-half q/k rows kept, the q/k norms as attn_q_norm and
    attn_k_norm), a Mistral one (`llama`: q/k rows interleaved for llama.cpp's rotary, the
    window as llama.attention.sliding_window) or a Phi-3 one (`phi3`: the fused attn_qkv
    and ffn_up, the rotated channels as rope.dimension_count, the window or 0 for none,
    and LongRoPE's factors as the rope_factors_long and rope_factors_short tensors with
    the original context and the attention factor the converter computes). The
    byte-level vocabulary (qwen2's pre-tokenizer for Qwen3, GPT-2's for the others), the
    template and the end-of-turn token as the model's tokenizer has them."""
    import gguf

    cfg = model.config
    family = str(cfg.model_type)
    arch = GGUF_ARCH[family]
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    rope = dict(cfg.rope_parameters or {})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if family == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family == "mistral" and cfg.sliding_window is not None:
        writer.add_sliding_window(cfg.sliding_window)
    if family == "phi3":
        partial = float(rope.get("partial_rotary_factor", 1.0))
        original = int(rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings)
        writer.add_rope_dimension_count(int(partial * hidden) // heads)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(cfg.sliding_window or 0)  # 0: llama.cpp's mark of a Phi model without one
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            )
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = set(tokenizer.all_special_tokens) | set(SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if family == "qwen3" else "gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<bos>"))
    writer.add_chat_template(tokenizer.chat_template)
    for name, tensor in model.state_dict().items():
        data = np.ascontiguousarray(tensor.float().numpy())
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            ours = "output.weight"
        elif name == "model.embed_tokens.weight":
            ours = "token_embd.weight"
        elif name == "model.norm.weight":
            ours = "output_norm.weight"
        else:
            match = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
            assert match, name
            part = match.group(2)
            if family == "mistral" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                count = heads if part == "self_attn.q_proj" else cfg.num_key_value_heads
                data = _llama_cpp_permute(data, count)
            ours = f"blk.{match.group(1)}.{GGUF_PARTS[part]}.weight"
            if quant and data.ndim == 2:
                qtype = gguf.GGMLQuantizationType[quant]
                q = gguf.quants.quantize(data, qtype)
                writer.add_tensor(ours, q, raw_shape=q.shape, raw_dtype=qtype)
                continue
        writer.add_tensor(ours, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
