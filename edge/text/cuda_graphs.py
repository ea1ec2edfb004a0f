"""Decode with CUDA graphs: one captured step per KV-length bucket, replayed per token.

A decode step of an 8B model is a few hundred small kernels; launched one by one from
Python they cost more than the weights take to stream. Captured once, a step replays
with the launch work done on the GPU. Positions live in a device tensor, so one graph
serves every position inside its bucket (attention is masked beyond the position).
"""

from __future__ import annotations

import logging

import torch

from edge.text.llama import KVCache, LlamaModel

logger = logging.getLogger(__name__)


class GraphDecoder:
    def __init__(self, model: LlamaModel, cache: KVCache, batch: int = 1, bucket: int = 256) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.model = model
        self.cache = cache
        self.bucket = bucket
        device = model.embed_tokens.weight.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def kv_len_for(self, pos: int) -> int:
        return min(self.cache.max_len, (pos // self.bucket + 1) * self.bucket)

    def _capture(self, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up on a side stream first: it runs kernel autotuning and lazy init,
        # which must not happen inside capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model.decode_step(self.ids, self.cache, self.pos, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.decode_step(self.ids, self.cache, self.pos, kv_len)
        logger.debug("captured decode graph for kv_len %d", kv_len)
        return graph, logits

    def step(self, token_ids: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [B, V] for tokens [B] at position `pos` (same for the whole batch)."""
        kv_len = self.kv_len_for(pos)
        self.ids.copy_(token_ids.view(-1, 1))
        self.pos.fill_(pos)
        if kv_len not in self.graphs:
            self.graphs[kv_len] = self._capture(kv_len)
        graph, logits = self.graphs[kv_len]
        graph.replay()
        return logits
