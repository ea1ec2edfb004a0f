"""2:4 sparse INT4: the pruning (engines/text/prune.py), the packed format
(edge/text/ops/sparse24.py), the CPU kernel (cpu_sparse24.c) and a sparse build served
through the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from bench.build_memory import SHAPES, write_hf
from edge.config.text import LayerRule, QAModelConfig
from edge.text.engine import TextEngine
from edge.text.ops import sparse24
from edge.text.ops.cpu import cpu_int4, cpu_sparse24
from edge.text.ops.cuda import cuda_sparse24
from edge.text.ops.int4 import Int4Linear, dequantize, fake_quantize
from edge.text.ops.sparse24 import Sparse24Linear, Sparse24Weight
from edge.text.runtime import cpu_step, fused_step
from engines.text.prune import prune_magnitude, prune_sparsegpt, prune_wanda
from engines.text.text_build import build_text_engine, layer_recipe
from engines.text.text_onnx import ExportError, export_text_onnx
from tests.conftest import Broker, Requester, edgectl, start_daemon, write_profile

N, K, G = 70, 256, 32  # 70 rows: tiles of four and the rows past them


def _pruned(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return prune_magnitude(torch.randn(n, k, generator=gen))


def _fours_nonzero(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    return (weight.reshape(n, k // 4, 4) != 0).sum(-1)


@pytest.mark.parametrize("symmetric", [False, True])
def test_the_packed_format_round_trips_and_pruned_weights_are_exactly_zero(symmetric: bool) -> None:
    weight = _pruned()
    weight[:, :64] += 0.5  # groups whose zero point is far from their range's middle
    weight = weight.masked_fill(_pruned() == 0, 0)
    q = sparse24.pack_sparse(weight, G, symmetric=symmetric)
    # Through the checkpoint's tensors and back.
    stored = q.stored("layer")
    again = Sparse24Weight(
        stored["layer.codes24"], stored["layer.index24"], stored["layer.scales"], stored["layer.zeros"], G
    )
    sparse24.check(again)
    got = sparse24.dequantize_sparse(again)
    # The weight the dense INT4 layout would hold, rounded the same way.
    assert torch.equal(got, fake_quantize(weight, G, symmetric=symmetric).to(torch.float16).float()) or torch.equal(
        got, dequantize(sparse24.to_dense(q))
    )
    assert torch.equal(got, dequantize(sparse24.to_dense(q)))
    pruned = ~sparse24.kept_mask(weight)
    assert bool((got[pruned] == 0).all()) and bool((weight[pruned] == 0).all())
    assert bool((q.zeros != 0).any())  # pruned weights are zero whatever their group's zero point
    # 3 bits a weight: half a byte of codes and an eighth of positions per four.
    assert q.codes.numel() + q.index.numel() == N * K * 3 // 8
    assert q.nbytes < sparse24.to_dense(q).nbytes


def test_the_format_refuses_weights_that_are_not_two_of_four() -> None:
    weight = _pruned()
    weight[3, 1] = weight[3, 0] = weight[3, 2] = 1.0
    with pytest.raises(ValueError, match="not 2:4"):
        sparse24.pack_sparse(weight, G)
    q = sparse24.pack_sparse(_pruned(), G)
    bad = q.index.clone()
    bad[0, 0] = 0  # positions (0, 0): not two distinct ones
    with pytest.raises(ValueError, match="distinct"):
        sparse24.check(Sparse24Weight(q.codes, bad, q.scales, q.zeros, G))


def _magnitude_pruned(seed: int) -> torch.Tensor:
    return _pruned(seed=seed)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_the_cpu_kernel_equals_the_dense_kernel_on_the_same_weights_bit_for_bit(rows: int) -> None:
    if not (cpu_sparse24.available() and cpu_int4.available()):
        pytest.skip("no C compiler")
    q = sparse24.pack_sparse(_magnitude_pruned(1), G)
    dense = sparse24.to_dense(q)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    ours = cpu_sparse24.linear(x, q.codes, q.index, q.scales.float(), q.zeros, G)
    theirs = cpu_int4.linear(x, dense.qweight, dense.scales.float(), dense.zeros, G)
    assert torch.equal(ours, theirs)
    # And the product of the dequantized weight, to float32 rounding (another order of sums).
    reference = x.double() @ sparse24.dequantize_sparse(q).double().T
    assert torch.allclose(ours.double(), reference, rtol=1e-5, atol=1e-4)
    # One row alone or in a batch: the same sums.
    alone = cpu_sparse24.linear(x[-1:], q.codes, q.index, q.scales.float(), q.zeros, G)
    assert torch.equal(alone[0], ours[-1])


def _calibration(tokens: int = 1024, k: int = K, seed: int = 0) -> torch.Tensor:
    """Activations shaped as a transformer's: correlated channels, a few with outliers
    (what makes activation-aware pruning matter)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k**0.5
    scale = torch.ones(k)
    scale[torch.randperm(k, generator=gen)[:8]] = 20.0
    x: torch.Tensor = (torch.randn(tokens, k, generator=gen) @ mix) * scale
    return x


def test_pruning_keeps_two_of_every_four_and_the_activation_aware_methods_lose_less() -> None:
    x = _calibration()
    weight = torch.randn(96, K, generator=torch.Generator().manual_seed(3))

    def error(pruned: torch.Tensor) -> float:
        return float(((x @ (pruned - weight).T) ** 2).mean())

    magnitude = prune_magnitude(weight)
    wanda = prune_wanda(weight, x.norm(dim=0))
    sparsegpt = prune_sparsegpt(weight, x.T @ x)
    for pruned in (magnitude, wanda, sparsegpt):
        assert bool((_fours_nonzero(pruned) <= 2).all())
        assert int((pruned == 0).sum()) >= weight.numel() // 2
    assert error(wanda) < 0.5 * error(magnitude)
    assert error(sparsegpt) < error(wanda)
    # SparseGPT's reconstruction (the kept weights updated) beats its own mask alone.
    masked = weight.masked_fill(sparsegpt == 0, 0)
    assert error(sparsegpt) < 0.95 * error(masked)
    # Wanda changes no kept weight.
    assert torch.equal(wanda[wanda != 0], weight[wanda != 0])


def test_the_profile_rules_say_which_layers_are_pruned_and_how() -> None:
    with pytest.raises(ValueError, match="int4"):
        LayerRule(match="*", format="float", sparsity="2:4")
    with pytest.raises(ValueError, match="pruning applies"):
        LayerRule(match="*", format="int4", pruning="wanda")
    rules = [
        LayerRule(match="layers.0.*", format="int4", sparsity="2:4", pruning="wanda").to_selector(),
        LayerRule(match="*.mlp.*", format="int4", sparsity="2:4").to_selector(),
        LayerRule(match="*", format="int4").to_selector(),
    ]
    assert "sparsity" not in rules[2]  # a dense rule's selector is as it was
    recipe = layer_recipe("awq", rules, group_size=32)
    assert recipe.sparsity_for("layers.0.self_attn.q_proj") == "wanda"
    assert recipe.sparsity_for("layers.3.mlp.down_proj") == "sparsegpt"  # the default method
    assert recipe.sparsity_for("layers.3.self_attn.o_proj") is None
    assert recipe.to_dict()["sparse"][0] == ["layers.0.*", "wanda"]
    assert "sparse" not in layer_recipe("awq", rules[2:], group_size=32).to_dict()


def test_devices_without_a_kernel_refuse_the_format_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_sparse24, "available", lambda device="cuda": False)
    with pytest.raises(RuntimeError, match="2:4 sparse INT4"):
        sparse24.sparse_kernel(torch.device("cuda"))
    with pytest.raises(RuntimeError, match="2:4 sparse INT4"):
        sparse24.sparse_kernel(torch.device("meta"))


# --- a 2:4 build, end to end ----------------------------------------------------------

SPARSE_RULES = [
    LayerRule(match="layers.0.mlp.*", format="int4", sparsity="2:4", pruning="sparsegpt").to_selector(),
    LayerRule(match="layers.1.self_attn.*", format="int4", sparsity="2:4", pruning="wanda").to_selector(),
    LayerRule(match="layers.2.mlp.down_proj", format="int4", sparsity="2:4", pruning="magnitude").to_selector(),
]
PRUNED = {
    *(f"layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    *(f"layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "layers.2.mlp.down_proj",
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sparse24")
    source = root / "source"
    write_hf(SHAPES["tiny"], source)
    sparse = build_text_engine(root / "engines", "none", "awq-int4", False, str(source), SPARSE_RULES)
    return {"sparse": sparse}


def test_the_build_prunes_the_layers_its_rules_name_and_stores_them_packed(builds: dict[str, Path]) -> None:
    path = builds["sparse"]
    quant = json.loads((path / "quant.json").read_text())["linears"]
    assert {name for name, info in quant.items() if info.get("sparsity") == "2:4"} == PRUNED
    tensors = load_file(str(path / "model.safetensors"))
    for name in quant:
        if name in PRUNED:
            assert f"{name}.qweight" not in tensors
            q = Sparse24Weight(
                tensors[f"{name}.codes24"], tensors[f"{name}.index24"], tensors[f"{name}.scales"],
                tensors[f"{name}.zeros"], quant[name]["group_size"],
            )  # fmt: skip
            sparse24.check(q)  # exactly two kept positions in every four
            assert bool((_fours_nonzero(sparse24.dequantize_sparse(q)) <= 2).all())
        else:
            assert f"{name}.codes24" not in tensors
            # An untouched layer stays dense: many of its fours hold more than two weights.
            from edge.text.ops.int4 import QuantizedWeight

            w = dequantize(QuantizedWeight(tensors[f"{name}.qweight"], tensors[f"{name}.scales"],
                                           tensors[f"{name}.zeros"], quant[name]["group_size"]))  # fmt: skip
            assert float((_fours_nonzero(w) > 2).float().mean()) > 0.5
    manifest: dict[str, Any] = json.loads((path / "manifest.json").read_text())
    assert manifest["layers"]["layers.0.mlp.up_proj"]["pruning"] == "sparsegpt"
    assert manifest["layers"]["layers.1.self_attn.v_proj"]["pruning"] == "wanda"
    # The ledger's account is the packed bytes: an eighth of a byte a weight less than dense
    # INT4 codes for each pruned linear (the same scales and zero points).
    assert manifest["weight_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name in PRUNED:
        n, k4 = tensors[f"{name}.codes24"].shape
        packed = tensors[f"{name}.codes24"].numel() + tensors[f"{name}.index24"].numel()
        assert packed == n * (4 * k4) // 2 - n * k4 // 2


def test_a_sparse_build_serves_through_the_engine_as_its_dense_equal(builds: dict[str, Path]) -> None:
    cfg = QAModelConfig(max_context_tokens=512, max_sequences=1, kv_offload="off", prefix_cache_mib=0)
    engine = TextEngine.load(builds["sparse"], cfg)
    model = engine.batcher.model
    sparse_layers = {name: m for name, m in model.named_modules() if isinstance(m, Sparse24Linear)}
    assert set(sparse_layers) == {"layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj",
                                  "layers.1.self_attn.qkv_proj", "layers.1.self_attn.o_proj",
                                  "layers.2.mlp.down_proj"}  # fmt: skip
    expect_kernel = "cpu-sparse24" if cpu_sparse24.available() else "dequant"
    assert {m.kernel for m in sparse_layers.values()} == {expect_kernel}
    refused = cpu_step.refusal(model)
    assert refused is not None and "2:4" in refused  # the C decode step names what it lacks
    assert "2:4" in (fused_step.refusal(model) or "")  # and the fused CUDA step
    with pytest.raises(ExportError, match="2:4"):
        export_text_onnx(builds["sparse"], builds["sparse"].parent / "onnx")
    ids = engine.tokenizer.encode("a b c d e f", add_special_tokens=False).ids[:6] or [5, 6, 7]
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), model.new_cache(1, 64), 0, last_only=False)
        # The same model with each 2:4 layer as the dense INT4 layer of its dequantized-equal codes.
        for name, layer in sparse_layers.items():
            q = Sparse24Weight(layer.codes, layer.index, layer.scales.half(), layer.zeros, layer.group_size)
            parent, _, child = name.rpartition(".")
            dense_kernel = "cpu-f32" if expect_kernel == "cpu-sparse24" else "dequant"
            setattr(model.get_submodule(parent), child, Int4Linear(sparse24.to_dense(q), dense_kernel))
        again = model(torch.tensor([ids]), model.new_cache(1, 64), 0, last_only=False)
    assert torch.equal(logits, again)


def test_a_sparse_build_answers_a_question(builds: dict[str, Path]) -> None:
    from edge.protocol.jobs import QAJob
    from edge.tasks import qa
    from edge.text.runtime.generate import SamplingParams

    cfg = QAModelConfig(max_context_tokens=512, max_sequences=1, kv_offload="off", prefix_cache_mib=0)
    engine = TextEngine.load(builds["sparse"], cfg)
    seq = engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(seq.tokens) == 4
    result = qa.answer(engine, QAJob(id="q", question="What is it?", max_new_tokens=4))
    assert "answer" in result


def build_sparse_and_ask(
    tmp_path: Path, broker: Broker, requester: Requester, device_id: str, **qa_fields: Any
) -> Path:
    """A tiny HF model's profile with 2:4 rules on every MLP projection (and `qa_fields`),
    built by `edgectl build` and served by the daemon as a real process, which answers a
    qa job; the engine directory it built."""
    from edge.builds import locate
    from edge.config.loader import load_profile

    write_hf(SHAPES["tiny"], tmp_path / "tiny")
    rules = [{"match": "layers.*.mlp.*", "format": "int4", "sparsity": "2:4", "pruning": "wanda"}]
    qa = {"source": str(tmp_path / "tiny"), "adapter": "none", "max_new_tokens": 6, "layers": rules, **qa_fields}
    models = {"ocr": {"enabled": False}, "inspect": {"enabled": False}, "qa": qa}
    profile = write_profile(tmp_path, broker.port, tmp_path / "engines", device_id=device_id, models=models)
    built = edgectl("build", "--profile", str(profile), timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    engine = locate(load_profile(profile), "qa", None)
    quant = json.loads((engine / "quant.json").read_text())["linears"]
    assert {n for n, info in quant.items() if info.get("sparsity") == "2:4"} == {
        f"layers.{i}.mlp.{p}" for i in range(SHAPES["tiny"].num_layers) for p in ("gate_proj", "up_proj", "down_proj")
    }
    d = start_daemon(profile)
    try:
        d.wait_ready(timeout=120)  # built already: the daemon finds it
        doc = requester.request(f"edge/{device_id}/jobs/qa", {"id": "q1", "question": "Is 38.5 a fever?"}, 120)
    finally:
        d.stop()
    assert doc["status"] == "ok", doc
    assert doc["output"]["completion_tokens"] >= 1
    return engine


@pytest.mark.integration
def test_a_profile_with_sparse_rules_is_built_by_edgectl_and_served_by_the_daemon(
    tmp_path: Path, broker: Broker, requester: Requester
) -> None:
    build_sparse_and_ask(tmp_path, broker, requester, "s24")
