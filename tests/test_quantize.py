"""INT4 formats, kernels and the AWQ/RTN quantizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.model.checkpoint import load_checkpoint
from edge.text.model.llama import LlamaModel
from edge.text.ops.int4 import (
    Int4Linear,
    concat_rows,
    cpu_kernel_available,
    dequantize,
    fake_quantize,
    group_size_for,
    pack,
    unpack_codes,
)
from engines.text.quantize import QuantRecipe, quantize_model, search_clip, search_scales
from engines.text.text_build import quantize_checkpoint

TINY = LlamaConfig(vocab_size=96, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256)


def tiny_model(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    return model.eval()


def test_pack_roundtrip_and_error_bound() -> None:
    w = torch.randn(64, 256)
    q = pack(w, 128)
    assert q.qweight.shape == (64, 128) and q.qweight.dtype == torch.uint8
    codes = unpack_codes(q)
    assert int(codes.max()) <= 15
    deq = dequantize(q)
    # Round to nearest: each weight is within half a step of its group's scale.
    step = q.scales.float().repeat_interleave(128, dim=1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-3).all())
    torch.testing.assert_close(deq, fake_quantize(w, 128), atol=2e-3, rtol=0)


def test_group_size_falls_back_when_width_does_not_divide() -> None:
    assert group_size_for(4096, 128) == 128
    assert group_size_for(576, 128) == 64
    with pytest.raises(ValueError):
        group_size_for(100, 128)


@pytest.mark.skipif(not cpu_kernel_available(), reason="torch has no CPU INT4 kernel")
def test_cpu_kernel_matches_dequantized_matmul() -> None:
    w = torch.randn(256, 512)
    q = pack(w, 128)
    x = torch.randn(3, 512)
    ref = x @ dequantize(q).T
    got = Int4Linear(q, "cpu")(x)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-2  # bf16 activations


@pytest.mark.skipif(not cpu_kernel_available(), reason="torch has no CPU INT4 kernel")
def test_the_output_layers_best_logits_are_exact_on_the_cpu_kernel() -> None:
    """The CPU kernel's bfloat16 output knows a logit of 20 to 1/16; the output layer's
    best entries per row are the float32 product of the stored weights, so greedy picks
    the quantized model's own argmax even among near-ties."""
    torch.manual_seed(3)
    w = torch.randn(4096, 256) * 0.05
    w[1:8] = w[0] + torch.randn(7, 256) * 1e-4  # near-ties with row 0
    q = pack(w, 32)
    x = torch.randn(64, 256) * 8
    exact = x @ dequantize(q).T
    plain = Int4Linear(q, "cpu")(x)
    refined = Int4Linear(q, "cpu", exact_top=16)(x)
    top = plain.float().topk(16, dim=-1).indices  # the candidates the kernel's figures name
    torch.testing.assert_close(refined.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-4)
    assert bool((refined.argmax(-1) == exact.argmax(-1)).all())
    # Without it the bf16 rounding picks a different token for some rows.
    assert int((plain.argmax(-1) != exact.argmax(-1)).sum()) > 0
    # The rest of each row is the kernel's figure.
    rest = torch.ones_like(refined, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(refined[rest], plain.float()[rest])


def test_concat_rows_is_one_matmul_of_the_parts() -> None:
    parts = [pack(torch.randn(n, 256), 128) for n in (64, 32, 32)]
    fused = Int4Linear(concat_rows(parts), "dequant")
    x = torch.randn(2, 256)
    expected = torch.cat([Int4Linear(p, "dequant")(x) for p in parts], dim=-1)
    torch.testing.assert_close(fused(x), expected)


def test_scale_search_beats_plain_rounding_on_outlier_channels() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 256)
    x[:, :4] *= 40.0  # a few activation channels carry most of the signal, as in LLMs
    w = torch.randn(128, 256) * 0.05
    s = search_scales(x, x.abs().mean(0), [w], 128)
    rtn = ((x @ (fake_quantize(w, 128) - w).T) ** 2).mean()
    awq = ((x @ (fake_quantize(w * s, 128) / s - w).T) ** 2).mean()
    assert awq < 0.7 * rtn


def test_clip_search_never_worse_than_no_clip() -> None:
    torch.manual_seed(1)
    x = torch.randn(256, 256)
    w = torch.randn(64, 256) * 0.05
    w[:, 7] = 1.0  # one outlier weight per row stretches every group's range
    clip = search_clip(x, w, 128)
    plain = ((x @ (fake_quantize(w, 128) - w).T) ** 2).mean()
    clipped = ((x @ (fake_quantize(w, 128, clip) - w).T) ** 2).mean()
    assert clipped <= plain + 1e-9


def test_clip_search_picks_per_group_the_ratio_with_least_per_token_error() -> None:
    # The search's quadratic form against the definition: for each (row, group) the
    # ratio whose clipped group gives the least mean squared per-token output error.
    from engines.text.quantize import CLIP_RATIOS

    torch.manual_seed(2)
    x = torch.randn(512, 96, dtype=torch.float64).float()
    x[:, 5] *= 20.0
    w = torch.randn(48, 96) * 0.05
    w[::3, 40] = 0.8
    clip = search_clip(x, w, 32)
    errors = []
    for ratio in CLIP_RATIOS:
        delta = (fake_quantize(w, 32, torch.full((48, 3), ratio)) - w).double().reshape(48, 3, 32)
        xg = x.double().reshape(512, 3, 32)
        errors.append(torch.einsum("tgc,ngc->tng", xg, delta).pow(2).mean(0))
    stacked = torch.stack(errors)  # [ratio, n, g]
    expected = torch.tensor(CLIP_RATIOS)[stacked.argmin(0)]
    assert torch.equal(clip, expected.float())
    assert (clip < 1.0).any() and (clip == 1.0).any()  # both outcomes occur: the test can tell


def test_awq_rescaling_leaves_the_float_model_unchanged() -> None:
    model = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (1, 24))
    before = model(ids, model.new_cache(1, 32), 0, last_only=False)
    calib = torch.randint(0, TINY.vocab_size, (256,)).tolist()
    recipe = QuantRecipe(method="awq", group_size=128, calib_tokens=256, sample_tokens=64, seq_len=64)
    with torch.inference_mode():
        packed, report = quantize_model(model, recipe, calib, progress=False)
    after = model(ids, model.new_cache(1, 32), 0, last_only=False)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert len(packed) == 2 * 7 + 1 and all(v["bits"] == 4 for v in report.layers.values())  # + lm_head


def test_keep_override_leaves_layers_in_float() -> None:
    model = tiny_model()
    recipe = QuantRecipe(method="rtn", keep=("layers.0.mlp.down_proj",))
    packed, report = quantize_model(model, recipe, None, progress=False)
    assert "layers.0.mlp.down_proj" not in packed
    assert report.layers["layers.0.mlp.down_proj"] == {"bits": 16}


def test_per_layer_rules_in_order_the_first_match_deciding() -> None:
    from engines.text.text_build import layer_recipe

    rules: list[dict[str, Any]] = [
        {"match": "*.self_attn.q_proj", "format": "int4", "group_size": 32},
        {"match": "*.self_attn.*", "format": "float"},
        {"match": "*.mlp.*", "format": "int4", "group_size": 128},
    ]
    recipe = layer_recipe("awq", rules, group_size=64)
    calib = list(range(96)) * 8
    packed, report = quantize_model(tiny_model(), recipe, calib, progress=False)
    for i in range(2):
        assert report.layers[f"layers.{i}.self_attn.q_proj"]["group_size"] == 32  # first rule, not the float one
        for name in ("k_proj", "v_proj", "o_proj"):
            assert report.layers[f"layers.{i}.self_attn.{name}"] == {"bits": 16}
            assert f"layers.{i}.self_attn.{name}" not in packed
        for name in ("gate_proj", "up_proj"):
            assert report.layers[f"layers.{i}.mlp.{name}"]["group_size"] == 128
        assert report.layers[f"layers.{i}.mlp.down_proj"]["group_size"] == 128  # 256 wide: 128 divides it
    assert report.layers["lm_head"]["group_size"] == 64  # no rule: the build's own
    assert recipe.to_dict()["groups"][1] == ["*.self_attn.*", 0]
    assert "groups" not in layer_recipe("awq", []).to_dict()  # builds without rules keep their cache keys


def test_quantized_checkpoint_loads_and_tracks_the_float_model(engine_dir: Path) -> None:
    from engines.text.import_gguf import import_smollm2

    base = import_smollm2(engine_dir, progress=False)
    rtn = quantize_checkpoint(base, QuantRecipe(method="rtn"), progress=False)
    ref = load_checkpoint(base)
    q = load_checkpoint(rtn, int4_kernel="dequant")
    ids = ref.tokenizer.encode("Wash your hands before and after every patient contact.").ids
    a = ref.model(torch.tensor([ids]), ref.model.new_cache(1, 64), 0, last_only=False)[0]
    b = q.model(torch.tensor([ids]), q.model.new_cache(1, 64), 0, last_only=False)[0]
    # Not equal (4-bit weights) but close: the same next token most of the time.
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    assert agree > 0.6
    manifest = (rtn / "manifest.json").read_text()
    assert '"group_size": 128' in manifest and '"group_size": 64' in manifest


def test_symmetric_codes_have_zero_point_eight_and_round_to_nearest() -> None:
    from edge.text.ops.int4 import quantize_codes

    w = torch.randn(32, 256)
    codes, scales, zeros = quantize_codes(w, 64, symmetric=True)
    assert bool((zeros == 8).all())
    groups = w.reshape(32, 4, 64)
    torch.testing.assert_close(scales, groups.abs().amax(-1) / 7.0)
    q = pack(w, 64, symmetric=True)
    deq = dequantize(q)
    step = q.scales.float().repeat_interleave(64, dim=1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-3).all())
    # The largest magnitude of each group is a code away from 8 by exactly 7.
    peak = (codes.reshape(32, 4, 64).int() - 8).abs().amax(-1)
    assert bool((peak == 7).all())


def test_the_symmetric_recipe_quantizes_every_layer_symmetrically() -> None:
    model = tiny_model()
    calib = list(range(TINY.vocab_size)) * 40
    recipe = QuantRecipe(method="awq", group_size=64, calib_tokens=512, sample_tokens=128, seq_len=64, symmetric=True)
    packed, _ = quantize_model(model, recipe, calib, progress=False)
    assert packed and all(bool((q.zeros == 8).all()) for q in packed.values())
    assert recipe.to_dict()["symmetric"] is True
    assert "symmetric" not in QuantRecipe().to_dict()  # asymmetric builds keep their cache keys
