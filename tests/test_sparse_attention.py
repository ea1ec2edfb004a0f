"""Top-k block attention in the CPU's decode step (models.qa.sparse_attention; cpu_step.c,
edge/text/kv/float_cache.py): the step's block selection is a torch reference's, a step
that keeps every block is the dense step bit for bit, a block planted far back is found
with one block to spare, the key summaries are the cache's own after every path that
writes it, and what does not select yet (CUDA) says so by name. The int8/int4 cache's
sparse attention: tests/test_sparse_quant_attention.py."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from edge.config.text import QAModelConfig, SparseAttentionConfig
from edge.text import engine as text_engine
from edge.text.engine import TextEngine
from edge.text.kv.float_cache import KVCache, SparseAttention
from edge.text.kv.kv_quant import FORMATS
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model import llama
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.model.llama import LlamaModel
from edge.text.ops.cpu import cpu_int4, cpu_step
from edge.text.runtime import cpu_step as runtime_step
from edge.text.runtime import fused_step
from edge.text.runtime.generate import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="no C compiler for the CPU kernels")


@pytest.fixture(scope="module")
def served(engine_dir: Path) -> TextCheckpoint:
    """The served build on the exact CPU kernel (float32 products: the step's sums in a
    fixed order, so a dense and a sparse step that keeps everything agree to the bit)."""
    from engines.text.text_build import build_text_engine

    path = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    return load_checkpoint(path, cpu_kernel="exact")


def _reference_spans(q: torch.Tensor, summary: torch.Tensor, last: int, block: int, k: int) -> list[tuple[int, int]]:
    """The selection as the issue states it, in torch: block 0 and the last two always;
    of the others the k with the highest bound max over the group's heads of sum over
    channels of max(q min, q max), ties to the lower block; spans in position order."""
    blocks = last // block + 1
    keep = {0, blocks - 1, max(blocks - 2, 0)}
    candidates = list(range(1, blocks - 2))
    if len(candidates) <= k:
        keep |= set(candidates)
    elif k > 0:
        lo, hi = summary[:blocks, 0], summary[:blocks, 1]
        bound = torch.maximum(q[:, None, :] * lo[None], q[:, None, :] * hi[None]).sum(-1).amax(0)
        keep |= set(sorted(candidates, key=lambda b: (-float(bound[b]), b))[:k])
    spans: list[tuple[int, int]] = []
    for b in sorted(keep):
        first, end = b * block, min(b * block + block - 1, last)
        if spans and spans[-1][1] + 1 == first:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((first, end))
    return spans


def test_the_steps_selection_is_the_references_ties_to_the_lower_block() -> None:
    """Small integers, so every bound is exact in float32 on both sides and ties are
    ties: equal blocks (copies of one) go to the lower index."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for group, dim in ((1, 8), (3, 64), (4, 16)):
        for block in (4, 16):
            for _ in range(40):
                last = int(torch.randint(0, 300, (1,), generator=gen))
                blocks = last // block + 1
                a = torch.randint(-6, 7, (blocks, dim), generator=gen).float()
                b = torch.randint(-6, 7, (blocks, dim), generator=gen).float()
                summary = torch.stack([torch.minimum(a, b), torch.maximum(a, b)], dim=1)
                if blocks > 6:
                    summary[blocks // 2] = summary[1]  # a tie with an earlier block
                q = torch.randint(-4, 5, (group, dim), generator=gen).float()
                for k in (0, 1, 2, 5, blocks):
                    got = cpu_step.select(q, summary, last, block, k)
                    assert got == _reference_spans(q, summary, last, block, k), (group, dim, block, last, k)
                    checked += 1
    assert checked == 3 * 2 * 40 * 5


def _decode(model: LlamaModel, cache: KVCache, tokens: list[int], positions: list[int]) -> torch.Tensor:
    """One step of the CPU's C step: token i at positions[i] of cache row i (the highest
    position attended sets kv_len; a row at the cache's last slot is not advanced)."""
    ids = torch.tensor(tokens).view(-1, 1)
    pos = torch.tensor(positions)
    live = [p for p in positions if p != cache.max_len - 1]
    return fused_step.decode_step(model, ids, cache, pos, max(live) + 1)


def test_a_step_that_keeps_every_block_is_the_dense_step_bit_for_bit(served: TextCheckpoint) -> None:
    """Two sequences and a row not advanced, decoded over 300 positions in blocks of 16,
    top_k covering every block from position 0 on: every logit as the dense step's, bit
    for bit (the same positions summed in the same order), and a verification of drafts
    likewise. Selection really ran (the summaries were brought up to each position), and
    with one block it answers otherwise."""
    model = served.model
    assert fused_step.steps_on_cpu(model)
    torch.manual_seed(3)
    slots, block = 384, 16
    every = SparseAttention(top_k_blocks=slots // block, block_tokens=block, min_context=0)
    dense, sparse = model.new_cache(3, slots), model.new_cache(3, slots, sparse=every)
    prompts = [torch.randint(0, model.config.vocab_size, (1, n)) for n in (40, 23)]
    for cache in (dense, sparse):
        for row, prompt in enumerate(prompts):
            model(prompt, cache.rows(row, 1), 0)
    tokens, lengths = [int(p[0, -1]) for p in prompts], [40, 23]
    for _ in range(280):
        positions = [lengths[0] - 1, lengths[1] - 1, slots - 1]
        want = _decode(model, dense, [*tokens, 0], positions)
        got = _decode(model, sparse, [*tokens, 0], positions)
        assert torch.equal(got[:2], want[:2]), positions
        tokens = want[:2].argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    assert sparse.summarized is not None and sparse.summarized[:2].tolist() == [n - 1 for n in lengths]
    chain = [tokens[0], 11, 220, 35, 987]
    start = lengths[0] - 1
    assert torch.equal(
        runtime_step.verify(model, chain, sparse, 0, start), runtime_step.verify(model, chain, dense, 0, start)
    )
    sparse.sparse = SparseAttention(top_k_blocks=1, block_tokens=block, min_context=0)
    one = _decode(model, sparse, [tokens[0]], [start])
    assert not torch.equal(one[0], _decode(model, dense, [tokens[0]], [start])[0])


def _queries(model: LlamaModel, cache: KVCache, token: int, position: int) -> dict[int, torch.Tensor]:
    """Each layer's queries [heads, head dim] (turned by the rotary, unscaled) for a token
    at `position` of row 0, from the model's own step op by op on a copy of the cache."""
    got: dict[int, torch.Tensor] = {}
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(model.layers)}
    original = llama.Attention._decode_at

    def record(self: llama.Attention, q: torch.Tensor, *args: Any) -> torch.Tensor:
        got[layer_of[id(self)]] = q[0, :, 0].clone()
        return original(self, q, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama.Attention, "_decode_at", record)
        model.decode_step(torch.tensor([[token]]), copy.deepcopy(cache), torch.tensor([position]), position + 1)
    return got


def _bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Each block's bound [blocks] for a group's queries q [group, D] (the reference's)."""
    return torch.maximum(q[:, None, :] * lo[None], q[:, None, :] * hi[None]).sum(-1).amax(0)


def test_a_key_planted_far_back_is_found_with_one_block(served: TextCheckpoint) -> None:
    """In every layer and KV head a key is planted at a position of block 3 (of 19) that
    the token's queries score far above every other key and whose block bounds above
    every other block: dense attention then reads almost nothing else, and the sparse
    step with one block to choose must choose it to answer as the dense one does
    (without the plants, one block answers otherwise: the check has teeth). Planted layer
    by layer, each from the queries the planted layers before it give."""
    model = served.model
    cfg = model.config
    torch.manual_seed(4)
    slots, block, length, planted = 320, 16, 300, 3 * 16 + 7
    one = SparseAttention(top_k_blocks=1, block_tokens=block, min_context=0)
    dense, sparse = model.new_cache(1, slots), model.new_cache(1, slots, sparse=one)
    prompt = torch.randint(0, cfg.vocab_size, (1, length))
    for cache in (dense, sparse):
        model(prompt, cache, 0)
    token, group = 42, cfg.num_heads // cfg.num_kv_heads
    unplanted = _decode(model, dense, [token], [length]), _decode(model, sparse, [token], [length])
    assert float((unplanted[1] - unplanted[0]).abs().max() / unplanted[0].abs().max()) > 1e-2
    first = model.layers[0]
    assert isinstance(first, llama.DecoderLayer)
    scale = first.self_attn.scale
    for i in range(cfg.num_layers):
        q = _queries(model, dense, token, length)[i].double()
        keys = dense.layer(i)[0][0, :, :length].double()  # [KV heads, positions, D]
        for j in range(cfg.num_kv_heads):
            group_q = q[j * group : (j + 1) * group]
            scores = group_q @ keys[j].T
            blocks = keys[j, : length // block * block].view(-1, block, cfg.head_dim)
            others = _bounds(group_q, blocks.amin(1), blocks.amax(1))
            others[planted // block] = -torch.inf
            # Every head of the group scores the key at `target`: 40 above its best other
            # key after the scale, and its block's bound above every other block's.
            target = max(float(scores.amax()) + 40.0 / scale, float(others.amax()) * 1.05 + 1.0)
            key = group_q.T @ torch.linalg.solve(group_q @ group_q.T, torch.full((group,), target).double())
            for cache in (dense, sparse):
                cache.layer(i)[0][0, j, planted] = key.float()
        sparse.rewritten(planted, 1)  # a write the step did not make
    want = _decode(model, dense, [token], [length])
    got = _decode(model, sparse, [token], [length])
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_steps_attention_is_a_torch_softmax_over_the_selected_blocks(served: TextCheckpoint) -> None:
    """Every layer's attention as the step runs it (edge_cpu_step_attention, which the
    benchmark times) for a token at position 299 with random queries: over every position
    it is torch's softmax attention, over the selected blocks torch's restricted to the
    reference's spans (summaries from a torch min and max), to float32 rounding; a k that
    covers every block is dense to the bit."""
    model = served.model
    cfg = model.config
    torch.manual_seed(6)
    length, block, k = 300, 16, 3
    cache = model.new_cache(1, 320, sparse=SparseAttention(top_k_blocks=k, block_tokens=block, min_context=0))
    model(torch.randint(0, cfg.vocab_size, (1, length - 1)), cache, 0)
    _decode(model, cache, [9], [length - 1])  # the summaries brought up to the position
    group, width = cfg.num_heads // cfg.num_kv_heads, cfg.num_heads * cfg.head_dim
    q = torch.randn(cfg.num_layers, 1, width)
    pos = torch.tensor([length - 1])
    sparse = runtime_step.attention(model, cache, q, pos, length)
    cache.sparse = None
    dense = runtime_step.attention(model, cache, q, pos, length)
    cache.sparse = SparseAttention(top_k_blocks=length // block, block_tokens=block, min_context=0)
    assert torch.equal(runtime_step.attention(model, cache, q, pos, length), dense)
    first = model.layers[0]
    assert isinstance(first, llama.DecoderLayer)
    scale = first.self_attn.scale
    compared = 0
    for i in range(cfg.num_layers):
        keys, values = (t[0, :, :length] for t in cache.layer(i))
        for j in range(cfg.num_kv_heads):
            heads = q[i, 0].view(cfg.num_heads, cfg.head_dim)[j * group : (j + 1) * group]
            blocks = torch.nn.functional.pad(keys[j], (0, 0, 0, -length % block)).view(-1, block, cfg.head_dim)
            last = blocks[-1, : length % block or block]
            lo = torch.cat([blocks[:-1].amin(1), last.amin(0, keepdim=True)])
            hi = torch.cat([blocks[:-1].amax(1), last.amax(0, keepdim=True)])
            bound = _bounds(heads, lo, hi)[1:-2].sort(descending=True).values
            if float(bound[k - 1] - bound[k]) < 1e-3 * float(bound[k - 1].abs()):
                continue  # a near tie float32 rounding may order either way
            spans = _reference_spans(heads, torch.stack([lo, hi], dim=1), length - 1, block, k)
            for got, kept in ((dense, [(0, length - 1)]), (sparse, spans)):
                at = torch.cat([torch.arange(a, b + 1) for a, b in kept])
                weights = torch.softmax(heads @ keys[j, at].T * scale, dim=-1)
                want = weights @ values[j, at]
                out = got[i, 0].view(cfg.num_heads, cfg.head_dim)[j * group : (j + 1) * group]
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared > cfg.num_layers * cfg.num_kv_heads // 2


def _assert_summaries_are_the_caches(cache: KVCache, lengths: dict[int, int]) -> None:
    """Every summarized layer's block summaries of each row, over the positions the row's
    count vouches for, equal a torch min and max over the cache's keys there; the rows in
    `lengths` are vouched for up to their length (the last step selected)."""
    assert cache.summary is not None and cache.summarized is not None
    block = cache.block_tokens
    for row, length in lengths.items():
        assert int(cache.summarized[row]) == length, row
    for layer, at in enumerate(cache.summary_index):
        if at < 0:
            continue
        keys = cache.layer(layer)[0]
        for row in range(cache.batch):
            upto = int(cache.summarized[row])
            for b in range(-(-upto // block)):
                span = keys[row, :, b * block : min(b * block + block, upto)]
                summary = cache.summary[at, row, :, b]
                assert torch.equal(summary[:, 0], span.amin(1)), (layer, row, b)
                assert torch.equal(summary[:, 1], span.amax(1)), (layer, row, b)


def test_the_summaries_are_the_caches_own_after_every_path_that_writes_it(served: TextCheckpoint) -> None:
    """Prefill, steps, a verification whose drafts are turned down and written again, the
    per-op step over those positions, a chunk after cached tokens, a new sequence in a row
    another filled further, and a saved row loaded over a longer one: after each, the
    summaries the step selects by are a torch min and max over the keys (a write path
    that left the summaries vouching for keys it changed fails here)."""
    model = served.model
    torch.manual_seed(5)
    vocab = model.config.vocab_size
    slots = 256
    cache = model.new_cache(3, slots, sparse=SparseAttention(top_k_blocks=2, block_tokens=16, min_context=0))

    def prompt(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (1, n))

    def steps(row: int, start: int, count: int) -> int:
        """count C steps of row `row` from `start` (the others not advanced); the length after."""
        for at in range(start, start + count):
            tokens, positions = [0, 0, 0], [slots - 1] * 3
            tokens[row], positions[row] = 7 + at, at
            _decode(model, cache, tokens, positions)
        return start + count

    model(prompt(70), cache.rows(0, 1), 0)
    length = steps(0, 70, 10)
    _assert_summaries_are_the_caches(cache, {0: length})
    # Four drafts verified, one taken: the next step writes over the others' keys.
    runtime_step.verify(model, [1, 2, 3, 4, 5], cache, 0, length)
    length = steps(0, length + 2, 3)
    _assert_summaries_are_the_caches(cache, {0: length})
    # Drafts verified, one of them written again by the per-op step (a write the C step
    # does not see), then the C step on after them.
    runtime_step.verify(model, [6, 7, 8, 9], cache, 0, length)
    model.fused_decode = False
    try:
        fused_step.decode_step(model, torch.tensor([[5]]), cache.rows(0, 1), torch.tensor([length + 1]), length + 2)
    finally:
        model.fused_decode = None
    length = steps(0, length + 4, 2)
    _assert_summaries_are_the_caches(cache, {0: length})
    # A prompt in two chunks, the second after cached tokens.
    model(prompt(40), cache.rows(1, 1), 0)
    model(prompt(30), cache.rows(1, 1), 40)
    steps(1, 70, 2)
    _assert_summaries_are_the_caches(cache, {0: length, 1: 72})
    # Row 2 filled far, then row 0's sequence saved and loaded over it.
    model(prompt(150), cache.rows(2, 1), 0)
    steps(2, 150, 3)
    saved = cache.save_row(0, length)
    cache.load_row(2, length, saved)
    steps(2, length, 1)
    # A new sequence in row 0, shorter than the one it replaces.
    model(prompt(50), cache.rows(0, 1), 0)
    steps(0, 50, 2)
    _assert_summaries_are_the_caches(cache, {0: 52, 1: 72, 2: length + 1})


def test_the_summaries_are_counted_in_the_caches_bytes(served: TextCheckpoint) -> None:
    model = served.model
    cfg = model.config
    dense = model.new_cache(2, 256)
    sparse = model.new_cache(2, 256, sparse=SparseAttention(top_k_blocks=2, block_tokens=64))
    summary = cfg.num_layers * 2 * cfg.num_kv_heads * (256 // 64) * 2 * cfg.head_dim * 4
    assert sparse.nbytes == dense.nbytes + summary + 2 * 8
    # An int8 cache on the CPU keeps its own (tests/test_sparse_quant_attention.py).
    quantized = model.new_cache(2, 256, FORMATS["int8"], sparse=SparseAttention(top_k_blocks=2))
    assert isinstance(quantized, QuantKVCache) and quantized.summary is not None
    with pytest.raises(ValueError, match="CPU's decode step"):
        KVCache(cfg, 1, 64, torch.float32, torch.device("meta"), sparse=SparseAttention(top_k_blocks=2))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sparse_attention": {"enabled": True, "top_k_blocks": 0}}, "top_k_blocks"),
        ({"sparse_attention": {"enabled": True, "block_tokens": 4}}, "block_tokens"),
        ({"sparse_attention": {"enabled": True, "topk": 4}}, "topk"),
        ({"sparse_attention": {"enabled": True, "min_context": 2048}}, r"min_context \(2048\) is not below"),
        (
            {"sparse_attention": {"enabled": True, "top_k_blocks": 30, "min_context": 1024}},
            r"top_k_blocks \(30\) blocks.*cover",
        ),
    ],
)
def test_a_sparse_section_that_cannot_select_is_refused_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        QAModelConfig.model_validate({"max_context_tokens": 2048, **fields})


def test_a_sparse_section_left_off_is_not_checked_against_the_context() -> None:
    off = {"enabled": False, "min_context": 4096, "top_k_blocks": 100}
    cfg = QAModelConfig.model_validate({"max_context_tokens": 2048, "sparse_attention": off})
    assert not cfg.sparse_attention.enabled


def test_the_engine_reports_sparse_attention_served_or_refused_by_name(
    served: TextCheckpoint, caplog: pytest.LogCaptureFixture
) -> None:
    on = SparseAttentionConfig(enabled=True, top_k_blocks=2, block_tokens=16, min_context=32)
    engine = TextEngine(served, QAModelConfig(max_context_tokens=256, max_sequences=1, sparse_attention=on))
    reported = engine.config()["sparse_attention"]
    assert reported == {**on.model_dump(), "served": True, "refused": None}
    assert isinstance(engine.batcher.cache, KVCache) and engine.batcher.cache.sparse == SparseAttention(2, 16, 32)
    answer = engine.generate(list(range(100, 200)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(answer.tokens) == 4
    off = TextEngine(served, QAModelConfig(max_context_tokens=256, max_sequences=1)).config()["sparse_attention"]
    assert off["enabled"] is False and off["served"] is False and off["refused"] is None
    # An int8 or int4 cache's CPU kernel selects too (its steps run op by op).
    for dtype in ("int8", "int4"):
        quantized = QAModelConfig.model_validate({"max_context_tokens": 256, "kv_dtype": dtype, "sparse_attention": on})
        assert text_engine.sparse_attention(quantized, served.model) == (SparseAttention(2, 16, 32), None)
    # CUDA's kernels neither, by name (decided before any CUDA device is touched).
    with caplog.at_level(logging.WARNING, logger="edge.text.engine"):
        for dtype in ("float16", "int8"):
            cuda = QAModelConfig.model_validate(
                {"device": "cuda", "max_context_tokens": 256, "kv_dtype": dtype, "sparse_attention": on}
            )
            policy, why = text_engine.sparse_attention(cuda, served.model)
            assert policy is None and why is not None and "CUDA and Triton" in why
    assert "CUDA and Triton" in caplog.text


def test_a_refused_model_serves_dense(served: TextCheckpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose steps run op by op (the C step refused it) selects nothing: the
    engine says so rather than keeping summaries nobody reads."""
    monkeypatch.setattr(fused_step, "steps_on_cpu", lambda model: False)
    on = SparseAttentionConfig(enabled=True, top_k_blocks=2, block_tokens=16, min_context=32)
    cfg = QAModelConfig(max_context_tokens=256, sparse_attention=on)
    policy, why = text_engine.sparse_attention(cfg, served.model)
    assert policy is None and why is not None and "op by op" in why


def test_the_benchmarks_quick_run_writes_every_field(engine_dir: Path, tmp_path: Path) -> None:
    """bench/sparse_attention.py --quick: one short context, one k, over a float16 and an
    int8 cache, through the engine the CPU profile builds with sparse attention on; each
    row holds what the docs render."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "sparse_attention.json"
    args = ["--quick", "--engine-dir", str(engine_dir), "--out", str(out), "--threads", "1"]
    res = subprocess.run(
        [sys.executable, "-m", "bench.sparse_attention", *args], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["served"] is False
    assert result["engine_config"]["sparse_attention"]["served"] is True
    rows = result["rows"]
    assert [row["kv_dtype"] for row in rows] == ["float16", "int8"]  # the float step's, the int8 kernel's
    for row in rows:
        for field in ("attention_us", "dense_attention_us", "decode_tok_s", "dense_decode_tok_s", "ppl_delta_pct"):
            assert row[field] > 0 or field == "ppl_delta_pct", field
        assert 0.0 <= row["passkey_accuracy"] <= 1.0 and 0.0 <= row["dense_passkey_accuracy"] <= 1.0
