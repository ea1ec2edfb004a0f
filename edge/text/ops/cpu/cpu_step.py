"""The whole-layer CPU decode step (cpu_step.c): its ctypes structures and entry point.
Built on the box like the CPU INT4 kernel (cpu_int4.build, the same kernel cache); the
runtime (edge/text/runtime/cpu_step.py) decides where it serves and lays a model out in
these structures once."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from edge.text.ops.cpu import cpu_int4

SOURCE = Path(__file__).with_name("cpu_step.c")
MAX_HEAD_DIM = 512  # cpu_step.c rotates a head in a buffer of this many floats
MAX_PARTS = 3  # cpu_step.c's product of up to this many weights (q, k, v)
_P, _I = ctypes.c_void_p, ctypes.c_int64


class Int4Matrix(ctypes.Structure):
    _fields_ = [
        ("q", _P),
        ("scales", _P),
        ("zeros", _P),
        ("n", _I),
        ("k", _I),
        ("group", _I),
        ("int8", _I),
        ("minimums", _P),  # 0: none
        ("halves", _I),  # nonzero: the rows are two weights [high; low] added after
    ]


class Int4Product(ctypes.Structure):
    """One of a layer's products: its parts' outputs side by side (q, k and v apart, or
    one fused weight)."""

    _fields_ = [("parts", _I), ("part", Int4Matrix * MAX_PARTS)]


class StepLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", Int4Product),
        ("o", Int4Product),
        ("gate_up", Int4Product),
        ("down", Int4Product),
        ("q_norm", _P),  # 0: none
        ("k_norm", _P),
        ("window", _I),  # 0: none
        ("cos", _P),  # 0: the model's table
        ("sin", _P),
        ("attn_out_norm", _P),  # 0: none
        ("mlp_out_norm", _P),
        ("gelu", _I),
    ]


class StepModel(ctypes.Structure):
    _fields_ = [
        ("layers", _I),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("intermediate", _I),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", _P),
        ("sin", _P),
        ("positions", _I),
        ("rotary", _I),
    ]


class StepCache(ctypes.Structure):
    _fields_ = [
        ("k", _P),
        ("v", _P),
        ("layer_stride", _I),
        ("row_stride", _I),
        ("slots", _I),
        ("rows", _I),
        ("local_k", _P),  # 0: no layer has a buffer of its own
        ("local_v", _P),
        ("local_layer_stride", _I),
        ("local_row_stride", _I),
        ("local_slots", _I),
        ("offsets", _P),
        ("index", _P),
    ]


@dataclass
class CacheParts:
    """A float32 cache as the step reads it (edge/text/kv/float_cache.KVCache): k, v
    [layers, rows, KV heads, slots, head dim] for the layers that hold every position;
    the sliding layers' own buffers (or None) with each row's offset there; each layer's
    index in its tensor (a sliding buffer's i as -1 - i)."""

    k: torch.Tensor
    v: torch.Tensor
    local_k: torch.Tensor | None
    local_v: torch.Tensor | None
    offsets: torch.Tensor
    index: torch.Tensor


_KERNEL = cpu_int4.CKernel(
    SOURCE,
    "edge_cpu_decode_layers",
    [_P, _P, _P, _P, _I, _P, _P, _I, ctypes.c_int],  # model, layers, cache, x [B, H], B, rows, pos, kv_len, threads
    "the CPU decode step",
)

_PRODUCT = cpu_int4.CKernel(
    SOURCE,
    "edge_cpu_step_product",
    [_P, _P, _I, _P, ctypes.c_int],  # product, x [M, K], M, y [M, outputs], threads
    "the CPU decode step's product",
)

ERRORS = {
    -1: "a head size or product shape it does not take",
    -2: "out of memory",
    -3: "a position or row past the cache, or a position past the RoPE table",
}


def available() -> bool:
    return _KERNEL.available()


def matrix(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    int8: bool = False,
    minimums: torch.Tensor | None = None,
    halves: bool = False,
) -> Int4Matrix:
    """An INT4 weight in the checkpoint's layout (scales float32), as the kernel reads it;
    `int8`: its products take int8 activations (the cpu-int8 kernel); `minimums`: float32
    block minimums (a GGUF Q4_1 weight's), added after the product; `halves`: its rows
    are two weights [high; low] whose sum is the layer's (QuantizedWeight.halves), added
    after the product in float32."""
    n, k2 = qweight.shape
    if halves and n % 2:
        raise ValueError(f"a weight in two halves has an even number of rows ({n})")
    for t in (qweight, scales, zeros, *(() if minimums is None else (minimums,))):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the CPU decode step reads contiguous CPU tensors")
    if scales.dtype != torch.float32 or qweight.dtype != torch.uint8 or zeros.dtype != torch.uint8:
        raise ValueError("the CPU decode step reads uint8 codes and zero points, float32 scales")
    if minimums is not None and (minimums.dtype != torch.float32 or minimums.shape != scales.shape):
        raise ValueError("block minimums: float32, one a group as the scales")
    if int8 and not cpu_int4.supports_int8(2 * k2, group):
        raise ValueError(f"the int8 CPU INT4 kernel takes groups of a power of two from 32 ({group})")
    if not cpu_int4.supports(2 * k2, group):
        raise ValueError(f"the CPU INT4 kernel takes groups of a multiple of {2 * cpu_int4.LANES} ({group})")
    return Int4Matrix(
        qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, 2 * k2, group, int(int8),
        minimums.data_ptr() if minimums is not None else 0, int(halves),
    )  # fmt: skip


def outputs(part: Int4Matrix) -> int:
    """A weight's outputs: its rows, or half of them for one in halves."""
    return int(part.n // 2 if part.halves else part.n)


def product(*parts: Int4Matrix) -> Int4Product:
    """A product of up to MAX_PARTS weights of one input, their outputs side by side."""
    if not 1 <= len(parts) <= MAX_PARTS or len({p.k for p in parts}) != 1:
        raise ValueError(f"the CPU decode step's product: 1 to {MAX_PARTS} weights of one input width")
    return Int4Product(len(parts), (Int4Matrix * MAX_PARTS)(*parts))


def multiply(prod: Int4Product, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times `prod` as the decode step makes it: [M, outputs] float32
    (for the tests to hold against Int4Linear; the tensors its matrices name must live)."""
    x = x.to(torch.float32).contiguous()
    parts = prod.part[: prod.parts]
    if x.dim() != 2 or x.shape[1] != parts[0].k:
        raise ValueError(f"the product takes [M, {parts[0].k}] inputs, not {list(x.shape)}")
    y = torch.empty(x.shape[0], sum(outputs(p) for p in parts), dtype=torch.float32)
    rc = _PRODUCT.function()(ctypes.byref(prod), x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the CPU decode step's product failed: {ERRORS.get(rc, f'code {rc}')}")
    return y


@dataclass
class Plan:
    """A model laid out for the kernel. `keep` holds every tensor the pointers name."""

    model: StepModel
    layers: ctypes.Array[StepLayer]
    keep: list[torch.Tensor]


def _heads(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.stride()[2:] == (t.shape[3] * t.shape[4], t.shape[4], 1)


def decode_layers(
    plan: Plan, x: torch.Tensor, parts: CacheParts, rows: torch.Tensor, pos: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """Every layer for one token per sequence: x [B, H] float32 (the embeddings) is
    replaced by the last layer's residual stream and returned. parts: the float32 cache
    (its rows may be a view of a larger cache's first rows); batch row b is a token at
    position pos[b] of cache row rows[b],
    attending to its positions below kv_len (a row the batch does not advance may sit
    past it). Batch rows may share a cache row at consecutive positions: a sequence's
    token and its drafts, each attending causally."""
    fn = _KERNEL.function()
    k, v, lk, lv = parts.k, parts.v, parts.local_k, parts.local_v
    if x.dtype != torch.float32:
        raise ValueError("the CPU decode step runs float32 activations over a float32 cache")
    for a, b in ((k, v), (lk, lv)):
        if a is not None and (b is None or a.stride() != b.stride() or not _heads(a) or not _heads(b)):
            raise ValueError("the CPU decode step reads a float32 cache of whole contiguous heads")
    if parts.index.dtype != torch.int64 or parts.index.shape != (plan.model.layers,):
        raise ValueError(f"the cache's layer index names {parts.index.shape} layers of {plan.model.layers}")
    offsets = parts.offsets
    x = x.contiguous()
    bsz = x.shape[0]
    positions, cache_rows = pos.to(torch.int64).contiguous(), rows.to(torch.int64).contiguous()
    if positions.shape != (bsz,) or cache_rows.shape != (bsz,):
        raise ValueError(f"{bsz} tokens need {bsz} positions and cache rows")
    local = (0, 0, 0, 0, 0)
    if lk is not None and lv is not None:
        local = (lk.data_ptr(), lv.data_ptr(), lk.stride(0), lk.stride(1), lk.shape[3])
        if offsets.dtype != torch.int64 or not offsets.is_contiguous() or offsets.shape != (k.shape[1],):
            raise ValueError("the sliding buffers' offsets: one int64 a cache row")
    cache = StepCache(
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.shape[3], k.shape[1], *local,
        offsets.data_ptr(), parts.index.data_ptr(),
    )  # fmt: skip
    rc = fn(
        ctypes.byref(plan.model), plan.layers, ctypes.byref(cache), x.data_ptr(), bsz,
        cache_rows.data_ptr(), positions.data_ptr(), kv_len, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CPU decode step failed: {ERRORS.get(rc, f'code {rc}')}")
    return x
