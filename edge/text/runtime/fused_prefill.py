"""Prefill of a fresh prompt in a few large kernels per layer, and captured as CUDA graphs.

Written op by op in torch, a 512-token prefill of an 8B INT4 model is about 1,100 kernel
launches, and on the H200 the host took longer to issue them than the GPU took to run
them. Here each layer is:

    residual add + RMSNorm -> qkv product -> rotary + KV-cache write -> attention ->
    o product -> residual add + RMSNorm -> gate/up product -> SiLU * up -> down product

with the rotary, the cache write and the SiLU each one kernel on contiguous rows (Triton's,
or ours in CUDA C where Triton is absent: ops/step_ops.py),
and the gate/up product kept in the CUDA kernel's paired row order (no reordering copy).

A fresh prompt starts at position 0, so attention reads the keys and values this
prefill computes, not the cache: nothing captured depends on which KV row the sequence
has. `PrefillGraphs` captures the whole prefill once per prompt-length bucket at load,
the row and the last token's index in device tensors; a prompt runs the graph of the
smallest bucket that holds it, padded at the end. The padding's keys and values land in
the row past the prompt, where decode overwrites each position before attending to it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from edge.text.kv.float_cache import KVCache
from edge.text.model.llama import DecoderLayer, LlamaModel
from edge.text.ops import step_ops
from edge.text.ops.int4 import silu_gate_up
from edge.text.runtime import fused_step
from edge.text.runtime.cuda_graphs import capture

logger = logging.getLogger(__name__)

# Prompt-length buckets captured at load. Past the largest the products are large
# enough that launching them one by one costs less than they take to run, and each
# bucket's activations stay in the graphs' pool for the life of the model.
GRAPH_BUCKETS = (16, 32, 64, 128, 256, 512)


def refusal(model: LlamaModel) -> str | None:
    """Why the fused prefill cannot take this model's graph where the fused decode step
    can: it implements Llama's graph alone (one rotary table turning whole heads, no q/k
    norms, no window, SiLU, no output norms, no query scale, embedding scale or logit
    cap), so every family option is refused by name. (A window would also need a sliding
    layer's buffer, float_cache.py, to take a prompt longer than its room in pieces.)
    None where it can."""
    options = model.config.family_options()
    return f"it does not implement {', '.join(options)}" if options else None


def supported(model: LlamaModel) -> bool:
    """The fused prefill takes what the fused decode step takes (Int4Linear projections
    without bias, on CUDA, with Triton's step kernels or ours) but the family options
    (refusal): such a model's prompts are prefilled op by op."""
    if model.device.type != "cuda" or not fused_step.can_fuse(model):
        return False
    refused = refusal(model)
    if refused:
        logger.info("fused prefill refused: %s; prompts are prefilled op by op", refused)
        return False
    return True


def rope_write(
    qkv: torch.Tensor, model: LlamaModel, row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (NH + 2 NKV) HD] of positions 0..T-1 -> q [1, NH, T, HD] (pre-scaled),
    k and v [1, NKV, T, HD]; k and v also written into cache row `row` [1]."""
    tokens = qkv.shape[0]
    n_heads, hd = model.config.num_heads, k_cache.shape[3]
    q, k, v = step_ops.rope_prefill(qkv, model.rope_cos, model.rope_sin, row, k_cache, v_cache, n_heads)
    return q.view(1, tokens, n_heads, hd).transpose(1, 2), k.unsqueeze(0), v.unsqueeze(0)


def fused_prefill(
    model: LlamaModel, ids: torch.Tensor, cache: KVCache, row: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """Logits [1, V] float32 after the token at index last [1] of ids [1, T], a fresh
    prompt (positions 0..T-1) whose keys and values go into cache row `row` [1]."""
    config = model.config
    dtype = model.dtype
    eps = config.rms_norm_eps
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    tokens = ids.shape[1]
    x = model.embed_tokens(ids.view(tokens)).float()  # the residual stream, float32
    delta: torch.Tensor | None = None
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
        h = step_ops.add_rmsnorm(x, delta, layer.input_layernorm.weight, eps)
        qkv = attn.qkv_proj(h)
        q, k, v = rope_write(qkv, model, row, *cache.layer(i))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=k.shape[1] != q.shape[1])
        o = attn.o_proj(out.transpose(1, 2).reshape(tokens, -1))
        h = step_ops.add_rmsnorm(x, o, layer.post_attention_layernorm.weight, eps)
        delta = mlp.down_proj(silu_gate_up(mlp.gate_up_proj, h, dtype))
    assert delta is not None
    x.add_(delta)
    h = step_ops.add_rmsnorm(x.index_select(0, last), None, model.norm.weight, eps)
    logits: torch.Tensor = model.lm_head(h)
    return logits.float()


class PrefillGraphs:
    """fused_prefill captured at load for each prompt-length bucket of `buckets` that
    fits the cache's rows; a prompt runs the smallest bucket that holds it."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        buckets: tuple[int, ...] = GRAPH_BUCKETS,
        pool: Any = None,
    ) -> None:
        """`pool`: the decode graphs' memory pool. Prefill and decode replay one after
        the other on one stream, so their intermediates can share memory: the longest
        prefill's activations then cost the model no more than they did op by op."""
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.model = model
        self.cache = cache
        self.buckets = [b for b in buckets if b <= cache.max_len]
        top = self.buckets[-1] if self.buckets else 0
        device = model.device
        # ids, then the row, then the last token's index: one copy from pinned memory.
        self._host = torch.zeros(top + 2, dtype=torch.long).pin_memory()
        self._dev = torch.zeros(top + 2, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool

    @property
    def longest(self) -> int:
        return self.buckets[-1] if self.buckets else 0

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        top = self.longest
        return self._dev[:bucket].view(1, bucket), self._dev[top : top + 1], self._dev[top + 1 :]

    def capture_all(self) -> int:
        """Capture every bucket, the largest first (the smaller reuse its pool); returns
        how many. Kernels are built by a warm-up run of each first, outside capture."""
        self._dev.zero_()
        for bucket in reversed(self.buckets):
            ids, row, last = self._inputs(bucket)
            run = functools.partial(fused_prefill, self.model, ids, self.cache, row, last)
            self.graphs[bucket] = capture(run, self.pool)
            logger.debug("captured the prefill for prompts up to %d tokens", bucket)
        torch.cuda.synchronize()
        return len(self.graphs)

    def covers(self, tokens: int) -> bool:
        return 0 < tokens <= self.longest and bool(self.graphs)

    def run(self, ids: list[int], row: int) -> torch.Tensor:
        """Next-token logits [V] (a copy: the graph's output is reused) of prompt `ids`
        prefilled into cache row `row`."""
        n = len(ids)
        bucket = next(b for b in self.buckets if b >= n)
        top = self.longest
        host = self._host
        host[:n] = torch.tensor(ids, dtype=torch.long)
        host[n:bucket] = 0
        host[top] = row
        host[top + 1] = n - 1
        self._dev.copy_(host, non_blocking=True)
        graph, logits = self.graphs[bucket]
        graph.replay()
        out = logits[0].clone()
        # The pinned buffer is rewritten by the next call: the copy must have run.
        torch.cuda.current_stream().synchronize()
        return out
