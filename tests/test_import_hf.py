"""A user's own Hugging Face model, Llama or Qwen2 family, against transformers itself:
random-weight models of both families are built here with transformers, saved as a
model directory with a tokenizer and a chat template, imported by engines/text/import_hf.py
and served by our runtime. Float logits and greedy tokens must equal transformers'; the
prompt is the model's own template, rendered as transformers renders it; what we do not
support is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.family_models import randomise
from edge.text.model.chat import ChatTemplateError
from edge.text.model.checkpoint import load_checkpoint
from edge.text.runtime.generate import SamplingParams, generate
from engines.text.import_gguf import SourceModelError
from engines.text.import_hf import import_hf, read_hf_config
from tests.conftest import Broker, Requester, start_daemon, write_profile

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|header|>", "<|eot|>"]
CORPUS = [
    "The patient reports a mild fever and a cough since Monday.",
    "Measure the resting heart rate before and after the walk.",
    "Insulin lowers blood glucose; check it before each meal.",
    "Serial SN-2041 passed inspection on line three at 14:05.",
] * 20
# Two templates in the shapes real models use: Llama 3's headers with a BOS, and Qwen2's
# ChatML with a default system turn, loop controls, filters and raise_exception.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|header|>' + message['role'] + '\\n\\n' + message['content'] | trim + '<|eot|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|header|>assistant\\n\\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Answer briefly. Température: 38,5 °C."},
    {"role": "user", "content": "  Is 38.5 a fever?  "},
]


def _tokenizer(directory: Path, template: str, eos: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos)
    fast.chat_template = template
    fast.save_pretrained(directory)
    return fast


def random_family_model(family: str, tokenizer: Any) -> Any:
    """A small random transformers model of `family` ("llama": Llama 3's RoPE scaling,
    untied head; "qwen2": q/k/v biases, tied embeddings) over `tokenizer`'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<s>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
    }
    if family == "llama":
        llama: Any = LlamaConfig  # its typed signature does not list the RoPE fields
        config: Any = llama(
            **shape,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model: Any = LlamaForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    randomise(model)
    model.eval()
    return model


def make_model(directory: Path, family: str) -> tuple[Any, Any]:
    """A small random model of `family` saved as a Hugging Face directory."""
    directory.mkdir(parents=True)
    template, eos = (LLAMA_TEMPLATE, "<|eot|>") if family == "llama" else (QWEN_TEMPLATE, "<|im_end|>")
    tokenizer = _tokenizer(directory, template, eos)
    model = random_family_model(family, tokenizer)
    model.save_pretrained(directory)
    return model, tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(str(request.param))
    model, tokenizer = make_model(root / "source", str(request.param))
    checkpoint = import_hf(root / "source", root / "engines", progress=False)
    return {"name": request.param, "hf": model, "tokenizer": tokenizer, "source": root / "source", "ckpt": checkpoint}


def test_the_import_keeps_the_familys_shape(family: dict[str, Any]) -> None:
    config = read_hf_config(family["source"])
    qwen = family["name"] == "qwen2"
    assert config.attention_bias is qwen and config.tie_embeddings is qwen
    assert (config.rope_scaling or {}).get("rope_type") == (None if qwen else "llama3")
    assert config.rope_theta == (10000.0 if qwen else 50000.0)


def test_float_logits_equal_transformers(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    ids = torch.randint(0, ours.model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = family["hf"](ids).logits
    got = ours.model(ids, ours.model.new_cache(2, 64), 0, last_only=False)
    assert got.shape == theirs.shape
    scale = theirs.abs().max().item()
    assert scale > 1.0  # the weights are wide enough for the comparison to mean something
    assert (got - theirs).abs().max().item() <= 1e-4 * scale


def test_the_prompt_is_the_models_own_template_as_transformers_renders_it(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    assert ours.chat is not None
    expected = family["tokenizer"].apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.chat.render(MESSAGES) == expected
    short = MESSAGES[1:]
    assert ours.chat.render(short) == family["tokenizer"].apply_chat_template(
        short, tokenize=False, add_generation_prompt=True
    )
    if family["name"] == "qwen2":
        with pytest.raises(ChatTemplateError, match="bad role"):
            ours.chat.render([{"role": "tool", "content": "x"}])


def test_greedy_tokens_equal_transformers(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    tokenizer = family["tokenizer"]
    assert ours.chat is not None
    prompt = tokenizer(ours.chat.render(MESSAGES), add_special_tokens=False)["input_ids"]
    assert list(ours.tokenizer.encode(ours.chat.render(MESSAGES), add_special_tokens=False).ids) == prompt
    got = generate(
        ours.model, ours.tokenizer, prompt, SamplingParams(max_new_tokens=24), frozenset(), ours.model.new_cache(1, 128)
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():  # every prompt token attended (id 0 is the BOS, not padding)
        out = family["hf"].generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=None
        )
    theirs = out[0, len(prompt) :].tolist()
    assert got.token_ids == theirs and len(set(theirs)) > 3


def test_awq_int4_stays_close_to_float(family: dict[str, Any]) -> None:
    from engines.text.quantize import QuantRecipe
    from engines.text.text_build import quantize_checkpoint

    flt = load_checkpoint(family["ckpt"], dtype=torch.float32)
    # Text, as served (AWQ chooses its scales on text: random ids are not its inputs).
    ids = torch.tensor([flt.tokenizer.encode(" ".join(CORPUS[:4]), add_special_tokens=False).ids[:60]])
    a = flt.model(ids, flt.model.new_cache(1, 64), 0, last_only=False)
    figures = {}
    for method in ("rtn", "awq"):
        int4 = quantize_checkpoint(family["ckpt"], QuantRecipe(method=method, group_size=32), progress=False)
        quant = json.loads((int4 / "quant.json").read_text())["linears"]
        assert len(quant) == 2 * 7 + 1  # every projection of both layers, and the head
        q = load_checkpoint(int4, dtype=torch.float32)
        b = q.model(ids, q.model.new_cache(1, 64), 0, last_only=False)
        figures[method] = (((a - b).norm() / a.norm()).item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item())
    print(f"{family['name']} INT4 g32 (relative logit error, top-1 agreement): {figures}")
    # Random Gaussian weights have none of the outlier channels AWQ exists for: it must
    # do no worse than rounding, and both stay far from chance (1 in 360).
    rel, top1 = figures["awq"]
    assert rel <= figures["rtn"][0] * 1.05 and rel < 0.45 and top1 >= 0.4


def _write_config(directory: Path, **fields: Any) -> Path:
    directory.mkdir(parents=True)
    base = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    (directory / "config.json").write_text(json.dumps({**base, **fields}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")
    return directory


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model_type 'gemma2'"),
        ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope short_factor: 0"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(tmp_path: Path, fields: dict[str, Any], named: str) -> None:
    with pytest.raises(SourceModelError, match=re.escape(named)):
        read_hf_config(_write_config(tmp_path / "m", **fields))


def test_a_directory_that_is_not_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceModelError, match=re.escape("no config.json, tokenizer.json, tokenizer_config.json")):
        read_hf_config(tmp_path)


@pytest.mark.integration
def test_a_profile_naming_a_qwen2_directory_and_a_peft_adapter_builds_them_and_answers(
    tmp_path: Path, broker: Broker, requester: Requester
) -> None:
    # Float weights, so the daemon's answer can be held to transformers' token for token:
    # the base with peft's own merge of the adapter, greedy.
    from edge.config.text import DEFAULT_SYSTEM_PROMPT
    from tests.test_peft_adapter import make_adapter

    base, tokenizer = make_model(tmp_path / "qwen-small", "qwen2")
    model = make_adapter(base, tmp_path / "clinic-lora").merge_and_unload()
    source, adapter = str(tmp_path / "qwen-small"), str(tmp_path / "clinic-lora")
    qa = {"source": source, "adapter": adapter, "quantization": "float", "max_new_tokens": 12}
    models = {"ocr": {"enabled": False}, "inspect": {"enabled": False}, "qa": qa}
    d = start_daemon(write_profile(tmp_path, broker.port, tmp_path / "engines", device_id="qw", models=models))
    try:
        d.wait_ready(timeout=300)  # the first start imports the model in a child build
        doc = requester.request("edge/qw/jobs/qa", {"id": "q1", "question": "Is 38.5 a fever?"}, 120)
    finally:
        d.stop()
    assert doc["status"] == "ok", doc
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": "Is 38.5 a fever?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    theirs = out[0, ids.shape[1] :].tolist()
    output = doc["output"]
    assert output["prompt_tokens"] == ids.shape[1]
    assert output["completion_tokens"] == len([t for t in theirs if t != tokenizer.eos_token_id])
    assert output["answer"] == tokenizer.decode(theirs, skip_special_tokens=True)
    assert output["completion_tokens"] >= 3 and output["answer"].strip()
