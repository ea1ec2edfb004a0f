"""The CPU decode step in one C call (edge/text/ops/cpu/cpu_step.c): on the served build it
answers as the model's own step op by op, a sequence's logits do not depend on the
sequences beside it, and what it does not implement is refused by name and served op by
op."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from edge.config.text import QAModelConfig
from edge.text.architecture import LlamaConfig
from edge.text.engine import TextEngine
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.model.llama import LlamaModel
from edge.text.ops.cpu import cpu_int4, cpu_step
from edge.text.ops.int4 import Int4Linear, QuantizedWeight, pack
from edge.text.runtime import cpu_step as runtime_step
from edge.text.runtime import fused_step
from edge.text.runtime.generate import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="no C compiler for the CPU kernels")


@pytest.fixture(scope="module", params=["exact", "int8"])
def served(engine_dir: Path, request: pytest.FixtureRequest) -> TextCheckpoint:
    """The served build on each of our CPU kernels (models.qa.cpu_kernel)."""
    from engines.text.text_build import build_text_engine

    path = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    return load_checkpoint(path, cpu_kernel=request.param)


def _prefilled(model: LlamaModel, prompts: torch.Tensor, slots: int = 128):  # type: ignore[no-untyped-def]
    cache = model.new_cache(prompts.shape[0], slots)
    with torch.no_grad():
        model(prompts, cache, 0)
    return cache


def test_the_served_build_decodes_in_the_c_step_as_op_by_op(served: TextCheckpoint) -> None:
    model = served.model
    assert runtime_step.refusal(model) is None
    torch.manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (2, 24))
    per_op, fused = _prefilled(model, prompts), _prefilled(model, prompts)
    ids = prompts[:, -1:]
    try:
        for step in range(12):
            pos = torch.full((2,), 24 + step)
            model.fused_decode = False
            ref = fused_step.decode_step(model, ids, per_op, pos, 25 + step)
            model.fused_decode = None
            got = fused_step.decode_step(model, ids, fused, pos, 25 + step)
            assert model.fused_decode is True
            # The same products: only the order of some float32 sums differs. With int8
            # activations such a difference can move an activation across a rounding
            # boundary, by a step of its block's scale: the two then differ as much as
            # either differs from the exact model (about 3% of the largest logit here).
            tolerance = 2e-5 if served.int4_kernel == "cpu-f32" else 5e-2
            assert float((got - ref).abs().max() / ref.abs().max()) < tolerance, step
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), step
            ids = ref.argmax(-1, keepdim=True)
        # It wrote the same keys and values into the cache (as above, to a rounding step
        # of the activations with int8 ones).
        for got_kv, ref_kv in ((fused.k, per_op.k), (fused.v, per_op.v)):
            atol = 1e-4 if served.int4_kernel == "cpu-f32" else 5e-2 * float(ref_kv.abs().max())
            torch.testing.assert_close(got_kv, ref_kv, rtol=0, atol=atol)
    finally:
        model.fused_decode = None


def test_a_sequence_answers_the_same_alone_and_beside_others(served: TextCheckpoint) -> None:
    """Three sequences at different positions in one step, against each alone in row 0:
    bit for bit. A fourth row the batch does not advance (parked at the cache's last slot,
    as the batcher parks it) changes nothing."""
    model = served.model
    torch.manual_seed(1)
    lengths = [9, 30, 17]
    prompts = [torch.randint(0, model.config.vocab_size, (1, n)) for n in lengths]
    slots = 64
    batch = model.new_cache(4, slots)
    alone = []
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            model(prompt, batch.rows(row, 1), 0)
            single = _prefilled(model, prompt, slots)
            alone.append(single)
        tokens = torch.tensor([[5], [6], [7], [0]])
        pos = torch.tensor([*lengths, slots - 1])
        together = fused_step.decode_step(model, tokens, batch, pos, max(lengths) + 1)
        for row, n in enumerate(lengths):
            own = fused_step.decode_step(model, tokens[row : row + 1], alone[row], torch.tensor([n]), n + 1)
            assert torch.equal(together[row], own[0]), row


def test_what_it_does_not_implement_is_refused_by_name_and_served_op_by_op(
    served: TextCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128)
    float_model = LlamaModel(tiny).eval()
    assert "not on our CPU INT4 kernels" in (runtime_step.refusal(float_model) or "")
    # Every family option of today's families is implemented (tests/test_families.py); one
    # it did not implement would be named.
    qwen3 = LlamaModel(dataclasses.replace(tiny, qk_norm=True)).eval()
    monkeypatch.setattr(runtime_step, "IMPLEMENTED", tuple(o for o in runtime_step.IMPLEMENTED if o != "qk_norm"))
    assert runtime_step.refusal(qwen3) == "it does not implement qk_norm"
    assert not fused_step.can_fuse(qwen3)
    # The op-by-op step still serves such a model.
    cache = qwen3.new_cache(1, 16)
    with torch.no_grad():
        qwen3(torch.tensor([[1, 2, 3]]), cache, 0)
        logits = fused_step.decode_step(qwen3, torch.tensor([[4]]), cache, torch.tensor([3]), 4)
    assert logits.shape == (1, 64) and bool(torch.isfinite(logits).all())
    # A quantized KV cache is read by the per-op step's kernel: the engine says so.
    cfg = QAModelConfig(max_context_tokens=128, max_sequences=1, kv_dtype="int8")
    engine = TextEngine(served, cfg)
    assert engine.config()["fused_step"] is False
    answer = engine.generate(served.tokenizer.encode("Fever?").ids, SamplingParams(max_new_tokens=4))
    assert len(answer.tokens) > 0


def test_the_engine_records_the_c_step_and_rejects_a_bad_position(served: TextCheckpoint) -> None:
    engine = TextEngine(served, QAModelConfig(max_context_tokens=128, max_sequences=2))
    assert engine.config()["fused_step"] is True and engine.config()["device"] == "cpu"
    model = served.model
    cache = model.new_cache(1, 16)
    plan = runtime_step._plans[model]
    assert isinstance(plan, cpu_step.Plan)
    x = torch.zeros(1, model.config.hidden_size)
    parts = runtime_step._parts(cache)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_step.decode_layers(plan, x, parts, torch.tensor([0]), torch.tensor([16]), 16)
    with pytest.raises(ValueError, match="float32"):
        cpu_step.decode_layers(plan, x.half(), parts, torch.tensor([0]), torch.tensor([0]), 1)


def test_a_token_and_its_drafts_verified_at_once_answer_as_decoded_one_by_one(served: TextCheckpoint) -> None:
    """Speculative verification on the CPU: the token and four drafts as five rows of one
    step on the same cache row, each attending causally: each position's logits are
    those of decoding it alone, bit for bit, so greedy speculation is lossless."""
    model = served.model
    torch.manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, 21))
    chain = [11, 220, 35, 987, 4]
    one, at_once = model.new_cache(2, 64), model.new_cache(2, 64)
    with torch.no_grad():
        model(prompt, one.rows(1, 1), 0)
        model(prompt, at_once.rows(1, 1), 0)
        stepped = []
        for i, token in enumerate(chain):
            # Decoded in row 1 beside an idle row 0 parked at the cache's end.
            pos = torch.tensor([63, 21 + i])
            stepped.append(fused_step.decode_step(model, torch.tensor([[0], [token]]), one, pos, 22 + i)[1])
        verified = runtime_step.verify(model, chain, at_once, 1, 21)
    assert verified.shape == (5, model.config.vocab_size)
    for i, logits in enumerate(stepped):
        assert torch.equal(verified[i], logits), i
    torch.testing.assert_close(at_once.k[:, 1, :, :26], one.k[:, 1, :, :26], rtol=0, atol=0)


def _q8_0(rows: int, columns: int, seed: int) -> QuantizedWeight:
    """A GGUF Q8_0 weight of random values in its two INT4 halves (gguf_int4.q8_halves)."""
    import gguf
    import numpy as np

    from engines.text.gguf_int4 import q8_halves

    data = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    return q8_halves(gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), rows, columns)


@pytest.mark.parametrize("kernel", ["cpu-f32", "cpu-int8"])
def test_a_product_of_parts_and_halves_is_the_layers_bit_for_bit(kernel: str) -> None:
    """A product as the step lays out a layer the loader kept unfused (a GGUF file's Q8_0
    weights, in two INT4 halves): q, k and v apart (q and v in halves, k plain at another
    group), a weight in halves alone (o, down) and a plain one alone (a fused product):
    each output the per-op layers' (Int4Linear, its halves added after in float32) bit for
    bit, for one row and for three."""
    k = 256
    g = torch.Generator().manual_seed(5)
    plain = pack(torch.randn(32, k, generator=g), 64)
    cases = {
        "q, k, v": [_q8_0(64, k, 1), plain, _q8_0(32, k, 2)],
        "one in halves": [_q8_0(96, k, 3)],
        "one": [plain],
    }
    for name, weights in cases.items():
        layers = [Int4Linear(w, kernel) for w in weights]
        assert all(layer.kernel == kernel for layer in layers)
        keep: list[torch.Tensor] = []
        product = runtime_step._product(list(layers), keep)
        assert product.parts == len(layers)
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=g)
            want = torch.cat([layer(x) for layer in layers], dim=-1)
            got = cpu_step.multiply(product, x)
            assert got.shape == want.shape and torch.equal(got, want), (name, rows)
    narrow, wide = (Int4Linear(pack(torch.randn(32, n, generator=g), 32), kernel) for n in (64, 128))
    with pytest.raises(ValueError, match="one input width"):
        runtime_step._product([narrow, wide], [])


def test_a_daemon_and_a_checkpoint_load_import_no_compiler_stack(engine_dir: Path) -> None:
    """The daemon's imports and a text checkpoint's load leave torch._dynamo (and sympy
    under it) unimported: they cost a CPU box about 4 s at every start."""
    import subprocess
    import sys

    from engines.text.text_build import build_text_engine

    path = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    code = (
        "import sys; from pathlib import Path; import edge.daemon; "
        "from edge.text.model.checkpoint import load_checkpoint; "
        f"load_checkpoint(Path({str(path)!r})); "
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
