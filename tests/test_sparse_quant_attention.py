"""Top-k block attention over the int8/int4 quantized KV cache on the CPU
(models.qa.sparse_attention; edge/text/kv/quant_cache.py keeps the block summaries,
ops/cpu/cpu_kv.c selects by cpu_select.c, the float decode step's rule): a call that keeps
every block is dense to the bit, a planted key far back is found with one block, the
selection is the float step's on the same summaries (plus the float part, always read),
the summaries are those of the decoded cache after every writer, and an engine served
with kv_dtype int8 and sparse attention on decodes near dense."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge.config.text import QAModelConfig, SparseAttentionConfig
from edge.text.architecture import LlamaConfig
from edge.text.engine import TextEngine
from edge.text.kv import kv_attention
from edge.text.kv.float_cache import SparseAttention
from edge.text.kv.kv_quant import FORMATS, KVFormat
from edge.text.kv.quant_cache import QuantKVCache, QuantLayer
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.ops.cpu import cpu_kv, cpu_step
from edge.text.runtime import fused_step
from edge.text.runtime.generate import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kv.available(), reason="no C compiler for the CPU kernels")

# 2 KV heads of 64 channels, 3 query heads each; layer 1 slides (a window of 48).
CONFIG = LlamaConfig(vocab_size=256, hidden_size=384, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=384)
FORMATS_UNDER_TEST = {
    "int8": FORMATS["int8"],
    "int4": FORMATS["int4"],
    "int8-32": KVFormat("int8", key_block=32, window=4, sink=2),
    "int4-32": KVFormat("int4", key_block=32, value_group=32, window=8, sink=3),
}


def _kv(tokens: int, rows: int = 2, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, CONFIG.num_kv_heads, tokens, CONFIG.head_dim, generator=gen)
    k[..., 7] *= 12.0  # an outlier channel, as real keys have
    v = torch.randn(rows, CONFIG.num_kv_heads, tokens, CONFIG.head_dim, generator=gen)
    return k, v


def _filled(fmt: KVFormat, k: torch.Tensor, v: torch.Tensor, prompt: int, steps: int, block: int) -> QuantKVCache:
    """Rows that took a `prompt`-token prefill then `steps` tokens one at a time, with
    summaries of blocks of `block` positions."""
    sparse = SparseAttention(top_k_blocks=1, block_tokens=block, min_context=0)
    cache = QuantKVCache(CONFIG, k.shape[0], 512, fmt, torch.float32, torch.device("cpu"), sparse=sparse)
    for i in range(CONFIG.num_layers):
        layer = cache.layer(i)
        layer.store(k[:, :, :prompt], v[:, :, :prompt], 0)
        for t in range(prompt, prompt + steps):
            layer.write_tokens(k[:, :, t : t + 1], v[:, :, t : t + 1], [t] * k.shape[0])
    return cache


def _attend(layer: QuantLayer, q: torch.Tensor, length: int, top_k: int | None) -> torch.Tensor:
    """Each row's query q [B, NH, D] at position length - 1, as kv_attention.decode calls
    the kernel: dense (top_k None) or selecting top_k blocks."""
    rows = list(range(q.shape[0]))
    selection = None
    if top_k is not None:
        assert layer.summary is not None and layer.sparse is not None
        selection = cpu_kv.Selection(layer.summary, layer.sparse.block_tokens, [top_k] * len(rows))
    return cpu_kv.attention(
        q,
        (layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero),
        kv_format=(layer.fmt.key_block, layer.fmt.group(q.shape[-1]), layer.fmt.dtype == "int4"),
        rows=rows,
        pos=[length - 1] * len(rows),
        coded=[layer.fmt.coded(length)] * len(rows),
        frows=rows,
        fbase=[0] * len(rows),
        float_kv=(layer.ring_k, layer.ring_v),
        fmod=layer.fmt.ring,
        sink_kv=(layer.sink_k, layer.sink_v) if layer.sink_k.numel() else None,
        selection=selection,
    )


@pytest.mark.parametrize("name", sorted(FORMATS_UNDER_TEST))
def test_a_call_that_keeps_every_block_is_dense_bit_for_bit(name: str) -> None:
    """At lengths either side of key blocks and of the float part, k covering every block
    gives dense's every bit (the same positions summed in the same order); one block
    answers otherwise (selection really ran)."""
    fmt, block = FORMATS_UNDER_TEST[name], 16
    k, v = _kv(400)
    cache = _filled(fmt, k, v, 300, 0, block)
    layer = cache.layer(0)
    gen = torch.Generator().manual_seed(1)
    for length in (5, 33, 64, 65, 97, 150, 211, 300):
        cut = _filled(fmt, k, v, length, 0, block).layer(0) if length != 300 else layer
        q = torch.randn(2, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
        dense = _attend(cut, q, length, None)
        assert torch.equal(_attend(cut, q, length, length // block + 1), dense), length
        assert torch.equal(_attend(cut, q, length, 0 if length <= 3 * block else 400), dense), length
    q = torch.randn(2, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
    assert not torch.equal(_attend(layer, q, 300, 1), _attend(layer, q, 300, None))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_key_planted_far_back_is_found_with_one_block(name: str) -> None:
    """A key in block 3 (of 19) that every query head of its group scores far above any
    other, its value distinct: with one block to choose, the kernel chooses its block (the
    selection says so) and answers as dense does, the planted value dominating; without
    the plant one block answers otherwise."""
    fmt, block, length, planted = FORMATS_UNDER_TEST[name], 16, 300, 3 * 16 + 5
    k, v = _kv(length, rows=1, seed=7)
    gen = torch.Generator().manual_seed(2)
    group = CONFIG.num_heads // CONFIG.num_kv_heads
    u = torch.randn(CONFIG.num_kv_heads, CONFIG.head_dim, generator=gen)
    q = (u[:, None, :] + 0.05 * torch.randn(CONFIG.num_kv_heads, group, CONFIG.head_dim, generator=gen)).reshape(
        1, CONFIG.num_heads, CONFIG.head_dim
    )
    plain = _filled(fmt, k, v, length, 0, block).layer(0)
    assert float((_attend(plain, q, length, 1) - _attend(plain, q, length, None)).abs().max()) > 1e-2
    for j in range(CONFIG.num_kv_heads):
        k[0, j, planted] = u[j] * (60.0 / float(u[j].norm()))  # scores ~60 |u| against u
        v[0, j, planted] = 4.0
    layer = _filled(fmt, k, v, length, 0, block).layer(0)
    assert layer.summary is not None
    for j in range(CONFIG.num_kv_heads):
        spans = cpu_kv.select(q[0, j * group : (j + 1) * group], layer.summary[0, j], length - 1,
                              fmt.coded(length), block, 1)  # fmt: skip
        assert any(a <= planted <= z for a, z in spans), spans
        assert sum(z - a + 1 for a, z in spans) < length // 3  # most of the row skipped
    got, want = _attend(layer, q, length, 1), _attend(layer, q, length, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert float((got - 4.0).abs().max()) < 0.1


def test_the_selection_is_the_float_steps_on_the_same_summaries() -> None:
    """Small integers (every bound exact, ties real): the kernel's blocks are the float
    decode step's (cpu_step.select), cut at the coded positions, with every float
    position after them; a query that does not select (k < 0) reads every position."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for group, dim in ((1, 8), (3, 64)):
        for block in (4, 16):
            for _ in range(30):
                last = int(torch.randint(0, 300, (1,), generator=gen))
                blocks = last // block + 1
                a = torch.randint(-6, 7, (blocks, dim), generator=gen).float()
                b = torch.randint(-6, 7, (blocks, dim), generator=gen).float()
                summary = torch.stack([torch.minimum(a, b), torch.maximum(a, b)], dim=1)
                if blocks > 6:
                    summary[blocks // 2] = summary[1]  # a tie with an earlier block
                q = torch.randint(-4, 5, (group, dim), generator=gen).float()
                coded = int(torch.randint(0, last + 2, (1,), generator=gen))
                for k in (0, 1, 2, 5, blocks):
                    want: list[tuple[int, int]] = []
                    for first, end in cpu_step.select(q, summary, last, block, k):
                        if first < coded:
                            want.append((first, min(end, coded - 1)))
                    if coded <= last:
                        if want and want[-1][1] + 1 == coded:
                            want[-1] = (want[-1][0], last)
                        else:
                            want.append((coded, last))
                    assert cpu_kv.select(q, summary, last, coded, block, k) == want, (group, block, last, coded, k)
                    if coded == last + 1:  # all coded: the float step's spans themselves
                        assert want == cpu_step.select(q, summary, last, block, k)
                    checked += 1
                assert cpu_kv.select(q, summary, last, coded, block, -1) == [(0, last)]
    assert checked == 2 * 2 * 30 * 5


def _assert_summaries_are_the_decoded_caches(cache: QuantKVCache, lengths: dict[int, int]) -> None:
    """Each row's summaries in every layer that keeps them, over its first lengths[row]
    positions, equal a torch min and max of the keys the row reads back (QuantLayer.read:
    decoded codes, sink and ring floats)."""
    assert cache.summary is not None and cache.sparse is not None
    block = cache.sparse.block_tokens
    for i, at in enumerate(cache.summary_index):
        if at < 0:
            continue
        for row, length in lengths.items():
            keys = cache.layer(i).rows(row).read(length)[0][0]  # [KV heads, length, D]
            for b in range(-(-length // block)):
                span = keys[:, b * block : min(b * block + block, length)]
                summary = cache.summary[at, row, :, b]
                assert torch.equal(summary[:, 0], span.amin(1)), (i, row, b)
                assert torch.equal(summary[:, 1], span.amax(1)), (i, row, b)


@pytest.mark.parametrize("name", sorted(FORMATS_UNDER_TEST))
def test_the_summaries_are_the_decoded_caches_after_every_writer(name: str) -> None:
    """A prefill, decode steps (key blocks coded from the ring), a chunk after cached
    tokens, drafts written and turned down (the next step written over them), a row saved
    and loaded over a longer one (the prefix cache's and the offload's path), a new
    sequence over a longer one: after each, the summaries are the decoded cache's. The
    sliding layer (its codes a circle) keeps none and is read densely."""
    fmt, block = FORMATS_UNDER_TEST[name], 16
    config = LlamaConfig(
        vocab_size=256, hidden_size=384, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=384,
        sliding_window=48, layer_types=("full", "sliding"),
    )  # fmt: skip
    sparse = SparseAttention(top_k_blocks=2, block_tokens=block, min_context=0)
    cache = QuantKVCache(config, 3, 384, fmt, torch.float32, torch.device("cpu"), window_sized=True, sparse=sparse)
    assert cache.summary_index == [0, -1] and cache.layer(1).summary is None
    k, v = _kv(384, rows=3, seed=11)
    gen = torch.Generator().manual_seed(4)

    def step(row: int, at: int) -> None:
        """A decode step of row `row` at `at` in every layer (the other rows not advanced)."""
        positions = torch.tensor([cache.max_len - 1] * 3)
        positions[row] = at
        q = torch.randn(3, config.num_heads, config.head_dim, generator=gen)
        for i in range(config.num_layers):
            layer = cache.layer(i)
            kv_attention.decode(layer, q, k[:, :, at], v[:, :, at], positions, at + 1, config.layer_window(i))

    def chunk(row: int, start: int, end: int) -> None:
        q = torch.randn(1, config.num_heads, end - start, config.head_dim, generator=gen)
        for i in range(config.num_layers):
            layer = cache.layer(i).rows(row)
            kx, vx = k[row : row + 1, :, start:end], v[row : row + 1, :, start:end]
            if start == 0:
                layer.store(kx, vx, 0)
            else:
                kv_attention.chunk(layer, q, kx, vx, start, config.layer_window(i))

    chunk(0, 0, 70)
    _assert_summaries_are_the_decoded_caches(cache, {0: 70})
    for at in range(70, 140):  # across key blocks coded from the ring
        step(0, at)
    _assert_summaries_are_the_decoded_caches(cache, {0: 140})
    chunk(1, 0, 40)
    chunk(1, 40, 100)
    _assert_summaries_are_the_decoded_caches(cache, {0: 140, 1: 100})
    # Drafts: a chunk of the token and 3 drafts, one taken: the next step writes over them.
    saved_k = k.clone()
    k[1, :, 101:104] += 50.0  # the rejected drafts' keys, far outside the others
    chunk(1, 100, 104)
    k.copy_(saved_k)
    step(1, 101)
    _assert_summaries_are_the_decoded_caches(cache, {0: 140, 1: 102})
    # Row 2 filled far, then row 0's sequence saved and loaded over it, and on.
    chunk(2, 0, 250)
    saved = cache.save_row(0, 140)
    assert "summary" in saved
    cache.load_row(2, 140, saved)
    _assert_summaries_are_the_decoded_caches(cache, {0: 140, 1: 102, 2: 140})
    k[2] = k[0]
    v[2] = v[0]
    step(2, 140)
    _assert_summaries_are_the_decoded_caches(cache, {0: 140, 1: 102, 2: 141})
    # A row saved without summaries (a cache that kept none) is summarized whole on load.
    del saved["summary"]
    assert cache.summary is not None
    cache.summary[:, 2] = 0.0
    cache.load_row(2, 140, saved)
    _assert_summaries_are_the_decoded_caches(cache, {2: 140})
    # A new, shorter sequence over row 0.
    chunk(0, 0, 30)
    step(0, 30)
    _assert_summaries_are_the_decoded_caches(cache, {0: 31, 1: 102})


def test_the_summaries_are_counted_and_kept_on_the_cpu_only() -> None:
    sparse = SparseAttention(top_k_blocks=2, block_tokens=64)
    cpu = torch.device("cpu")
    dense = QuantKVCache(CONFIG, 2, 256, FORMATS["int8"], torch.float32, cpu)
    kept = QuantKVCache(CONFIG, 2, 256, FORMATS["int8"], torch.float32, cpu, sparse=sparse)
    summary = CONFIG.num_layers * 2 * CONFIG.num_kv_heads * (256 // 64) * 2 * CONFIG.head_dim * 4
    assert kept.nbytes == dense.nbytes + summary
    with pytest.raises(ValueError, match="runs on the CPU"):
        QuantKVCache(CONFIG, 1, 256, FORMATS["int8"], torch.float32, torch.device("meta"), sparse=sparse)


@pytest.fixture(scope="module")
def served(engine_dir: Path) -> TextCheckpoint:
    from engines.text.text_build import build_text_engine

    path = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    return load_checkpoint(path, cpu_kernel="exact")


def test_an_int8_engine_serves_sparse_attention_near_dense(served: TextCheckpoint) -> None:
    """The engine serves kv_dtype int8 with sparse attention (said in its config) and
    decodes; the model's steps over an int8 cache that selects keep its logits near
    dense's over the same prompt, and equal to them where k covers every block."""
    model = served.model
    on = SparseAttentionConfig(enabled=True, top_k_blocks=4, block_tokens=16, min_context=64)
    engine = TextEngine(
        served, QAModelConfig(max_context_tokens=512, max_sequences=1, kv_dtype="int8", sparse_attention=on)
    )
    reported = engine.config()["sparse_attention"]
    assert reported["served"] is True and reported["refused"] is None
    cache = engine.batcher.cache
    assert isinstance(cache, QuantKVCache) and cache.sparse == SparseAttention(4, 16, 64)
    answer = engine.generate(list(range(100, 400)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(answer.tokens) == 4

    torch.manual_seed(8)
    prompt = torch.randint(0, model.config.vocab_size, (1, 300))
    caches = {
        "dense": model.new_cache(1, 512, FORMATS["int8"]),
        "sparse": model.new_cache(1, 512, FORMATS["int8"], sparse=SparseAttention(8, 16, 64)),
        "every": model.new_cache(1, 512, FORMATS["int8"], sparse=SparseAttention(32, 16, 0)),
    }
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
    for name, c in caches.items():
        model(prompt, c, 0)
        for at in range(300, 306):
            out = fused_step.decode_step(model, torch.tensor([[7 + at]]), c, torch.tensor([at]), at + 1)
            logits[name].append(out[0].float())
    for got, want in zip(logits["every"], logits["dense"], strict=True):
        assert torch.equal(got, want)
    # 8 of 16 candidate blocks over a random prompt (flat attention, the hard case): the
    # float C step's sparse logits differ from its dense ones by 6-11% of their largest
    # at these positions, the int8 cache's alike.
    for got, want in zip(logits["sparse"], logits["dense"], strict=True):
        rel = float((got - want).abs().max() / want.abs().max())
        assert 0.0 < rel < 0.2, rel
