"""Random-weight Qwen3 and Gemma 3 text models built with transformers, as the tests and
bench.models compare our decoder against them: saved as Hugging Face directories with a
byte-level tokenizer and the family's chat template, and a Qwen3 one written as
llama.cpp's converter writes a GGUF. Random weights: never a quality figure."""

from __future__ import annotations

import json
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
    with a sliding window on every layer."""
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
    }[family]
    tokenizer = _tokenizer(directory, template, eos)
    model = random_family_model(family, tokenizer)
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


def write_qwen3_gguf(model: Any, tokenizer: Any, path: Path) -> Path:
    """The model as llama.cpp's converter writes a Qwen3 file: rotate-half q/k rows kept,
    the q/k norms as attn_q_norm and attn_k_norm, the byte-level vocabulary with the
    qwen2 pre-tokenizer, the template and the end-of-turn token."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = set(tokenizer.all_special_tokens) | set(SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<bos>"))
    writer.add_chat_template(tokenizer.chat_template)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            ours = "token_embd.weight"
        elif name == "model.norm.weight":
            ours = "output_norm.weight"
        else:
            match = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
            assert match, name
            ours = f"blk.{match.group(1)}.{names[match.group(2)]}.weight"
        writer.add_tensor(ours, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
