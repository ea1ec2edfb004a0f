"""Attention over a quantized KV cache (edge/text/kv/quant_cache.py), on the device the cache
is on: our C kernel on the CPU (cpu_kv.c), on CUDA Triton's (triton_kv.py) or, where
Triton is absent, ours (ops/cuda/kv_ops.cu), as ops/step_ops.py chooses. All read the
codes where they are stored; none dequantizes into a buffer.

- decode: one token per row at each row's own position: written (and a key block coded
  when one leaves the window), then attended to with everything before it, or, with
  sparse attention on the CPU (a layer whose cache keeps block summaries), from
  min_context on to the blocks it selects and the float part;
- chunk: a prompt's tokens after `start` cached ones, in one row: they attend to the
  cached codes, the ring's float tokens and each other in float (causally), as a fresh
  prefill attends to itself; then they are stored.
"""

from __future__ import annotations

import torch

from edge.text.kv.quant_cache import QuantLayer
from edge.text.ops import step_ops
from edge.text.ops.cpu import cpu_kv


def _codes(layer: QuantLayer) -> tuple[torch.Tensor, ...]:
    return (layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero)


def _sink(layer: QuantLayer) -> tuple[torch.Tensor, torch.Tensor] | None:
    return (layer.sink_k, layer.sink_v) if layer.sink_k.numel() else None


def _format(layer: QuantLayer) -> tuple[int, int, bool]:
    fmt = layer.fmt
    return fmt.key_block, fmt.group(layer.ring_k.shape[-1]), fmt.dtype == "int4"


def _query_scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else q.shape[-1] ** -0.5


def decode(
    layer: QuantLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    kv_len: int,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, NH, D] (unscaled), k and v [B, NKV, D] of the new tokens at positions pos [B]
    -> [B, NH, D] in q's type. A row's attention reaches no further than kv_len (rows a
    step does not advance sit at the last position; their output is not read), nor, in a
    sliding layer, further back than its `window` (every kernel: CPU C, Triton, CUDA C);
    `scale`: the queries' (None: 1/sqrt(D))."""
    q_scale = _query_scale(q, scale)
    if q.is_cuda:
        kernels = step_ops.kv_kernels(q.device)
        kernels.write_tokens(layer, k, v, pos)
        out = kernels.attention(layer, q.contiguous(), pos, kv_len, q_scale=q_scale, window=window)
        return out.view(q.shape).to(q.dtype)
    positions = [int(p) for p in pos.tolist()]
    layer.write_tokens(k.unsqueeze(2), v.unsqueeze(2), positions)
    ends = [min(p, kv_len - 1) for p in positions]
    rows = list(range(len(positions)))
    selection = None
    if layer.summary is not None and layer.sparse is not None:
        # As the float decode step decides (cpu_step.c): a row not advanced keeps the
        # blocks always kept and selects none; a token before min_context is dense (-1).
        policy = layer.sparse
        top_k = [0 if p >= kv_len else policy.top_k_blocks if p >= policy.min_context else -1 for p in positions]
        selection = cpu_kv.Selection(layer.summary, policy.block_tokens, top_k)
    out = cpu_kv.attention(
        q,
        _codes(layer),
        kv_format=_format(layer),
        rows=rows,
        pos=ends,
        coded=[layer.fmt.coded(e + 1) for e in ends],
        frows=rows,
        fbase=[0] * len(rows),
        float_kv=(layer.ring_k, layer.ring_v),
        fmod=layer.fmt.ring,
        sink_kv=_sink(layer),
        window=window,
        scale=q_scale,
        selection=selection,
    )
    return out.to(q.dtype)


def chunk(
    layer: QuantLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """q [1, NH, T, D] (unscaled), k and v [1, NKV, T, D] of positions start..start+T-1 of
    the layer's one row -> [1, NH, T, D] in q's type; the tokens are stored after.
    window and scale as decode's."""
    if q.shape[0] != 1:
        raise ValueError(f"a chunk after cached tokens is one row's, not {q.shape[0]}")
    seq = q.shape[2]
    coded = layer.fmt.coded(start)
    ring_k, ring_v = layer.ring_span(coded, start)
    float_k = torch.cat([ring_k, k.to(ring_k.dtype)], dim=2)
    float_v = torch.cat([ring_v, v.to(ring_v.dtype)], dim=2)
    queries = q[0].transpose(0, 1)  # [T, NH, D]
    q_scale = _query_scale(q, scale)
    if q.is_cuda:
        kernels = step_ops.kv_kernels(q.device)
        out = kernels.chunk_attention(layer, queries, float_k, float_v, start, coded, q_scale=q_scale, window=window)
    else:
        out = cpu_kv.attention(
            queries,
            _codes(layer),
            kv_format=_format(layer),
            rows=[0] * seq,
            pos=list(range(start, start + seq)),
            coded=[coded] * seq,
            frows=[0] * seq,
            fbase=[coded] * seq,
            float_kv=(float_k, float_v),
            fmod=float_k.shape[2],
            sink_kv=_sink(layer),
            window=window,
            scale=q_scale,
        )
    layer.store(k, v, start)
    return out.to(q.dtype).transpose(0, 1).unsqueeze(0)
