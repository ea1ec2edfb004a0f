"""2:4 sparse INT4 linears: the packed format and the layer that multiplies by it.

A 2:4 weight keeps two of every four consecutive input weights of a row (the rest pruned
to zero by the build: engines/text/prune.py). Packed, it stores only the kept ones:

  codes24  uint8 [N, K/4]  one byte per four inputs: the two kept weights' INT4 codes,
                           the lower-indexed one in the low nibble
  index24  uint8 [N, K/8]  the kept weights' positions in their four, 2 bits each (i0 < i1,
                           i0 in bits 0-1 and i1 in bits 2-3 of a four's nibble; two fours a
                           byte, the even four in the low nibble)
  scales   float16 [N, K/G]  as the dense INT4 layout's (edge/text/ops/int4.py)
  zeros    uint8 [N, K/G]
  kept weight = (code - zero) * scale; a pruned weight is not stored and is exactly 0.

So a weight costs 3 bits instead of 4 (plus the same scales and zero points). Pruned
weights are kept out of the codes rather than stored as the code equal to their group's
zero point: that is what saves the bytes, and it makes a pruned weight 0 whatever the
zero point. The positions are NVIDIA's sparse metadata's (two 2-bit indices per four,
ascending), so a tensor-core kernel (mma.sp) can read them as they are.

Kernels: "cpu-sparse24" (ours, edge/text/ops/cpu/cpu_sparse24.c, float32, equal bit for
bit to our dense float32 INT4 kernel on the same weights), "cuda-sparse24" (ours,
edge/text/ops/cuda/cuda_sparse24.cu: a packed GEMV for decode, its dequantization and
cuBLAS for prefill), "dequant" (the reference: the weight dequantized once, multiplied by
torch; where no C compiler is). Other paths (Triton, the fused decode steps and prefill
graphs, the CPU's C decode step, ONNX export) refuse the format by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from edge.text.ops.cpu import cpu_sparse24
from edge.text.ops.cuda import cuda_sparse24
from edge.text.ops.int4 import QuantizedWeight, dequantize, quantize_codes

logger = logging.getLogger(__name__)

SPARSITY = "2:4"  # what quant.json and the profile's rules call the format
FOUR = 4
KEPT = 2
# Why a path does not serve the format, for its refusals.
REFUSED = "2:4 sparse INT4 weights (served by their own per-op kernels only)"
# Values the CUDA prefill product dequantizes at once (as the dense kernels' slabs).
PREFILL_SLAB_VALUES = 8192 * 4096


@dataclass(frozen=True)
class Sparse24Weight:
    """A 2:4 sparse INT4 weight in the packed layout above."""

    codes: torch.Tensor  # uint8 [N, K/4]
    index: torch.Tensor  # uint8 [N, K/8]
    scales: torch.Tensor  # float16 [N, K/G]
    zeros: torch.Tensor  # uint8 [N, K/G]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1]) * FOUR

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.index, self.scales, self.zeros))

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """Its tensors as a checkpoint stores them, by name (module `name`'s)."""
        parts = {
            f"{name}.codes24": self.codes,
            f"{name}.index24": self.index,
            f"{name}.scales": self.scales,
            f"{name}.zeros": self.zeros,
        }
        return {key: t.contiguous() for key, t in parts.items()}

    def to(self, device: torch.device | str) -> Sparse24Weight:
        return Sparse24Weight(
            self.codes.to(device), self.index.to(device), self.scales.to(device), self.zeros.to(device), self.group_size
        )


# What a build packs a linear into: the dense INT4 layout or this one.
PackedLinear = QuantizedWeight | Sparse24Weight


def stored_specs(name: str, n: int, k: int, group: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The checkpoint's tensors of an [n, k] 2:4 linear: (dtype, shape) by name."""
    return {
        f"{name}.codes24": (torch.uint8, (n, k // 4)),
        f"{name}.index24": (torch.uint8, (n, k // 8)),
        f"{name}.scales": (torch.float16, (n, k // group)),
        f"{name}.zeros": (torch.uint8, (n, k // group)),
    }


def kept_mask(weight: torch.Tensor) -> torch.Tensor:
    """bool [N, K]: the two weights of each four along the input that a pruned weight keeps
    (its largest in magnitude, the lower position first among equals: a four with fewer
    than two non-zero weights keeps zeros, which cost nothing). Raises where a four has
    more than two non-zero weights: the weight was not pruned to 2:4."""
    n, k = weight.shape
    if k % 8:
        raise ValueError(f"a 2:4 weight needs an input width that is a multiple of 8, not {k}")
    fours = weight.detach().reshape(n, k // FOUR, FOUR)
    if bool(((fours != 0).sum(-1) > KEPT).any()):
        raise ValueError("the weight is not 2:4 sparse: a four of its inputs has more than two non-zero weights")
    order = torch.sort(-fours.abs().float(), dim=-1, stable=True).indices[..., :KEPT]
    mask = torch.zeros_like(fours, dtype=torch.bool).scatter_(-1, order, True)
    return mask.reshape(n, k)


def compress(codes: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes24, index24) of dense codes [N, K] with two of each four kept (`keep`)."""
    n, k = codes.shape
    keep4 = keep.reshape(n, k // FOUR, FOUR)
    if bool((keep4.sum(-1) != KEPT).any()):
        raise ValueError("a 2:4 mask keeps exactly two of every four inputs")
    # A stable sort puts the kept positions first, in ascending order.
    order = torch.sort((~keep4).to(torch.uint8), dim=-1, stable=True).indices[..., :KEPT]
    kept = codes.reshape(n, k // FOUR, FOUR).gather(-1, order).to(torch.uint8)
    packed = kept[..., 0] | (kept[..., 1] << 4)
    nibbles = (order[..., 0] | (order[..., 1] << 2)).to(torch.uint8)  # [N, K/4]
    index = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed.contiguous(), index.contiguous()


def positions(q: Sparse24Weight) -> torch.Tensor:
    """int64 [N, K/4, 2]: each four's kept positions (0..3), as the index bytes say."""
    n = q.index.shape[0]
    nibbles = torch.stack([q.index & 15, q.index >> 4], dim=-1).reshape(n, -1)  # [N, K/4]
    return torch.stack([nibbles & 3, nibbles >> 2], dim=-1).long()


def check(q: Sparse24Weight) -> None:
    """Raises where the tensors are not a 2:4 weight of this format (shapes, positions)."""
    n, k = q.shape
    g = q.group_size
    want = {"index24": (n, k // 8), "scales": (n, k // g), "zeros": (n, k // g)}
    got = {"index24": tuple(q.index.shape), "scales": tuple(q.scales.shape), "zeros": tuple(q.zeros.shape)}
    if k % g or got != want:
        raise ValueError(f"a 2:4 weight of [{n}, {k}] group {g} has tensors {got}, not {want}")
    pos = positions(q)
    if bool((pos[..., 0] >= pos[..., 1]).any()):
        raise ValueError("a 2:4 weight's positions must be two distinct ones in ascending order")


def pack_sparse(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, symmetric: bool = False
) -> Sparse24Weight:
    """The packed form of a weight pruned to 2:4 (zeros outside its mask): rounded as the
    dense INT4 layout is (edge/text/ops/int4.quantize_codes, the pruned zeros inside each
    group's range as every group's range holds 0), then only the kept codes stored."""
    keep = kept_mask(weight)
    codes, scales, zeros = quantize_codes(weight, group_size, clip, symmetric)
    packed, index = compress(codes, keep)
    return Sparse24Weight(packed, index, scales.to(torch.float16), zeros, group_size)


def to_dense(q: Sparse24Weight) -> QuantizedWeight:
    """The dense INT4 weight equal to it: each pruned weight's code its group's zero point,
    so that it dequantizes to exactly 0."""
    n, k = q.shape
    codes = q.zeros.repeat_interleave(q.group_size, dim=1).reshape(n, k // FOUR, FOUR).clone()
    kept = torch.stack([q.codes & 15, q.codes >> 4], dim=-1)
    codes.scatter_(-1, positions(q), kept)
    codes = codes.reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return QuantizedWeight(packed, q.scales, q.zeros, q.group_size)


def dequantize_sparse(q: Sparse24Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K], pruned weights 0."""
    return dequantize(to_dense(q), dtype)


def concat_sparse_rows(parts: list[Sparse24Weight]) -> Sparse24Weight:
    """Stack 2:4 weights that share an input (q, k, v) into one."""
    groups = {p.group_size for p in parts}
    if len(groups) != 1:
        raise ValueError(f"cannot fuse weights with group sizes {sorted(groups)}")
    return Sparse24Weight(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.index for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        parts[0].group_size,
    )


def sparse_kernel(device: torch.device) -> str:
    """The kernel a 2:4 layer is served by on `device`; raises, naming the format, where
    none of ours is."""
    if device.type == "cuda":
        if cuda_sparse24.available(device):
            return "cuda-sparse24"
        raise RuntimeError(f"{REFUSED}: the CUDA 2:4 kernel did not build here (nvcc; see the log)")
    if device.type != "cpu":
        raise RuntimeError(f"{REFUSED}: no kernel of ours serves the format on {device.type}")
    if cpu_sparse24.available():
        return "cpu-sparse24"
    logger.warning("the 2:4 CPU kernel is unavailable: its layers are dequantized and multiplied by torch")
    return "dequant"


class Sparse24Linear(nn.Module):
    """y = x @ W.T for a 2:4 sparse INT4 weight: our C kernel reads the packed codes as
    they are; "dequant" multiplies the weight dequantized once (the reference)."""

    codes: torch.Tensor
    index: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    w: torch.Tensor

    def __init__(
        self, q: Sparse24Weight, kernel: str, bias: torch.Tensor | None = None, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        check(q)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = q.shape
        self.group_size = q.group_size
        if kernel == "cuda-sparse24" and not cuda_sparse24.supports(self.in_features, self.group_size):
            raise ValueError(f"{REFUSED}: the CUDA kernel takes K and groups of multiples of 16")
        if kernel == "cpu-sparse24" and not cpu_sparse24.supports(self.in_features, self.group_size):
            logger.info(
                "2:4 layer of group %d: dequantized (the CPU kernel takes groups of multiples of 32)", q.group_size
            )
            kernel = "dequant"
        self.kernel = kernel
        # What it holds: the packed tensors (or, dequantized, the float weight).
        self.weight_bytes = q.nbytes
        q = q.to(device)
        if kernel == "cuda-sparse24":
            self.register_buffer("codes", q.codes.contiguous())
            self.register_buffer("index", q.index.contiguous())
            self.register_buffer("scales", q.scales.to(torch.float16).contiguous())
            self.register_buffer("zeros", q.zeros.contiguous())
        elif kernel == "cpu-sparse24":
            self.register_buffer("codes", q.codes.contiguous())
            self.register_buffer("index", q.index.contiguous())
            self.register_buffer("scales", q.scales.float().contiguous())
            self.register_buffer("zeros", q.zeros.contiguous())
        elif kernel == "dequant":
            self.register_buffer("w", dequantize_sparse(q))
            self.weight_bytes = self.w.numel() * self.w.element_size()
        else:
            raise ValueError(f"unknown 2:4 kernel {kernel!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.kernel == "cpu-sparse24":
            out = cpu_sparse24.linear(flat, self.codes, self.index, self.scales, self.zeros, self.group_size)
        elif self.kernel == "cuda-sparse24":
            out = self._cuda(flat)
        else:
            out = flat.to(self.w.dtype) @ self.w.T
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        result: torch.Tensor = out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])
        return result

    def _cuda(self, flat: torch.Tensor) -> torch.Tensor:
        """A decode batch by the packed GEMV; a prefill by slabs of rows dequantized and
        multiplied by cuBLAS (never the whole dense weight at once)."""
        args = (self.codes, self.index, self.scales, self.zeros, self.group_size)
        if flat.shape[0] <= cuda_sparse24.MAX_ROWS and flat.dtype in cuda_sparse24.DTYPES:
            return cuda_sparse24.gemv(flat, *args)
        dtype = flat.dtype if flat.dtype in cuda_sparse24.DTYPES else torch.float32
        x = flat.to(dtype)
        out = torch.empty(flat.shape[0], self.out_features, device=flat.device, dtype=dtype)
        slab = max(1, PREFILL_SLAB_VALUES // self.in_features)
        for r0 in range(0, self.out_features, slab):
            rows = min(slab, self.out_features - r0)
            w = cuda_sparse24.dequant(*args, r0, rows, dtype)
            torch.mm(x, w.T, out=out[:, r0 : r0 + rows])
        return out
