"""Our Triton kernels against plain torch: the INT4 GEMV and the fused decode step.

On a machine without CUDA, conftest runs Triton in its interpreter, so the same kernel
code (masks, bit tricks, online softmax) is checked on CPU; on a GPU it runs compiled.
"""

from __future__ import annotations

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.kv.float_cache import KVCache
from edge.text.ops.int4 import dequantize, pack
from edge.text.ops.triton import decode_ops, triton_int4
from edge.text.runtime import fused_step
from engines.text.random_llama import random_int4_llama

pytestmark = pytest.mark.skipif(not triton_int4.TRITON_SUPPORT, reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("n", "k", "group", "rows", "block_w"),
    [
        (64, 256, 32, 1, 32),  # one tile per split
        (48, 576, 32, 3, 64),  # SmolLM2's width: a partial last tile, odd row count
        (40, 512, 128, 1, 32),  # a group spans the whole tile
        (33, 1536, 64, 8, 64),  # N not a multiple of the block, the most rows a GEMV takes
    ],
)
def test_gemv_matches_dequantized_matmul(n: int, k: int, group: int, rows: int, block_w: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    q = pack(torch.randn(n, k, generator=gen), group)
    x = torch.randn(rows, k, generator=gen)
    ref = x @ dequantize(q).T
    for split in (1, 2):
        out = triton_int4.int4_gemv(
            x.to(DEVICE),
            q.qweight.to(DEVICE),
            q.scales.to(DEVICE),
            q.zeros.to(DEVICE),
            group,
            config={"BLOCK_N": 16, "BLOCK_W": block_w, "SPLIT_K": split},
        ).cpu()
        assert out.shape == (rows, n)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


def test_kept_split_k_counters_come_back_zeroed_for_the_next_product() -> None:
    """The counters a layer keeps between products (no zeroing kernel per product) are
    left at zero by every split-K launch, so the next product on them is right too."""
    gen = torch.Generator().manual_seed(5)
    q = pack(torch.randn(40, 512, generator=gen), 32)
    weight = (q.qweight.to(DEVICE), q.scales.to(DEVICE), q.zeros.to(DEVICE))
    x = torch.randn(3, 512, generator=gen)
    ref = x @ dequantize(q).T
    counters = torch.zeros(triton_int4.counter_size(3, 40), dtype=torch.int32, device=DEVICE)
    config = {"BLOCK_N": 8, "BLOCK_W": 32, "SPLIT_K": 2}
    for _ in range(2):
        out = triton_int4.int4_gemv(x.to(DEVICE), *weight, 32, config=config, counters=counters).cpu()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))
        assert int(counters.count_nonzero()) == 0
    with pytest.raises(ValueError, match="split-K counters"):
        triton_int4.int4_gemv(x.to(DEVICE), *weight, 32, config=config, counters=counters[:4])


def test_gemv_refuses_too_many_rows() -> None:
    q = pack(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="at most"):
        triton_int4.int4_gemv(torch.randn(triton_int4.GEMV_MAX_ROWS + 1, 64), q.qweight, q.scales, q.zeros, 32)


# Grouped-query attention with 3 query heads per KV head, like SmolLM2.
GQA = LlamaConfig(vocab_size=256, hidden_size=192, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=384)


def test_fused_decode_step_matches_reference() -> None:
    """Decode tokens through the fused step and through the float32 dequantized model
    with the same weights; the logits agree at every position, including positions in
    later attention chunks and a second sequence at a different position."""
    config = GQA
    batch = 2
    fused = random_int4_llama(config, DEVICE, "triton", group=32, seed=5)
    ref = random_int4_llama(config, DEVICE, "dequant", group=32, dtype=torch.float32, seed=5)
    ref.fused_decode = False
    gen = torch.Generator().manual_seed(1)
    steps = 38  # both sequences reach the second chunk of 32 positions
    ids = torch.randint(0, config.vocab_size, (batch, steps), generator=gen).to(DEVICE)
    want = torch.stack(
        [ref(ids[b : b + 1], ref.new_cache(1, 64), 0, last_only=False)[0] for b in range(batch)]
    )  # [B, T, V]
    cache = KVCache(config, batch, 64, torch.bfloat16, DEVICE)
    kv_len = 64  # two chunks of 32 positions: a chunk past a position must contribute nothing
    # Sequences at different positions: the second one holds at position 0 (rewriting
    # the same token) for 5 steps, then runs 5 positions behind the first.
    offsets = [0, 5][:batch]
    for step in range(steps):
        pos = torch.tensor([max(0, step - o) for o in offsets], device=DEVICE)
        tokens = torch.stack([ids[b, int(pos[b])] for b in range(batch)]).view(batch, 1)
        got = fused_step.fused_decode_step(fused, tokens, cache, pos, kv_len)
        for b in range(batch):
            expect = want[b, int(pos[b])]
            err = float((got[b].float().cpu() - expect.cpu()).norm() / expect.norm())
            assert err < 2e-2, f"sequence {b} position {int(pos[b])}: relative error {err:.4f}"


def test_attention_splits_cover_the_window() -> None:
    for kv_len in (32, 100, 256, 4096):
        splits, chunk = decode_ops.attn_splits(kv_len, 8, 132)
        assert splits & (splits - 1) == 0 and splits <= decode_ops.MAX_ATTN_SPLITS
        assert splits * chunk >= kv_len and chunk % decode_ops.ATTN_BLOCK_T == 0
        assert (splits - 1) * chunk < kv_len  # no chunk lies wholly past the window


@pytest.mark.gpu
def test_tune_gemv_tunes_every_shape_at_load() -> None:
    """After tune_gemv, decode at any batch size finds its configuration cached: the
    autotuner (which captures CUDA graphs) never runs while other threads use the GPU."""
    from edge.text.ops.int4 import Int4Linear, tune_gemv

    model = random_int4_llama(GQA, "cuda", "triton", group=32, dtype=torch.float16, seed=3)
    tuner = triton_int4._int4_gemv_bits_tuned
    tuner.cache.clear()  # process-wide: earlier tests' models tuned shapes of their own
    tuned = tune_gemv(model, torch.float16)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    shapes = {(m.out_features, m.in_features) for m in layers}
    assert tuned == len(shapes)
    before = dict(tuner.cache)
    for rows in (1, 3, 8):
        x = torch.randn(rows, GQA.hidden_size, device="cuda", dtype=torch.float16)
        for layer in layers:
            if layer.in_features == GQA.hidden_size:
                layer.gemv(x)
    assert dict(tuner.cache) == before
    assert {(k[0], k[1]) for k in before} == shapes


@pytest.mark.parametrize("split", [1, 2])
def test_a_rows_result_is_the_same_alone_and_in_a_batch(split: int) -> None:
    """Batch invariance: row i of an M-row GEMV equals the one-row GEMV of that row, bit
    for bit, for every M (split-K partials added in a fixed order)."""
    gen = torch.Generator().manual_seed(11)
    q = pack(torch.randn(72, 576, generator=gen), 32)
    weight = (q.qweight.to(DEVICE), q.scales.to(DEVICE), q.zeros.to(DEVICE))
    x = torch.randn(8, 576, generator=gen).to(DEVICE)
    config = {"BLOCK_N": 16, "BLOCK_W": 32, "SPLIT_K": split}
    alone = [triton_int4.int4_gemv(x[i : i + 1], *weight, 32, config=config) for i in range(8)]
    for rows in (2, 3, 8):
        batch = triton_int4.int4_gemv(x[:rows], *weight, 32, config=config)
        for i in range(rows):
            assert torch.equal(batch[i : i + 1], alone[i]), (rows, i)
    again = triton_int4.int4_gemv(x, *weight, 32, config=config)
    assert torch.equal(again, torch.cat(alone))  # and the same from run to run


@pytest.mark.gpu
def test_the_tuned_gemv_is_batch_invariant_and_repeatable_on_every_shape() -> None:
    """The configuration the tuner picks, on SmolLM2's layer shapes: each row of a batch
    of 1 to 8 equals that row alone, and every run gives the same bits."""
    gen = torch.Generator().manual_seed(12)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
        q = pack(torch.randn(n, k, generator=gen), 32)
        weight = (q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda())
        x = torch.randn(8, k, generator=gen).cuda().half()
        alone = torch.cat([triton_int4.int4_gemv(x[i : i + 1], *weight, 32) for i in range(8)])
        for rows in range(1, 9):
            for _ in range(3):
                assert torch.equal(triton_int4.int4_gemv(x[:rows], *weight, 32), alone[:rows]), (n, k, rows)


def test_prefill_rotary_kernel_writes_q_k_v_and_the_cache_row() -> None:
    """fused_prefill.rope_write (Triton's interpreter here, the GPU in a bench run):
    q rotated and scaled by 1/sqrt(head_dim), k rotated, v copied, for positions
    0..T-1, with k and v also in the given cache row and no other."""
    from edge.text.model.llama import LlamaModel, apply_rope
    from edge.text.runtime.fused_prefill import rope_write

    model = LlamaModel(GQA).float().to(DEVICE)
    nh, nkv, hd, tokens = GQA.num_heads, GQA.num_kv_heads, GQA.head_dim, 7
    qkv = torch.randn(tokens, (nh + 2 * nkv) * hd, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cache = model.new_cache(3, 16)
    k_cache, v_cache = cache.k[0], cache.v[0]
    q, k, v = rope_write(qkv, model, torch.tensor([1], device=DEVICE), k_cache, v_cache)
    cos, sin = model.rope_cos[:tokens], model.rope_sin[:tokens]
    heads = qkv.view(tokens, nh + 2 * nkv, hd).transpose(0, 1)  # [heads, T, HD]
    ref_q = apply_rope(heads[:nh], cos, sin) * hd**-0.5
    ref_k = apply_rope(heads[nh : nh + nkv], cos, sin)
    ref_v = heads[nh + nkv :]
    torch.testing.assert_close(q[0], ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k[0], ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v[0], ref_v)
    torch.testing.assert_close(k_cache[1, :, :tokens], ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache[1, :, :tokens], ref_v)
    assert not k_cache[[0, 2]].any() and not v_cache[[0, 2]].any()
    assert not k_cache[1, :, tokens:].any()


def test_paired_silu_kernel_reads_the_paired_column_order() -> None:
    """A paired gate/up product (columns in cuda_int4.pair_order) gives silu(gate) * up
    in the original order, with no reordering copy first."""
    from edge.text.ops.cuda import cuda_int4
    from edge.text.ops.triton.decode_ops import _silu_mul_paired_kernel

    tokens, f = 3, 2 * 1024 + 48  # more than one block, the last one partial
    plain = torch.randn(tokens, 2 * f, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    paired = plain[:, cuda_int4.pair_order(2 * f).to(DEVICE)].contiguous()
    assert torch.equal(cuda_int4.unpair(paired), plain)
    out = torch.empty(tokens, f, device=DEVICE)
    _silu_mul_paired_kernel[(tokens, -(-f // 1024))](paired, out, f, 1024)
    ref = torch.nn.functional.silu(plain[:, :f]) * plain[:, f:]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
