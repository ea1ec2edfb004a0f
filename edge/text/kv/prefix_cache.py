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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edge.text.kv.recheck import Recheck

logger = logging.getLogger(__name__)

MIN_TOKENS = 16  # shorter prefixes cost less to prefill than to copy and track


class PrefillCost:
    """What a prefill of n tokens costs, fixed + n x per_token (ms), fitted to the last
    `keep` measured prefills of one kind by least squares. A call has a fixed part
    (launches, a graph or a weight pass) that a rate per token alone would spread over
    its tokens: a warm-up's 3-token chunk would make every later chunk look dear.

    Until its samples span a factor of two in length the slope cannot be fitted; then
    the slope is `fallback` (the whole prefills' per-token cost: a chunk after cached
    tokens does a prompt token's work, plus attention to them) and the rest of what was
    measured is the fixed part."""

    def __init__(self, keep: int = 32) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=keep)

    def note(self, tokens: int, ms: float) -> None:
        self.samples.append((tokens, ms))

    def fit(self, fallback: float | None = None) -> tuple[float, float] | None:
        """(fixed ms, ms a token), or None before any sample (or any fallback slope)."""
        if not self.samples:
            return None
        n = np.array([t for t, _ in self.samples], dtype=np.float64)
        ms = np.array([m for _, m in self.samples], dtype=np.float64)
        if n.max() >= 2 * n.min():
            slope = float(np.cov(n, ms, bias=True)[0, 1] / n.var())
            fixed = float(ms.mean() - slope * n.mean())
            if slope > 0 and fixed >= 0:
                return fixed, slope
            if slope > 0:  # through the origin
                return 0.0, float((n * ms).sum() / (n * n).sum())
        per_token = fallback if fallback is not None else float((ms / n).mean())
        return max(0.0, float(np.median(ms - per_token * n))), per_token

    def per_token(self) -> float | None:
        fitted = self.fit()
        return None if fitted is None else fitted[1]


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
        # Measured prefill costs: prefills from position 0 (whole prompts, prefixes),
        # and chunks after cached tokens (what a hit runs). Where the GPU prefills a whole
        # prompt in a captured graph, a chunk after cached tokens runs op by op and can
        # cost more than the whole prompt: then prompts are not split (and no prefix kept),
        # but for one now and then, which measures a hit's cost again.
        self.whole = PrefillCost()
        self.chunk = PrefillCost()
        self.recheck = Recheck()

    def estimates(self) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """((fixed ms, ms a token) of a whole prefill, the same of a chunk after cached
        tokens), or None until both kinds have been measured."""
        with self._lock:
            whole = self.whole.fit()
            chunk = self.chunk.fit(fallback=whole[1] if whole is not None else None)
        return None if whole is None or chunk is None else (whole, chunk)

    def worth(self, prefix: int, rest: int) -> bool:
        """Whether splitting a prompt at its prefix pays: a hit (the rest prefilled after
        the kept prefix) at most half a whole prefill, by the costs measured so far (until
        both are measured, it is assumed to)."""
        fitted = self.estimates()
        if fitted is None:
            return True
        (w_fixed, w_rate), (c_fixed, c_rate) = fitted
        return c_fixed + rest * c_rate <= 0.5 * (w_fixed + (prefix + rest) * w_rate)

    def should_split(self, prefix: int, rest: int) -> bool:
        """Whether to split this prompt: where it pays, and now and then where it does not
        (after 16 prompts left whole, then 32, ...), so that a hit's cost is measured
        again (recheck.py)."""
        if self.worth(prefix, rest):
            self.recheck.chosen()
            return True
        return self.recheck.take_anyway()

    def note_prefill(self, start: int, tokens: int, ms: float, whole: bool) -> None:
        """A measured prefill: `whole` (from position 0, as a prompt or a prefix is
        prefilled fresh), or a chunk of `tokens` after `start` cached ones."""
        if tokens <= 0 or ms <= 0 or not (whole or start > 0):
            return
        with self._lock:
            (self.whole if whole else self.chunk).note(tokens, ms)

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
        snap: dict[str, int | float | None]
        with self._lock:
            snap = {
                "entries": len(self._entries),
                "bytes": self.nbytes,
                "capacity_bytes": self.capacity_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "refused": self.refused,
                "declined": self.recheck.declined,
                "rechecked": self.recheck.taken,
            }
        fitted = self.estimates()
        if fitted is not None:
            (snap["whole_fixed_ms"], snap["whole_ms_per_token"]), (snap["hit_fixed_ms"], snap["hit_ms_per_token"]) = (
                fitted
            )
        return snap
