"""A user's own GGUF file, Llama or Qwen2 family, against transformers: random-weight
models of both families are built here with transformers, with tokenizers that split
text as those families' real ones do, and written as llama.cpp's converter writes them
(a Llama file's q/k rows interleaved, Llama 3's RoPE scaling as a rope_freqs tensor,
Qwen2's biases, the vocabulary, merges and the pre-tokenizer's name). Transformers' own
GGUF reader checks that layout; engines/text/import_gguf.py imports the file, and its logits,
greedy tokens, tokenizer and chat prompt must equal transformers' on the source model.
A SentencePiece vocabulary (Llama 2, TinyLlama) is held to transformers' reading of it."""

from __future__ import annotations

import math
import re
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge.text.model.checkpoint import load_checkpoint
from edge.text.runtime.generate import SamplingParams, generate
from engines.text.gguf_header import GgufHeader
from engines.text.import_gguf import SourceModelError, build_tokenizer_json, import_gguf, smollm2_gguf_path
from engines.text.random_llama import LLAMA3_8B
from tests.test_import_hf import LLAMA_TEMPLATE, MESSAGES, QWEN_TEMPLATE, random_family_model

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|header|>", "<|eot|>"]
CORPUS = [
    "The patient's temperature was 38.5 degrees; they'll re-check it at 14:05.",
    "Température élevée: 39,2 °C. Café, crème brûlée and naïve résumé.",
    "Serial SN-20417 passed inspection on line 3 with 1234567 parts counted.",
    "Don't stop.\n\nTwo  spaces,   three spaces, and\ttabs\r\nend of line.",
] * 25
# Text the tokenizers must split alike: contractions in any case, long digit runs,
# decomposed accents (NFC matters to Qwen2), blank runs and line ends, a special token.
PROBES = [
    "They'RE here: 1234567 units, 38.5 °C.",
    unicodedata.normalize("NFD", "Café crème brûlée, naïve résumé."),
    "Line one\n\n  indented   line\r\n\tand a tab",
    "<|im_start|>user\nIs 39,2 a fever?<|im_end|>",
    "   leading blanks and trailing ones   ",
]


def _split_regex(pre: str) -> str:
    # The families' own patterns, from transformers (independent of the importer's copy).
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    return str(GGUF_PRE_TOKENIZER_SPLITS[pre])


def _tokenizer(directory: Path, family: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pre = "qwen2" if family == "qwen2" else "llama-bpe"
    tok = Tokenizer(models.BPE(ignore_merges=family == "llama"))
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_split_regex(pre)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    template, eos = (QWEN_TEMPLATE, "<|im_end|>") if family == "qwen2" else (LLAMA_TEMPLATE, "<|eot|>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos)
    fast.chat_template = template
    fast.save_pretrained(directory)
    return fast


def make_model(directory: Path, family: str) -> tuple[Any, Any]:
    directory.mkdir(parents=True)
    tokenizer = _tokenizer(directory, family)
    return random_family_model(family, tokenizer), tokenizer


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves (its NORM RoPE)."""
    return np.asarray(
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _llama3_rope_factors(config: Any) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp's converter stores it: a divisor per frequency."""
    scaling = config.rope_scaling
    dim = config.hidden_size // config.num_attention_heads
    theta = float(scaling.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    model: Any,
    tokenizer: Any,
    path: Path,
    family: str,
    quant: str | None = None,
    keep_float: tuple[str, ...] = (),
) -> Path:
    """The model as llama.cpp's convert_hf_to_gguf.py writes one (float32 tensors), or with
    `quant` ("Q4_0", "Q4_1", "Q8_0", or "mixed": Q4_1 in even blocks, Q4_0 in odd ones, or
    "mixed-q8": Q8_0 in even blocks) its block linears quantized as llama-quantize does,
    but those named in `keep_float`."""
    import json

    import gguf

    cfg = model.config
    arch = "qwen2" if family == "qwen2" else "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = cfg.rope_scaling.get("rope_theta") if cfg.rope_scaling else None
    writer.add_rope_freq_base(float(theta or getattr(cfg, "rope_theta", None) or 10000.0))
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    doc = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = set(SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if family == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab[tokenizer.eos_token])
    writer.add_chat_template(tokenizer.chat_template)
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if family == "llama":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            writer.add_tensor("output.weight", data)
            continue
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", data)
            continue
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", data)
            continue
        match = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        assert match, name
        layer, part, kind = match.groups()
        if family == "llama" and part == "self_attn.q_proj":
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif family == "llama" and part == "self_attn.k_proj":
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        tensor_name = f"blk.{layer}.{parts[part]}.{kind}"
        if quant and kind == "weight" and data.ndim == 2 and tensor_name not in keep_float:
            even = {"mixed": "Q4_1", "mixed-q8": "Q8_0"}.get(quant)
            kind_here = (even if int(layer) % 2 == 0 else "Q4_0") if even else quant
            qtype = gguf.GGMLQuantizationType[kind_here]
            q = gguf.quants.quantize(data, qtype)
            writer.add_tensor(tensor_name, q, raw_shape=q.shape, raw_dtype=qtype)
            continue
        writer.add_tensor(tensor_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    name = str(request.param)
    root = tmp_path_factory.mktemp(f"gguf-{name}")
    model, tokenizer = make_model(root / "source", name)
    gguf_path = write_gguf(model, tokenizer, root / "source" / f"tiny-{name}.gguf", name)
    checkpoint = import_gguf(gguf_path, root / "engines", f"tiny-{name}", progress=False)
    return {"name": name, "hf": model, "tokenizer": tokenizer, "gguf": gguf_path, "ckpt": checkpoint}


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # type: ignore[no-any-return]


def test_the_written_file_is_what_transformers_reads_as_the_source_model(family: dict[str, Any]) -> None:
    # Transformers' own GGUF reader undoes llama.cpp's layout: reading the test's file
    # back to the source model's logits shows the file is laid out as llama.cpp's are.
    from transformers import AutoModelForCausalLM

    path: Path = family["gguf"]
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    source = family["hf"]
    if family["name"] == "llama":
        # That reader takes no RoPE scaling from rope_freqs (the importer's own test
        # below holds it to the scaled model): compare with the same weights unscaled.
        assert theirs.config.rope_parameters == {"rope_theta": 50000.0, "rope_type": "default"}
        unscaled = {"rope_parameters": theirs.config.rope_parameters, "rope_scaling": None}
        config = type(source.config).from_dict({**source.config.to_dict(), **unscaled})
        assert config.rope_parameters["rope_type"] == "default"
        source = type(source)(config).eval()
        source.load_state_dict(family["hf"].state_dict())
    ids = torch.randint(0, source.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(theirs, ids), _logits(source, ids), atol=1e-4, rtol=1e-4)


def test_float_logits_equal_transformers(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    config = ours.model.config
    assert config.attention_bias is (family["name"] == "qwen2")
    assert config.tie_embeddings is (family["name"] == "qwen2")
    assert (config.rope_scaling or {}).get("rope_type") == (None if family["name"] == "qwen2" else "freq_factors")
    # Past the scaled model's original 64 positions, where Llama 3's RoPE scaling acts.
    ids = torch.randint(0, config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(1))
    theirs = _logits(family["hf"], ids)
    got = ours.model(ids, ours.model.new_cache(2, 256), 0, last_only=False)
    scale = theirs.abs().max().item()
    assert scale > 1.0  # the weights are wide enough for the comparison to mean something
    assert (got - theirs).abs().max().item() <= 1e-4 * scale


def test_the_tokenizer_splits_text_as_the_source_tokenizer_does(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32).tokenizer
    theirs = family["tokenizer"]
    for text in PROBES:
        want = theirs(text, add_special_tokens=False)["input_ids"]
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == want, text
        assert ours.decode(got, skip_special_tokens=False) == theirs.decode(want)


def test_greedy_tokens_and_the_prompt_equal_transformers(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    tokenizer = family["tokenizer"]
    assert ours.chat is not None
    rendered = ours.chat.render(MESSAGES)
    assert rendered == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ours.tokenizer.encode(rendered, add_special_tokens=False).ids == prompt
    got = generate(
        ours.model, ours.tokenizer, prompt, SamplingParams(max_new_tokens=24), frozenset(), ours.model.new_cache(1, 128)
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = family["hf"].generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=None
        )
    theirs = out[0, len(prompt) :].tolist()
    assert got.token_ids == theirs and len(set(theirs)) > 3
    assert tokenizer.convert_tokens_to_ids(tokenizer.eos_token) in ours.eos_ids


def test_the_text_pipeline_builds_a_gguf_source_with_a_peft_adapter(family: dict[str, Any], tmp_path: Path) -> None:
    # What a profile naming the file and an adapter builds: import, merge, AWQ INT4,
    # found by the profile's words. The merge equals peft's; the INT4 model stays close.
    import json

    from edge.builds import source_id
    from engines.text.text_build import build_text_engine, layer_recipe, quantize_checkpoint
    from tests.test_peft_adapter import make_adapter

    peft_model = make_adapter(family["hf"], tmp_path / "adapter")
    source, adapter = str(family["gguf"]), str(tmp_path / "adapter")
    built = build_text_engine(tmp_path / "engines", adapter, "awq-int4", progress=False, source=source)
    manifest = json.loads((built / "manifest.json").read_text())
    assert {"task": "qa", "source": source_id(source), "adapter": source_id(adapter), "quantization": "awq-int4"} in (
        manifest["serves"]
    )
    # The INT4 build merged a layer at a time and wrote no float merge: the merge that
    # serves as the reference is built here, by the same cached step a float build runs.
    from engines.text.peft_adapter import merge_checkpoint

    imported = import_gguf(Path(source), tmp_path / "engines", Path(source).stem, progress=False)
    merged_dir = merge_checkpoint(imported, Path(adapter))
    merged = load_checkpoint(merged_dir, dtype=torch.float32)
    ids = torch.tensor([merged.tokenizer.encode(" ".join(CORPUS[:3]), add_special_tokens=False).ids[:60]])
    with torch.no_grad():
        expected = peft_model.merge_and_unload()(ids).logits
    got = merged.model(ids, merged.model.new_cache(1, 64), 0, last_only=False)
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    # The served checkpoint is the serving recipe's AWQ INT4 of that merged model, under the
    # same cache key (its accuracy against float is tested in tests/test_import_hf.py, its
    # weights against the whole-model quantizer's in tests/test_build_memory.py).
    assert quantize_checkpoint(merged_dir, layer_recipe("awq", []), progress=False) == built
    int4 = load_checkpoint(built, dtype=torch.float32)
    assert int4.int4_kernel is not None
    q = int4.model(ids, int4.model.new_cache(1, 64), 0, last_only=False)
    assert (q.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.2  # chance: 1 in 420


def test_a_build_quantizes_at_the_group_its_model_size_gets(
    family: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small models are built at group 32, 7B-class ones at 128 (text_build.serving_group):
    here the line between them is moved below this small model, which then gets 128."""
    import json

    from engines.text import text_build

    def groups(built: Path) -> tuple[int, set[int]]:
        """The recipe's group size, and the ones its layers got (the largest that divides
        a width where the recipe's does not: 64 and 32 for this model's 64 and 96)."""
        linears = json.loads((built / "quant.json").read_text())["linears"]
        recipe = json.loads((built / "manifest.json").read_text())["recipe"]
        return int(recipe["group_size"]), {int(info["group_size"]) for info in linears.values()}

    source = str(family["gguf"])
    small = text_build.build_text_engine(tmp_path / "engines", "none", "rtn-int4", progress=False, source=source)
    assert groups(small) == (32, {32})
    monkeypatch.setattr(text_build, "LARGE_MODEL_PARAMETERS", 1)
    large = text_build.build_text_engine(tmp_path / "engines", "none", "rtn-int4", progress=False, source=source)
    assert large != small and groups(large) == (128, {64, 32})
    assert text_build.serving_group(LLAMA3_8B.parameter_count()) == 128


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "mixed", "Q8_0", "mixed-q8"])
def test_a_q4_file_is_served_as_stored(
    family: dict[str, Any], quant: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A GGUF whose block linears are all Q4_0, all Q4_1 (a float minimum a block), both,
    all Q8_0 (kept as two INT4 halves) or Q8_0 and Q4_0, built with no adapter at the
    default INT4 quantization, serves the file's weights bit for bit: each linear of the
    build equals gguf's own dequantization of its tensor (q and k in rotate-half order),
    with no AWQ; and it answers as the float import
    of the same file does with the same output projection, op by op and in the CPU's C
    decode step. With one linear left in float the file is rounded again by AWQ, and the
    build says why."""
    import json
    import logging

    from safetensors.torch import load_file

    from edge.text.ops.int4 import QuantizedWeight, dequantize
    from engines.text import gguf_int4
    from engines.text.import_gguf import GgufSource
    from engines.text.text_build import build_text_engine

    name, hf, tokenizer = family["name"], family["hf"], family["tokenizer"]
    source = write_gguf(hf, tokenizer, tmp_path / f"tiny-{name}-{quant}.gguf", name, quant=quant)
    # What the build reads: each stored linear once, as stored, and never in float too.
    float_reads: list[str] = []
    kept_reads: list[str] = []
    read_float, read_kept = GgufSource.read, gguf_int4.KeptWeights.__getitem__

    def recording_read(self: GgufSource, names: Any) -> dict[str, torch.Tensor]:
        float_reads.extend(names)
        return read_float(self, names)

    def recording_get(self: gguf_int4.KeptWeights, key: str) -> QuantizedWeight:
        kept_reads.append(key)
        return read_kept(self, key)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GgufSource, "read", recording_read)
        patch.setattr(gguf_int4.KeptWeights, "__getitem__", recording_get)
        with caplog.at_level(logging.INFO, logger="engines.text.gguf_int4"):
            built = build_text_engine(tmp_path / "engines", "none", "awq-int4", progress=False, source=str(source))
    assert "served as stored" in caplog.text
    assert sorted(kept_reads) == sorted(set(kept_reads)) and len(kept_reads) == 7 * hf.config.num_hidden_layers
    assert not {f"{n}.weight" for n in kept_reads} & set(float_reads), "a kept linear read in float too"
    manifest = json.loads((built / "manifest.json").read_text())
    methods = {"Q4_0": "q4_0", "Q4_1": "q4_1", "mixed": "q4_0+q4_1", "Q8_0": "q8_0", "mixed-q8": "q4_0+q8_0"}
    assert manifest["recipe"]["method"] == "gguf-" + methods[quant]
    float_dir = import_gguf(source, tmp_path / "engines", source.stem, progress=False)  # the build's own import
    floats = load_file(str(float_dir / "model.safetensors"))
    packed = load_file(str(built / "model.safetensors"))
    linears = json.loads((built / "quant.json").read_text())["linears"]
    blocks = [n for n in linears if n.startswith("layers.")]
    assert len(blocks) == 7 * hf.config.num_hidden_layers
    for layer in blocks:
        minimums = packed.get(f"{layer}.minimums")
        assert (minimums is not None) == (quant == "Q4_1" or (quant == "mixed" and int(layer.split(".")[1]) % 2 == 0))
        parts = (packed[f"{layer}.qweight"], packed[f"{layer}.scales"], packed[f"{layer}.zeros"])
        halves = bool(linears[layer].get("halves"))
        assert halves == (quant == "Q8_0" or (quant == "mixed-q8" and int(layer.split(".")[1]) % 2 == 0))
        weight = QuantizedWeight(*parts, 32, minimums, halves)
        assert torch.equal(dequantize(weight), floats[f"{layer}.weight"]), layer
    ids = torch.tensor([tokenizer.encode(" ".join(CORPUS[:3]))[:40]])
    int4 = load_checkpoint(built, dtype=torch.float32)
    exact = load_checkpoint(float_dir, dtype=torch.float32)
    # The output projection is rounded to INT4 by every build (the file's is float here):
    # the reference takes the same rounded weights, untied from its token table.
    head = QuantizedWeight(packed["lm_head.qweight"], packed["lm_head.scales"], packed["lm_head.zeros"], 32)
    exact.model.lm_head.weight = torch.nn.Parameter(dequantize(head))
    got = int4.model(ids, int4.model.new_cache(1, 64), 0, last_only=False)
    want = exact.model(ids, exact.model.new_cache(1, 64), 0, last_only=False)
    # The linears' weights exact in float32 (cpu-f32); the norms and the token table are
    # stored in float16 by every INT4 build, the only other difference.
    assert int4.int4_kernel == "cpu-f32"
    assert (got - want).abs().max().item() <= 3e-3 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95
    caplog.clear()
    if quant == "Q4_0":  # (the fallback is the same for every kind)
        mixed = write_gguf(
            hf, tokenizer, tmp_path / "mixed.gguf", name, quant=quant, keep_float=("blk.1.attn_v.weight",)
        )
        with caplog.at_level(logging.INFO, logger="engines.text.gguf_int4"):
            rounded = build_text_engine(tmp_path / "engines", "none", "awq-int4", progress=False, source=str(mixed))
        assert "blk.1.attn_v.weight is F32, not Q4_0, Q4_1 or Q8_0" in caplog.text
        assert json.loads((rounded / "manifest.json").read_text())["recipe"]["method"] == "awq"
    if quant == "Q4_1":  # asked for TensorRT's symmetric form, which a block minimum is not
        with caplog.at_level(logging.INFO, logger="engines.text.gguf_int4"):
            sym = build_text_engine(tmp_path / "engines", "none", "awq-int4-sym", progress=False, source=str(source))
        assert "not the symmetric INT4 asked for" in caplog.text
        assert json.loads((sym / "manifest.json").read_text())["recipe"]["method"] == "awq"
    # Decoded in the CPU's C step as op by op: the minimums added after each product there
    # too, a Q8_0 weight's halves added after its product, q/k/v and gate/up of a layer
    # with halves multiplied apart (the loader keeps them so).
    from edge.text.model.llama import DecoderLayer
    from edge.text.runtime import cpu_step, fused_step

    q8 = "q8" in quant.lower()
    if q8:  # (the CUDA fused step does not take the halves)
        assert "two INT4 halves" in str(fused_step.refusal(int4.model))
        layers = [layer for layer in int4.model.layers if isinstance(layer, DecoderLayer)]
        assert [layer.self_attn.qkv_proj is None for layer in layers] == [
            i % 2 == 0 or quant == "Q8_0" for i in range(hf.config.num_hidden_layers)
        ]
    if name == "qwen2":  # (its biased q/k/v are served op by op)
        assert "bias" in str(cpu_step.refusal(int4.model))
        return
    assert cpu_step.refusal(int4.model) is None
    steps = {}
    for fused in (False, True):
        cache = int4.model.new_cache(1, 64)
        int4.model(ids[:, :20], cache, 0)
        int4.model.fused_decode = None if fused else False
        steps[fused] = torch.cat(
            [
                fused_step.decode_step(int4.model, ids[:, t : t + 1], cache, torch.tensor([t]), t + 1)
                for t in range(20, ids.shape[1])
            ]
        )
        assert int4.model.fused_decode is fused
    # The products are the per-op layers' bit for bit (tests/test_cpu_step.py); attention
    # and the norms sum in another order. A half left out moves them far past this.
    error = ((steps[True] - steps[False]).abs().amax(-1) / steps[False].abs().amax(-1)).max().item()
    assert error < 2e-5, error
    if q8:  # in serving: the step is the C one, and two rows answer as each alone
        assert fused_step.steps_on_cpu(int4.model)
        cache = int4.model.new_cache(2, 64)
        for row, n in enumerate((20, 14)):
            int4.model(ids[:, :n], cache.rows(row, 1), 0)
        both = fused_step.decode_step(int4.model, ids[0, [20, 14]].view(2, 1), cache, torch.tensor([20, 14]), 21)
        assert torch.equal(both[0], steps[True][0]), "a row beside another answers as alone"


def test_the_real_smollm2_q4_1_file_is_served_as_stored(tmp_path: Path) -> None:
    """SmolLM2's own GGUF (every block linear Q4_1, as the package ships it) built with no
    adapter keeps the file's weights: each of its 210 linears equals gguf's dequantization
    of the tensor bit for bit, the same weights llama.cpp serves from the file; and the
    CPU's C decode step gives its per-op logits."""
    import json

    from safetensors.torch import load_file

    from edge.text.ops.int4 import QuantizedWeight, dequantize
    from edge.text.runtime import cpu_step, fused_step
    from engines.text.text_build import build_text_engine

    path = smollm2_gguf_path()
    built = build_text_engine(tmp_path / "engines", "none", "awq-int4", progress=False, source=str(path))
    assert json.loads((built / "manifest.json").read_text())["recipe"]["method"] == "gguf-q4_1"
    floats = load_file(str(import_gguf(path, tmp_path / "engines", path.stem, progress=False) / "model.safetensors"))
    packed = load_file(str(built / "model.safetensors"))
    blocks = [n for n in json.loads((built / "quant.json").read_text())["linears"] if n.startswith("layers.")]
    assert len(blocks) == 7 * 30
    for layer in blocks:
        parts = (packed[f"{layer}.qweight"], packed[f"{layer}.scales"], packed[f"{layer}.zeros"])
        weight = QuantizedWeight(*parts, 32, packed[f"{layer}.minimums"])
        assert torch.equal(dequantize(weight), floats[f"{layer}.weight"]), layer
    model = load_checkpoint(built, dtype=torch.float32, cpu_kernel="exact").model
    assert cpu_step.refusal(model) is None
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    steps = {}
    for fused in (False, True):
        cache = model.new_cache(1, 32)
        model(ids[:, :16], cache, 0)
        model.fused_decode = None if fused else False
        steps[fused] = torch.cat(
            [fused_step.decode_step(model, ids[:, t : t + 1], cache, torch.tensor([t]), t + 1) for t in range(16, 24)]
        )
    model.fused_decode = None
    error = ((steps[True] - steps[False]).abs().amax(-1) / steps[False].abs().amax(-1)).max().item()
    assert error < 2e-5, error


# --- a SentencePiece vocabulary (tokenizer.ggml.model "llama") ---------------------


def _spm_gguf(path: Path) -> Path:
    """A Llama 2-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then BPE pieces
    with U+2581 word starts, scored as SentencePiece scores them (earlier merges higher)."""
    import gguf
    from tokenizers import SentencePieceBPETokenizer

    spm = SentencePieceBPETokenizer(add_prefix_space=True)
    spm.train_from_iterator(CORPUS, vocab_size=300, min_frequency=2, special_tokens=[], show_progress=False)
    learned = sorted(spm.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(learned):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_reads_it(tmp_path: Path) -> None:
    import json

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = _spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_str(json.dumps(build_tokenizer_json(GgufHeader(path))))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    # Not text that starts with a blank: SentencePiece (and llama.cpp) put the word-start
    # mark before it regardless, transformers' reading only where the text has none.
    texts = [p for p in PROBES if "<|" not in p and not p.startswith(" ")] + ["Nothing €uro-like ✓ at all"]
    for text in texts:
        want = theirs(text, add_special_tokens=False)["input_ids"]
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == want, text
        assert ours.decode(got) == theirs.decode(want)
    assert "".join(ours.encode("  two blanks", add_special_tokens=False).tokens) == "\u2581\u2581\u2581two\u2581blanks"
    # A character outside the vocabulary falls back to its UTF-8 bytes, and comes back.
    euro = ours.encode("€", add_special_tokens=False).tokens
    assert euro[-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]
    assert ours.decode(ours.encode("x € y", add_special_tokens=False).ids) == "x € y"


# --- refusals ---------------------------------------------------------------------


def _metadata_only(path: Path, arch: str, **fields: Any) -> Any:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GgufHeader(path)


@pytest.mark.parametrize(
    ("arch", "fields", "named"),
    [
        ("gemma2", {}, "architecture 'gemma2' is not supported; supported: llama, qwen2, qwen3, gemma3, phi3"),
        ("llama", {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}, "tokenizer model 't5'"),
        (
            "llama",
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "tekken",
                "tokenizer.ggml.tokens": ["a", "b", "ab"],
                "tokenizer.ggml.merges": ["a b"],
            },
            "pre-tokenizer 'tekken' is not supported",
        ),
    ],
)
def test_what_is_not_supported_is_refused_by_name(
    tmp_path: Path, arch: str, fields: dict[str, Any], named: str
) -> None:
    from engines.text.import_gguf import read_config

    reader = _metadata_only(tmp_path / "m.gguf", arch, **fields)
    with pytest.raises(SourceModelError, match=re.escape(named)):
        if arch != "llama":
            read_config(reader)
        else:
            build_tokenizer_json(reader)


@pytest.mark.parametrize(
    ("arch", "fields", "named"),
    [
        (
            "qwen2",
            {"qwen2.attention.sliding_window": 32},
            "sliding-window attention (qwen2.attention.sliding_window 32) is not supported in a qwen2 file",
        ),
        ("llama", {"llama.rope.dimension_count": 4}, "partial rotary embeddings (4 of 8 dimensions)"),
        ("phi3", {"phi3.rope.dimension_count": 3}, "partial rotary embeddings (3 of 8 dimensions)"),
    ],
)
def test_a_window_or_a_partial_rotary_outside_the_families_that_have_them_is_refused_by_name(
    arch: str, fields: dict[str, Any], named: str
) -> None:
    """Mistral's window (a `llama` file) and Phi's partial rotary (a `phi3` file) are
    served; elsewhere (a Llama file's q/k rows are interleaved for a rotary of every
    channel) they are refused naming them."""
    from types import SimpleNamespace

    from engines.text.import_gguf import read_config

    given = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 16,
        f"{arch}.attention.head_count": 2,
        f"{arch}.block_count": 2,
        **fields,
    }
    reader = SimpleNamespace(
        fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in given.items()},
        tensors=[SimpleNamespace(name="token_embd.weight", shape=np.array([16, 32]))],
    )
    with pytest.raises(SourceModelError, match=re.escape(named)):
        read_config(reader)


# --- the header reader ------------------------------------------------------------------


def _same_as_gguf_py(path: Path) -> None:
    import gguf

    ours, theirs = GgufHeader(path), gguf.GGUFReader(str(path))
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}  # (its own header, as fields)
    for key, field in ours.fields.items():
        if key != "t.nested":  # (gguf-py flattens an array of arrays; the file holds [[1, 2], [3]])
            assert field.contents() == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for o, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert (o.tensor_type, o.data_offset, o.shape.tolist()) == (t.tensor_type, t.data_offset, t.shape.tolist())
        assert (o.raw_dtype, o.raw_shape) == (t.data.dtype, tuple(t.data.shape)), o.name
        assert np.array_equal(o.data, t.data), o.name


def test_the_header_reader_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    """Every field (each value type, arrays of strings and of numbers) and every
    tensor (plain and quantized, at the file's alignment) as gguf-py's GGUFReader reads
    them: of a written file, and of the shipped SmolLM2's (49,152 tokens)."""
    import gguf

    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 1 << 31)
    writer.add_int32("t.i32", -(1 << 30))
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_int64("t.i64", -(1 << 40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strs", ["a", "", "ü" * 40])
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.weight", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((5,)).astype(np.float16))
    q4 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("q4.weight", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_gguf_py(path)
    assert GgufHeader(path).fields["t.nested"].contents() == [[1, 2], [3]]
    _same_as_gguf_py(smollm2_gguf_path())
    # A file cut short is said so, not read past its end.
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="past the end"):
        GgufHeader(cut)


def test_a_q8_0_tensor_is_two_int4_halves_whose_sum_is_the_files_weights() -> None:
    """A Q8_0 block's codes split into a high half (codes h + 8, zero points 8, scales 16 d)
    and a low one (codes l, zero points 0, scales d), both our INT4 layout, stacked: their
    sum in float32 is gguf's dequantization of the file, bit for bit, across the whole code
    range and large and tiny scales."""
    import gguf

    from edge.text.ops.int4 import dequantize
    from engines.text.gguf_int4 import q8_halves

    rng = np.random.default_rng(3)
    data = rng.standard_normal((6, 256)).astype(np.float32)
    data[0] *= 1e-4  # tiny scales
    data[1] *= 300.0  # large ones
    data[2, :32] = np.linspace(-1.0, 1.0, 32)  # every step of the code range in one block
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
    q = q8_halves(raw, 6, 256)
    assert q.halves and q.shape == (6, 256) and q.qweight.shape == (12, 128)
    assert torch.equal(dequantize(q), torch.from_numpy(want))
    assert int(q.zeros[:6].unique()) == 8 and int(q.zeros[6:].unique()) == 0
    with pytest.raises(SourceModelError, match="not whole blocks"):
        q8_halves(raw[:, :34], 6, 48)


@pytest.mark.parametrize("kernel", ["cpu-f32", "cpu-int8", "cpu", "dequant"])
def test_a_linear_in_q8_0_halves_multiplies_as_the_files_weights(kernel: str) -> None:
    """A layer of a Q8_0 weight in two halves: every CPU kernel takes both in one product
    and adds them, as x @ W.T of the file's weights (to the kernel's own rounding: exact
    float32 weights for ours; cpu-int8 rounds the activations, torch's bfloat16)."""
    import gguf

    from edge.text.ops.int4 import Int4Linear
    from engines.text.gguf_int4 import q8_halves

    rng = np.random.default_rng(4)
    data = rng.standard_normal((48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32))
    layer = Int4Linear(q8_halves(raw, 48, 256), kernel)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    want = (x.double() @ w.double().T).float()
    got = layer(x)
    assert got.shape == (5, 48)
    tol = {"cpu-f32": 1e-5, "dequant": 1e-5, "cpu-int8": 2e-2, "cpu": 5e-2}[kernel]
    assert ((got - want).abs().max() / want.abs().max()).item() < tol
    if kernel == "cpu-f32":
        with pytest.raises(RuntimeError, match="halves"):
            layer.gemv(x)
