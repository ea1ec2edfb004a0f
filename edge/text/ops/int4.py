"""INT4 weight-only linear layers: group-wise asymmetric quantization and the kernels
that multiply by it.

Storage (what a checkpoint holds per quantized linear, out x in = N x K):
  qweight  uint8 [N, K/2]  two 4-bit codes per byte, even k in the low nibble
  scales   float16 [N, K/G]
  zeros    uint8 [N, K/G]  integer zero points in 0..15
  weight ≈ (code - zero) * scale, per group of G consecutive input channels.

Kernels: on the CPU our float32 kernel (cpu_int4.c, built on the box) reads this layout
as it is. Torch's tiled INT4 GEMM (`_weight_int4pack_mm` on CUDA,
`_weight_int4pack_mm_for_cpu` on x86/ARM CPUs) needs the codes repacked at load, and its
zero convention is w = (code - 8) * scale + offset, so offset = (8 - zero) * scale.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from edge.text.ops import step_ops

# Import-safe without triton (it sets TRITON_SUPPORT = False) and without nvcc (the CUDA
# kernel is then unavailable); either kernel is then refused or replaced.
from edge.text.ops.cpu import cpu_int4
from edge.text.ops.cuda import cuda_int4
from edge.text.ops.triton import triton_int4

logger = logging.getLogger(__name__)

SUPPORTED_GROUPS = (256, 128, 64, 32)
SYMMETRIC_ZERO = 8
PREFILL_SLAB_ROWS = 8192
# The most weight values the cuda-mma prefill dequantizes at once (64 MiB in 16 bits):
# the 8B model's gate/up slab of 8192 x 4096, and its down projection (4096 x 14336) in
# two slabs of 2048 rows instead of one of 117 MB.
PREFILL_SLAB_VALUES = 8192 * 4096
# Kernels whose GEMV the fused decode step (runtime/fused_step.py) calls: float32 sums out.
GEMV_KERNELS = ("triton", "cuda-mma")
# Rows of logits up to which the exact top is refined by our C kernels one row at a time
# (a decode step, a verification's drafts); more rows (a scored prompt) take torch's route.
REFINE_ROWS = 8
# Logits recomputed exactly per position on the CPU kernel (see Int4Linear.exact_top).
EXACT_TOP = 16
# Kernels that read our layout's integer zero points: a weight's block minimums are added
# after their product (Int4Linear.forward).
OWN = ("cpu-f32", "cpu-int8", "triton", "cuda-mma")


@dataclass(frozen=True)
class QuantizedWeight:
    qweight: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # float16 [N, K/G]
    zeros: torch.Tensor  # uint8 [N, K/G]
    group_size: int
    # float16 [N, K/G] added to each weight of its group (a GGUF Q4_1 block's minimum, kept
    # as stored: code * scale + minimum, zeros 0), or None.
    minimums: torch.Tensor | None = None
    # The tensors' rows are two weights [high; low] whose sum is this one (a GGUF Q8_0
    # weight kept as two INT4 halves: engines/text/gguf_int4.q8_halves).
    halves: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's [N, K] (with halves: half the tensors' rows)."""
        return int(self.qweight.shape[0]) // (2 if self.halves else 1), int(self.qweight.shape[1]) * 2

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.zeros, *(() if self.minimums is None else (self.minimums,)))
        return sum(t.numel() * t.element_size() for t in parts)

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """Its tensors as a checkpoint stores them, by name (module `name`'s)."""
        parts = {f"{name}.qweight": self.qweight, f"{name}.scales": self.scales, f"{name}.zeros": self.zeros}
        if self.minimums is not None:
            parts[f"{name}.minimums"] = self.minimums.to(torch.float16)
        return {key: t.contiguous() for key, t in parts.items()}

    def to(self, device: torch.device | str) -> QuantizedWeight:
        minimums = None if self.minimums is None else self.minimums.to(device)
        return QuantizedWeight(
            self.qweight.to(device),
            self.scales.to(device),
            self.zeros.to(device),
            self.group_size,
            minimums,
            self.halves,
        )


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights that share an input (q, k, v) into one, so one kernel reads them all."""
    groups = {p.group_size for p in parts}
    if len(groups) != 1:
        raise ValueError(f"cannot fuse weights with group sizes {sorted(groups)}")
    if any(p.halves for p in parts):
        raise ValueError("cannot fuse weights kept in two halves (GGUF Q8_0)")
    with_minimums = [p.minimums is not None for p in parts]
    minimums = None
    if any(with_minimums):
        # A part without minimums (Q4_0 beside Q4_1) adds zeros: its weights unchanged.
        minimums = torch.cat([p.minimums if p.minimums is not None else torch.zeros_like(p.scales) for p in parts])
    return QuantizedWeight(
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        zeros=torch.cat([p.zeros for p in parts]),
        group_size=parts[0].group_size,
        minimums=minimums,
    )


def group_size_for(in_features: int, preferred: int) -> int:
    """The preferred group size if it divides the input width, else the largest that does."""
    for g in (preferred, *[g for g in SUPPORTED_GROUPS if g < preferred]):
        if in_features % g == 0:
            return g
    raise ValueError(f"no supported INT4 group size divides {in_features}")


def quantize_codes(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes, scales and zeros for weight [N, K] (float32 math).

    `clip` [N, K/G], if given, shrinks each group's range to [min*clip, max*clip] before
    rounding (AWQ's clipping search trades a little range for finer steps).
    `symmetric`: every zero point is 8 and a group's scale is its largest magnitude / 7,
    so a weight is (code - 8) * scale, a signed 4-bit value times a scale: the only
    INT4 form TensorRT's weight-only kernels take. It spends one code of sixteen (-8)
    and half the range of a one-signed group, which is what it costs in accuracy.
    """
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    if symmetric:
        amax = w.abs().amax(dim=-1)
        if clip is not None:
            amax = amax * clip
        scales = (amax / 7.0).clamp(min=1e-8)
        zeros = torch.full_like(scales, SYMMETRIC_ZERO)
        codes = torch.clamp(torch.round(w / scales.unsqueeze(-1)) + SYMMETRIC_ZERO, 0, 15)
        return codes.reshape(n, k).to(torch.uint8), scales, zeros.to(torch.uint8)
    w_max = w.amax(dim=-1)
    w_min = w.amin(dim=-1)
    if clip is not None:
        w_max = w_max * clip
        w_min = w_min * clip
    w_max = torch.maximum(w_max, torch.zeros_like(w_max))
    w_min = torch.minimum(w_min, torch.zeros_like(w_min))
    scales = ((w_max - w_min) / 15.0).clamp(min=1e-8)
    zeros = torch.round(-w_min / scales).clamp(0, 15)
    codes = torch.clamp(torch.round(w / scales.unsqueeze(-1)) + zeros.unsqueeze(-1), 0, 15)
    return codes.reshape(n, k).to(torch.uint8), scales, zeros.to(torch.uint8)


def _codes_to_weights(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(code - zero) * scale per group, in float32, for codes [N, K]."""
    n, k = codes.shape
    grouped = codes.float().reshape(n, k // group_size, group_size)
    return ((grouped - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)).reshape(n, k)


def fake_quantize(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, symmetric: bool = False
) -> torch.Tensor:
    """Quantize and dequantize again: the weight the INT4 model will actually use."""
    return _codes_to_weights(*quantize_codes(weight, group_size, clip, symmetric), group_size)


def pack(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, symmetric: bool = False
) -> QuantizedWeight:
    codes, scales, zeros = quantize_codes(weight, group_size, clip, symmetric)
    # fp16 scales are what is stored; recompute nothing from the fp32 ones later.
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return QuantizedWeight(packed, scales.to(torch.float16), zeros, group_size)


def unpack_codes(q: QuantizedWeight) -> torch.Tensor:
    n, half = q.qweight.shape
    codes = torch.empty(n, half * 2, dtype=torch.uint8, device=q.qweight.device)
    codes[:, 0::2] = q.qweight & 0x0F
    codes[:, 1::2] = q.qweight >> 4
    return codes


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] (with halves: high + low, exact in float32)."""
    w = _codes_to_weights(unpack_codes(q), q.scales, q.zeros, q.group_size)
    if q.minimums is not None:  # code * scale + minimum, in float32 as llama.cpp's Q4_1
        n, k = w.shape
        w = (w.view(n, k // q.group_size, q.group_size) + q.minimums.float().unsqueeze(-1)).view(n, k)
    if q.halves:
        w = w[: w.shape[0] // 2] + w[w.shape[0] // 2 :]
    return w.to(dtype)


def _scales_and_offsets(q: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """[K/G, N, 2] (scale, offset) in the tiled kernels' convention: (code - 8) * scale + offset."""
    scales = q.scales.float()
    offsets = (8.0 - q.zeros.float()) * scales
    if q.minimums is not None:
        offsets = offsets + q.minimums.float()
    return torch.stack([scales, offsets], dim=-1).transpose(0, 1).contiguous().to(dtype)


def cpu_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear(nn.Module):
    """y = x @ dequant(W).T, computed by the machine's INT4 kernel without materialising W.

    Kernels: "cpu-f32" (ours, float32 throughout; reads our layout directly), "cpu-int8"
    (ours, the same weights against activations rounded to int8 in blocks of 32), "cpu"
    (torch's tiled CPU kernel, bf16 activations), "cuda" (torch's tiled CUDA kernel, bf16
    activations), "triton" (our GEMV for decode, dequantize + cuBLAS for prefill; reads
    our layout directly), "cuda-mma" (our CUDA GEMV on the tensor cores for decode, its
    dequantization + cuBLAS for prefill; reads a tiled copy made here, cuda_int4.py),
    "dequant" (reference: dequantize, matmul).
    """

    packed: torch.Tensor
    sz: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    w: torch.Tensor
    codes: torch.Tensor
    tile_scales: torch.Tensor
    tile_zeros: torch.Tensor

    def __init__(
        self,
        q: QuantizedWeight,
        kernel: str,
        bias: torch.Tensor | None = None,
        exact_top: int = 0,
        gated: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        """A weight in halves (QuantizedWeight.halves: a GGUF Q8_0 weight) is multiplied
        as its tensors' rows, both halves in one call, and the halves added after.
        `gated`: the weight is a gated unit's [gate; up] (the fused gate/up product);
        the cuda-mma kernel then keeps its rows paired and can return silu(gate) * up
        itself (gemv_silu). `device`: where the layer's buffers are made (default: q's);
        q may stay on the host, and the cuda-mma kernel's tiled copy is then made there a
        slab at a time without the whole of q on the device (cuda_int4.repack). `bias`
        is taken where it is."""
        super().__init__()
        device = q.qweight.device if device is None else torch.device(device)
        # A float bias added after the product (Qwen2's q/k/v); None for most layers.
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias)
        self.in_features = q.shape[1]
        self.out_features = int(q.qweight.shape[0])  # the kernels' rows (with halves: twice the layer's)
        self.halves = q.halves
        if q.halves and (exact_top or gated or q.minimums is not None):
            raise ValueError("a weight in two halves (GGUF Q8_0) has no exact top, pairing or minimums")
        self.group_size = q.group_size
        if kernel == "cuda-mma" and not cuda_int4.supports(self.in_features, self.group_size):
            # Triton where it is; without it (JetPack's torch) torch's tiled kernel.
            fallback = "triton" if triton_int4.TRITON_SUPPORT else "cuda"
            logger.info("INT4 layer [%d x %d] group %d: %s kernel (the CUDA one takes K a multiple of %d)",
                        self.out_features, q.shape[1], q.group_size, fallback, cuda_int4.CHUNK)  # fmt: skip
            kernel = fallback
        if kernel in ("cpu", "cuda") and self.out_features % 16:
            # torch's tiled INT4 packers take rows in multiples of 16 (a vocabulary of
            # 32001 tokens, say): such a layer is dequantized once and multiplied instead.
            logger.info(
                "INT4 layer with %d rows: dequantized (the %s kernel packs 16 at a time)", self.out_features, kernel
            )
            kernel = "dequant"
        if kernel == "cpu-int8" and not cpu_int4.supports_int8(self.in_features, self.group_size):
            logger.info("INT4 layer of group %d: the float32 kernel (cpu-int8 takes powers of two)", q.group_size)
            kernel = "cpu-f32"
        if kernel == "cpu-f32" and not cpu_int4.supports(self.in_features, self.group_size):
            logger.info("INT4 layer of group %d: torch's tiled kernel (cpu-f32 takes multiples of 32)", q.group_size)
            kernel = "cpu"
        self.kernel = kernel
        self.weight_bytes = q.nbytes
        # A Q4_1 weight's block minimums: torch's tiled kernels and the dequantized weight
        # take them in their offsets; ours (integer zero points) add them after the product,
        # as the group sums of x times the minimums (exact: sum (q d + m) x = d sum q x + m sum x).
        self.minimums: torch.Tensor | None
        self.register_buffer(
            "minimums",
            q.minimums.to(device=device, dtype=torch.float32) if q.minimums is not None and kernel in OWN else None,
        )
        if q.minimums is not None and exact_top:
            raise ValueError("a weight with block minimums (GGUF Q4_1) has no exact top: the output projection")
        if kernel != "cuda-mma":
            q = q.to(device)  # the other kernels keep q, or make their buffers from it there
        self._counters: torch.Tensor | None = None  # the Triton GEMV's split-K tile counters
        # Where the prefill product dequantizes its slabs: one flat buffer the model's
        # layers share (share_dequant_buffer), or None for a fresh slab each product.
        self.dequant_buffer: torch.Tensor | None = None
        self.paired = False
        # Torch's CPU kernel rounds its inputs, scales and outputs to bfloat16: a logit of
        # 20 is then known to 1/16, and greedy decoding picks among near-ties by rounding;
        # cpu-int8 rounds the activations. Where either serves, the output layer's
        # `exact_top` best of each row are computed again in float32 from the stored
        # codes, so at least the last product's choice is the quantized model's own.
        self.exact_top = exact_top if kernel in ("cpu", "cpu-int8") else 0
        if kernel == "cpu":
            codes = unpack_codes(q).to(torch.int32)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
            self.register_buffer("sz", _scales_and_offsets(q, torch.bfloat16))
            if self.exact_top:
                self.register_buffer("qweight", q.qweight)
                self.register_buffer("scales", q.scales)
                self.register_buffer("zeros", q.zeros)
        elif kernel == "cuda":
            # The CUDA packer takes [N, K/2] bytes with the even k in the high nibble.
            swapped = ((q.qweight & 0x0F) << 4) | (q.qweight >> 4)
            inner_k_tiles = 8 if self.in_features % 1024 == 0 else (4 if self.in_features % 512 == 0 else 2)
            self.register_buffer(
                "packed", torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
            )
            self.register_buffer("sz", _scales_and_offsets(q, torch.bfloat16))
        elif kernel in ("cpu-f32", "cpu-int8"):
            self.register_buffer("qweight", q.qweight.contiguous())
            self.register_buffer("scales", q.scales.float().contiguous())
            self.register_buffer("zeros", q.zeros.contiguous())
        elif kernel == "triton":
            if not triton_int4.TRITON_SUPPORT:
                raise RuntimeError("the triton INT4 kernel needs triton (CUDA builds of torch ship it)")
            self.register_buffer("qweight", q.qweight)
            self.register_buffer("scales", q.scales)
            self.register_buffer("zeros", q.zeros)
        elif kernel == "cuda-mma":
            self.paired = gated and bias is None and q.minimums is None and cuda_int4.can_pair(self.out_features)
            tiled = cuda_int4.repack(q.qweight, q.scales, q.zeros, q.group_size, paired=self.paired, device=device)
            self.register_buffer("codes", tiled.codes)
            self.register_buffer("tile_scales", tiled.scales)
            self.register_buffer("tile_zeros", tiled.zeros)
            # Its rows padded to a multiple of 16; block minimums kept beside it.
            self.weight_bytes = tiled.nbytes + (0 if q.minimums is None else q.minimums.numel() * 4)
        elif kernel == "dequant":
            self.register_buffer("w", dequantize(q))
        else:
            raise ValueError(f"unknown INT4 kernel {kernel!r}")

    @property
    def tiled(self) -> cuda_int4.TiledInt4:
        """The cuda-mma kernel's weight (its buffers, wherever the module now lives)."""
        return cuda_int4.TiledInt4(
            self.codes, self.tile_scales, self.tile_zeros, self.out_features, self.in_features, self.group_size,
            self.paired,
        )  # fmt: skip

    def gemv_silu(self, x: torch.Tensor, norm: cuda_int4.NormInput | None = None) -> torch.Tensor | None:
        """silu(gate) * up [M, N/2] in x's dtype straight from the GEMV, for a paired
        gate/up layer and activations it takes; None where this layer cannot. `norm`:
        x is a producer's un-divided norm input (see folds_norm)."""
        if self.kernel != "cuda-mma" or not self.paired or x.dtype not in cuda_int4.DTYPES or self.minimums is not None:
            return None  # (a weight in halves is never paired)
        return cuda_int4.gemv_silu(x, self.tiled, norm=norm) if x.shape[0] <= cuda_int4.MAX_ROWS else None

    def folds_norm(self, rows: int, dtype: torch.dtype, producer: bool) -> bool:
        """Whether this layer's GEMV takes the RMSNorm folded into it for `rows` rows of
        `dtype`: as the producer (gemv_residual) or as the consumer (`norm=`)."""
        if self.kernel != "cuda-mma" or dtype not in cuda_int4.DTYPES or rows > cuda_int4.MAX_ROWS:
            return False
        if self.minimums is not None or self.halves:
            return False
        if producer:
            return not self.paired and self.out_features % cuda_int4.TILE_ROWS == 0
        return cuda_int4.parts_fit(rows, self.in_features)

    def gemv_residual(
        self, x: torch.Tensor, residual: cuda_int4.Residual, eps: float
    ) -> tuple[torch.Tensor, cuda_int4.NormInput]:
        """resid += x @ W.T in place; returns the next norm's un-divided input and the
        partial sums its consumer finishes it with (layers where folds_norm(producer=True))."""
        return cuda_int4.gemv_residual(x, self.tiled, residual, eps)

    def gemv(self, x: torch.Tensor, norm: cuda_int4.NormInput | None = None) -> torch.Tensor:
        """x [M, K] (a few rows) -> [M, N] float32, straight from the GEMV: the fused
        decode step reads the float32 sums without a cast kernel in between. `norm`
        (cuda-mma only): x is a producer's un-divided norm input. Not for a weight with
        block minimums (the fused step refuses such a model)."""
        if self.minimums is not None or self.halves:
            raise RuntimeError("gemv() adds neither block minimums nor halves: such a layer is served by forward()")
        return self._gemv(x, norm)

    def _gemv(self, x: torch.Tensor, norm: cuda_int4.NormInput | None = None) -> torch.Tensor:
        """gemv() without the block minimums (forward() adds them)."""
        if self.kernel == "cuda-mma":
            if x.dtype in cuda_int4.DTYPES:
                return cuda_int4.gemv(x, self.tiled, norm=norm)
            if norm is not None:
                raise ValueError("a folded norm takes bfloat16 or float16 activations")
            return self._dequant_matmul(x.float())  # float32 activations: no tensor-core form
        if norm is not None:
            raise ValueError(f"the {self.kernel!r} kernel takes no folded norm")
        if self.kernel != "triton":
            raise RuntimeError(f"gemv() is the GEMV kernels' entry point; this layer uses {self.kernel!r}")
        counters = self._counters
        if counters is None or counters.device != x.device:
            # Made once, outside any capture (serving warms up before it captures), and
            # left zeroed by every launch: no zeroing kernel per product in the step.
            size = triton_int4.counter_size(triton_int4.GEMV_MAX_ROWS, self.out_features)
            counters = self._counters = torch.zeros(size, device=x.device, dtype=torch.int32)
        return triton_int4.int4_gemv(x, self.qweight, self.scales, self.zeros, self.group_size, counters=counters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.kernel in ("cpu-f32", "cpu-int8"):
            int8 = self.kernel == "cpu-int8"
            out = cpu_int4.linear(flat, self.qweight, self.scales, self.zeros, self.group_size, int8=int8)
        elif self.kernel == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(torch.bfloat16), self.packed, self.group_size, self.sz
            )
        elif self.kernel == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(flat.to(torch.bfloat16), self.packed, self.group_size, self.sz)
        elif self.kernel == "triton":
            if flat.shape[0] <= triton_int4.GEMV_MAX_ROWS:
                out = self._gemv(flat)
            else:
                # Dequantize a slab of rows at a time: the bf16 copy of a wide weight
                # (the 28672-row gate/up of an 8B model is 235 MB) never exists whole.
                out = torch.empty(flat.shape[0], self.out_features, device=flat.device, dtype=flat.dtype)
                for n0 in range(0, self.out_features, PREFILL_SLAB_ROWS):
                    n1 = min(self.out_features, n0 + PREFILL_SLAB_ROWS)
                    w = triton_int4.int4_dequant(
                        self.qweight[n0:n1], self.scales[n0:n1], self.zeros[n0:n1], self.group_size, flat.dtype
                    )
                    out[:, n0:n1] = flat @ w.T
        elif self.kernel == "cuda-mma":
            out = self._gemv(flat) if flat.shape[0] <= cuda_int4.MAX_ROWS else self._dequant_matmul(flat)
        else:
            out = flat.to(self.w.dtype) @ self.w.T
        if self.minimums is not None:
            sums = flat.float().view(flat.shape[0], -1, self.group_size).sum(-1)  # [M, K/G]
            if flat.shape[0] <= REFINE_ROWS:
                # A row at a time: a decode step's row gets the same sums alone or batched.
                term = torch.stack([torch.mv(self.minimums, row) for row in sums])
            else:
                term = sums @ self.minimums.T
            out = out + term.to(out.dtype)
        if self.halves and self.kernel != "dequant":  # high + low (the dequantized weight is their sum)
            # Added in float32: a 16-bit output's halves rounded once each, not a third time.
            rows = self.out_features // 2
            out = out[:, :rows].float() + out[:, rows:].float()
        if self.exact_top:
            out = self._refine(flat, out.float())
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        result: torch.Tensor = out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])
        return result

    def forward_paired(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(x [M, K] @ W.T, paired): a paired gate/up weight's prefill product is left in
        its paired column order (cuda_int4.pair_order) for a SiLU kernel that reads it so,
        instead of being reordered by a copy; paired False: the usual order."""
        if self.kernel == "cuda-mma" and self.paired and x.shape[0] > cuda_int4.MAX_ROWS and self.bias is None:
            # (A paired weight has no block minimums: see __init__.)
            if self.exact_top:
                raise ValueError("a paired gate/up weight has no exact top")
            return self._dequant_matmul(x, unpair=False), True
        return self(x), False

    def _dequant_matmul(self, flat: torch.Tensor, unpair: bool = True) -> torch.Tensor:
        """flat @ W.T in flat's dtype, W dequantized from the tiled copy a slab of rows at
        a time (never whole: the 8B model's gate/up would be 235 MB in bf16)."""
        tiled = self.tiled
        out = torch.empty(flat.shape[0], self.out_features, device=flat.device, dtype=flat.dtype)
        slab = dequant_slab_rows(self.out_features, self.in_features) // cuda_int4.TILE_ROWS
        buffer = self.dequant_buffer
        if buffer is not None and buffer.dtype != flat.dtype:
            buffer = None  # float32 activations (no tensor-core form): a slab of their own
        for t0 in range(0, tiled.tiles, slab):
            w = cuda_int4.dequant(tiled, t0, min(slab, tiled.tiles - t0), flat.dtype, buffer)
            n0 = t0 * cuda_int4.TILE_ROWS
            torch.mm(flat, w.T, out=out[:, n0 : n0 + w.shape[0]])  # written in place: no copy
        return cuda_int4.unpair(out) if tiled.paired and unpair else out

    def _refine(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [M, N] with each row's `exact_top` largest entries recomputed in float32
        from the codes: the rows of the weight they need are dequantized, nothing else."""
        top = min(self.exact_top, self.out_features)
        ours = self.kernel == "cpu-int8" and out.device.type == "cpu" and out.shape[0] <= REFINE_ROWS
        idx = cpu_int4.top_k(out, top) if ours else None
        if idx is not None and bool((idx >= 0).all()):  # (-1: a row of NaNs, left to torch below)
            # Our C selection and our exact float32 kernel over the rows picked: a fraction
            # of what torch's topk, dequantization and einsum took a decode step (SmolLM2's
            # 49,152 logits on two threads).
            exact = torch.stack(
                [
                    cpu_int4.linear(flat[i : i + 1], self.qweight[r], self.scales[r], self.zeros[r], self.group_size)[0]
                    for i, r in enumerate(idx)
                ]
            )
            return out.scatter(-1, idx, exact)
        idx = out.topk(top, dim=-1).indices  # [M, top]
        rows = idx.reshape(-1)
        q = QuantizedWeight(self.qweight[rows], self.scales[rows], self.zeros[rows], self.group_size)
        w = dequantize(q).view(flat.shape[0], top, self.in_features)
        exact = torch.einsum("mk,mtk->mt", flat.float(), w)
        return out.scatter(-1, idx, exact)


def dequant_slab_rows(n: int, k: int) -> int:
    """Rows per slab of an [n, k] weight's cuda-mma prefill product: whole 16-row tiles,
    the n rows split evenly into the fewest slabs of at most PREFILL_SLAB_VALUES values
    (even slabs keep each slab's product wide enough to fill the GPU)."""
    tile = cuda_int4.TILE_ROWS
    most = max(tile, min(PREFILL_SLAB_ROWS, PREFILL_SLAB_VALUES // k) // tile * tile)
    slabs = -(-n // most)
    return -(-n // slabs // tile) * tile


def dequant_slab_elements(layer: Int4Linear) -> int:
    """Values in the largest slab `layer`'s prefill product dequantizes at once."""
    return min(layer.out_features, dequant_slab_rows(layer.out_features, layer.in_features)) * layer.in_features


def share_dequant_buffer(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every cuda-mma INT4 layer of `model` one dequantization buffer (flat, `dtype`,
    as large as the largest slab); returns its size in bytes, 0 where no layer uses one.

    Prefill products run one after another on one stream, so one buffer serves them all.
    Without it each product's slab is a fresh allocation: the op-by-op prefill takes its
    slabs from the allocator and each captured prefill graph keeps its own in the graphs'
    pool, so the 8B model's 117 MB down-projection slab would be held twice. Call it at
    load, before any graph is captured: a graph keeps the buffer's address."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == "cuda-mma"]
    if not layers or dtype not in cuda_int4.DTYPES:
        return 0
    size = max(dequant_slab_elements(layer) for layer in layers)
    buffer = torch.empty(size, device=layers[0].tiled.codes.device, dtype=dtype)
    for layer in layers:
        layer.dequant_buffer = buffer
    return buffer.numel() * buffer.element_size()


def tune_gemv(model: nn.Module, dtype: torch.dtype) -> int:
    """Run the Triton GEMV's autotuner now, once for every INT4 layer shape (one choice
    serves every batch size: that keeps rows batch-invariant; activations in `dtype`);
    returns how many shapes were tuned.

    The tuner times candidates inside CUDA graphs it captures. Left to first use, that
    capture would happen while another branch's thread works on the same GPU, and the
    other thread's synchronising calls fail during a capture. Call it at load, before
    any worker starts."""
    shapes: dict[tuple[int, int, str], Int4Linear] = {}
    for module in model.modules():
        if isinstance(module, Int4Linear) and module.kernel in GEMV_KERNELS:
            shapes.setdefault((module.out_features, module.in_features, module.kernel), module)
    for layer in shapes.values():
        if layer.kernel == "cuda-mma" and dtype in cuda_int4.DTYPES:
            cuda_int4.tuned_config(layer.tiled, dtype)  # one choice for gemv and gemv_silu
        elif layer.kernel == "triton":
            layer._gemv(torch.zeros(1, layer.in_features, device=layer.qweight.device, dtype=dtype))
    if shapes:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the tuner's L2-cold copies of the small weights
    return len(shapes)


def silu_gate_up(linear: torch.nn.Module, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up [T, F] of a gated unit's [gate; up] product on h [T, K]."""
    if isinstance(linear, Int4Linear):
        out, paired = linear.forward_paired(h)
    else:
        out, paired = linear(h), False
    return step_ops.silu_mul(out, dtype, paired)
