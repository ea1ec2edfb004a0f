"""Our CUDA INT4 kernels (edge/text/cuda_int4.cu): the tiled layout they read, and, on
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

from edge.text import cuda_int4
from edge.text.int4 import QuantizedWeight, dequantize, pack

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
    from edge.text import triton_int4
    from edge.text.int4 import Int4Linear

    monkeypatch.setattr(triton_int4, "TRITON_SUPPORT", triton)
    q = _weight(40, 96, 32, seed=7)
    layer = Int4Linear(q, "cuda-mma")
    assert layer.kernel == expect
    if expect == "dequant":
        x = torch.randn(3, 96)
        torch.testing.assert_close(layer(x), x @ dequantize(q).T)


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
def test_linear_serves_decode_and_prefill_from_the_tiled_copy() -> None:
    from edge.text.int4 import Int4Linear, tune_gemv

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
def test_fused_decode_with_the_cuda_gemv_matches_the_reference() -> None:
    """The whole decode step (fused, CUDA graphs) on the CUDA GEMV: logits agree with the
    float32 dequantized model at every position."""
    from edge.text.cuda_graphs import GraphDecoder
    from edge.text.llama import KVCache, LlamaConfig
    from engines.random_llama import random_int4_llama

    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1536
    )
    model = random_int4_llama(config, "cuda", "cuda-mma", group=64, seed=5)
    ref = random_int4_llama(config, "cuda", "dequant", group=64, dtype=torch.float32, seed=5)
    ref.fused_decode = False
    assert model.fused_decode is not False
    ids = torch.randint(0, config.vocab_size, (1, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = ref(ids, ref.new_cache(1, 64), 0, last_only=False)[0]
    cache = KVCache(config, 1, 64, torch.bfloat16, torch.device("cuda"))
    got = model(ids[:, :32], cache, 0, last_only=False)[0]
    assert float((got.float() - want[:32]).norm() / want[:32].norm()) < 2e-2
    decoder = GraphDecoder(model, cache, bucket=16)
    for pos in range(32, 40):
        step = decoder.step(ids[0, pos : pos + 1], pos)[0]
        err = float((step.float() - want[pos]).norm() / want[pos].norm())
        assert err < 2e-2, f"position {pos}: relative error {err:.4f}"


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
    assert all(hasattr(lib, name) for name in ("edge_int4_gemv", "edge_int4_dequant", "edge_l2_prefetch"))
