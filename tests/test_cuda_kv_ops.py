"""Our CUDA C kernels for the quantized KV cache (edge/text/ops/cuda/kv_ops.cu), the path of
a box without Triton (a Jetson): the choice and its refusals (no GPU needed), the build
with nvcc where it is installed, and on the GPU (the `gpu` marker): the decode write
leaves the codes torch's store leaves, byte for byte; decode and chunk attention match
attention over the format's reference read-back; the fused decode step over a quantized
cache agrees with the op-by-op step and is the same bits alone and batched.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.kv.kv_quant import FORMATS, KVFormat
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.llama import Attention
from edge.text.ops import step_ops
from edge.text.ops.cuda import cuda_build, kv_ops
from edge.text.ops.cuda import decode_ops as cuda_ops
from edge.text.runtime import fused_step
from engines.text.random_llama import random_int4_llama
from tests.test_quant_cache import CONFIG, _attend

# Formats the CUDA kernels take (key blocks of whole 64-position tiles): the served two,
# and the options they do not use (value groups, int4 zero points, int8 with a window
# and sink). Value groups of at least head_dim / 8 channels take the tensor-core kernel;
# smaller ones (int8-small-groups) the scalar one.
CUDA_FORMATS = {
    "int8": FORMATS["int8"],
    "int4": FORMATS["int4"],
    "int8-grouped-sink": KVFormat("int8", key_block=64, value_group=32, window=4, sink=2),
    "int4-asymmetric": KVFormat("int4", key_block=64, value_group=32, window=8, sink=3),
    "int8-small-groups": KVFormat("int8", key_block=64, value_group=4, window=4, sink=2),
}


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(step_ops, "_chosen", {})
    yield


def test_without_triton_our_kernels_serve_the_quantized_formats_and_say_what_they_refuse(
    monkeypatch: pytest.MonkeyPatch, fresh_choice: None
) -> None:
    """Without Triton, where our kernels build, the int8 and int4 caches load on CUDA;
    the shapes, types and formats they do not take are refused in words; where they do
    not build either, a quantized format is refused at load and float16 KV still loads."""
    from edge.config.text import QAModelConfig
    from edge.text.engine import kv_format

    monkeypatch.setattr(step_ops, "triton_present", lambda: False)
    monkeypatch.setattr(step_ops, "cuda_present", lambda device: True)
    monkeypatch.setattr(kv_ops, "available", lambda device="cuda": True)
    assert step_ops.quantized_kv("cuda:0") and step_ops.kv_kernels("cuda:0") is kv_ops
    for dtype in ("int8", "int4"):
        fmt = kv_format(QAModelConfig(device="cuda", kv_dtype=dtype))
        assert step_ops.kv_refusal("cuda:0", fmt, 64, 3, torch.float16) is None
        assert step_ops.kv_refusal("cuda:0", fmt, 128, 4, torch.bfloat16) is None
    fmt = FORMATS["int8"]
    assert "float32" in str(step_ops.kv_refusal("cuda:0", fmt, 64, 3, torch.float32))
    assert "head_dim 96" in str(step_ops.kv_refusal("cuda:0", fmt, 96, 3, torch.float16))
    assert "head_dim 256" in str(step_ops.kv_refusal("cuda:0", fmt, 256, 2, torch.float16))
    assert "17 query heads" in str(step_ops.kv_refusal("cuda:0", fmt, 64, 17, torch.float16))
    small_blocks = KVFormat("int8", key_block=32)
    assert "key blocks of 32" in str(step_ops.kv_refusal("cuda:0", small_blocks, 64, 3, torch.float16))

    monkeypatch.setattr(kv_ops, "available", lambda device="cuda": False)
    assert not step_ops.quantized_kv("cuda:0")
    assert kv_format(QAModelConfig(device="cuda", kv_dtype="float16")).dtype == "float16"
    with pytest.raises(RuntimeError, match="kv_dtype int8 on CUDA needs Triton or our CUDA kernels"):
        kv_format(QAModelConfig(device="cuda", kv_dtype="int8"))
    assert "no quantized-KV kernels here" in str(step_ops.kv_refusal("cuda:0", fmt, 64, 3, torch.float16))

    # Triton's kernels: heads and value groups of a power of two (Qwen3's test model's 24 is not).
    monkeypatch.setattr(step_ops, "triton_present", lambda: True)
    monkeypatch.setattr(step_ops, "_chosen", {})
    assert "head_dim 24" in str(step_ops.kv_refusal("cuda:0", fmt, 24, 2, torch.float16))


def test_the_tensor_core_attention_serves_the_shipped_formats_and_says_what_it_leaves_to_the_scalar_one() -> None:
    """The served formats on the 8B shape (head_dim 128, four query heads a KV head) and the
    test model's take the tensor-core kernels; value groups narrower than a lane's eighth of
    a head, more than 8 query heads a KV head, or head_dim 256 leave it, saying which."""
    for name in ("int8", "int4"):
        assert kv_ops.attention_kernel(FORMATS[name], 128, 4) == "mma"
        assert kv_ops.attention_kernel(FORMATS[name], 64, 3) == "mma"
    assert cuda_ops.attention_kernel(128, 4) == "mma"
    assert "value groups of 4" in kv_ops.attention_kernel(CUDA_FORMATS["int8-small-groups"], 64, 3)
    assert "16 query heads" in kv_ops.attention_kernel(FORMATS["int8"], 128, 16)
    assert "head_dim 256" in cuda_ops.attention_kernel(256, 2)


@pytest.mark.parametrize("sms", [16, 132])  # an AGX Orin's, an H100's
def test_the_quantized_cache_splits_on_key_blocks_and_covers_every_position(sms: int) -> None:
    """A split of a quantized cache starts on a whole tile (so on a key block: its scales
    apply to the whole tile) and the splits cover the cache, as many as the float cache's
    rule takes at the quantized cache's spread."""
    for kv_len in [1, 63, 64, 65, 256, 768, 4096, 4352, 20000]:
        splits, chunk = kv_ops.attention_splits(kv_len, 8, sms)
        float_splits, float_chunk = cuda_ops.attention_splits(kv_len, 8, sms, kv_ops.KV_SPREAD)
        assert chunk % kv_ops.TILE == 0 and chunk >= float_chunk and splits == float_splits
        assert splits * chunk >= kv_len, (kv_len, splits, chunk)


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="no nvcc on this machine")
def test_kv_kernels_build_for_the_orin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_ops.cu (with the header it shares with decode_ops.cu) compiles for sm_87, the
    Orin (as compute_80 PTX, the proxy's build, it runs in the GPU tests); its entry
    points load."""
    monkeypatch.setenv("EDGE_KERNEL_CACHE", str(tmp_path))
    path = cuda_build.build(kv_ops.SOURCE, "87")
    lib = ctypes.CDLL(str(path))
    assert all(hasattr(lib, name) for name in ("edge_kv_rope_write", "edge_kv_write", "edge_kv_attention"))


def test_a_change_to_the_shared_header_builds_the_libraries_again(tmp_path: Path) -> None:
    """The cache key of a library covers the header its source includes: an edit there
    cannot leave a stale build in the kernel cache."""
    src = tmp_path / "one.cu"
    src.write_text('#include "common.cuh"\n')
    header = tmp_path / "common.cuh"
    header.write_text("// one\n")
    before = cuda_build.library_path("true", src, "87")
    header.write_text("// two\n")
    assert cuda_build.library_path("true", src, "87") != before


# ---- on the GPU ------------------------------------------------------------------------

gpu = pytest.mark.gpu
CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture
def cuda_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Our CUDA kernels serve this test's steps, Triton installed or not."""
    from edge.text.ops.cuda import decode_ops

    if not (decode_ops.available("cuda") and kv_ops.available("cuda")):
        pytest.skip("our CUDA kernels did not build here")
    monkeypatch.setattr(step_ops, "_chosen", {"cuda": "cuda", "cuda:0": "cuda"})
    yield


def _kv(
    tokens: int, config: LlamaConfig = CONFIG, dtype: torch.dtype = torch.float16, rows: int = 2, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, config.num_kv_heads, tokens, config.head_dim, generator=gen)
    k[..., 7] *= 12.0  # an outlier channel, as real keys have
    v = torch.randn(rows, config.num_kv_heads, tokens, config.head_dim, generator=gen)
    return k.to(dtype), v.to(dtype)


# Head size 128 (the 8B shape's: three query heads a KV head as here, four there) beside
# the test model's 64; bfloat16 beside float16.
CONFIG_128 = LlamaConfig(
    vocab_size=256, hidden_size=768, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=384
)
CASES = {
    **{name: (name, CONFIG, torch.float16) for name in CUDA_FORMATS},
    "int8-hd128-bf16": ("int8", CONFIG_128, torch.bfloat16),
    "int4-hd128-f16": ("int4", CONFIG_128, torch.float16),
    "int8-grouped-sink-bf16": ("int8-grouped-sink", CONFIG, torch.bfloat16),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_write_codes_as_torch_and_attention_matches_the_reference(case: str, cuda_backend: None) -> None:
    """Token by token past three key blocks, our write leaves the codes, scales and zero
    points torch's store leaves (byte for byte, from the same float16 or bfloat16
    tokens); decode attention and a chunk after the cached tokens match attention over
    the reference's read-back of the same cache. Head sizes 64 and 128."""
    name, config, dtype = CASES[case]
    fmt = CUDA_FORMATS[name]
    tol = 2e-3 if dtype == torch.float16 else 8e-3  # the output's rounding: bfloat16 keeps 8 bits
    total, chunk = 232, 24
    k, v = _kv(total + chunk, config, dtype)
    want_cache = QuantKVCache(config, 2, 256, fmt, dtype, torch.device("cpu"))
    cache = QuantKVCache(config, 2, 256, fmt, dtype, CUDA)
    want, layer = want_cache.layer(1), cache.layer(1)
    want.store(k[:, :, :20], v[:, :, :20], 0)
    layer.store(k[:, :, :20].to(CUDA), v[:, :, :20].to(CUDA), 0)
    for t in range(20, total):
        want.write_tokens(k[:, :, t : t + 1], v[:, :, t : t + 1], [t, t])
        kv_ops.write_tokens(layer, k[:, :, t].to(CUDA), v[:, :, t].to(CUDA), torch.tensor([t, t], device=CUDA))
    coded = fmt.coded(total)
    blocks = coded // fmt.key_block
    assert blocks >= 2
    for part, upto in (("k_codes", coded), ("v_codes", coded), ("v_scale", coded), ("v_zero", coded)):
        if getattr(want, part).numel():  # (a format without zero points holds none)
            got, expect = getattr(layer, part)[:, :, :upto].cpu(), getattr(want, part)[:, :, :upto]
            assert torch.equal(got, expect), part
    for part in ("k_scale", "k_zero"):
        if getattr(want, part).numel():
            got, expect = getattr(layer, part)[:, :, :blocks].cpu(), getattr(want, part)[:, :, :blocks]
            assert torch.equal(got, expect), part
    assert torch.equal(layer.ring_k.cpu(), want.ring_k) and torch.equal(layer.sink_k.cpu(), want.sink_k)

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, config.num_heads, config.head_dim, generator=gen).to(dtype)
    pos = torch.tensor([total - 1, total - 1], device=CUDA)
    out = kv_ops.attention(layer, q.to(CUDA), pos, 256, q_scale=config.head_dim**-0.5).float().cpu()
    again = kv_ops.attention(layer, q.to(CUDA), pos, 256, q_scale=config.head_dim**-0.5).float().cpu()
    assert torch.equal(out, again)  # the split counters left zeros for the next call
    rk, rv = want.read(total)
    for b in range(2):
        expect_out = _attend(q[b, :, None].float(), rk[b], rv[b])[:, 0].reshape(-1)
        torch.testing.assert_close(out[b], expect_out, rtol=tol, atol=tol)

    # A chunk of 24 after the cached tokens of row 0.
    one, one_want = cache.rows(0, 1).layer(1), want_cache.rows(0, 1).layer(1)
    qc = torch.randn(chunk, config.num_heads, config.head_dim, generator=gen).to(dtype)
    coded = fmt.coded(total)
    ring_k, ring_v = one.ring_span(coded, total)
    float_k = torch.cat([ring_k, k[:1, :, total:].to(CUDA)], dim=2)
    float_v = torch.cat([ring_v, v[:1, :, total:].to(CUDA)], dim=2)
    got = kv_ops.chunk_attention(one, qc.to(CUDA), float_k, float_v, total, coded, config.head_dim**-0.5)
    rk, rv = one_want.read(total)
    kk = torch.cat([rk, k[:1, :, total:].float()], dim=2)
    vv = torch.cat([rv, v[:1, :, total:].float()], dim=2)
    expect_chunk = _attend(qc.float().transpose(0, 1), kk[0], vv[0]).transpose(0, 1)
    torch.testing.assert_close(got.float().cpu(), expect_chunk, rtol=tol, atol=tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("window", [5, 150])  # inside the float tokens; across key blocks and splits
@pytest.mark.parametrize("case", ["int8", "int4-hd128-f16", "int8-small-groups", "int8-grouped-sink-bf16"])
def test_attention_keeps_a_sliding_window_and_a_query_scale(case: str, window: int, cuda_backend: None) -> None:
    """A sliding layer (Gemma 3's, Mistral's) over our kernels, tensor-core and scalar:
    decode and a chunk see each query's last `window` positions only (the sink tokens
    only inside them), with the family's query scale; as attention over the reference's
    read-back with the window's mask, and unlike it without."""
    name, config, dtype = CASES[case]
    fmt = CUDA_FORMATS[name]
    tol = 2e-3 if dtype == torch.float16 else 8e-3
    # A query scale other than head_dim^-0.5, below it as Gemma 3 27B's: at 0.3 (2.4x the
    # default) the scores are so large that the float16 queries' rounding alone moves a
    # chunk's outputs by up to 0.0054 (measured on an H100), past this tolerance.
    total, chunk, scale = 232, 24, 0.7 * config.head_dim**-0.5
    k, v = _kv(total + chunk, config, dtype, rows=1)
    want_cache = QuantKVCache(config, 1, 256, fmt, dtype, torch.device("cpu"))
    cache = QuantKVCache(config, 1, 256, fmt, dtype, CUDA)
    want, layer = want_cache.layer(0), cache.layer(0)
    want.store(k[:, :, :total], v[:, :, :total], 0)
    layer.store(k[:, :, :total].to(CUDA), v[:, :, :total].to(CUDA), 0)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, config.num_heads, config.head_dim, generator=gen).to(dtype)
    pos = torch.tensor([total - 1], device=CUDA)
    out = kv_ops.attention(layer, q.to(CUDA), pos, 256, q_scale=scale, window=window).float().cpu()
    rk, rv = want.read(total)
    expect = _attend(q[0, :, None].float(), rk[0], rv[0], window, scale)[:, 0].reshape(-1)
    torch.testing.assert_close(out[0], expect, rtol=tol, atol=tol)
    dense = _attend(q[0, :, None].float(), rk[0], rv[0], 0, scale)[:, 0].reshape(-1)
    assert (expect - dense).abs().max() > 10 * tol
    qc = torch.randn(chunk, config.num_heads, config.head_dim, generator=gen).to(dtype)
    coded = fmt.coded(total)
    ring_k, ring_v = layer.ring_span(coded, total)
    float_k = torch.cat([ring_k, k[:, :, total:].to(CUDA)], dim=2)
    float_v = torch.cat([ring_v, v[:, :, total:].to(CUDA)], dim=2)
    got = kv_ops.chunk_attention(layer, qc.to(CUDA), float_k, float_v, total, coded, scale, window)
    kk = torch.cat([rk, k[:, :, total:].float()], dim=2)
    vv = torch.cat([rv, v[:, :, total:].float()], dim=2)
    expect_chunk = _attend(qc.float().transpose(0, 1), kk[0], vv[0], window, scale).transpose(0, 1)
    torch.testing.assert_close(got.float().cpu(), expect_chunk, rtol=tol, atol=tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", ["int8", "int4-hd128-f16"])
def test_our_kernels_read_and_write_a_sliding_layers_codes_in_a_circle(case: str, cuda_backend: None) -> None:
    """Our decode write codes each key block into its slot of a sliding layer's circle (a
    prefill having coded more blocks than the circle holds), and decode and chunk
    attention over the circle, in the window, give what they give over a cache holding
    every position, bit for bit (the same codes, from other slots)."""
    name, config, dtype = CASES[case]
    fmt = CUDA_FORMATS[name]
    sliding = dataclasses.replace(config, sliding_window=70, layer_types=("sliding",) * config.num_layers)
    k, v = _kv(424, config, dtype, rows=1)
    layers = []
    for sized in (True, False):
        cache = QuantKVCache(sliding, 1, 512, fmt, dtype, CUDA, window_sized=sized)
        layer = cache.layer(0)
        layer.store(k[:, :, :260].to(CUDA), v[:, :, :260].to(CUDA), 0)
        for t in range(260, 400):
            kv_ops.write_tokens(layer, k[:, :, t].to(CUDA), v[:, :, t].to(CUDA), torch.tensor([t], device=CUDA))
        layers.append(layer)
    circle, every = layers
    assert circle.circular and circle.code_len == 3 * 64 < every.code_len
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, config.num_heads, config.head_dim, generator=gen).to(dtype).to(CUDA)
    pos = torch.tensor([399], device=CUDA)
    outs = [kv_ops.attention(layer, q, pos, 512, q_scale=0.1, window=70).cpu() for layer in layers]
    assert torch.equal(outs[0], outs[1])
    coded = fmt.coded(400)
    qc = torch.randn(24, config.num_heads, config.head_dim, generator=gen).to(dtype).to(CUDA)
    chunks = []
    for layer in layers:
        ring_k, ring_v = layer.ring_span(coded, 400)
        float_k = torch.cat([ring_k, k[:, :, 400:424].to(CUDA)], dim=2)
        float_v = torch.cat([ring_v, v[:, :, 400:424].to(CUDA)], dim=2)
        chunks.append(kv_ops.chunk_attention(layer, qc, float_k, float_v, 400, coded, 0.1, 70).cpu())
    assert torch.equal(chunks[0], chunks[1])


@gpu
@needs_cuda
def test_a_sliding_model_over_a_quantized_cache_on_our_kernels(cuda_backend: None) -> None:
    """A model with a sliding layer and a query scale of its own (Mistral's and Gemma 3's
    options; the families' test models have heads our kernels do not take) served op by
    op over an int8 cache on our kernels: past the window (a prefill longer than it, then
    one token at a time) its logits stay near the float cache's; the same codes read as
    if the model had no window do not, so the window is what the kernels kept."""
    window = 16
    config = dataclasses.replace(CONFIG, sliding_window=window, layer_types=("sliding", "full"), attention_scale=0.1)
    model = random_int4_llama(config, CUDA, "dequant", group=32, dtype=torch.float16, seed=5)
    model.fused_decode = False
    ids = torch.randint(0, config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(2)).to(CUDA)
    prefill = window + 5

    def run(kv_format: KVFormat | None) -> torch.Tensor:
        cache = model.new_cache(1, 256, kv_format)
        steps = [model(ids[:, :prefill], cache, 0)[0, -1]]
        steps += [model(ids[:, t : t + 1], cache, t)[0, -1] for t in range(prefill, ids.shape[1])]
        return torch.stack(steps).float()

    want = run(None)
    got = run(FORMATS["int8"])
    error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert [a.window for a in attentions] == [window, 0]
    attentions[0].window = 0
    unwindowed = run(FORMATS["int8"])
    attentions[0].window = window
    far = ((unwindowed - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert error < 0.05 and far > 10 * error, (error, far)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_fused_step_over_a_quantized_cache_on_our_kernels(name: str, cuda_backend: None) -> None:
    """The fused decode step's rotary kernel writes and codes the quantized cache itself:
    its logits agree with the op-by-op step over a cache of the same format (whose write
    is kv_ops' own), past the coding of key blocks, for two rows at different positions;
    the codes agree, bar a step where the two rotaries' last bits put a key across a
    rounding edge (a float16 key's last bit moves its int8 code by up to about 0.06 of a
    step: 2.3% of codes measured, a step apart at most); a sequence's logits are the same bits alone and
    beside another."""
    config = CONFIG
    fmt = FORMATS[name]  # type: ignore[index]
    fused = random_int4_llama(config, CUDA, "cuda-mma", group=32, dtype=torch.float16, seed=5)
    ref = random_int4_llama(config, CUDA, "dequant", group=32, dtype=torch.float16, seed=5)
    ref.fused_decode = False
    assert fused_step.can_fuse(fused)
    cache = QuantKVCache(config, 2, 256, fmt, torch.float16, CUDA)
    alone = QuantKVCache(config, 1, 256, fmt, torch.float16, CUDA)
    ref_cache = QuantKVCache(config, 2, 256, fmt, torch.float16, CUDA)
    gen = torch.Generator().manual_seed(1)
    steps = 170  # past two key blocks of 64 leaving the window
    ids = torch.randint(0, config.vocab_size, (2, steps), generator=gen).to(CUDA)
    offsets = [0, 5]
    for step in range(steps):
        pos = torch.tensor([max(0, step - o) for o in offsets], device=CUDA)
        tokens = torch.stack([ids[b, int(pos[b])] for b in range(2)]).view(2, 1)
        got = fused_step.fused_decode_step(fused, tokens, cache, pos, 256)
        one = fused_step.fused_decode_step(fused, tokens[:1], alone, pos[:1], 256)
        expect = ref.decode_step(tokens, ref_cache, pos, 256)
        assert torch.equal(one[0], got[0]), f"position {step}: batched logits differ from alone"
        for b in range(2):
            err = float((got[b].float() - expect[b].float()).norm() / expect[b].float().norm())
            assert err < 3e-2, f"row {b} position {int(pos[b])}: relative error {err:.4f}"
    coded = fmt.coded(steps - offsets[1])
    assert coded >= 2 * fmt.key_block
    got_codes = cache.k_codes[:, :, :, :coded].cpu().to(torch.int16)
    want_codes = ref_cache.k_codes[:, :, :, :coded].cpu().to(torch.int16)
    if fmt.dtype == "int4":  # two codes a byte: compare each nibble
        got_codes = torch.stack([got_codes & 15, got_codes >> 4])
        want_codes = torch.stack([want_codes & 15, want_codes >> 4])
    assert (got_codes - want_codes).abs().max() <= 1 and (got_codes != want_codes).float().mean() < 0.05
