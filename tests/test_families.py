"""Qwen3, Gemma 3, Mistral and Phi-3 text models against transformers itself: random-weight
models of each family are built here with transformers, saved as Hugging Face directories
(Gemma 3's also as Gemma 3 4B's vision-language layout, whose text model is imported
alone) and written as llama.cpp's converter writes their GGUF files (Qwen3, Mistral,
Phi-3), imported and served by our decoder. Float logits over 200 positions (prefilled in
chunks and decoded token by token, so every mask a served model uses is compared, a
sliding window's included), greedy tokens and the rendered prompt must equal
transformers'; a GGUF file imports to its directory's checkpoint; AWQ must quantize the
new linears and keep the norms float; each family's INT4 build answers a qa job through
the daemon; what a fast path does not implement is refused by name; and the real Gemma 3
270M GGUF answers token for token as transformers does. On a GPU (the `gpu` marker), each
family's float logits and its INT4 build as the GPU profile serves it."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.family_models import (
    CORPUS,
    LONGROPE_ORIGINAL,
    MESSAGES,
    WINDOW,
    make_gemma3_vlm,
    make_model,
    served_logits,
    write_family_gguf,
)
from edge.text.architecture import LlamaConfig
from edge.text.kv.float_cache import LOCAL_ROOM, KVCache, SparseAttention
from edge.text.kv.kv_quant import FORMATS
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.checkpoint import load_checkpoint
from edge.text.model.llama import Attention, LlamaModel
from edge.text.ops import step_ops
from edge.text.ops.cpu import cpu_int4
from edge.text.runtime import cpu_step, fused_prefill, fused_step
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams, generate
from engines.text.import_gguf import SourceModelError, import_gguf
from engines.text.import_hf import import_hf, read_hf_config
from tests.conftest import Broker, Requester, edgectl, start_daemon, write_profile

POSITIONS = 200


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "mistral", "phi3"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(str(request.param))
    model, tokenizer = make_model(root / "source", str(request.param))
    checkpoint = import_hf(root / "source", root / "engines", progress=False)
    return {"name": request.param, "hf": model, "tokenizer": tokenizer, "source": root / "source", "ckpt": checkpoint}


def assert_close(got: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = theirs.abs().max().item()
    assert scale > 1.0  # the weights are wide enough for the comparison to mean something
    assert (got - theirs).abs().max().item() <= 1e-4 * scale


def test_the_import_keeps_the_familys_options(family: dict[str, Any]) -> None:
    config = read_hf_config(family["source"])
    assert not config.attention_bias
    if family["name"] in ("mistral", "phi3"):
        assert config.family_options()[0] == f"sliding_window {WINDOW}" and not config.tie_embeddings
        assert config.layer_types == ("sliding", "sliding") and config.layer_window(1) == WINDOW
    if family["name"] == "phi3":  # Phi-4-mini's rotary: three quarters of a head, LongRoPE
        assert config.family_options()[1:] == ["rotary_dim 12"] and config.rotated == 12
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["attention_factor"] == pytest.approx(family["hf"].model.rotary_emb.attention_scaling)
        assert config.max_position == LONGROPE_ORIGINAL  # where its short factors hold
    elif family["name"] == "mistral":
        assert config.family_options() == [f"sliding_window {WINDOW}"]
    elif family["name"] == "qwen3":
        assert config.head_dim == 24 and config.family_options() == ["qk_norm"] and config.tie_embeddings
    else:
        assert config.qk_norm and config.tie_embeddings
        assert config.layer_types == ("sliding", "sliding", "full", "sliding") and config.sliding_window == WINDOW
        assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
        assert config.mlp_activation == "gelu_tanh" and config.output_norms
        assert config.embedding_scale == pytest.approx(8.0) and config.attention_scale == pytest.approx(20**-0.5)
        assert config.final_logit_softcap == 30.0


def test_float_logits_equal_transformers_over_200_positions(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    ids = torch.randint(0, ours.model.config.vocab_size, (1, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = family["hf"](ids).logits[0]
    whole = ours.model(ids, ours.model.new_cache(1, 256), 0, last_only=False)[0]
    assert_close(whole, theirs)
    assert_close(served_logits(ours.model, ids), theirs)


def test_the_prompt_is_the_models_own_template_with_thinking_off(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    assert ours.chat is not None
    tokenizer = family["tokenizer"]
    for thinking in (False, True):
        expected = tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        assert ours.chat.render(MESSAGES, thinking=thinking) == expected
    if family["name"] == "qwen3":  # off unless asked: the answer, not a reasoning trace
        assert ours.chat.render(MESSAGES).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_greedy_tokens_equal_transformers(family: dict[str, Any]) -> None:
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    assert ours.chat is not None
    _greedy_equals_transformers(ours, family["tokenizer"], family["hf"], ours.chat.render(MESSAGES), 48)


def _greedy_equals_transformers(ours: Any, tokenizer: Any, hf: Any, text: str, new: int) -> None:
    """`text` tokenized alike by both, and `new` greedy tokens after it (past the
    family's window) equal to transformers' generate's, not a degenerate repeat."""
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert list(ours.tokenizer.encode(text, add_special_tokens=False).ids) == prompt
    got = generate(
        ours.model,
        ours.tokenizer,
        prompt,
        SamplingParams(max_new_tokens=new),
        frozenset(),
        ours.model.new_cache(1, 128),
    )
    t = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new, do_sample=False, eos_token_id=None)
    assert got.token_ids == out[0, len(prompt) :].tolist() and len(set(got.token_ids)) > 3


def test_the_served_engine_answers_as_transformers_past_the_window(family: dict[str, Any]) -> None:
    # The CPU profile's engine: its continuous batcher prefills and then decodes every
    # sequence through the batched step, whose masks are the decode step's.
    from bench.text_engines import load_engine

    engine = load_engine(family["ckpt"], "cpu")
    assert not engine.config()["fused_step"]
    # The sliding layers keep their window and room alone (the rows are longer).
    sliding = family["name"] != "qwen3"
    assert engine.config()["kv_sliding_slots"] == (WINDOW + LOCAL_ROOM if sliding else None)
    tokenizer = family["tokenizer"]
    prompt = tokenizer(engine.prompter.text("Is 38.5 a fever?", None), add_special_tokens=False)["input_ids"]
    assert engine.prompter.ids("Is 38.5 a fever?", None) == prompt
    new = 2 * WINDOW
    got = list(engine.generate(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)).tokens)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = family["hf"].generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=None
        )
    assert got == out[0, len(prompt) :].tolist()


def test_awq_quantizes_the_linears_and_keeps_the_norms_float(family: dict[str, Any]) -> None:
    from safetensors import safe_open

    from engines.text.quantize import QuantRecipe
    from engines.text.text_build import quantize_checkpoint

    flt = load_checkpoint(family["ckpt"], dtype=torch.float32)
    ids = torch.tensor([flt.tokenizer.encode(" ".join(CORPUS[:4]), add_special_tokens=False).ids[:60]])
    a = flt.model(ids, flt.model.new_cache(1, 64), 0, last_only=False)
    figures = {}
    for method in ("rtn", "awq"):
        int4 = quantize_checkpoint(family["ckpt"], QuantRecipe(method=method, group_size=32), progress=False)
        q = load_checkpoint(int4, dtype=torch.float32)
        b = q.model(ids, q.model.new_cache(1, 64), 0, last_only=False)
        figures[method] = (((a - b).norm() / a.norm()).item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item())
    quant = json.loads((int4 / "quant.json").read_text())["linears"]
    layers = flt.model.config.num_layers
    assert len(quant) == layers * 7 + 1  # every projection of every layer, and the head (tied: a copy)
    with safe_open(str(int4 / "model.safetensors"), framework="pt") as fh:
        norms = [k for k in fh.keys() if "norm" in k]
    # Two per layer, with the q/k norms four, with Gemma's output norms six.
    per_layer = {"mistral": 2, "phi3": 2, "qwen3": 4, "gemma3": 6}[family["name"]]
    assert len(norms) == layers * per_layer + 1
    # Random Gaussian weights have none of the outlier channels AWQ exists for: it must do
    # no worse than rounding, and the top token stays far from chance (1 in 360). Gemma's
    # output norms lift every branch to the residual's scale, rounding error with it.
    rel, top1 = figures["awq"]
    assert rel <= figures["rtn"][0] * 1.05 and top1 >= 0.2, figures


@pytest.fixture(scope="module")
def int4_build(family: dict[str, Any]) -> Path:
    """The family's INT4 build (round to nearest, groups of 32): its checkpoint."""
    from engines.text.quantize import QuantRecipe
    from engines.text.text_build import quantize_checkpoint

    built: Path = quantize_checkpoint(family["ckpt"], QuantRecipe(method="rtn", group_size=32), progress=False)
    return built


@pytest.fixture(scope="module")
def int4(int4_build: Path) -> LlamaModel:
    """The family's INT4 build on our float32 CPU kernel, which the C step serves."""
    if not cpu_int4.available():
        pytest.skip("no C compiler for the CPU kernels")
    return load_checkpoint(int4_build, cpu_kernel="exact").model


def test_the_c_step_serves_the_int4_build_as_op_by_op_past_the_window(family: dict[str, Any], int4: LlamaModel) -> None:
    """The CPU's one-call decode step (cpu_step.c) takes each family's options (Qwen3's q/k
    head norms, the sliding window, Gemma 3's local rotary table, GELU, output norms,
    scaled embedding, attention scale and logit cap): on each family's INT4 build (our
    float32 kernel) a decode past the window gives the op-by-op step's logits to float32
    rounding, and the C step with the window taken away does not."""
    model = int4
    assert cpu_step.refusal(model) is None
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    prefill = WINDOW - 4

    def decode(fused: bool) -> torch.Tensor:
        cache = model.new_cache(1, 64)
        model.fused_decode = None if fused else False  # None: decided on the first step
        try:
            with torch.no_grad():
                model(ids[:, :prefill], cache, 0)
                steps = [
                    fused_step.decode_step(model, ids[:, t : t + 1], cache, torch.tensor([t]), t + 1)
                    for t in range(prefill, ids.shape[1])
                ]
            assert model.fused_decode is fused
        finally:
            model.fused_decode = None
        return torch.cat(steps)

    want, got = decode(False), decode(True)
    error = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    assert error < 2e-5 and torch.equal(got.argmax(-1), want.argmax(-1)), error
    if any(a.window for a in model.modules() if isinstance(a, Attention)):
        cpu_step._plans.pop(model)  # laid out again without the window
        try:
            with _without_windows(model):
                unwindowed = decode(True)
        finally:
            cpu_step._plans.pop(model)
        far = ((unwindowed - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
        assert far > 1e3 * error and far > 1e-3, (error, far)


def _steps(
    model: LlamaModel, cache: KVCache | QuantKVCache, ids: torch.Tensor, row: int, start: int, fused: bool
) -> torch.Tensor:
    """Logits of ids[start:] decoded one token a step in cache row `row` (the other row
    parked at the cache's end), room made in a float cache's sliding buffers before each
    as the batcher does: the fused step (`fused`: on the CPU the C step) or the op-by-op
    one, on the model's device."""
    model.fused_decode = None if fused else False  # None: decided on the first step
    rows = []
    device = model.device
    try:
        with torch.no_grad():
            for t in range(start, ids.shape[1]):
                positions = [cache.max_len - 1] * cache.batch
                positions[row] = t
                if isinstance(cache, KVCache):
                    cache.make_room_for_step(positions)
                tokens = torch.zeros(cache.batch, 1, dtype=torch.long)
                tokens[row] = ids[0, t]
                pos = torch.tensor(positions, device=device)
                rows.append(fused_step.decode_step(model, tokens.to(device), cache, pos, t + 1)[row].float())
        assert model.fused_decode is fused
    finally:
        model.fused_decode = None
    return torch.stack(rows)


def test_the_sliding_layers_keep_their_window_alone_and_answer_as_with_every_position(
    family: dict[str, Any], int4: LlamaModel
) -> None:
    """A sliding layer's keys and values live in a buffer of its window and a little room
    (float_cache.py), moved to the front as positions go by: the cache takes less memory
    by exactly the positions the sliding layers no longer hold, and the INT4 build decodes
    far past the window (30 moves of the buffer: room for 8 new positions), in the C step
    and op by op, as with every position held (to float32 rounding: a prefill's masked
    keys are fewer, so its sums round otherwise). A row saved after those moves (what the prefix cache
    and the offload keep) and put in another row decodes on as the first."""
    model, config = int4, int4.config
    sliding = sum(1 for i in range(config.num_layers) if config.layer_window(i))
    full = KVCache(config, 2, 256, model.dtype, model.device, window_sized=False)
    held = KVCache(config, 2, 256, model.dtype, model.device, room=8)
    if not sliding:
        assert held.local_slots == 0 and held.nbytes == full.nbytes
        return
    assert held.local_slots == WINDOW + 8 and full.local_slots == 0
    per_position = full.nbytes // (config.num_layers * 256)
    assert full.nbytes - held.nbytes == sliding * (256 - held.local_slots) * per_position
    ids = torch.randint(0, config.vocab_size, (1, 250), generator=torch.Generator().manual_seed(4))
    prefill = 37  # longer than the room: written in pieces of 8 (so too with every position)
    for fused in (True, False):
        got: list[torch.Tensor] = []
        want: list[torch.Tensor] = []
        for cache, out in ((held, got), (full, want)):
            with torch.no_grad():
                model(ids[:, :prefill], cache.rows(1, 1), 0)
                if cache is full:  # the same pieces, so the same rounding
                    for at in range(0, prefill, 8):
                        model(ids[:, at : min(at + 8, prefill)], cache.rows(1, 1), at)
            out.append(_steps(model, cache, ids, 1, prefill, fused))
        assert int(held.offsets[1]) > 200  # the buffer moved with the positions
        error = ((got[0] - want[0]).abs().amax(-1) / want[0].abs().amax(-1)).max().item()
        assert error < 2e-5 and torch.equal(got[0].argmax(-1), want[0].argmax(-1)), (fused, error)
    # Saved at position 230 (its offset with it), put in row 0, decoded on in both rows.
    at = 230
    again = KVCache(config, 2, 256, model.dtype, model.device, room=8)
    with torch.no_grad():
        model(ids[:, :prefill], again.rows(1, 1), 0)
    _steps(model, again, ids[:, :at], 1, prefill, True)
    again.load_row(0, at, again.save_row(1, at))
    assert int(again.offsets[0]) == int(again.offsets[1]) > 0
    assert torch.equal(_steps(model, again, ids, 0, at, True), _steps(model, again, ids, 1, at, True))


def test_sparse_attention_keeps_summaries_for_the_full_layers_alone_and_every_block_is_dense(
    family: dict[str, Any], int4: LlamaModel
) -> None:
    """Top-k block attention (float_cache.SparseAttention) beside a family's sliding layers:
    block summaries only for the layers that see every position (a sliding layer's window
    bounds it already, and its buffer moves), and with top_k covering every block the C
    step decodes far past the window in blocks of 8 with the dense step's logits bit for
    bit; with one block it does not, where a layer sees every position."""
    model, config = int4, int4.config
    every = [i for i in range(config.num_layers) if not config.layer_window(i)]
    dense = KVCache(config, 2, 256, model.dtype, model.device, room=8)
    sparse = KVCache(config, 2, 256, model.dtype, model.device, room=8, sparse=SparseAttention(32, 8, 0))
    assert sparse.summary is not None and sparse.summary.shape[0] == len(every)
    assert [i for i, at in enumerate(sparse.summary_index) if at >= 0] == every
    ids = torch.randint(0, config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(5))
    prefill = 37
    for cache in (dense, sparse):
        with torch.no_grad():
            model(ids[:, :prefill], cache.rows(1, 1), 0)
    want = _steps(model, dense, ids, 1, prefill, True)
    assert torch.equal(_steps(model, sparse, ids, 1, prefill, True), want)
    sparse.sparse = SparseAttention(1, 8, 0)
    with torch.no_grad():
        model(ids[:, :prefill], sparse.rows(0, 1), 0)
    one = _steps(model, sparse, ids[:, :120], 0, prefill, True)
    assert torch.equal(one, want[: 120 - prefill]) == (not every)


def _quant_steps(model: LlamaModel, cache: QuantKVCache, ids: torch.Tensor, row: int, start: int) -> torch.Tensor:
    """Logits of ids[start:] decoded one token a step, op by op, in cache row `row` (the
    other row parked at the cache's end)."""
    rows = []
    with torch.no_grad():
        for t in range(start, ids.shape[1]):
            positions = [cache.max_len - 1] * cache.batch
            positions[row] = t
            tokens = torch.zeros(cache.batch, 1, dtype=torch.long)
            tokens[row] = ids[0, t]
            rows.append(model.decode_step(tokens, cache, torch.tensor(positions), t + 1)[row])
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_quantized_cache_codes_its_sliding_layers_window_alone_and_answers_as_with_every_position(
    family: dict[str, Any], int4: LlamaModel, name: str
) -> None:
    """On the CPU a sliding layer's codes live in a circle of the key blocks its window can
    reach and one more (quant_cache.py): the cache takes less memory by exactly the code
    slots the sliding layers no longer hold, and the INT4 build answers bit for bit as
    over a cache coding every position (the same codes, read from other slots) through a
    prefill that codes more blocks than the circle holds, a chunk after it and a decode
    going round the circle again; a row saved there (what the prefix cache and the
    offload keep) and put in another row decodes on as the first."""
    model, config, fmt = int4, int4.config, FORMATS[name]  # type: ignore[index]
    sliding = sum(1 for i in range(config.num_layers) if config.layer_window(i))
    full = model.new_cache(2, 512, fmt, window_sized=False)
    held = model.new_cache(2, 512, fmt)
    assert isinstance(full, QuantKVCache) and isinstance(held, QuantKVCache) and full.local_slots == 0
    if not sliding or config.window >= 512:
        assert held.local_slots == 0 and held.nbytes == full.nbytes
        return
    assert held.local_slots == 2 * fmt.key_block  # a window of 24: its block and one more
    assert all(held.layer(i).circular == bool(config.layer_window(i)) for i in range(config.num_layers))

    def codes(cache: QuantKVCache, prefix: str) -> int:
        kept = (prefix + "k_", prefix + "v_")
        return sum(t.numel() * t.element_size() for n, t in cache._tensors().items() if n.startswith(kept))

    per_slot_full = codes(full, "") / (config.num_layers * full.layer(0).code_len)
    assert codes(held, "local_") == sliding * held.local_slots * per_slot_full  # the same slots, fewer
    assert full.nbytes - held.nbytes == sliding * (full.layer(0).code_len - held.local_slots) * per_slot_full
    # Rows of 512 (Phi-3's of 256: its original context): the prefill codes 192 positions
    # into 128 slots (Phi-3's 64), and the decode goes round the circle.
    length = held.max_len
    ids = torch.randint(0, config.vocab_size, (1, length - 42), generator=torch.Generator().manual_seed(4))
    prefill, chunk = (200, 40) if length >= 512 else (100, 20)
    logits = []
    for cache in (held, full):
        with torch.no_grad():
            first = model(ids[:, :prefill], cache.rows(1, 1), 0)[0, -1]
            after = model(ids[:, prefill : prefill + chunk], cache.rows(1, 1), prefill)[0, -1]
        logits.append(torch.cat([first[None], after[None], _quant_steps(model, cache, ids, 1, prefill + chunk)]))
    assert torch.equal(logits[0], logits[1])
    # Saved 30 positions before the end, put in row 0, decoded on in both rows.
    at = ids.shape[1] - 30
    again = model.new_cache(2, 512, fmt)
    assert isinstance(again, QuantKVCache)
    with torch.no_grad():
        model(ids[:, :prefill], again.rows(1, 1), 0)
    _quant_steps(model, again, ids[:, :at], 1, prefill)
    again.load_row(0, at, again.save_row(1, at))
    assert torch.equal(_quant_steps(model, again, ids, 0, at), _quant_steps(model, again, ids, 1, at))


def test_a_sliding_buffer_moves_the_window_to_its_front_and_refuses_what_it_cannot_hold() -> None:
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32,
        sliding_window=8, layer_types=("sliding", "full"),
    )  # fmt: skip
    cache = KVCache(config, 1, 64, torch.float32, torch.device("cpu"), room=4)
    assert cache.local_slots == 12 and cache.is_local == [True, False] and cache.layer(0)[0].shape[2] == 12
    assert cache.local_k is not None
    cache.local_k[0, 0, 0, :, 0] = torch.arange(12.0)  # slot j holds position j
    cache.make_room(0, 8, 11)  # fits below the scratch slot: nothing moves
    assert int(cache.offsets[0]) == 0
    with pytest.raises(ValueError, match="takes 4"):
        cache.make_room(0, 11, 16)
    cache.make_room(0, 11, 12)  # past the last data slot: positions 4..10 (the window before 11) to the front
    assert int(cache.offsets[0]) == 4 and cache.local_k[0, 0, 0, :7, 0].tolist() == list(range(4, 11))
    with pytest.raises(ValueError, match="before its sliding buffers' first"):
        cache.make_room(0, 3, 4)
    cache.make_room(0, 0, 2)  # a new sequence in the row
    assert int(cache.offsets[0]) == 0


@pytest.mark.skipif(not cpu_int4.available(), reason="no C compiler for the CPU kernels")
def test_the_batcher_speculates_over_the_sliding_buffers_as_over_every_position(
    family: dict[str, Any], int4: LlamaModel
) -> None:
    """Served: two sequences decoded together with prompt-lookup drafts (verified in the
    C step as rows of one step) over sliding buffers with room for 8 new positions take
    the tokens the same batcher takes with every position held."""
    if not any(int4.config.layer_window(i) for i in range(int4.config.num_layers)):
        pytest.skip("no sliding layer")
    config = int4.config
    pattern = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [pattern * 4, pattern[3:] * 3 + [7, 8]]  # repeated text: drafts to take
    answers = []
    for window_sized in (True, False):
        batcher = ContinuousBatcher(int4, None, frozenset(), slots=2, slot_len=256)
        batcher.cache = KVCache(config, 2, 256, int4.dtype, int4.device, window_sized=window_sized, room=8)
        batcher.speculative_tokens = 3
        params = [SamplingParams(max_new_tokens=250 - len(p), ignore_eos=True) for p in prompts]
        seqs = [Sequence(i, p, params[i]) for i, p in enumerate(prompts)]
        for seq in seqs:
            slot = batcher.kv.allocate_slots(str(seq.owner), len(seq.prompt) + seq.params.max_new_tokens)
            assert slot is not None
            batcher.admit(seq, slot)
        while batcher.running:
            for seq in batcher.step():
                assert seq.kv is not None
                batcher.kv.free(seq.kv)
        assert sum(s.accepted for s in seqs) > 0 and all(s.finish == "length" for s in seqs)
        answers.append([s.tokens for s in seqs])
    assert answers[0] == answers[1]


def test_what_the_fast_paths_do_not_implement_is_refused_by_name(family: dict[str, Any]) -> None:
    """The fused decode step implements every family's options (on CUDA, where the step
    kernels take the heads); the fused prefill and the ONNX export refuse them by name."""
    ours = load_checkpoint(family["ckpt"], dtype=torch.float32)
    assert fused_step.refusal(ours.model) is None
    refused = fused_prefill.refusal(ours.model)
    first = ours.model.config.family_options()[0]
    assert refused is not None and first in refused
    if family["name"] == "gemma3":
        assert f"sliding_window {WINDOW}" in refused and "mlp_activation gelu_tanh" in refused
    from engines.text.text_onnx import ExportError, export_text_onnx

    with pytest.raises(ExportError, match=first):
        export_text_onnx(family["ckpt"], family["ckpt"])


@contextmanager
def _without_windows(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention layers with their windows taken away inside the block (what a
    kernel that ignored the window would compute)."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    windows = [a.window for a in attentions]
    for a in attentions:
        a.window = 0
    try:
        yield
    finally:
        for a, w in zip(attentions, windows, strict=True):
            a.window = w


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.mark.parametrize("device", DEVICES)
def test_a_quantized_cache_keeps_the_window_and_the_query_scale(family: dict[str, Any], device: str) -> None:
    """Past the sliding window (a prefill longer than it, then one token at a time), the
    logits over an int8 cache stay near the float cache's; the same codes read as if the
    model had no window do not (so the window is what the kernel kept): the CPU's C
    kernel, and on CUDA Triton's or ours. int4's codes are checked against their own
    read-back with a window in tests/test_quant_cache.py and tests/test_cuda_kv_ops.py:
    on these random weights (q/k norms, sharp attention) its rounding alone moves the
    logits too far for this comparison to single out the window."""
    int8 = FORMATS["int8"]
    dtype = torch.float32 if device == "cpu" else torch.float16  # (the CUDA kernels take 16-bit types)
    ours = load_checkpoint(family["ckpt"], dtype=dtype, device=torch.device(device))
    model = ours.model
    config = model.config
    group = config.num_heads // config.num_kv_heads
    if device == "cuda" and (refused := step_ops.kv_refusal(device, int8, config.head_dim, group, dtype)):
        # (Qwen3's test model has heads of 24 channels, which no CUDA kernel of ours takes.)
        with pytest.raises(ValueError, match=re.escape(refused)):
            model.new_cache(1, 256, int8)
        return
    ids = torch.tensor([ours.tokenizer.encode(" ".join(CORPUS), add_special_tokens=False).ids[:200]], device=device)
    assert ids.shape[1] == 200  # past the int4 format's float tokens and three key blocks
    prefill = WINDOW + 5

    def run(kv_format: Any) -> torch.Tensor:
        cache = model.new_cache(1, 256, kv_format)
        steps = [model(ids[:, :prefill], cache, 0)[0, -1]]
        steps += [model(ids[:, t : t + 1], cache, t)[0, -1] for t in range(prefill, ids.shape[1])]
        return torch.stack(steps).float()

    want = run(None)
    got = run(int8)
    error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    if any(a.window for a in model.modules() if isinstance(a, Attention)):
        with _without_windows(model):
            unwindowed = run(int8)
        far = ((unwindowed - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        assert far > 10 * error, (error, far)
    assert error < 0.1, error


def test_family_options_name_each_option() -> None:
    base: dict[str, Any] = dict(vocab_size=8, hidden_size=8, num_layers=2, num_heads=2)
    base.update(num_kv_heads=1, intermediate_size=8)
    assert LlamaConfig(**base).family_options() == []
    gemma = LlamaConfig(
        **base,
        qk_norm=True,
        sliding_window=4,
        layer_types=("sliding", "full"),
        rope_local_theta=10_000.0,
        mlp_activation="gelu_tanh",
        embedding_scale=2.0,
        output_norms=True,
        attention_scale=0.25,
        final_logit_softcap=30.0,
    )
    assert gemma.family_options() == [
        "qk_norm",
        "sliding_window 4",
        "rope_local_theta 10000",
        "mlp_activation gelu_tanh",
        "embedding_scale 2",
        "output_norms",
        "attention_scale 0.25",
        "final_logit_softcap 30",
    ]
    assert [gemma.layer_window(i) for i in range(2)] == [4, 0]
    with pytest.raises(ValueError, match="mlp_activation 'relu'"):
        LlamaConfig(**base, mlp_activation="relu")


def _write_config(directory: Path, **fields: Any) -> Path:
    directory.mkdir(parents=True)
    base = {
        "model_type": "gemma3_text",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
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
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
        ({"hidden_activation": "gelu"}, "hidden_act 'gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias on a Qwen3 model"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        # A partial rotary of an odd count of a head's 8 channels; LongRoPE factors not one a frequency.
        ({"model_type": "phi3", "partial_rotary_factor": 0.7}, "partial_rotary_factor 0.7 (5 of 8 channels)"),
        (
            {"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
            "longrope short_factor: 1 factors for 4 frequencies",
        ),
    ],
)
def test_what_a_family_needs_that_we_do_not_do_is_refused_by_name(
    tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(SourceModelError, match=re.escape(named)):
        read_hf_config(_write_config(tmp_path / "m", **fields))


# -- Qwen3, Mistral and Phi-3 from GGUF ----------------------------------------------------


def _same_checkpoint(got: Path, want: Path) -> None:
    """Two float imports are one checkpoint: the same tensors bit for bit, and the same
    config but for what a GGUF file keeps in float32 (the norm epsilon, LongRoPE's
    attention factor)."""
    from safetensors.torch import load_file

    ours, theirs = LlamaConfig.from_json(got / "config.json"), LlamaConfig.from_json(want / "config.json")
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    if theirs.rope_scaling is not None:
        assert ours.rope_scaling is not None
        assert ours.rope_scaling["attention_factor"] == pytest.approx(theirs.rope_scaling["attention_factor"], rel=1e-6)
        assert ours.rope_scaling["short_factor"] == pytest.approx(theirs.rope_scaling["short_factor"], rel=1e-6)
        ours = dataclasses.replace(ours, rope_scaling=theirs.rope_scaling)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    a, b = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _gguf_answers_as_transformers(hf: Any, tokenizer: Any, gguf_ckpt: Path) -> None:
    """The GGUF import's float logits over 200 positions as serving computes them (a
    prefill past the window, a chunk, then token by token) within 1e-4 of transformers',
    its greedy tokens and its rendered prompt transformers'."""
    ours = load_checkpoint(gguf_ckpt, dtype=torch.float32)
    ids = torch.randint(0, ours.model.config.vocab_size, (1, POSITIONS), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf(ids).logits[0]
    assert_close(served_logits(ours.model, ids), theirs)
    assert ours.chat is not None
    text = ours.chat.render(MESSAGES)
    assert text == tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    _greedy_equals_transformers(ours, tokenizer, hf, text, 2 * WINDOW)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "phi3"], indirect=True)
def test_a_gguf_file_imports_to_the_hf_checkpoint_and_transformers_logits(
    family: dict[str, Any], tmp_path: Path
) -> None:
    """A file written as llama.cpp's converter writes the family's (Mistral's as `llama`
    with its window and interleaved q/k rows; Phi-4-mini's as `phi3` with its fused
    q/k/v and gate/up, its partial rotary, its LongRoPE factor tensors and its window) is
    imported to the checkpoint the model's Hugging Face directory imports to, and answers
    as transformers does."""
    path = write_family_gguf(family["hf"], family["tokenizer"], tmp_path / f"{family['name']}.gguf")
    imported = import_gguf(path, tmp_path / "engines", f"{family['name']}-small", progress=False)
    _same_checkpoint(imported, family["ckpt"])
    config = LlamaConfig.from_json(imported / "config.json")
    if family["name"] in ("mistral", "phi3"):
        assert config.layer_types == ("sliding", "sliding") and config.sliding_window == WINDOW
    if family["name"] == "phi3":
        assert config.rotary_dim == 12 and config.max_position == LONGROPE_ORIGINAL
    _gguf_answers_as_transformers(family["hf"], family["tokenizer"], imported)


def test_a_phi3_gguf_without_longrope_or_a_window_imports_as_its_hf_directory(tmp_path: Path) -> None:
    """Phi-3-mini's shape (every channel turned, no RoPE scaling) with no window, which
    llama.cpp's converter writes as a window of 0 (its mark of a Phi-4): a file whose
    q/k/v and gate/up are fused imports to the HF import's checkpoint, with no window; its
    Q4_0 linears are served as stored, the fused ones read as the row ranges they hold."""
    from edge.text.ops.int4 import dequantize
    from engines.text import gguf_int4
    from engines.text.import_gguf import GgufSource

    hf, tokenizer = make_model(tmp_path / "source", "phi3-plain")
    want = import_hf(tmp_path / "source", tmp_path / "engines", progress=False)
    path = write_family_gguf(hf, tokenizer, tmp_path / "phi3.gguf")
    got = import_gguf(path, tmp_path / "engines", "phi3-plain", progress=False)
    _same_checkpoint(got, want)
    config = LlamaConfig.from_json(got / "config.json")
    assert config.window == 0 and config.rotary_dim == 0 and config.rope_scaling is None
    _gguf_answers_as_transformers(hf, tokenizer, got)
    # Q4_0: each of q, k, v, gate and up is its fused tensor's rows, as gguf dequantizes them.
    import gguf

    q4 = write_family_gguf(hf, tokenizer, tmp_path / "phi3-q4.gguf", quant="Q4_0")
    source = GgufSource(q4)
    kept, why = gguf_int4.kept_linears(source)
    assert why is None and len(kept) == 2 * 7
    floats = source.read(list(source.names()))
    for name in ("layers.1.self_attn.k_proj", "layers.0.mlp.up_proj", "layers.0.mlp.gate_proj"):
        assert torch.equal(dequantize(kept[name]), floats[f"{name}.weight"]), name
    fused = gguf.GGUFReader(str(q4)).tensors
    qkv = next(t for t in fused if t.name == "blk.1.attn_qkv.weight")
    whole = torch.from_numpy(gguf.quants.dequantize(qkv.data, qkv.tensor_type).copy())
    assert torch.equal(floats["layers.1.self_attn.v_proj.weight"], whole[-2 * 16 :])


# -- Gemma 3 4B's layout: a vision-language model's text model ------------------------------


@pytest.mark.parametrize("layout", ["transformers-5", "transformers-4"])
def test_a_gemma3_vision_language_directory_imports_its_text_model_alone(
    tmp_path: Path, layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B): its language model is imported
    as a Gemma 3 text model from text_config, its weights under language_model.model.*
    (as transformers 5 and the Hub save them) or model.language_model.* (as transformers
    4 did), the head tied, the tower left out and said so; the text logits over 200
    positions are transformers' text-only forward's within 1e-4, and a job's image is
    refused naming the tower."""
    import logging

    import transformers
    from safetensors.torch import load_file, save_file

    from edge.vlm.vision_language import has_image_part, unserved_image_part
    from engines.text.hf_defaults import GEMMA3_TEXT_DEFAULTS

    defaults = transformers.Gemma3TextConfig().to_dict()
    assert {k: defaults[k] for k in GEMMA3_TEXT_DEFAULTS} == GEMMA3_TEXT_DEFAULTS
    hf, _ = make_gemma3_vlm(tmp_path / "source")
    weights = tmp_path / "source" / "model.safetensors"
    names = list(load_file(str(weights)))
    assert any(n.startswith("language_model.model.layers.") for n in names) and "lm_head.weight" not in names
    if layout == "transformers-4":
        moved = {
            (
                "model." + n if n.startswith(("language_model.", "multi_modal_projector.", "vision_tower.")) else n
            ).replace("model.language_model.model.", "model.language_model."): t
            for n, t in load_file(str(weights)).items()
        }
        save_file(moved, str(weights), metadata={"format": "pt"})
        assert any(n.startswith("model.language_model.layers.") for n in moved)
    with caplog.at_level(logging.INFO, logger="engines.text.import_hf"):
        checkpoint = import_hf(tmp_path / "source", tmp_path / "engines", progress=False)
    assert "Gemma 3's vision tower is not served" in caplog.text
    config = read_hf_config(tmp_path / "source")
    assert config.output_norms and config.tie_embeddings and config.sliding_window == WINDOW
    # Its text_config names a logit cap, which transformers' Gemma3ForConditionalGeneration
    # does not apply (its released configs name none): neither do we.
    assert hf.config.text_config.final_logit_softcapping == 30.0 and config.final_logit_softcap == 0.0
    assert not has_image_part(checkpoint)
    why = unserved_image_part(checkpoint)
    assert why is not None and why.startswith("Gemma 3's vision tower is not served")
    ours = load_checkpoint(checkpoint, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (1, POSITIONS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[0]
    assert_close(served_logits(ours.model, ids), theirs)


# -- the real Gemma 3 270M ----------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Insulin lowers blood glucose because"]


@pytest.mark.slow
def test_the_real_gemma3_270m_gguf_answers_as_transformers_does(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers parses the file again for each thing it loads from it (the config, the
    # tokenizer, the weights), a GGUFReader each: 13 s apiece for Gemma's 262,144 tokens.
    # One parse serves them all here; what each reads from it is the same.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))

    from engines.text.gemma3_270m import NAME, gemma3_270m_gguf
    from engines.text.import_gguf import GEMMA3_TEMPLATE
    from tests.conftest import _shared_engines

    engines = _shared_engines(tmp_path_factory)
    path = gemma3_270m_gguf(engines / "sources")
    ours = load_checkpoint(import_gguf(path, engines, NAME, progress=False), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert ours.model.config.layer_types == tuple(t.split("_")[0] for t in hf.config.layer_types)
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]  # the BOS first, as the model was trained
        assert [ours.tokenizer.token_to_id("<bos>"), *ours.tokenizer.encode(text, add_special_tokens=False).ids] == ids
        new = 24
        cache = ours.model.new_cache(1, 64)
        got = generate(ours.model, ours.tokenizer, ids, SamplingParams(max_new_tokens=new), frozenset(), cache)
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False)
        assert got.token_ids == out[0, len(ids) :].tolist()
    # The file holds no template: Gemma 3's is served, rendered as transformers renders it.
    assert ours.chat is not None and ours.model.config.vocab_size == len(tokenizer)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    rendered = ours.chat.render(MESSAGES)
    assert rendered == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<bos><start_of_turn>user\n") and rendered.endswith("<start_of_turn>model\n")
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in ours.eos_ids


# -- INT4 through the daemon ---------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mistral", "phi3"])
def test_a_family_directory_built_by_edgectl_answers_a_qa_job_in_int4(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, broker: Broker, requester: Requester
) -> None:
    """Each family's Hugging Face directory (Gemma 3's as Gemma 3 4B's: a vision-language
    model whose text model is served) is built by `edgectl build` in AWQ INT4 and answers a
    qa job through the daemon, the same answer greedy decoding of the build gives here; a
    job's image sent to the Gemma 3 build is refused naming its unserved tower. The builds
    go to the session's engine cache (EDGE_TEST_ENGINE_DIR reuses them: the models are
    the same, seeded, so their builds' keys are)."""
    import base64

    from edge.builds import locate
    from edge.config.loader import load_profile
    from edge.config.text import DEFAULT_SYSTEM_PROMPT
    from edge.text.prompt import Prompter
    from tests.conftest import _shared_engines

    source = tmp_path / f"{name}-small"
    if name == "gemma3":
        make_gemma3_vlm(source)
    else:
        make_model(source, name)
    qa = {"source": str(source), "adapter": "none", "max_new_tokens": 12}
    models = {"ocr": {"enabled": False}, "inspect": {"enabled": False}, "qa": qa}
    device = f"fam-{name}"
    profile = write_profile(tmp_path, broker.port, _shared_engines(tmp_path_factory), device_id=device, models=models)
    built = edgectl("build", "--profile", str(profile), timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    engine = locate(load_profile(profile), "qa", None)
    assert json.loads((engine / "manifest.json").read_text())["recipe"]["method"] == "awq"
    d = start_daemon(profile)
    try:
        d.wait_ready(timeout=120)  # built already: the daemon finds it
        doc = requester.request(f"edge/{device}/jobs/qa", {"id": "q1", "question": "Is 38.5 a fever?"}, 120)
        if name == "gemma3":
            png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(32)).decode()
            job = {"id": "q2", "question": "What is on the label?", "image": {"data": png}}
            refused = requester.request(f"edge/{device}/jobs/qa", job, 120)
    finally:
        d.stop()
    assert doc["status"] == "ok", doc
    if name == "gemma3":
        error = refused["error"]
        assert (error["code"], error["field"]) == ("unavailable", "image"), refused
        assert error["message"].startswith("Gemma 3's vision tower is not served"), refused
    # The same INT4 checkpoint in this process, greedy: the daemon served it as built.
    ours = load_checkpoint(engine, dtype=torch.float32)
    prompt = Prompter(ours.tokenizer, ours.chat, DEFAULT_SYSTEM_PROMPT).ids("Is 38.5 a fever?", None)
    cache = ours.model.new_cache(1, len(prompt) + 12)
    got = generate(ours.model, ours.tokenizer, prompt, SamplingParams(max_new_tokens=12), ours.eos_ids, cache)
    output = doc["output"]
    assert output["prompt_tokens"] == len(prompt)
    assert output["completion_tokens"] == len(got.token_ids) >= 3
    assert output["answer"].strip() == got.text.strip() != ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_each_family_answers_as_transformers_and_its_int4_build_as_on_the_cpu(family: dict[str, Any]) -> None:
    """On a GPU: the float model's logits over 200 positions as serving computes them
    (a prefill, a chunk, then the decode step; a sliding window's masks included) equal
    transformers' to float32 rounding. Its AWQ INT4 build, loaded as the GPU profile
    serves it (our INT4 kernel, float16; the fused step, tested against the per-op one
    below, where the step kernels take its heads: Triton's), with a float token table gives
    the same build's float32
    CPU logits to float16 rounding (within 2%: measured 0.2-0.6%); with the served int8
    table (random weights: 2% off, Gemma's scaled embedding 7%), the same top token at
    nearly every position."""
    from bench.text_engines import load_engine
    from engines.text.quantize import QuantRecipe
    from engines.text.text_build import quantize_checkpoint

    cuda = torch.device("cuda")
    flt = load_checkpoint(family["ckpt"], dtype=torch.float32, device=cuda)
    ids = torch.randint(0, flt.model.config.vocab_size, (1, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = family["hf"](ids).logits[0]
    assert_close(served_logits(flt.model, ids.to(cuda)).cpu(), theirs)

    int4 = quantize_checkpoint(family["ckpt"], QuantRecipe(method="awq", group_size=32), progress=False)
    want = served_logits(load_checkpoint(int4, dtype=torch.float32).model, ids)
    for table, most_rel, least_top1 in (("float", 2e-2, 0.95), ("auto", 1.0, 0.85)):
        engine = load_engine(int4, "cuda", warm=False, embedding=table)
        config = engine.config()
        assert config["device"] == "cuda" and config["kernel"] == "cuda-mma"
        assert config["fused_step"] == (step_ops.backend(cuda) == "triton")  # ours take no heads of 16 or 24
        assert config["embedding"] == ("float" if table == "float" else "int8")
        with torch.inference_mode():
            got = served_logits(engine.model, ids.to(cuda)).float().cpu()
        rel = ((got - want).norm() / want.norm()).item()
        top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert rel < most_rel and top1 >= least_top1, (table, rel, top1)


# -- the fused decode step on CUDA -----------------------------------------------------------


def _step_kernels(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """The step kernels that serve CUDA in this test: Triton's, or ours with Triton hidden
    (as on a Jetson)."""
    from edge.text.ops.cuda import decode_ops as cuda_ops

    if backend == "triton" and not step_ops.triton_present():
        pytest.skip("Triton is not installed")
    if backend == "cuda" and not cuda_ops.available("cuda"):
        pytest.skip("our CUDA decode kernels did not build here")
    monkeypatch.setattr(step_ops, "_chosen", {"cuda": backend, "cuda:0": backend})


def _logits_of(model: LlamaModel, kv: str, positions: int, fused: bool) -> torch.Tensor | None:
    """Logits of the fused decode step (`fused`) or the per-op one, decoding row 1 of a
    2-row cache (the other parked at its end) from a prefill shorter than the window to
    `positions`: a float cache whose sliding layers keep their window and room for 8 new
    positions (moved every 8 steps past the window), or an int8 one. None where the
    quantized-KV kernels refuse the model's heads (the refusal asserted)."""
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, positions), generator=torch.Generator().manual_seed(6))
    prefill = WINDOW - 4
    if kv == "float":  # in the activations' type
        cache: KVCache | QuantKVCache = KVCache(config, 2, 256, model.dtype, model.device, room=8)
    else:
        group = config.num_heads // config.num_kv_heads
        refused = step_ops.kv_refusal(model.device, FORMATS["int8"], config.head_dim, group, model.dtype)
        if refused:
            with pytest.raises(ValueError, match=re.escape(refused)):
                model.new_cache(2, 256, FORMATS["int8"])
            return None
        cache = model.new_cache(2, 256, FORMATS["int8"])
    with torch.no_grad():
        model(ids[:, :prefill].to(model.device), cache.rows(1, 1), 0)
    logits = _steps(model, cache, ids, 1, prefill, fused).cpu()
    if isinstance(cache, KVCache) and config.window:
        assert int(cache.offsets[1]) > positions - 2 * WINDOW  # the buffers moved with the positions
    return logits


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(the largest relative error of any position's logits, the share of positions with
    the same top token)."""
    error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    return error, (got.argmax(-1) == want.argmax(-1)).float().mean().item()


def _fused_against_per_op(model: LlamaModel, kv: str, positions: int) -> tuple[float, float] | None:
    """_compare of the fused step's logits against the per-op step's (_logits_of); None
    where the quantized-KV kernels refuse the model's heads."""
    got = _logits_of(model, kv, positions, fused=True)
    if got is None:
        return None
    want = _logits_of(model, kv, positions, fused=False)
    assert want is not None
    return _compare(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("kv", ["float", "int8"])
def test_on_cuda_the_fused_step_serves_the_familys_int4_build_as_the_per_op_step(
    family: dict[str, Any], int4_build: Path, backend: str, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the family's INT4 build (float16, our INT4 kernel) decodes in the fused
    step (every option of its family: q/k norms, the window over the sliding buffers, the
    local rotary table, the partial rotary, GeGLU, the output norms, the scaled embedding,
    the query scale and the logit cap) with the per-op step's logits over 200 positions,
    past the window, over a float16 cache and an int8 one. With Triton's step kernels, or
    ours with Triton hidden: ours take heads of 64, 128 or 256 channels, not these test
    models' 16 and 24, and say so (the family-shaped models of the next test have heads
    ours take); Triton's quantized-KV kernels refuse Qwen3's heads of 24 by name."""
    _step_kernels(monkeypatch, backend)
    cuda = torch.device("cuda")
    model = load_checkpoint(int4_build, dtype=torch.float16, device=cuda).model
    config = model.config
    group = config.num_heads // config.num_kv_heads
    refused = step_ops.attention_refusal(cuda, config.head_dim, group, model.dtype, config.hidden_size)
    if refused:
        assert backend == "cuda" and f"head_dim {config.head_dim}" in refused
        assert not fused_step.can_fuse(model)
        return
    assert fused_step.can_fuse(model) and fused_step.refusal(model) is None
    measured = _fused_against_per_op(model, kv, POSITIONS)
    if measured is None:
        assert family["name"] == "qwen3" and kv == "int8"
        return
    error, top1 = measured
    # An int8 cache's rounding differs between the steps' orders of operations.
    assert error < (2e-2 if kv == "float" else 4e-2) and top1 >= 0.95, (error, top1)


def _family_shaped(config: LlamaConfig) -> LlamaConfig:
    """A family's options (its config's) on heads of 64 channels, which both step backends'
    kernels take: a partial rotary turns the same share of a head, LongRoPE's factors
    stretched to its frequencies."""
    rotary = config.rotary_dim * 64 // config.head_dim if config.rotary_dim else 0
    scaling = config.rope_scaling
    if scaling and "short_factor" in scaling:
        short = scaling["short_factor"]
        half = (rotary or 64) // 2
        scaling = {**scaling, "short_factor": [short[i * len(short) // half] for i in range(half)]}
    return dataclasses.replace(
        config,
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=min(config.num_kv_heads, 2),
        head_size=64,
        rotary_dim=rotary,
        rope_scaling=scaling,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("kv", ["float", "int8"])
def test_on_cuda_the_fused_step_serves_each_familys_options_on_both_backends(
    family: dict[str, Any], backend: str, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The family's options on heads of 64 channels (random INT4 weights, bfloat16, our
    INT4 kernel): the fused step serves them with either backend's step kernels (and the
    norms folded into the products where the layer is Llama's between them: no output
    norms, SiLU), its logits over 200 positions, past the window, over a float cache (the
    activations' type) and an int8 one as near the same model's float32 per-op step as
    the bfloat16 per-op step's are."""
    from engines.text.random_llama import random_int4_llama

    _step_kernels(monkeypatch, backend)
    config = _family_shaped(read_hf_config(family["source"]))
    assert [o.split()[0] for o in config.family_options()] == [
        o.split()[0] for o in read_hf_config(family["source"]).family_options()
    ]
    model = random_int4_llama(config, "cuda", "cuda-mma", group=32, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:  # about one: a norm applied with another's weight, or not at all, shows
                weight.copy_(1.0 + 0.2 * torch.randn(weight.shape, device="cuda", generator=gen))
    assert fused_step.can_fuse(model)
    assert fused_step.folds_norm(model, 2)[0] == (not config.output_norms and config.mlp_activation == "silu")
    # The same model in float32 (its INT4 weights and its bfloat16 parameters, widened),
    # per op: what both bfloat16 steps are measured against. bfloat16 rounding alone
    # parts them further on some families (Gemma 3's scaled embedding and output norms
    # amplify it), so the fused step must be as near the float32 step as the per-op one
    # is, not equal to the per-op one.
    exact = random_int4_llama(config, "cuda", "dequant", group=32, dtype=torch.float32, seed=3)
    with torch.no_grad():
        for (name, wide), (twin, narrow) in zip(exact.named_parameters(), model.named_parameters(), strict=True):
            assert name == twin
            wide.copy_(narrow.float())
    want = _logits_of(exact, "float", POSITIONS, fused=False)
    got = _logits_of(model, kv, POSITIONS, fused=True)
    per_op = _logits_of(model, kv, POSITIONS, fused=False)
    assert want is not None and got is not None and per_op is not None
    (error, top1), (per_op_error, per_op_top1) = _compare(got, want), _compare(per_op, want)
    assert error <= max(4e-2, 1.25 * per_op_error) and top1 >= min(0.9, per_op_top1 - 0.03), (
        (error, top1),
        (per_op_error, per_op_top1),
    )
