"""The quantized KV cache as served (edge/text/kv/quant_cache.py): codes written in steps
equal the formats' reference, and the attention kernels that read them (our C kernel on
the CPU, the Triton kernels, here in Triton's interpreter) give what attention over the
reference's read-back gives; on the real SmolLM2, sequences served together over a
quantized cache answer as each does alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edge.config.text import QAModelConfig
from edge.text.architecture import LlamaConfig
from edge.text.engine import kv_format
from edge.text.kv import kv_attention
from edge.text.kv.kv_quant import FORMATS, KVFormat, dequantize, quantize
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.ops.cpu import cpu_kv
from edge.text.ops.triton import decode_ops
from edge.text.prompt import chatml
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams
from engines.text.import_gguf import import_smollm2

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Small enough for Triton's interpreter: 2 KV heads of 64 channels, 3 query heads each.
CONFIG = LlamaConfig(vocab_size=256, hidden_size=384, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=384)
SMALL_FORMATS = {
    "int8": KVFormat("int8", key_block=32),
    "int8-sink": KVFormat("int8", key_block=32, window=4, sink=2),
    "int8-64": KVFormat("int8", key_block=64),  # the served block: 64-position tiles on CUDA
    "int8-grouped": KVFormat("int8", key_block=32, value_group=32),  # value scales per group, not per token
    "int4": KVFormat("int4", key_block=32, value_group=32, window=8, sink=3),
    "int4-sym": KVFormat("int4", key_block=32, value_group=64, window=8, value_symmetric=True, sink=4),
}
needs_triton = pytest.mark.skipif(not decode_ops.TRITON_SUPPORT, reason="triton is not installed")
needs_cc = pytest.mark.skipif(not cpu_kv.available(), reason="no C compiler for the CPU kernel")


def _kv(tokens: int, rows: int = 2, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, CONFIG.num_kv_heads, tokens, CONFIG.head_dim, generator=gen)
    k[..., 7] *= 12.0  # an outlier channel, as real keys have
    v = torch.randn(rows, CONFIG.num_kv_heads, tokens, CONFIG.head_dim, generator=gen)
    return k, v


def _reference(fmt: KVFormat, k: torch.Tensor, v: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a row holding `length` tokens must read: its first fmt.coded(length) tokens
    through the format's reference (kv_quant), the rest as stored (float32 here)."""
    coded = fmt.coded(length)
    whole = KVFormat(fmt.dtype, fmt.key_block, fmt.value_group, 0, fmt.value_symmetric, fmt.sink)  # all coded
    q = quantize(k[:, :, :coded], v[:, :, :coded], whole)
    assert q.quantized == coded
    dk, dv = dequantize(q)
    sink = min(fmt.sink, coded)  # kept in the activations' type (float32 here), not float16
    dk[:, :, :sink], dv[:, :, :sink] = k[:, :, :sink], v[:, :, :sink]
    return torch.cat([dk, k[:, :, coded:length]], dim=2), torch.cat([dv, v[:, :, coded:length]], dim=2)


def _filled(
    fmt: KVFormat, k: torch.Tensor, v: torch.Tensor, prompt: int, steps: int, device: torch.device | None = None
) -> QuantKVCache:
    """A cache whose rows took a `prompt`-token prefill, then `steps` tokens one at a time."""
    device = device or torch.device("cpu")
    cache = QuantKVCache(CONFIG, k.shape[0], 128, fmt, torch.float32, device)
    k, v = k.to(device), v.to(device)
    for i in range(CONFIG.num_layers):
        layer = cache.layer(i)
        layer.store(k[:, :, :prompt], v[:, :, :prompt], 0)
        for t in range(prompt, prompt + steps):
            layer.write_tokens(k[:, :, t : t + 1], v[:, :, t : t + 1], [t] * k.shape[0])
    return cache


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, scale: float | None = None
) -> torch.Tensor:
    """q [NH, T, D] against k, v [NKV, L, D]: the last T positions, causally (and each
    seeing only its last `window` positions, where given)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    t, length = q.shape[1], k.shape[1]
    query = torch.arange(t)[:, None] + length - t
    mask = torch.arange(length)[None, :] <= query
    if window:
        mask &= torch.arange(length)[None, :] > query - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("name", sorted(SMALL_FORMATS))
def test_codes_written_in_steps_equal_the_reference(name: str) -> None:
    """A prefill then single tokens, each coding a key block as it leaves the window:
    what the row reads is the reference's codes of its oldest tokens, bit for bit, and
    its newest tokens as written."""
    fmt = SMALL_FORMATS[name]
    k, v = _kv(110)
    for prompt, steps in ((20, 90), (75, 35), (110, 0)):
        cache = _filled(fmt, k, v, prompt, steps)
        length = prompt + steps
        assert fmt.coded(length) > 0
        got_k, got_v = cache.layer(1).read(length)
        want_k, want_v = _reference(fmt, k, v, length)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (prompt, steps)


def test_the_cache_is_smaller_by_what_the_format_says() -> None:
    fmt = FORMATS["int4"]
    cache = QuantKVCache(CONFIG, 2, 2048, fmt, torch.float16, torch.device("cpu"))
    coded = fmt.coded(2048)  # codes for the positions a row can code; the rest stay float
    assert coded == 2048 - 64
    per_head_row = (
        coded * 64  # int4 key and value codes, 32 bytes each per token
        + coded // 64 * 64 * 2 * 2  # key scales and zero points per channel per block
        + coded * 2  # one value scale per token (64 channels), no zero point
        + (fmt.ring + 1) * 64 * 2 * 2  # the float16 ring of keys and values
        + fmt.sink * 64 * 2 * 2  # the first tokens, float16
    )
    assert cache.nbytes == per_head_row * 2 * CONFIG.num_layers * CONFIG.num_kv_heads
    assert cache.v_zero.numel() == 0 and cache.k_zero.numel() > 0


@needs_cc
@pytest.mark.parametrize("name", sorted(SMALL_FORMATS))
@pytest.mark.parametrize("window", [3, 40])  # inside the float tokens; across key blocks
def test_cpu_kernel_takes_a_sliding_window_and_a_query_scale(name: str, window: int) -> None:
    """A sliding layer's decode and chunk (Gemma 3's, Mistral's) over a quantized cache:
    each query sees its last `window` positions, sink tokens included only inside it, with
    the family's own query scale; as attention over the reference's read-back with the
    window's mask. Without the window the outputs differ (the test can fail)."""
    fmt = SMALL_FORMATS[name]
    k, v = _kv(100)
    gen = torch.Generator().manual_seed(11)
    scale = 0.3
    cache = _filled(fmt, k[:1], v[:1], 77, 0)
    layer = cache.layer(0)
    q = torch.randn(1, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
    out = kv_attention.decode(layer, q, k[:1, :, 77], v[:1, :, 77], torch.tensor([77]), 128, window, scale)
    rk, rv = _reference(fmt, k[:1], v[:1], 78)
    want = _attend(q[0, :, None], rk[0], rv[0], window, scale)[:, 0]
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-5)
    dense = _attend(q[0, :, None], rk[0], rv[0], 0, scale)[:, 0]
    assert (want - dense).abs().max() > 1e-2
    cache = _filled(fmt, k[:1], v[:1], 61, 0)
    layer = cache.layer(0)
    qc = torch.randn(1, CONFIG.num_heads, 30, CONFIG.head_dim, generator=gen)
    out = kv_attention.chunk(layer, qc, k[:1, :, 61:91], v[:1, :, 61:91], 61, window, scale)
    coded = fmt.coded(61)
    rk, rv = _reference(fmt, k[:1], v[:1], 61)
    rk = torch.cat([rk[:, :, :coded], k[:1, :, coded:91]], dim=2)
    rv = torch.cat([rv[:, :, :coded], v[:1, :, coded:91]], dim=2)
    torch.testing.assert_close(out[0], _attend(qc[0], rk[0], rv[0], window, scale), rtol=1e-4, atol=1e-5)


@needs_cc
@pytest.mark.parametrize("name", sorted(SMALL_FORMATS))
def test_cpu_kernel_decode_and_chunk_match_attention_over_the_reference(name: str) -> None:
    fmt = SMALL_FORMATS[name]
    k, v = _kv(100)
    gen = torch.Generator().manual_seed(9)
    # Decode: two rows at different positions, each writing its token then attending.
    cache = _filled(fmt, k, v, 60, 0)
    layer = cache.layer(0)
    # Row 1 is ahead: give it 17 more tokens first.
    for t in range(60, 77):
        layer.rows(1).write_tokens(k[1:, :, t : t + 1], v[1:, :, t : t + 1], [t])
    positions = torch.tensor([60, 77])
    q = torch.randn(2, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
    new_k = torch.stack([k[b, :, int(p)] for b, p in enumerate(positions)])
    new_v = torch.stack([v[b, :, int(p)] for b, p in enumerate(positions)])
    out = kv_attention.decode(layer, q, new_k, new_v, positions, kv_len=128)
    for b, p in enumerate(positions.tolist()):
        rk, rv = _reference(fmt, k[b : b + 1], v[b : b + 1], p + 1)
        want = _attend(q[b, :, None] * 1.0, rk[0], rv[0])[:, 0]
        torch.testing.assert_close(out[b], want, rtol=1e-4, atol=1e-5)
    # A chunk of 30 tokens after 61 cached ones, in one row: it reads the codes, the
    # ring and itself, then is stored as a decode would have stored it.
    cache = _filled(fmt, k[:1], v[:1], 61, 0)
    layer = cache.layer(0)
    qc = torch.randn(1, CONFIG.num_heads, 30, CONFIG.head_dim, generator=gen)
    out = kv_attention.chunk(layer, qc, k[:1, :, 61:91], v[:1, :, 61:91], 61)
    coded = fmt.coded(61)
    rk, rv = _reference(fmt, k[:1], v[:1], 61)
    rk = torch.cat([rk[:, :, :coded], k[:1, :, coded:91]], dim=2)
    rv = torch.cat([rv[:, :, :coded], v[:1, :, coded:91]], dim=2)
    torch.testing.assert_close(out[0], _attend(qc[0], rk[0], rv[0]), rtol=1e-4, atol=1e-5)
    got_k, got_v = layer.read(91)
    want_k, want_v = _reference(fmt, k[:1], v[:1], 91)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@needs_triton
@pytest.mark.parametrize("name", sorted(SMALL_FORMATS))
def test_triton_write_codes_as_torch_and_attends_as_the_reference(name: str) -> None:
    """Triton's decode write (interpreted here, compiled on a GPU) leaves the codes the
    torch store leaves, byte for byte, and its decode and chunk attention match
    attention over the reference's read-back."""
    from edge.text.ops.triton import triton_kv

    fmt = SMALL_FORMATS[name]
    k, v = _kv(104)  # 80 cached, then a chunk of 24
    torch_cache = _filled(fmt, k, v, 20, 60)
    cache = QuantKVCache(CONFIG, 2, 128, fmt, torch.float32, DEVICE)
    layer = cache.layer(1)
    layer.store(k[:, :, :20].to(DEVICE), v[:, :, :20].to(DEVICE), 0)
    for t in range(20, 80):
        pos = torch.tensor([t, t], device=DEVICE)
        triton_kv.write_tokens(layer, k[:, :, t].to(DEVICE), v[:, :, t].to(DEVICE), pos)
    want = torch_cache.layer(1)
    coded = fmt.coded(80)
    for name_ in ("k_codes", "v_codes", "v_scale"):
        a, b = getattr(layer, name_)[:, :, :coded].cpu(), getattr(want, name_)[:, :, :coded]
        assert torch.equal(a, b), name_
    for name_ in ("k_scale", "k_zero"):
        a, b = getattr(layer, name_).cpu(), getattr(want, name_)
        if a.numel():
            assert torch.equal(a[:, :, : coded // fmt.key_block], b[:, :, : coded // fmt.key_block]), name_
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
    pos = torch.tensor([79, 79], device=DEVICE)
    out = triton_kv.attention(layer, q.to(DEVICE), pos, 128, q_scale=CONFIG.head_dim**-0.5).cpu()
    rk, rv = _reference(fmt, k[:, :, :80], v[:, :, :80], 80)
    for b in range(2):
        want_out = _attend(q[b, :, None], rk[b], rv[b])[:, 0].reshape(-1)
        torch.testing.assert_close(out[b], want_out, rtol=1e-4, atol=1e-4)
    qc = torch.randn(24, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
    one = cache.rows(0, 1).layer(1)
    coded = fmt.coded(80)
    float_k = torch.cat([one.ring_span(coded, 80)[0], k[:1, :, 80:104].to(DEVICE)], dim=2)
    float_v = torch.cat([one.ring_span(coded, 80)[1], v[:1, :, 80:104].to(DEVICE)], dim=2)
    out = triton_kv.chunk_attention(one, qc.to(DEVICE), float_k, float_v, 80, coded, CONFIG.head_dim**-0.5).cpu()
    rk, rv = _reference(fmt, k[:1], v[:1], 80)
    kk = torch.cat([rk[:, :, :coded], k[:1, :, coded:104]], dim=2)
    vv = torch.cat([rv[:, :, :coded], v[:1, :, coded:104]], dim=2)
    want_out = _attend(qc.transpose(0, 1), kk[0], vv[0]).transpose(0, 1)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize(
    ("name", "window"),
    [*((name, 40) for name in sorted(SMALL_FORMATS)), ("int8-sink", 3), ("int4", 3)],
)  # across key blocks, the sink tokens left out; inside the float tokens
def test_triton_kernels_take_a_sliding_window_and_a_query_scale(name: str, window: int) -> None:
    """Triton's decode and chunk attention in a sliding layer (Gemma 3's, Mistral's): each
    query sees its last `window` positions, sink tokens only inside them, with the
    family's query scale; as attention over the reference's read-back with the window's
    mask, and unlike it without the mask."""
    from edge.text.ops.triton import triton_kv

    fmt = SMALL_FORMATS[name]
    k, v = _kv(100)
    gen = torch.Generator().manual_seed(12)
    scale = 0.3
    layer = _filled(fmt, k[:1], v[:1], 77, 0, DEVICE).layer(0)
    q = torch.randn(1, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
    pos = torch.tensor([77], device=DEVICE)
    triton_kv.write_tokens(layer, k[:1, :, 77].to(DEVICE), v[:1, :, 77].to(DEVICE), pos)
    out = triton_kv.attention(layer, q.to(DEVICE), pos, 128, q_scale=scale, window=window).cpu()
    rk, rv = _reference(fmt, k[:1], v[:1], 78)
    want = _attend(q[0, :, None], rk[0], rv[0], window, scale)[:, 0].reshape(-1)
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-4)
    dense = _attend(q[0, :, None], rk[0], rv[0], 0, scale)[:, 0].reshape(-1)
    assert (want - dense).abs().max() > 1e-2
    layer = _filled(fmt, k[:1], v[:1], 61, 0, DEVICE).layer(0)
    qc = torch.randn(30, CONFIG.num_heads, CONFIG.head_dim, generator=gen)
    coded = fmt.coded(61)
    ring_k, ring_v = layer.ring_span(coded, 61)
    float_k = torch.cat([ring_k, k[:1, :, 61:91].to(DEVICE)], dim=2)
    float_v = torch.cat([ring_v, v[:1, :, 61:91].to(DEVICE)], dim=2)
    got = triton_kv.chunk_attention(layer, qc.to(DEVICE), float_k, float_v, 61, coded, scale, window).cpu()
    rk, rv = _reference(fmt, k[:1], v[:1], 61)
    rk = torch.cat([rk[:, :, :coded], k[:1, :, coded:91]], dim=2)
    rv = torch.cat([rv[:, :, :coded], v[:1, :, coded:91]], dim=2)
    want_chunk = _attend(qc.transpose(0, 1), rk[0], rv[0], window, scale).transpose(0, 1)
    torch.testing.assert_close(got, want_chunk, rtol=1e-4, atol=1e-4)


def test_kv_dtype_is_checked_and_reaches_the_pool() -> None:
    assert kv_format(QAModelConfig(device="cpu", kv_dtype="int4")) == FORMATS["int4"]
    with pytest.raises(ValueError, match="kv_dtype"):
        QAModelConfig.model_validate({"device": "cpu", "kv_dtype": "fp8"})


@pytest.fixture(scope="module")
def ckpt(engine_dir: Path) -> TextCheckpoint:
    return load_checkpoint(import_smollm2(engine_dir, progress=False))


def _batch(ckpt: TextCheckpoint, fmt: KVFormat, prompts: list[list[int]], new: int, chunk: int = 0) -> list[list[int]]:
    batcher = ContinuousBatcher(
        ckpt.model, ckpt.tokenizer, frozenset(), slots=len(prompts), slot_len=512, kv_format=fmt
    )
    batcher.prefill_chunk = chunk
    seqs = [Sequence(i, p, SamplingParams(max_new_tokens=new)) for i, p in enumerate(prompts)]
    for seq in seqs:
        slot = batcher.kv.allocate_slots(str(seq.owner), len(seq.prompt) + new)
        assert slot is not None
        batcher.admit(seq, slot)
        batcher.step()  # each joins those already decoding
    while batcher.running:
        for done in batcher.step():
            assert done.kv is not None
            batcher.kv.free(done.kv)
    return [s.tokens for s in seqs]


@needs_cc
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_real_model_served_over_a_quantized_cache_answers_as_alone(ckpt: TextCheckpoint, dtype: str) -> None:
    """SmolLM2 (real weights) over a quantized cache in the serving batcher: sequences
    that join one another, one of them prefilled in chunks after cached tokens, decode
    exactly what each decodes alone over the same format, and the pool is the format's
    size."""
    fmt = FORMATS[dtype]  # type: ignore[index]
    questions = ["Name three symptoms of dehydration.", "What is a normal body temperature?"]
    prompts = [
        list(ckpt.tokenizer.encode(chatml("You are terse.", q), add_special_tokens=False).ids) for q in questions
    ]
    new = 180  # past several key blocks leaving the window
    assert fmt.coded(len(prompts[0]) + new) >= 2 * fmt.key_block
    together = _batch(ckpt, fmt, prompts, new, chunk=16)  # the second joins in chunks
    for prompt, tokens in zip(prompts, together, strict=True):
        assert _batch(ckpt, fmt, [prompt], new) == [tokens]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=2, slot_len=512, kv_format=fmt)
    float_bytes = ckpt.model.new_cache(2, 512).nbytes
    assert batcher.kv.snapshot()["kv_dtype"] == dtype
    assert batcher.cache.nbytes < float_bytes / (1.8 if dtype == "int8" else 2.5)
    assert batcher.kv.bytes_per_token * 2 * 512 >= batcher.cache.nbytes


SLIDING = dataclasses.replace(CONFIG, sliding_window=24, layer_types=("sliding", "full"))


def test_a_sliding_layers_codes_in_a_circle_go_where_the_kernels_read_them_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sliding layer keeps codes for the key blocks its window reaches and one more (slot
    t % slots) where that is fewer than a row can code, and only where asked; every
    kernel reads them so, the CPU's, Triton's and ours on CUDA (step_ops.circular_kv,
    which LlamaModel.new_cache asks)."""
    from edge.text.ops import step_ops

    meta, fmt = torch.device("meta"), FORMATS["int8"]
    circle = QuantKVCache(SLIDING, 1, 512, fmt, torch.float16, meta, window_sized=True)
    every = QuantKVCache(SLIDING, 1, 512, fmt, torch.float16, meta, window_sized=False)
    assert circle.local_slots == 128 and [circle.layer(i).circular for i in range(2)] == [True, False]
    assert every.local_slots == 0 and not any(every.layer(i).circular for i in range(2))
    assert every.layer(0).code_len == 448 and circle.layer(0).code_len == 128 and circle.nbytes < every.nbytes
    # Rows of 160 tokens code 128 positions at most: a circle of 128 would save nothing.
    assert QuantKVCache(SLIDING, 1, 160, fmt, torch.float16, meta, window_sized=True).local_slots == 0
    assert QuantKVCache(SLIDING, 1, 512, fmt, torch.float16, meta).local_slots == 0  # asked for only
    assert step_ops.circular_kv("cpu")
    monkeypatch.setattr(step_ops, "_chosen", {"cuda:0": "triton"})
    assert step_ops.circular_kv("cuda:0")
    monkeypatch.setattr(step_ops, "_chosen", {"cuda:0": "cuda"})
    assert step_ops.circular_kv("cuda:0")
    monkeypatch.setattr(step_ops, "_chosen", {"cuda:0": None})
    assert not step_ops.circular_kv("cuda:0")


@needs_triton
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_triton_kernels_read_and_write_a_sliding_layers_codes_in_a_circle(name: str) -> None:
    """Triton's decode write codes each key block into its slot of the circle (a prefill
    having coded more blocks than the circle holds), and its decode and chunk attention
    over the circle, in the layer's window, give what they give over a cache holding
    every position, bit for bit (the same codes, from other slots)."""
    from edge.text.ops.triton import triton_kv

    fmt, window, steps = SMALL_FORMATS[name], 24, range(100, 140)
    k, v = _kv(164, rows=1)
    layers = []
    for sized in (True, False):
        cache = QuantKVCache(SLIDING, 1, 256, fmt, torch.float32, DEVICE, window_sized=sized)
        layer = cache.layer(0)
        layer.store(k[:, :, :100].to(DEVICE), v[:, :, :100].to(DEVICE), 0)
        for t in steps:
            at = torch.tensor([t], device=DEVICE)
            triton_kv.write_tokens(layer, k[:, :, t].to(DEVICE), v[:, :, t].to(DEVICE), at)
        layers.append(layer)
    circle, every = layers
    assert circle.circular and circle.code_len == 2 * fmt.key_block < every.code_len
    coded = fmt.coded(140)
    live = torch.arange(coded - fmt.key_block, coded)  # the newest coded block: where each cache put it
    assert torch.equal(circle.k_codes[:, :, live % circle.code_len].cpu(), every.k_codes[:, :, live].cpu())
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, CONFIG.num_heads, CONFIG.head_dim, generator=gen).to(DEVICE)
    pos = torch.tensor([139], device=DEVICE)
    outs = [triton_kv.attention(layer, q, pos, 256, q_scale=0.2, window=window).cpu() for layer in layers]
    assert torch.equal(outs[0], outs[1])
    qc = torch.randn(24, CONFIG.num_heads, CONFIG.head_dim, generator=gen).to(DEVICE)
    chunks = []
    for layer in layers:
        ring_k, ring_v = layer.ring_span(coded, 140)
        float_k = torch.cat([ring_k, k[:, :, 140:164].to(DEVICE)], dim=2)
        float_v = torch.cat([ring_v, v[:, :, 140:164].to(DEVICE)], dim=2)
        chunks.append(triton_kv.chunk_attention(layer, qc, float_k, float_v, 140, coded, 0.2, window).cpu())
    assert torch.equal(chunks[0], chunks[1])
    dense = triton_kv.chunk_attention(every, qc, float_k, float_v, 140, coded, 0.2, 0).cpu()
    assert not torch.allclose(dense, chunks[1], atol=1e-2)  # the window is what both kept
