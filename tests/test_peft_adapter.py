"""A user's PEFT LoRA adapter merged at build, against peft itself: adapters made with
peft on the random-weight models of both families (tests/test_import_hf.py), merged by
engines/text/peft_adapter.py, must give the logits of peft's merge_and_unload; rank, alpha,
rsLoRA and target_modules honoured; what is not handled refused by name."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from edge.text.model.checkpoint import load_checkpoint
from edge.text.ops.int4 import dequantize, pack
from engines.text.import_hf import import_hf
from engines.text.peft_adapter import AdapterError, merge_checkpoint, read_adapter
from tests.test_import_hf import make_model


def make_adapter(base: Any, directory: Path, seed: int = 3, **lora: Any) -> Any:
    """A PEFT LoRA adapter on `base` with non-zero B (peft starts B at zero), saved."""
    from peft import LoraConfig, get_peft_model

    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], **lora}
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**settings))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(str(directory))
    return peft_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(f"peft-{request.param}")
    model, _ = make_model(root / "source", str(request.param))
    return {"root": root, "hf": model, "ckpt": import_hf(root / "source", root / "engines", progress=False)}


def _logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    ours = load_checkpoint(ckpt, dtype=torch.float32)
    logits: torch.Tensor = ours.model(ids, ours.model.new_cache(1, 64), 0, last_only=False)
    return logits


@pytest.mark.parametrize(
    "lora",
    [
        {},
        {"use_rslora": True, "r": 8, "lora_alpha": 4},
        {"target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"], "rank_pattern": {"o_proj": 2}},
    ],
    ids=["plain", "rslora", "rank-pattern"],
)
def test_the_merge_equals_peft_merge_and_unload(base: dict[str, Any], lora: dict[str, Any], tmp_path: Path) -> None:
    peft_model = make_adapter(base["hf"], tmp_path / "adapter", **lora)
    merged = merge_checkpoint(base["ckpt"], tmp_path / "adapter")
    theirs = peft_model.merge_and_unload()
    ids = torch.randint(0, theirs.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = theirs(ids).logits
        plain = base["hf"](ids).logits
    got = _logits(merged, ids)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-4 * scale
    assert (expected - plain).abs().max().item() > 0.05 * scale  # the adapter changes the model
    manifest = json.loads((merged / "manifest.json").read_text())
    assert manifest["merged_adapter"]["use_rslora"] is bool(lora.get("use_rslora", False))


def test_an_adapter_trained_on_our_int4_base_merges_into_that_base(base: dict[str, Any], tmp_path: Path) -> None:
    make_adapter(base["hf"], tmp_path / "adapter")
    (tmp_path / "adapter" / "base_quantization.json").write_text('{"format": "edge-int4", "group_size": 32}')
    merged = load_checkpoint(merge_checkpoint(base["ckpt"], tmp_path / "adapter"), dtype=torch.float32)
    plain = load_checkpoint(base["ckpt"], dtype=torch.float32, fuse=False)
    adapter = read_adapter(tmp_path / "adapter", plain.model)
    # Untargeted layers keep their float weights; targeted ones are dequant(INT4) + update.
    before: Any = plain.model.layers[0].self_attn
    after: Any = merged.model.layers[0].self_attn
    w, fused = before.k_proj.weight, after.qkv_proj.weight
    q_rows, k_rows = before.q_proj.weight.shape[0], w.shape[0]
    assert torch.equal(fused[q_rows : q_rows + k_rows], w)
    q = before.q_proj.weight
    expected = (dequantize(pack(q.float(), 32)).double() + adapter.updates["layers.0.self_attn.q_proj"].delta()).float()
    assert torch.allclose(fused[:q_rows], expected, atol=1e-6)


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    ("kind", "double_quant"), [("nf4", True), ("nf4", False), ("fp4", False)], ids=["nf4-double", "nf4", "fp4"]
)
def test_an_adapter_trained_on_a_bitsandbytes_4bit_base_merges_into_that_base(
    base: dict[str, Any], tmp_path: Path, kind: str, double_quant: bool
) -> None:
    # The model a QLoRA adapter is trained as: transformers loads the base 4-bit through
    # bitsandbytes (NF4, bf16), peft puts the adapter on it. Its layers' rounded weights
    # plus peft's own deltas, in float32, are what the merge must give.
    bnb = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes ships wheels for x86_64 only")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    make_adapter(base["hf"], tmp_path / "adapter", target_modules=ALL_PROJECTIONS)
    setting = {"format": f"bnb-{kind}", "dtype": "bfloat16", "double_quant": double_quant}
    (tmp_path / "adapter" / "base_quantization.json").write_text(json.dumps(setting))
    merged = merge_checkpoint(base["ckpt"], tmp_path / "adapter")
    assert json.loads((merged / "manifest.json").read_text())["merged_adapter"]["base_quantization"] == {
        **setting,
        "block_size": 64,
        "compute_dtype": "bfloat16",
    }
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    four_bit = AutoModelForCausalLM.from_pretrained(
        str(base["root"] / "source"), quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
    )
    trained: Any = PeftModel.from_pretrained(four_bit, str(tmp_path / "adapter"))
    reference = copy.deepcopy(base["hf"])
    modules = dict(reference.named_modules())
    rounded = 0
    for name, layer in trained.base_model.model.named_modules():
        if not hasattr(layer, "get_delta_weight"):
            continue
        weight = layer.base_layer.weight
        restored = bnb.dequantize_4bit(weight.data, weight.quant_state).to(torch.bfloat16).float()
        delta = layer.get_delta_weight("default").float()
        with torch.no_grad():
            modules[name].weight.copy_(restored + delta)
        rounded += 1
    assert rounded == 7 * reference.config.num_hidden_layers
    ids = torch.randint(0, reference.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(ids).logits
    float_base = merge_checkpoint(base["ckpt"], _without_base_file(tmp_path / "adapter", tmp_path / "plain"))
    got, on_float = _logits(merged, ids), _logits(float_base, ids)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-4 * scale
    # The rounding matters: merged into the float base instead, the model is another one.
    assert (on_float - expected).abs().max().item() > 100 * (got - expected).abs().max().item()


def _without_base_file(adapter: Path, copy_to: Path) -> Path:
    import shutil

    shutil.copytree(adapter, copy_to)
    (copy_to / "base_quantization.json").unlink()
    return copy_to


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"format": "gptq"}, "format 'gptq' is not supported"),
        ({"format": "bnb-nf4", "double_quant": True}, "dtype (what the base was loaded in"),
        ({"format": "bnb-nf4", "dtype": "bfloat16"}, "double_quant must be true or false"),
        ({"format": "bnb-nf4", "dtype": "bfloat16", "double_quant": False, "block_size": 48}, "block_size"),
        ({"format": "edge-int4", "group_size": 32, "dtype": "float16"}, "field 'dtype' is not a edge-int4 setting"),
    ],
)
def test_a_base_quantization_that_cannot_be_applied_is_refused_by_field(
    base: dict[str, Any], tmp_path: Path, setting: dict[str, Any], named: str
) -> None:
    make_adapter(base["hf"], tmp_path / "adapter")
    (tmp_path / "adapter" / "base_quantization.json").write_text(json.dumps(setting))
    with pytest.raises(AdapterError, match=re.escape(named)):
        merge_checkpoint(base["ckpt"], tmp_path / "adapter")


@pytest.mark.parametrize(
    ("lora", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias 'lora_only'"),
        ({"target_modules": ["embed_tokens"]}, "embeddings"),
    ],
)
def test_what_the_merge_does_not_handle_is_refused_by_name(
    base: dict[str, Any], lora: dict[str, Any], named: str, tmp_path: Path
) -> None:
    make_adapter(base["hf"], tmp_path / "adapter", **lora)
    with pytest.raises(AdapterError, match=named):
        merge_checkpoint(base["ckpt"], tmp_path / "adapter")


def test_an_adapter_for_another_model_is_refused(base: dict[str, Any], tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    make_adapter(other, tmp_path / "adapter")
    with pytest.raises(AdapterError, match="trained for another base model"):
        merge_checkpoint(base["ckpt"], tmp_path / "adapter")
