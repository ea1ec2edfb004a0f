"""Quantization-aware training of a 2:4 pruned model (engines/text/qat.py): the mask held,
the straight-through gradient, recomputation's gradients, and the build it is a step of."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from bench.build_memory import SHAPES, write_hf
from edge.config.text import QAModelConfig, QATConfig
from edge.text.model.llama import LlamaModel
from edge.text.ops import sparse24
from edge.text.ops.int4 import fake_quantize
from edge.text.ops.sparse24 import Sparse24Weight
from engines.text.prune import prune_magnitude
from engines.text.qat import (
    FakeQuantLinear,
    QATRecipe,
    attach_fake_quant,
    detach_fake_quant,
    forward_logits,
    train,
)
from engines.text.qlora import lm_loss
from engines.text.quantize import linear_names
from engines.text.text_build import build_text_engine, layer_recipe
from tests.conftest import Broker, Requester
from tests.test_sparse24 import build_sparse_and_ask

TINY = replace(SHAPES["tiny"], vocab_size=256, num_layers=2)
RULES = [
    {"match": "layers.*.mlp.*", "format": "int4", "sparsity": "2:4", "pruning": "sparsegpt"},
    {"match": "layers.1.self_attn.*", "format": "int4", "sparsity": "2:4", "pruning": "magnitude"},
]
RECIPE = layer_recipe("awq", RULES)


def _pruned_model(seed: int = 0) -> LlamaModel:
    """A tiny random model, its linears that RULES name pruned to 2:4 by magnitude."""
    torch.manual_seed(seed)
    model = LlamaModel(TINY).float()
    with torch.no_grad():
        for name in linear_names(model):
            if RECIPE.sparsity_for(name) is not None:
                linear = model.get_submodule(name)
                assert isinstance(linear, nn.Linear)
                linear.weight.copy_(prune_magnitude(linear.weight))
    return model


def _data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two sequences repeated every step: something a few steps can learn."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (2, 24), generator=gen)
    return [(ids, ids.clone()) for _ in range(steps)]


def _weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    linears = {name: model.get_submodule(name) for name in linear_names(model)}
    return {name: m.weight.detach().clone() for name, m in linears.items() if isinstance(m, nn.Linear)}


def test_training_keeps_the_mask_exactly_and_lowers_the_loss() -> None:
    model = _pruned_model()
    before = _weights(model)
    stats = train(model, _data(25), RECIPE, QATRecipe(lr=3e-3, recompute=False))
    after = _weights(model)
    assert stats["final_loss"] < stats["first_loss"] * 0.9, stats
    pruned = [name for name in after if RECIPE.sparsity_for(name) is not None]
    assert len(pruned) == 3 * TINY.num_layers + 4
    for name in pruned:
        zero = before[name] == 0
        assert int(zero.sum()) >= before[name].numel() // 2
        assert bool((after[name][zero] == 0).all()), name  # exactly zero, not nearly
        sparse24.kept_mask(after[name])  # still 2:4: it raises otherwise
        assert not torch.equal(after[name], before[name])  # and it did train
    # Plain linears again: the model is what the build reads, no fake quantizer left.
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())


def test_the_straight_through_gradient_flows_to_the_kept_weights_only() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(prune_magnitude(linear.weight))
    mask = sparse24.kept_mask(linear.weight)
    fq = FakeQuantLinear(linear, 32, False, mask)
    x = torch.randn(5, 64)
    out = fq(x)
    # The forward pass computes with the rounded weight...
    assert torch.allclose(out, x @ fake_quantize(linear.weight.detach(), 32).T, atol=1e-5)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    grad = fq.weight.grad
    assert grad is not None
    # ... and the backward pass as if the rounding were the identity, on the kept weights.
    assert torch.allclose(grad, (upstream.T @ x) * mask, atol=1e-5)
    assert bool((grad[~mask] == 0).all()) and float(grad[mask].abs().min()) >= 0
    assert float(grad.abs().sum()) > 0


def test_recomputation_gives_the_same_gradients() -> None:
    grads = []
    for recompute in (False, True):
        model = _pruned_model()
        wrapped = attach_fake_quant(model, RECIPE)
        ids, labels = _data(1)[0]
        lm_loss(forward_logits(model, ids, recompute), labels).backward()
        grads.append({name: fq.weight.grad.clone() for name, fq in wrapped.items() if fq.weight.grad is not None})
        detach_fake_quant(model)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 7 * TINY.num_layers
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name


def test_training_is_deterministic_under_its_seed() -> None:
    results = []
    for _ in range(2):
        model = _pruned_model()
        train(model, _data(4), RECIPE, QATRecipe(lr=1e-3))
        results.append(_weights(model))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_the_profile_section_selects_the_step() -> None:
    from edge.builds import build_command, selector
    from edge.config.profile import Profile

    with pytest.raises(ValueError, match="qat"):
        QAModelConfig(quantization="float", qat=QATConfig(enabled=True))
    base: dict[str, Any] = {"device_id": "qat", "models": {"qa": {"layers": RULES}}}
    plain = Profile.model_validate(base)
    assert "qat" not in selector("qa", plain) and "--qat" not in build_command("qa", plain).args
    base["models"]["qa"]["qat"] = {"enabled": True, "steps": 7, "recompute": False}
    trained = Profile.model_validate(base)
    wanted = selector("qa", trained)
    # recompute changes memory and time, not the weights: not what a build is found by.
    assert wanted["qat"] == {"steps": 7, "batch": 4, "seq_len": 128, "lr": 1e-4, "general_fraction": 0.5, "seed": 0}
    args = build_command("qa", trained).args
    assert json.loads(args[args.index("--qat") + 1]) == {**wanted["qat"], "recompute": False}


QAT = {"steps": 3, "batch": 2, "seq_len": 32, "lr": 1e-3, "general_fraction": 1.0, "seed": 0, "recompute": True}


@pytest.fixture(scope="module")
def qat_build(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qat")
    write_hf(SHAPES["tiny"], root / "source")
    engines = root / "engines"
    one_shot = build_text_engine(engines, "none", "awq-int4", False, str(root / "source"), RULES)
    trained = build_text_engine(engines, "none", "awq-int4", False, str(root / "source"), RULES, QAT)
    return {"root": root, "one-shot": one_shot, "qat": trained}


def test_the_qat_build_is_packed_2_4_and_differs_from_the_one_shot_build(qat_build: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    path = qat_build["qat"]
    assert path != qat_build["one-shot"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["inputs"]["qat"]["steps"] == 3 and manifest["qat"]["steps"] == 3
    assert manifest["layers"]["layers.0.mlp.up_proj"]["pruning"] == "sparsegpt"
    assert manifest["layers"]["layers.0.mlp.up_proj"]["qat"] is True
    assert {"qat": {k: v for k, v in QAT.items() if k != "recompute"}}.items() <= manifest["serves"][0].items()
    quant = json.loads((path / "quant.json").read_text())["linears"]
    sparse = {name for name, info in quant.items() if info.get("sparsity") == "2:4"}
    assert sparse == {n for n in quant if RECIPE.sparsity_for(n) is not None}
    tensors = load_file(str(path / "model.safetensors"))
    before = load_file(str(qat_build["one-shot"] / "model.safetensors"))
    for name in sparse:
        q = Sparse24Weight(tensors[f"{name}.codes24"], tensors[f"{name}.index24"], tensors[f"{name}.scales"],
                           tensors[f"{name}.zeros"], quant[name]["group_size"])  # fmt: skip
        sparse24.check(q)
    assert any(not torch.equal(tensors[k], before[k]) for k in tensors)  # the training changed the build
    # Cached: asked again, the same directory at once.
    root = qat_build["root"]
    assert build_text_engine(root / "engines", "none", "awq-int4", False, str(root / "source"), RULES, QAT) == path


def test_a_qat_build_serves(qat_build: dict[str, Path]) -> None:
    from edge.text.engine import TextEngine
    from edge.text.runtime.generate import SamplingParams

    cfg = QAModelConfig(max_context_tokens=512, max_sequences=1, kv_offload="off", prefix_cache_mib=0)
    engine = TextEngine.load(qat_build["qat"], cfg)
    seq = engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(seq.tokens) == 4


@pytest.mark.integration
def test_a_profile_with_qat_is_built_by_edgectl_and_served_by_the_daemon(
    tmp_path: Path, broker: Broker, requester: Requester
) -> None:
    qat = {"enabled": True, "steps": 2, "batch": 2, "seq_len": 32}
    engine = build_sparse_and_ask(tmp_path, broker, requester, "qat", qat=qat)
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["qat"]["steps"] == 2
