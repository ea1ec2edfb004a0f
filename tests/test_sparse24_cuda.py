"""The CUDA kernels of 2:4 sparse INT4 weights (cuda_sparse24.cu) against the dense product
of the same pruned weights: the packed GEMV for decode, its dequantization for prefill."""

from __future__ import annotations

import pytest
import torch

from edge.text.ops import sparse24
from edge.text.ops.cuda import cuda_sparse24
from edge.text.ops.sparse24 import Sparse24Linear

pytestmark = pytest.mark.gpu

N, K, G = 200, 512, 32


@pytest.fixture(scope="module")
def weight() -> sparse24.Sparse24Weight:
    if not cuda_sparse24.available("cuda"):
        pytest.skip("no CUDA device, or nvcc did not build the kernel")
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(N, K, generator=gen)
    fours = dense.reshape(N, K // 4, 4)
    keep = torch.zeros_like(fours, dtype=torch.bool).scatter_(-1, fours.abs().topk(2, dim=-1).indices, True)
    return sparse24.pack_sparse((fours * keep).reshape(N, K), G)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_gemv_equals_the_dense_product_of_the_same_pruned_weights(
    weight: sparse24.Sparse24Weight, dtype: torch.dtype, rows: int
) -> None:
    q = weight.to("cuda")
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to("cuda", dtype)
    got = cuda_sparse24.gemv(x, q.codes, q.index, q.scales, q.zeros, G)
    reference = x.double() @ sparse24.dequantize_sparse(weight).double().cuda().T
    # float32 sums in another order than the reference's: float32 rounding only.
    assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-4)


def test_the_dequantization_and_the_prefill_product_are_the_dense_weights(weight: sparse24.Sparse24Weight) -> None:
    q = weight.to("cuda")
    w = cuda_sparse24.dequant(q.codes, q.index, q.scales, q.zeros, G, 0, N, torch.float32)
    assert torch.equal(w.cpu(), sparse24.dequantize_sparse(weight))
    layer = Sparse24Linear(weight, "cuda-sparse24", device="cuda")
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(9)).cuda()
    assert torch.allclose(layer(x), x @ w.T, rtol=1e-5, atol=1e-4)
    assert sparse24.sparse_kernel(torch.device("cuda")) == "cuda-sparse24"
