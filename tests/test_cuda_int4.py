"""Our CUDA INT4 kernels (edge/text/ops/cuda/cuda_int4.cu): the tiled layout they read, and, on
a GPU, the tensor-core GEMV and the prefill dequantization against the float reference.

Without a GPU the layout is still checked: `reference_weight` decodes the tiled codes
with the kernels' own index formulas (not by undoing repack), so a layout bug in either
the packer or the formulas the kernel shares shows up in CI.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from edge.text.ops.cuda import cuda_int4
from edge.text.ops.int4 import QuantizedWeight, dequantize, pack

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


def _weight(n: int, k: int, group: int, seed: int, symmetric: bool = False) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return pack(torch.randn(n, k, generator=gen), group, symmetric=symmetric)


@pytest.mark.parametrize(
    ("n", "k", "group"),
    [
        (16, 64, 32),  # one tile, one chunk, two groups in it
        (40, 576, 64),  # SmolLM2's width; rows padded to a multiple of 16
        (33, 1536, 128),  # a group spans two chunks
        (48, 512, 256),
    ],
)
def test_tiled_layout_holds_the_checkpoint_weight(n: int, k: int, group: int) -> None:
    q = _weight(n, k, group, seed=n * k)
    tiled = cuda_int4.repack(q.qweight, q.scales, q.zeros, group)
    assert tiled.codes.shape == (-(-n // 16), k // 64, 32, 4)
    assert tiled.codes.dtype == torch.int32 and tiled.scales.dtype == torch.float16
    assert torch.equal(cuda_int4.reference_weight(tiled), dequantize(q))
    # The same bytes as the checkpoint's, but for the padded rows.
    pad_rows = tiled.tiles * 16 - n
    assert tiled.nbytes == q.nbytes + pad_rows * (k // 2 + 3 * (k // group))


def test_paired_gate_up_rows_sit_in_one_tile() -> None:
    """A gated unit's [gate; up] weight, paired: tile i holds gate rows 8i..8i+7 and
    their up rows, and the layout still holds the weight (in [gate | up] order once
    unpaired)."""
    n, k = 64, 128
    order = cuda_int4.pair_order(n)
    assert order[:16].tolist() == [*range(8), *range(32, 40)]
    assert sorted(order.tolist()) == list(range(n))
    q = _weight(n, k, 64, seed=6)
    tiled = cuda_int4.repack(q.qweight, q.scales, q.zeros, 64, paired=True)
    assert tiled.paired
    assert torch.equal(cuda_int4.reference_weight(tiled), dequantize(q))
    scrambled = torch.arange(2 * n, dtype=torch.float32).view(2, n)[:, order]
    assert torch.equal(cuda_int4.unpair(scrambled), torch.arange(2 * n, dtype=torch.float32).view(2, n))
    with pytest.raises(ValueError, match="multiples of 32"):
        cuda_int4.repack(q.qweight[:48], q.scales[:48], q.zeros[:48], 64, paired=True)


def test_repack_refuses_what_the_kernel_cannot_take() -> None:
    q = _weight(16, 96, 32, seed=1)  # K = 96: not a whole number of 64-channel chunks
    assert not cuda_int4.supports(96, 32)
    with pytest.raises(ValueError, match="multiple of 64"):
        cuda_int4.repack(q.qweight, q.scales, q.zeros, 32)
    assert not cuda_int4.supports(4096, 16) and cuda_int4.supports(4096, 128)


@pytest.mark.parametrize(("triton", "expect"), [(True, "triton"), (False, "dequant")])
def test_a_layer_the_cuda_kernel_cannot_take_falls_back(
    triton: bool, expect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 96 is no whole number of chunks: such a layer takes the Triton kernel, or,
    where Triton is absent (JetPack's torch), torch's tiled kernel, which in turn
    dequantizes a layer of 40 rows (it packs 16 at a time). It never fails to load."""
    from edge.text.ops.int4 import Int4Linear
    from edge.text.ops.triton import triton_int4

    monkeypatch.setattr(triton_int4, "TRITON_SUPPORT", triton)
    q = _weight(40, 96, 32, seed=7)
    layer = Int4Linear(q, "cuda-mma")
    assert layer.kernel == expect
    if expect == "dequant":
        x = torch.randn(3, 96)
        torch.testing.assert_close(layer(x), x @ dequantize(q).T)


def test_folded_norm_refuses_buffers_it_cannot_take() -> None:
    """The folded RMSNorm's buffers are checked before anything launches: a wrong shape,
    dtype or a paired weight is a clear error, never memory read out of bounds."""
    q = _weight(64, 256, 64, seed=2)
    tiled = cuda_int4.repack(q.qweight, q.scales, q.zeros, 64)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    bad_parts = cuda_int4.NormInput(torch.zeros(2, 8), 1e-5)  # 256 channels: 16 partial sums a row
    with pytest.raises(ValueError, match=r"\[2, 16\] float32"):
        cuda_int4.gemv(x, tiled, norm=bad_parts)
    residual = cuda_int4.Residual(torch.zeros(2, 64), torch.ones(64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"norm weight is \[64\] torch.bfloat16"):
        cuda_int4.gemv_residual(x, tiled, residual, 1e-5)
    with pytest.raises(ValueError, match=r"residual is \[2, 64\] float32"):
        cuda_int4.gemv_residual(x, tiled, cuda_int4.Residual(torch.zeros(2, 64).half(), torch.ones(64)), 1e-5)
    paired = cuda_int4.repack(q.qweight, q.scales, q.zeros, 64, paired=True)
    with pytest.raises(ValueError, match="unpaired"):
        cuda_int4.gemv_residual(x, paired, cuda_int4.Residual(torch.zeros(2, 64), torch.ones(64)), 1e-5)
    assert cuda_int4.parts_fit(8, 16384) and not cuda_int4.parts_fit(8, 16448)


@pytest.mark.parametrize(
    ("n", "k", "rows"),
    [(6144, 4096, 6144), (4096, 4096, 4096), (28672, 4096, 7168), (4096, 14336, 2048), (40, 576, 48)],
)
def test_prefill_slabs_are_even_whole_tiles_under_the_cap(n: int, k: int, rows: int) -> None:
    """The 8B model's shapes: the down projection goes in two slabs of 2048 rows (64 MiB
    at most dequantized at once, not its whole 117 MB), gate/up in four even ones."""
    from edge.text.ops.int4 import PREFILL_SLAB_VALUES, dequant_slab_rows

    got = dequant_slab_rows(n, k)
    assert got == rows
    assert got % cuda_int4.TILE_ROWS == 0
    assert min(got, n) * k <= PREFILL_SLAB_VALUES
    slabs = -(-n // got)
    assert slabs == -(-n * k // PREFILL_SLAB_VALUES) or n * k <= PREFILL_SLAB_VALUES  # the fewest


def test_unavailable_without_a_cuda_device() -> None:
    assert not cuda_int4.available("cpu")


SHAPES = [
    (64, 256, 32),
    (40, 576, 64),  # padded rows, 9 chunks: warps with uneven runs
    (4096, 4096, 128),  # the 8B model's o_proj
    (1000, 14336, 128),  # the 8B model's down_proj width
    (48, 512, 256),
]


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_the_float_reference(n: int, k: int, group: int, dtype: torch.dtype) -> None:
    """Products of exact (code - zero) integers and the activations, float32 sums: the
    result is the float32 product of the same activations, to float32 rounding."""
    q = _weight(n, k, group, seed=n + k)
    tiled = cuda_int4.repack(q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda(), group)
    weight = dequantize(q).cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
        ref = x.float() @ weight.T
        for config in cuda_int4.configs(k):
            out = cuda_int4.gemv(x, tiled, config)
            assert out.shape == (rows, n) and out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_rows_result_is_the_same_alone_and_in_a_batch() -> None:
    q = _weight(4096, 4096, 128, seed=9)
    tiled = cuda_int4.repack(q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda(), 128)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    config = cuda_int4.tuned_config(tiled, torch.bfloat16)
    batch = cuda_int4.gemv(x, tiled, config)
    for row in range(8):
        assert torch.equal(cuda_int4.gemv(x[row : row + 1], tiled, config)[0], batch[row])
        assert torch.equal(cuda_int4.gemv(x[: row + 1], tiled, config)[row], batch[row])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_silu_is_the_gated_unit_of_the_product(dtype: torch.dtype) -> None:
    """A paired gate/up weight: gemv returns [gate | up] in order, and gemv_silu returns
    silu(gate) * up in the activations' type, from the same float32 sums."""
    f, k = 1536, 576
    q = _weight(2 * f, k, 64, seed=8)
    tiled = cuda_int4.repack(q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda(), 64, paired=True)
    weight = dequantize(q).cuda()
    for rows in (1, 5, 8):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        ref = x.float() @ weight.T
        for config in cuda_int4.configs(k)[:4]:
            torch.testing.assert_close(
                cuda_int4.gemv(x, tiled, config), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())
            )
            want = (torch.nn.functional.silu(ref[:, :f]) * ref[:, f:]).to(dtype)
            got = cuda_int4.gemv_silu(x, tiled, config)
            assert got.dtype == dtype and got.shape == (rows, f)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2 * float(want.abs().max()))


def _rms_norm(r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_norm_is_the_norm_between_two_products(dtype: torch.dtype) -> None:
    """resid += x @ o.T, then RMSNorm(resid) * w feeds the next products: folded into the
    producer (the residual in place, resid * w and the tiles' sums of squares) and the
    consumers (the plain GEMV and the gated one), it gives the unfolded result."""
    hidden, width, f, eps = 1024, 768, 1536, 1e-5
    o_q = _weight(hidden, width, 128, seed=11)
    up_q = _weight(2 * f, hidden, 128, seed=12)
    o = cuda_int4.repack(o_q.qweight.cuda(), o_q.scales.cuda(), o_q.zeros.cuda(), 128)
    qkv = cuda_int4.repack(up_q.qweight.cuda(), up_q.scales.cuda(), up_q.zeros.cuda(), 128)
    gate_up = cuda_int4.repack(up_q.qweight.cuda(), up_q.scales.cuda(), up_q.zeros.cuda(), 128, paired=True)
    o_w, up_w = dequantize(o_q).cuda(), dequantize(up_q).cuda()
    gen = torch.Generator(device="cuda").manual_seed(4)
    norm_w = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype)
    for rows in (1, 3, 8):
        x = torch.randn(rows, width, device="cuda", generator=gen).to(dtype)
        resid = 4 * torch.randn(rows, hidden, device="cuda", generator=gen)
        want_resid = resid + x.float() @ o_w.T
        want_h = _rms_norm(want_resid, norm_w, eps)
        for config in cuda_int4.configs(width)[::3]:
            r = resid.clone()
            normed, norm_in = cuda_int4.gemv_residual(x, o, cuda_int4.Residual(r, norm_w), eps, config)
            scale = float(want_resid.abs().max())
            torch.testing.assert_close(r, want_resid, rtol=1e-4, atol=1e-4 * scale)
            assert normed.dtype == dtype and norm_in.parts.shape == (rows, hidden // 16)
            torch.testing.assert_close(normed.float(), want_resid * norm_w.float(), rtol=1e-2, atol=1e-2 * scale)
            tiles = want_resid.view(rows, hidden // 16, 16).pow(2).sum(-1)
            torch.testing.assert_close(norm_in.parts, tiles, rtol=1e-4, atol=1e-4 * float(tiles.max()))
            # The consumers, from what the producer wrote, against the unfolded product of
            # the normalised input in the activations' type.
            ref = want_h.to(dtype).float() @ up_w.T
            tol = 2e-2 * float(ref.abs().max())
            torch.testing.assert_close(cuda_int4.gemv(normed, qkv, norm=norm_in), ref, rtol=2e-2, atol=tol)
            act = cuda_int4.gemv_silu(normed, gate_up, norm=norm_in)
            want_act = torch.nn.functional.silu(ref[:, :f]) * ref[:, f:]
            torch.testing.assert_close(act.float(), want_act, rtol=3e-2, atol=3e-2 * float(want_act.abs().max()))
    # A row's result is the same bits alone and in a batch, folded as unfolded.
    x = torch.randn(8, width, device="cuda", generator=gen).to(dtype)
    resid = torch.randn(8, hidden, device="cuda", generator=gen)
    config = cuda_int4.tuned_config(o, dtype)
    batch_r = resid.clone()
    batch_h, batch_in = cuda_int4.gemv_residual(x, o, cuda_int4.Residual(batch_r, norm_w), eps, config)
    batch_out = cuda_int4.gemv(batch_h, qkv, norm=batch_in)
    for row in (0, 5):
        one_r = resid[row : row + 1].clone()
        one_h, one_in = cuda_int4.gemv_residual(x[row : row + 1], o, cuda_int4.Residual(one_r, norm_w), eps, config)
        assert torch.equal(one_r[0], batch_r[row]) and torch.equal(one_h[0], batch_h[row])
        assert torch.equal(one_in.parts[0], batch_in.parts[row])
        assert torch.equal(cuda_int4.gemv(one_h, qkv, norm=one_in)[0], batch_out[row])


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequant_is_the_reference_weight_rounded_once(dtype: torch.dtype) -> None:
    q = _weight(40, 576, 64, seed=4)
    tiled = cuda_int4.repack(q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda(), 64)
    whole = cuda_int4.dequant(tiled, 0, tiled.tiles, dtype)
    assert torch.equal(whole.cpu(), dequantize(q).to(dtype))
    part = cuda_int4.dequant(tiled, 1, 2, dtype)  # rows 16..39: the last tile is partial
    assert torch.equal(part.cpu(), dequantize(q)[16:40].to(dtype))


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_dequant_writes_into_a_given_buffer_or_refuses_it() -> None:
    q = _weight(40, 576, 64, seed=4)
    tiled = cuda_int4.repack(q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda(), 64)
    buffer = torch.full((48 * 576,), float("nan"), device="cuda", dtype=torch.float16)
    part = cuda_int4.dequant(tiled, 1, 2, torch.float16, buffer)
    assert part.data_ptr() == buffer.data_ptr()
    assert torch.equal(part.cpu(), dequantize(q)[16:40].half())
    with pytest.raises(ValueError, match="dequantization buffer"):
        cuda_int4.dequant(tiled, 0, tiled.tiles, torch.float16, buffer[: 40 * 576 - 1])
    with pytest.raises(ValueError, match="dequantization buffer"):
        cuda_int4.dequant(tiled, 0, tiled.tiles, torch.bfloat16, buffer)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_prefill_products_share_one_dequantization_buffer() -> None:
    from torch import nn

    from edge.text.ops.int4 import Int4Linear, dequant_slab_elements, share_dequant_buffer

    shapes = [(640, 576), (256, 1152)]
    weights = [_weight(n, k, 64, seed=i) for i, (n, k) in enumerate(shapes)]
    linears = [
        Int4Linear(QuantizedWeight(q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda(), 64), "cuda-mma") for q in weights
    ]
    layers = nn.ModuleList(linears)
    xs = [torch.randn(40, k, device="cuda", dtype=torch.float16) for _, k in shapes]
    alone = [layer(x) for layer, x in zip(linears, xs, strict=True)]
    nbytes = share_dequant_buffer(layers, torch.float16)
    assert nbytes == 2 * max(dequant_slab_elements(layer) for layer in linears) == 2 * 640 * 576
    buffer = linears[0].dequant_buffer
    assert buffer is not None and all(layer.dequant_buffer is buffer for layer in linears)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    shared = [layer(x) for layer, x in zip(linears, xs, strict=True)]
    torch.cuda.synchronize()
    # Only the outputs are new: no slab is allocated beside the shared buffer.
    outputs = sum(out.numel() * out.element_size() for out in shared)
    assert torch.cuda.max_memory_allocated() - before <= outputs + 4096
    for a, b in zip(alone, shared, strict=True):
        assert torch.equal(a, b)
    assert share_dequant_buffer(layers, torch.float32) == 0  # no tensor-core form: slabs of their own


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_linear_serves_decode_and_prefill_from_the_tiled_copy() -> None:
    from edge.text.ops.int4 import Int4Linear, tune_gemv

    q = _weight(640, 576, 64, seed=2)
    weight = dequantize(q).cuda()
    for gated in (False, True):
        on_gpu = QuantizedWeight(q.qweight.cuda(), q.scales.cuda(), q.zeros.cuda(), 64)
        layer = Int4Linear(on_gpu, "cuda-mma", gated=gated)
        assert layer.kernel == "cuda-mma" and layer.paired == gated
        assert tune_gemv(layer, torch.float16) == 1
        for rows in (1, 8, 40):  # GEMV, GEMV at its most rows, dequantize + matmul
            x = torch.randn(rows, 576, device="cuda", dtype=torch.float16)
            ref = x.float() @ weight.T
            got = layer(x)
            assert got.dtype == torch.float16
            torch.testing.assert_close(got.float(), ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))
    narrow = _weight(32, 96, 32, seed=3)  # K = 96: the Triton kernel serves that layer
    on_gpu = QuantizedWeight(narrow.qweight.cuda(), narrow.scales.cuda(), narrow.zeros.cuda(), 32)
    assert Int4Linear(on_gpu, "cuda-mma").kernel == "triton"


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fold", [True, False])
def test_fused_decode_with_the_cuda_gemv_matches_the_reference(fold: bool) -> None:
    """The whole decode step (fused, CUDA graphs) on the CUDA GEMV, with the RMSNorms
    folded into the products or as kernels of their own: logits agree with the float32
    dequantized model after a prefill, and three sequences stepped together give each
    one's logits alone."""
    from edge.text.architecture import LlamaConfig
    from edge.text.kv.float_cache import KVCache
    from edge.text.runtime.cuda_graphs import GraphDecoder
    from edge.text.runtime.fused_step import folds_norm, fused_decode_step
    from engines.text.random_llama import random_int4_llama

    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1536
    )
    model = random_int4_llama(config, "cuda", "cuda-mma", group=64, seed=5)
    model.fold_norms = fold
    ref = random_int4_llama(config, "cuda", "dequant", group=64, dtype=torch.float32, seed=5)
    ref.fused_decode = False
    assert model.fused_decode is not False
    assert folds_norm(model, 1) == (fold, fold)  # folded: no norm kernel runs but the first
    ids = torch.randint(0, config.vocab_size, (3, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = torch.stack([ref(ids[b : b + 1], ref.new_cache(1, 64), 0, last_only=False)[0] for b in range(3)])
    cache = KVCache(config, 1, 64, torch.bfloat16, torch.device("cuda"))
    got = model(ids[:1, :32], cache, 0, last_only=False)[0]
    assert float((got.float() - want[0, :32]).norm() / want[0, :32].norm()) < 2e-2
    decoder = GraphDecoder(model, cache, bucket=16)
    for pos in range(32, 40):
        step = decoder.step(ids[0, pos : pos + 1], pos)[0]
        err = float((step.float() - want[0, pos]).norm() / want[0, pos].norm())
        assert err < 2e-2, f"position {pos}: relative error {err:.4f}"
    # Three sequences at different positions in one step: each row is the same bits as
    # that sequence decoded alone (every kernel of the step is batch-invariant).
    offsets = (0, 3, 7)
    alone = []
    for b in range(3):
        one = KVCache(config, 1, 64, torch.bfloat16, torch.device("cuda"))
        alone.append(
            [
                fused_decode_step(model, ids[b, p].view(1, 1), one, torch.tensor([p], device="cuda"), 64)[0]
                for p in range(12)
            ]
        )
    batch = KVCache(config, 3, 64, torch.bfloat16, torch.device("cuda"))
    for t in range(12):
        at = [max(0, t - o) for o in offsets]
        tokens = torch.stack([ids[b, at[b]] for b in range(3)]).view(3, 1)
        logits = fused_decode_step(model, tokens, batch, torch.tensor(at, device="cuda"), 64)
        for b in range(3):
            assert torch.equal(logits[b], alone[b][at[b]]), f"sequence {b} position {at[b]}"


@pytest.mark.slow
@pytest.mark.skipif(cuda_int4.nvcc() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("arch", ["87", "90"])
def test_kernel_builds_for_the_orin_and_for_hopper(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default path compiles for sm_87 (the Orin) as well as sm_90, into the kernel
    cache, once: a second build finds the library there; its entry points load."""
    monkeypatch.setenv("EDGE_KERNEL_CACHE", str(tmp_path))
    path = cuda_int4.build(arch)
    assert path.parent == tmp_path and f"sm{arch}" in path.name and path.stat().st_size > 0
    mtime = path.stat().st_mtime_ns
    assert cuda_int4.build(arch) == path and path.stat().st_mtime_ns == mtime
    lib = ctypes.CDLL(str(path))
    assert all(hasattr(lib, name) for name in ("edge_int4_gemv", "edge_int4_dequant"))


@gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("kernel", ["cuda-mma", "triton", "cuda", "dequant"])
def test_block_minimums_are_added_once_by_every_cuda_kernel(kernel: str) -> None:
    """A weight with block minimums (GGUF Q4_1) on each CUDA kernel, in decode's GEMV
    (a few rows) and prefill's product (many): code x scale + minimum, to float16 rounding."""
    from edge.text.ops.int4 import Int4Linear
    from edge.text.ops.triton import triton_int4
    from tests.test_cpu_int4 import with_minimums

    if kernel == "triton" and not triton_int4.TRITON_SUPPORT:
        pytest.skip("triton is not installed")
    q = with_minimums(256, 1024)
    layer = Int4Linear(q.to("cuda"), kernel)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(6)).half().cuda()
    for rows in (1, 3, 40):
        want = x[:rows].float() @ dequantize(q).cuda().T
        got = layer(x[:rows]).float()
        assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()), (kernel, rows)


@gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("kernel", ["cuda-mma", "triton", "cuda", "dequant"])
def test_a_weight_in_two_halves_is_summed_once_by_every_cuda_kernel(kernel: str) -> None:
    """A GGUF Q8_0 weight kept as two INT4 halves on each CUDA kernel, in decode's GEMV (a
    few rows) and prefill's product (many): both halves in one product, added after, as
    the file's weights, to float16 rounding."""
    import gguf
    import numpy as np

    from edge.text.ops.int4 import Int4Linear
    from edge.text.ops.triton import triton_int4
    from engines.text.gguf_int4 import q8_halves

    if kernel == "triton" and not triton_int4.TRITON_SUPPORT:
        pytest.skip("triton is not installed")
    data = np.random.default_rng(5).standard_normal((256, 1024)).astype(np.float32)
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    q = q8_halves(raw, 256, 1024)
    layer = Int4Linear(q.to("cuda"), kernel)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(6)).half().cuda()
    for rows in (1, 3, 40):
        want = x[:rows].float() @ dequantize(q).cuda().T
        got = layer(x[:rows]).float()
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()), (kernel, rows)
