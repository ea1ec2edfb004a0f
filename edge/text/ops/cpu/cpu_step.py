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
        ("summary", _P),  # 0: no block summaries, dense attention
        ("summary_layer_stride", _I),
        ("summary_row_stride", _I),
        ("blocks", _I),
        ("block_tokens", _I),
        ("summary_index", _P),
        ("summarized", _P),
        ("top_k", _I),  # 0: no token selects
        ("min_context", _I),
    ]


@dataclass
class Summaries:
    """Sparse attention's part of the cache (edge/text/kv/float_cache.KVCache): the block
    summaries [summarized layers, rows, KV heads, blocks, 2, head dim] float32, each
    layer's index there (-1: none), each row's count of positions they are exact over
    (int64, updated by the step), the block size, and what a token selects: top_k blocks
    besides those always kept from position min_context on (top_k 0: none selects, the
    summaries still kept honest)."""

    summary: torch.Tensor
    index: torch.Tensor
    summarized: torch.Tensor
    block_tokens: int
    top_k: int
    min_context: int


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
    sparse: Summaries | None = None


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

_SELECT = cpu_int4.CKernel(
    SOURCE,
    "edge_cpu_step_select",
    [_P, _I, _I, _P, _I, _I, _I, _P],  # q [group, D], group, D, summary [blocks, 2, D], last, block, k, spans
    "the CPU decode step's block selection",
)

_ATTENTION = cpu_int4.CKernel(
    SOURCE,
    "edge_cpu_step_attention",
    # model, layers, cache, q [layers, B, NH * D], B, rows, pos, kv_len, out [layers, B, NH * D], threads
    [_P, _P, _P, _P, _I, _P, _P, _I, _P, ctypes.c_int],
    "the CPU decode step's attention",
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


def select(q: torch.Tensor, summary: torch.Tensor, last: int, block_tokens: int, k: int) -> list[tuple[int, int]]:
    """The positions a token at `last` attends to in a layer that sees every position, as
    the decode step selects them (first, last) span by span: q [group, D] its KV group's
    query heads, summary [blocks, 2, D] the (row, KV head)'s block minimums and maximums
    (for the tests to hold against a reference)."""
    q, summary = q.to(torch.float32).contiguous(), summary.to(torch.float32).contiguous()
    blocks = last // block_tokens + 1
    if q.dim() != 2 or summary.dim() != 3 or summary.shape[0] < blocks or summary.shape[1:] != (2, q.shape[1]):
        raise ValueError(f"queries {list(q.shape)} and summaries {list(summary.shape)} up to position {last}")
    spans = torch.zeros(2 * blocks, dtype=torch.int64)
    n = _SELECT.function()(
        q.data_ptr(), q.shape[0], q.shape[1], summary.data_ptr(), last, block_tokens, k, spans.data_ptr()
    )
    if n < 0:
        raise RuntimeError(f"the CPU decode step's block selection failed: {ERRORS.get(n, f'code {n}')}")
    pairs: list[int] = spans[: 2 * n].tolist()
    return list(zip(pairs[::2], pairs[1::2], strict=True))


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
    if x.dtype != torch.float32:
        raise ValueError("the CPU decode step runs float32 activations over a float32 cache")
    x = x.contiguous()
    bsz = x.shape[0]
    cache, cache_rows, positions = _step_cache(plan, parts, rows, pos, bsz)
    rc = fn(
        ctypes.byref(plan.model), plan.layers, ctypes.byref(cache), x.data_ptr(), bsz,
        cache_rows.data_ptr(), positions.data_ptr(), kv_len, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CPU decode step failed: {ERRORS.get(rc, f'code {rc}')}")
    return x


def attention(
    plan: Plan, q: torch.Tensor, parts: CacheParts, rows: torch.Tensor, pos: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """Every layer's attention alone as the decode step runs it, over the cache as it
    stands (nothing written, no summary brought up to date), in one call: q [layers, B,
    heads x head dim] float32 the tokens' query heads, turned by the rotary; out likewise.
    For the benchmarks, to time attention apart from the layers' products."""
    fn = _ATTENTION.function()
    q = q.to(torch.float32).contiguous()
    model = plan.model
    bsz = q.shape[1]
    if q.shape != (model.layers, bsz, model.heads * model.head_dim):
        raise ValueError(f"queries [{model.layers}, B, {model.heads * model.head_dim}], not {list(q.shape)}")
    cache, cache_rows, positions = _step_cache(plan, parts, rows, pos, bsz)
    out = torch.empty_like(q)
    rc = fn(
        ctypes.byref(model), plan.layers, ctypes.byref(cache), q.data_ptr(), bsz,
        cache_rows.data_ptr(), positions.data_ptr(), kv_len, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CPU decode step's attention failed: {ERRORS.get(rc, f'code {rc}')}")
    return out


def _step_cache(
    plan: Plan, parts: CacheParts, rows: torch.Tensor, pos: torch.Tensor, bsz: int
) -> tuple[StepCache, torch.Tensor, torch.Tensor]:
    """The cache as the kernel reads it (checked), and the tokens' cache rows and
    positions as int64 (kept alive by the caller through the call)."""
    k, v, lk, lv = parts.k, parts.v, parts.local_k, parts.local_v
    for a, b in ((k, v), (lk, lv)):
        if a is not None and (b is None or a.stride() != b.stride() or not _heads(a) or not _heads(b)):
            raise ValueError("the CPU decode step reads a float32 cache of whole contiguous heads")
    if parts.index.dtype != torch.int64 or parts.index.shape != (plan.model.layers,):
        raise ValueError(f"the cache's layer index names {parts.index.shape} layers of {plan.model.layers}")
    offsets = parts.offsets
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
        offsets.data_ptr(), parts.index.data_ptr(), *_sparse(parts, plan.model.layers),
    )  # fmt: skip
    return cache, cache_rows, positions


def _sparse(parts: CacheParts, layers: int) -> tuple[int, ...]:
    """StepCache's sparse attention fields: the summaries' pointers and shape, checked
    against the cache; all 0 (dense) for a cache without them."""
    got = parts.sparse
    if got is None:
        return (0,) * 9
    summary, k = got.summary, parts.k
    rows, heads, slots, dim = k.shape[1], k.shape[2], k.shape[3], k.shape[4]
    blocks = -(-slots // got.block_tokens)
    if (
        summary.dtype != torch.float32
        or summary.shape[1:] != (rows, heads, blocks, 2, dim)
        or summary.stride()[2:] != (blocks * 2 * dim, 2 * dim, dim, 1)
    ):
        raise ValueError(f"block summaries {list(summary.shape)} for a cache of {rows} rows x {slots} positions")
    index, marks = got.index, got.summarized
    if index.dtype != torch.int64 or index.shape != (layers,) or int(index.max()) >= summary.shape[0]:
        raise ValueError(f"the summaries' layer index names {index.shape} layers of {layers}")
    if marks.dtype != torch.int64 or not marks.is_contiguous() or marks.shape != (rows,):
        raise ValueError("the summaries' counts: one int64 a cache row")
    return (
        summary.data_ptr(), summary.stride(0), summary.stride(1), blocks, got.block_tokens,
        index.data_ptr(), marks.data_ptr(), got.top_k, got.min_context,
    )  # fmt: skip
