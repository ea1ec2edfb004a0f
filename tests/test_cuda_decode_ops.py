"""Our CUDA C decode-step kernels (edge/text/ops/cuda/decode_ops.cu), the path of a box
without Triton (a Jetson), and the choice between them and Triton's (ops/step_ops.py).

The choice is tested here with its probes replaced (no GPU needed); the build with
nvcc where it is installed; the kernels themselves against plain torch on the GPU (the
`gpu` marker), one by one and as the fused decode step and prefill they serve.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.kv.float_cache import KVCache
from edge.text.ops import step_ops
from edge.text.ops.cuda import cuda_build, kv_ops
from edge.text.ops.cuda import decode_ops as cuda_ops
from edge.text.runtime import fused_step
from engines.text.random_llama import random_int4_llama

# Grouped-query attention with 3 query heads per KV head, like SmolLM2.
GQA = LlamaConfig(vocab_size=256, hidden_size=384, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=512)


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(step_ops, "_chosen", {})
    yield


def test_triton_is_chosen_where_present_and_our_cuda_kernels_where_not(
    monkeypatch: pytest.MonkeyPatch, fresh_choice: None
) -> None:
    """Triton serves where it is installed; without it (a Jetson) our CUDA kernels do,
    and each refused backend says why. Neither: None, and the fused step is refused."""
    monkeypatch.setattr(step_ops, "cuda_present", lambda device: device.type == "cuda")
    monkeypatch.setattr(step_ops, "triton_present", lambda: True)
    assert step_ops.backend("cuda:0") == "triton"
    assert step_ops.quantized_kv("cuda:0")

    monkeypatch.setattr(step_ops, "_chosen", {})
    monkeypatch.setattr(step_ops, "triton_present", lambda: False)
    assert step_ops.backend("cuda:0") == "cuda"
    assert step_ops.refusals("cuda:0") == {"triton": "Triton is not installed"}
    # The CUDA attention's own limits, named.
    assert step_ops.attention_refusal("cuda:0", 128, 4, torch.float16) is None
    assert "head_dim 96" in str(step_ops.attention_refusal("cuda:0", 96, 4, torch.float16))
    assert "float32" in str(step_ops.attention_refusal("cuda:0", 64, 4, torch.float32))
    assert "17 query heads" in str(step_ops.attention_refusal("cuda:0", 64, 17, torch.float16))
    assert step_ops.attention_refusal("cuda:0", 128, 4, torch.float16, 8192) is None
    assert "hidden size 16384" in str(step_ops.attention_refusal("cuda:0", 128, 4, torch.float16, 16384))

    monkeypatch.setattr(step_ops, "_chosen", {})
    monkeypatch.setattr(step_ops, "cuda_present", lambda device: False)
    assert step_ops.backend("cuda:0") is None
    assert step_ops.attention_refusal("cuda:0", 64, 4, torch.float16) == "no decode step kernels here"
    assert "did not build" in step_ops.refusals("cuda:0")["cuda"]


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("sms", [16, 132])  # an AGX Orin's, an H100's
@pytest.mark.parametrize("n_kv", [1, 2, 8])
def test_the_cache_splits_into_whole_tiles_each_with_positions_to_read(sms: int, n_kv: int) -> None:
    """Our attention's chunks are whole tiles and none lies wholly past the cache (a block
    with nothing to read still costs its whole latency), as many as give each SM about
    ATTN_SPREAD blocks until a chunk is one tile, at most MAX_SPLITS however long the cache;
    the quantized cache's spread likewise."""
    for spread in (cuda_ops.ATTN_SPREAD, kv_ops.KV_SPREAD):
        for kv_len in [1, 63, 64, 65, 256, 768, 4096, 4352, 16384, 20000, 131072]:
            splits, chunk = cuda_ops.attention_splits(kv_len, n_kv, sms, spread)
            assert chunk % cuda_ops.ATTN_TILE == 0 and 1 <= splits <= cuda_ops.MAX_SPLITS
            assert (splits - 1) * chunk < kv_len <= splits * chunk, (kv_len, splits, chunk)
            wanted = max(1, min(cuda_ops.MAX_SPLITS, sms * spread // n_kv))
            assert splits <= wanted, (kv_len, splits, chunk)
            if chunk > cuda_ops.ATTN_TILE:  # longer chunks only where a tile less would take more splits than wanted
                assert -(-kv_len // (chunk - cuda_ops.ATTN_TILE)) > wanted, (kv_len, splits, chunk)
    # The float cache's 8B shape at 4K on an H100: 16 chunks of four tiles, what was measured.
    assert cuda_ops.attention_splits(4096, 8, 132) == (16, 256)


@pytest.mark.parametrize(("arch", "virtual"), [("87", None), ("90", "compute_80")])
def test_decode_kernels_build_for_the_orin_and_as_ampere_ptx(
    arch: str, virtual: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_ops.cu compiles for sm_87 (the Orin), and as compute_80 PTX alone when
    EDGE_CUDA_ARCH asks (the Jetson proxy on a newer GPU), into the kernel cache, once;
    its entry points load."""
    monkeypatch.setenv("EDGE_KERNEL_CACHE", str(tmp_path))
    if virtual:
        monkeypatch.setenv(cuda_build.ARCH_ENV, virtual)
    path = cuda_build.build(cuda_ops.SOURCE, arch)
    assert path.parent == tmp_path and (virtual or f"sm_{arch}").replace("_", "") in path.name
    mtime = path.stat().st_mtime_ns
    assert cuda_build.build(cuda_ops.SOURCE, arch) == path and path.stat().st_mtime_ns == mtime
    lib = ctypes.CDLL(str(path))
    names = ("edge_add_rmsnorm", "edge_rope_kv_write", "edge_rope_prefill", "edge_decode_attention", "edge_silu_mul")
    assert all(hasattr(lib, name) for name in names)


# ---- on the GPU ------------------------------------------------------------------------

gpu = pytest.mark.gpu
CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture
def cuda_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Our CUDA kernels serve this test's steps, Triton installed or not."""
    if not cuda_ops.available("cuda"):
        pytest.skip("the CUDA decode kernels did not build here")
    monkeypatch.setattr(step_ops, "_chosen", {"cuda": "cuda", "cuda:0": "cuda"})
    yield


@gpu
@needs_cuda
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 1000, 4096, 8192])  # SmolLM2's, a ragged one, the 8B's, the largest taken
def test_add_rmsnorm(delta_dtype: torch.dtype | None, dtype: torch.dtype, hidden: int, cuda_backend: None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(3, hidden, device="cuda", generator=gen)
    delta = None if delta_dtype is None else torch.randn(3, hidden, device="cuda", generator=gen).to(delta_dtype)
    w = torch.randn(hidden, device="cuda", generator=gen).to(dtype)
    want_x = x + (0 if delta is None else delta.float())
    want = (want_x * torch.rsqrt(want_x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(dtype)
    h = cuda_ops.add_rmsnorm(x, delta, w, 1e-5)
    torch.testing.assert_close(x, want_x)
    torch.testing.assert_close(h, want)


@gpu
@needs_cuda
def test_rotary_writes_queries_and_the_cache_at_each_rows_position(cuda_backend: None) -> None:
    from edge.text.model.llama import LlamaModel, apply_rope

    model = LlamaModel(GQA).to("cuda")
    nh, nkv, hd = GQA.num_heads, GQA.num_kv_heads, GQA.head_dim
    qkv = torch.randn(2, (nh + 2 * nkv) * hd, generator=torch.Generator().manual_seed(3)).cuda()
    cache = KVCache(GQA, 2, 32, torch.float16, CUDA)
    pos = torch.tensor([5, 17], device="cuda")
    q = cuda_ops.rope_kv_write(qkv, model.rope_cos, model.rope_sin, pos, cache.k[0], cache.v[0], nh)
    for b, p in enumerate(pos.tolist()):
        heads = qkv[b].view(nh + 2 * nkv, 1, hd)
        cos, sin = model.rope_cos[p : p + 1], model.rope_sin[p : p + 1]
        torch.testing.assert_close(q[b], (apply_rope(heads[:nh], cos, sin)[:, 0] * hd**-0.5).half())
        torch.testing.assert_close(cache.k[0, b, :, p], apply_rope(heads[nh : nh + nkv], cos, sin)[:, 0].half())
        assert torch.equal(cache.v[0, b, :, p], heads[nh + nkv :, 0].half())
        others = [t for t in range(32) if t != p]
        assert not cache.k[0, b, :, others].any() and not cache.v[0, b, :, others].any()


@gpu
@needs_cuda
def test_prefill_rotary_writes_q_k_v_and_the_cache_row(cuda_backend: None) -> None:
    """As the Triton kernel's test: q rotated and scaled, k rotated, v copied, for
    positions 0..T-1, with k and v also in the given cache row and no other."""
    from edge.text.model.llama import LlamaModel, apply_rope
    from edge.text.runtime.fused_prefill import rope_write

    model = LlamaModel(GQA).float().to("cuda")
    nh, nkv, hd, tokens = GQA.num_heads, GQA.num_kv_heads, GQA.head_dim, 7
    qkv = torch.randn(tokens, (nh + 2 * nkv) * hd, generator=torch.Generator().manual_seed(5)).cuda()
    cache = model.new_cache(3, 16)
    k_cache, v_cache = cache.k[0], cache.v[0]
    q, k, v = rope_write(qkv, model, torch.tensor([1], device="cuda"), k_cache, v_cache)
    cos, sin = model.rope_cos[:tokens], model.rope_sin[:tokens]
    heads = qkv.view(tokens, nh + 2 * nkv, hd).transpose(0, 1)
    ref_k = apply_rope(heads[nh : nh + nkv], cos, sin)
    torch.testing.assert_close(q[0], apply_rope(heads[:nh], cos, sin) * hd**-0.5, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k[0], ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v[0], heads[nh + nkv :])
    torch.testing.assert_close(k_cache[1, :, :tokens], ref_k, rtol=1e-5, atol=1e-5)
    assert not k_cache[[0, 2]].any() and not v_cache[[0, 2]].any()


@gpu
@needs_cuda
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(6, 2, 64), (32, 8, 128), (8, 8, 128), (16, 1, 64), (8, 2, 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sms", [132, 1])
def test_decode_attention_matches_softmax_over_each_rows_positions(
    heads: int, kv_heads: int, hd: int, dtype: torch.dtype, sms: int, cuda_backend: None
) -> None:
    """Each sequence attends to its own positions 0..pos[b] and to nothing after, over
    chunks split across the GPU (a partial last tile, chunks past a short sequence's
    position) or, as on a GPU of few SMs, one chunk of many tiles (the online softmax
    rescaling across them); to float32 rounding of the cache's values. The chunks' last
    block merges them and leaves the split counters zeros: a second call (a graph's
    replay) gives the same output, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    max_len, kv_len = 1024, 900
    q = torch.randn(3, heads, hd, device="cuda", generator=gen).to(dtype) * hd**-0.5
    k = torch.randn(3, kv_heads, max_len, hd, device="cuda", generator=gen).to(dtype)
    v = torch.randn(3, kv_heads, max_len, hd, device="cuda", generator=gen).to(dtype)
    pos = torch.tensor([899, 0, 130], device="cuda")
    out = cuda_ops.decode_attention(q, k, v, pos, kv_len, sms=sms).view(3, heads, hd)
    assert int(cuda_build.split_counters(q.device, 1).count_nonzero()) == 0
    assert torch.equal(cuda_ops.decode_attention(q, k, v, pos, kv_len, sms=sms).view(3, heads, hd), out)
    group = heads // kv_heads
    for b, p in enumerate(pos.tolist()):
        keys = k[b, :, : p + 1].float().repeat_interleave(group, 0)
        values = v[b, :, : p + 1].float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,htd->ht", q[b].float(), keys)
        want = torch.einsum("ht,htd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[b].float(), want, rtol=2e-2, atol=2e-2 if dtype == torch.bfloat16 else 4e-3)


@gpu
@needs_cuda
@pytest.mark.parametrize("paired", [False, True])
def test_silu_mul(paired: bool, cuda_backend: None) -> None:
    from edge.text.ops.cuda import cuda_int4

    tokens, f = 3, 2 * 1024 + 48
    plain = torch.randn(tokens, 2 * f, generator=torch.Generator().manual_seed(6)).cuda()
    gate_up = plain[:, cuda_int4.pair_order(2 * f).cuda()].contiguous() if paired else plain
    out = cuda_ops.silu_mul(gate_up, torch.float32, paired)
    torch.testing.assert_close(out, torch.nn.functional.silu(plain[:, :f]) * plain[:, f:], rtol=1e-5, atol=1e-6)


@gpu
@needs_cuda
def test_fused_step_on_our_kernels_matches_the_reference_and_is_batch_invariant(cuda_backend: None) -> None:
    """The fused decode step with our CUDA kernels between the products: logits agree with
    the float32 dequantized model at every position (sequences at different positions,
    reaching later attention chunks), and a sequence's logits are the same bits alone
    and beside another."""
    config = GQA
    fused = random_int4_llama(config, "cuda", "cuda-mma", group=32, dtype=torch.float16, seed=5)
    ref = random_int4_llama(config, "cuda", "dequant", group=32, dtype=torch.float32, seed=5)
    ref.fused_decode = False
    assert fused_step.can_fuse(fused)
    gen = torch.Generator().manual_seed(1)
    steps = 70  # past the first attention tile of 64 positions
    ids = torch.randint(0, config.vocab_size, (2, steps), generator=gen).cuda()
    want = torch.stack([ref(ids[b : b + 1], ref.new_cache(1, 128), 0, last_only=False)[0] for b in range(2)])
    cache = KVCache(config, 2, 128, torch.float16, CUDA)
    alone = KVCache(config, 1, 128, torch.float16, CUDA)
    offsets = [0, 5]
    for step in range(steps):
        pos = torch.tensor([max(0, step - o) for o in offsets], device="cuda")
        tokens = torch.stack([ids[b, int(pos[b])] for b in range(2)]).view(2, 1)
        got = fused_step.fused_decode_step(fused, tokens, cache, pos, 128)
        one = fused_step.fused_decode_step(fused, tokens[:1], alone, pos[:1], 128)
        assert torch.equal(one[0], got[0]), f"position {step}: batched logits differ from alone"
        for b in range(2):
            expect = want[b, int(pos[b])]
            err = float((got[b].float() - expect).norm() / expect.norm())
            assert err < 2e-2, f"sequence {b} position {int(pos[b])}: relative error {err:.4f}"


@gpu
@needs_cuda
def test_fused_prefill_on_our_kernels_matches_the_per_op_prefill(cuda_backend: None) -> None:
    """A fresh prompt through fused_prefill with our kernels: the last token's logits and
    the cache row it wrote agree with the model's own prefill."""
    from edge.text.runtime.fused_prefill import fused_prefill

    config = GQA
    model = random_int4_llama(config, "cuda", "cuda-mma", group=32, dtype=torch.float16, seed=7)
    ids = torch.randint(0, config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(8)).cuda()
    cache = KVCache(config, 2, 64, torch.float16, CUDA)
    logits = fused_prefill(model, ids, cache, torch.tensor([1], device="cuda"), torch.tensor([36], device="cuda"))
    ref_cache = KVCache(config, 1, 64, torch.float16, CUDA)
    model.fused_decode = False
    want = model(ids, ref_cache.rows(0, 1), 0, last_only=False)[0, -1].float()
    err = float((logits[0] - want).norm() / want.norm())
    assert err < 2e-2, f"relative error {err:.4f}"
    torch.testing.assert_close(cache.k[:, 1, :, :37], ref_cache.k[:, 0, :, :37], rtol=2e-2, atol=2e-2)
    assert not cache.k[:, 0].any()
