"""Prefilled prompt prefixes kept for reuse: the system prompt and a job's reference
documents, prefilled once and copied into the row of every later job that starts with
the same tokens.

A prompt is split where its reusable part ends (edge/text/qa.py: after the system turn
and the context documents, before the question). The batcher prefills the prefix on its
own, keeps a copy of the row at that point here (llama.KVCache / QuantKVCache.save_row,
on the device), then prefills the rest as a chunk after it. A later prompt with the same
prefix gets the copy and prefills only the rest, the same chunk after the same cached
tokens: a hit computes exactly what a miss computes.

Entries are held on the device, evicted least recently used first, within `capacity_bytes`
and within what the memory ledger grants: each entry's bytes are reserved through
`reserve` (None: refused, so older entries go first) and given back through `release`
when it is evicted. Both are plain function fields, set by the daemon's wiring to the
ledger's; a unit test sets its own.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

MIN_TOKENS = 16  # shorter prefixes cost less to prefill than to copy and track


@dataclass
class PrefixEntry:
    tokens: int
    saved: dict[str, torch.Tensor]
    nbytes: int
    grant: Any = None  # what `reserve` returned for it


def prefix_key(ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


class PrefixCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.reserve: Callable[[int], Any | None] = lambda nbytes: True
        self.release: Callable[[Any], None] = lambda grant: None
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = self.refused = 0
        # Measured prefill rates (ms a token): prefills from position 0 (whole prompts,
        # prefixes), and chunks after cached tokens (what a hit runs). Where the GPU prefills a whole
        # prompt in a captured graph, a chunk after cached tokens runs op by op and can
        # cost more than the whole prompt: then prompts are not split (and no prefix kept).
        self.whole_ms_per_token: float | None = None
        self.chunk_ms_per_token: float | None = None

    def worth(self, prefix: int, rest: int) -> bool:
        """Whether splitting a prompt at its prefix pays: a hit (the rest prefilled after
        the kept prefix) at most half a whole prefill, by the rates measured so far (until
        both are measured, it is assumed to)."""
        whole, chunk = self.whole_ms_per_token, self.chunk_ms_per_token
        if whole is None or chunk is None:
            return True
        return rest * chunk <= 0.5 * (prefix + rest) * whole

    def note_prefill(self, start: int, tokens: int, ms: float, whole: bool) -> None:
        """A measured prefill: `whole` (from position 0, as a prompt or a prefix is
        prefilled fresh), or a chunk of `tokens` after `start` cached ones."""
        if tokens <= 0 or ms <= 0 or not (whole or start > 0):
            return
        name = "whole_ms_per_token" if whole else "chunk_ms_per_token"
        with self._lock:
            old, new = getattr(self, name), ms / tokens
            setattr(self, name, new if old is None else 0.7 * old + 0.3 * new)

    def get(self, ids: list[int]) -> PrefixEntry | None:
        key = prefix_key(ids)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, ids: list[int], saved: dict[str, torch.Tensor]) -> bool:
        """Keep `saved` (a row's state after `ids`) unless it cannot fit even alone, or
        the ledger refuses it once nothing older is left to evict."""
        nbytes = sum(t.numel() * t.element_size() for t in saved.values())
        key = prefix_key(ids)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            if nbytes > self.capacity_bytes:
                self.refused += 1
                return False
            while self._entries and self.nbytes + nbytes > self.capacity_bytes:
                self._evict_oldest()
            grant = self.reserve(nbytes)
            while grant is None and self._entries:
                self._evict_oldest()
                grant = self.reserve(nbytes)
            if grant is None:
                self.refused += 1
                logger.info("prefix cache: the ledger has no room for %d bytes", nbytes)
                return False
            self._entries[key] = PrefixEntry(len(ids), saved, nbytes, grant)
            self.nbytes += nbytes
            return True

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        self.evictions += 1
        self.release(entry.grant)

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._evict_oldest()

    def snapshot(self) -> dict[str, int | float | None]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self.nbytes,
                "capacity_bytes": self.capacity_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "refused": self.refused,
                "whole_ms_per_token": self.whole_ms_per_token,
                "hit_ms_per_token": self.chunk_ms_per_token,
            }
