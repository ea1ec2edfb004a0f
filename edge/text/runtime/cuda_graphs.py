"""Decode with CUDA graphs: one captured step per KV-length bucket, replayed per token.

A decode step of an 8B model is a few hundred small kernels; launched one by one from
Python they cost more than the weights take to stream. Captured once, a step replays
with the launch work done on the GPU. Positions live in a device tensor, so one graph
serves every position inside its bucket (attention is masked beyond the position).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from edge.gpu_streams import side_stream
from edge.text.kv.float_cache import KVCache
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.llama import LlamaModel
from edge.text.runtime import fused_step

logger = logging.getLogger(__name__)


def capture(run: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, output) of `run` captured into memory pool `pool`. Two warm-up runs on the
    thread's side stream (gpu_streams.side_stream) come first: lazy initialisation and
    kernel builds must not happen inside a capture. thread_local: another branch's thread
    may launch its own work meanwhile."""
    stream = side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    graph = torch.cuda.CUDAGraph()
    # Captured on the warm-up's stream: its cuBLAS workspace serves the graph too.
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = run()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


class GraphDecoder:
    def __init__(self, model: LlamaModel, cache: KVCache | QuantKVCache, batch: int = 1, bucket: int = 256) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.model = model
        self.cache = cache
        self.bucket = bucket
        device = model.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def kv_len_for(self, pos: int) -> int:
        return min(self.cache.max_len, (pos // self.bucket + 1) * self.bucket)

    def _capture(self, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        captured = capture(
            lambda: fused_step.decode_step(self.model, self.ids, self.cache, self.pos, kv_len), self.pool
        )
        logger.debug("captured decode graph for kv_len %d", kv_len)
        return captured

    def step(self, token_ids: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [B, V] for tokens [B] at position `pos` (same for the whole batch)."""
        kv_len = self.kv_len_for(pos)
        if isinstance(self.cache, KVCache):  # room in the sliding layers' own buffers
            self.cache.make_room_for_step([pos] * self.ids.shape[0])
        self.ids.copy_(token_ids.view(-1, 1))
        self.pos.fill_(pos)
        if kv_len not in self.graphs:
            self.graphs[kv_len] = self._capture(kv_len)
        graph, logits = self.graphs[kv_len]
        graph.replay()
        return logits


def buckets_up_to(top: int, start: int = 1) -> list[int]:
    """start, 2*start, 4*start, ... and top itself: the shapes one capture serves."""
    sizes = [min(start, top)]
    while sizes[-1] < top:
        sizes.append(min(sizes[-1] * 2, top))
    return sizes


class StepGraphs:
    """The continuous batcher's decode step, captured at load once per (batch bucket,
    KV-length bucket) and replayed for every step.

    Running sequences hold the lowest rows of the cache, so a step over n of them runs
    the graph of the smallest batch bucket >= n, rows past n fed a dummy token at
    position 0 (free rows: the next prefill there overwrites it). Positions and which
    chosen token each row takes go to the device in one copy from pinned host memory;
    nothing else crosses per step but the chosen tokens coming back.
    """

    def __init__(
        self, model: LlamaModel, cache: KVCache | QuantKVCache, max_batch: int, min_kv_bucket: int = 256
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.model = model
        self.cache = cache
        self.batch_buckets = buckets_up_to(max_batch)
        self.kv_buckets = buckets_up_to(cache.max_len, min_kv_bucket)
        device = model.device
        # Rows: positions, and the chosen token each cache row takes. Two pinned copies,
        # used in turn: the host fills one while the device may still be reading the
        # other (run_chosen returns before its step has run).
        self._host = [torch.zeros(2, max_batch, dtype=torch.long).pin_memory() for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._back = [torch.zeros(max_batch, dtype=torch.long).pin_memory() for _ in range(2)]
        self._back_ready = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0
        self._dev = torch.zeros(3, max_batch, dtype=torch.long, device=device)  # ids, then the host's rows
        self._chosen = torch.zeros(max_batch + 1, dtype=torch.long, device=device)  # the last stays 0
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dev[0, :batch].view(batch, 1), self._dev[1, :batch]

    def capture_all(self) -> int:
        """Capture every (batch, KV length) pair; returns how many. Kernels are built and
        tuned by the caller's warm-up first: nothing may compile inside a capture."""
        for batch in self.batch_buckets:
            for kv_len in self.kv_buckets:
                self.graphs[(batch, kv_len)] = self._capture(batch, kv_len)
        torch.cuda.synchronize()
        return len(self.graphs)

    def _capture(self, batch: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos = self._inputs(batch)
        self._dev.zero_()
        captured = capture(lambda: fused_step.decode_step(self.model, ids, self.cache, pos, kv_len), self.pool)
        logger.debug("captured the decode step for batch %d, KV length %d", batch, kv_len)
        return captured

    def run_chosen(
        self,
        chosen: torch.Tensor,
        sources: list[int],
        positions: list[int],
        kv_len: int,
        reported: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The step after tokens chosen on the device (`chosen` [m], not yet seen by the
        host): row i of the cache takes chosen[sources[i]] at positions[i] (sources[i] = m:
        a row not advanced, token 0 at its last position). The step is launched first and the chosen
        tokens come back while it runs, so the GPU does not wait on the host between
        steps; returns the step's logits [n, V] and the chosen tokens. The caller drops
        the step's logits for a sequence those tokens end (its row's KV past its end is
        never read: the next prefill there overwrites it). `reported`: what comes back to
        the host in place of `chosen` (the batcher marks a failed row there)."""
        m, n = int(chosen.shape[0]), len(sources)
        batch = next(b for b in self.batch_buckets if b >= n)
        bucket = next(k for k in self.kv_buckets if k >= kv_len)
        turn = self._turn
        self._turn ^= 1
        back, ready = self._back[turn], self._back_ready[turn]
        back[:m].copy_(chosen if reported is None else reported, non_blocking=True)
        ready.record()
        host = self._host_np[turn]
        # A row not advanced (free, or a sequence mid-prefill) writes its dummy token's KV
        # at its last position, which any sequence there writes before attending to it.
        host[0, :batch] = self.cache.max_len - 1
        host[1, :batch] = m
        host[0, :n] = positions
        host[1, :n] = sources
        self._dev[1:, :batch].copy_(self._host[turn][:, :batch], non_blocking=True)
        self._chosen[:m].copy_(chosen)
        torch.index_select(self._chosen, 0, self._dev[2, :batch], out=self._dev[0, :batch])
        graph, logits = self.graphs[(batch, bucket)]
        graph.replay()
        ready.synchronize()
        tokens: list[int] = back[:m].tolist()
        return logits[:n], tokens
