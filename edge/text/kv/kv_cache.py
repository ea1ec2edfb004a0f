"""The one owner of the text branch's KV memory.

The KV cache is allocated once at load, inside the text model's measured footprint:
`rows` sequences of `row_tokens` positions each. This manager decides which sequence
holds which row and how many of its positions it may fill (its prompt plus
max_new_tokens), and answers `allocate_slots` with None when it cannot: the text worker
then waits, pauses a lower-priority sequence, or answers over_budget. Nothing else books
KV (the ledger holds the whole cache inside the model's entry; the batcher writes only
into the rows it is handed), so the figures cannot disagree.

Rows are handed out lowest first, so running sequences stay packed at the front of the
cache and a decode step over the first n rows covers them all.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSlot:
    """A row of the cache held by one sequence, with the positions it reserved."""

    row: int
    tokens: int
    owner: str


class KVCacheManager:
    def __init__(self, rows: int, row_tokens: int, bytes_per_token: int, dtype: str = "float16") -> None:
        if rows < 1 or row_tokens < 1 or bytes_per_token < 0:
            raise ValueError(f"a KV cache of {rows} rows x {row_tokens} tokens ({bytes_per_token} B/token)")
        self.dtype = dtype  # the format the cache holds keys and values in (models.qa.kv_dtype)
        # The paused sequences' offloaded rows, for status (edge/text/kv/kv_offload.py).
        self.offload_snapshot: Callable[[], dict[str, Any]] | None = None
        # The prefix cache's entries, for status (edge/text/kv/prefix_cache.py).
        self.prefix_snapshot: Callable[[], dict[str, Any]] | None = None
        self.rows = rows
        self.row_tokens = row_tokens
        self.bytes_per_token = bytes_per_token
        self._held: dict[int, KVSlot] = {}
        self._lock = threading.Lock()
        self.peak_tokens = 0
        self.peak_rows = 0
        self.refusals = 0

    @property
    def capacity_tokens(self) -> int:
        return self.rows * self.row_tokens

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    @property
    def rows_free(self) -> int:
        with self._lock:
            return self.rows - len(self._held)

    def reserved_tokens(self) -> int:
        with self._lock:
            return sum(s.tokens for s in self._held.values())

    def fits_ever(self, tokens: int) -> bool:
        return 0 < tokens <= self.row_tokens

    def allocate_slots(self, owner: str, tokens: int) -> KVSlot | None:
        """The lowest free row with `tokens` positions reserved in it, or None (and
        nothing changed) when no row is free or the tokens do not fit a row."""
        if tokens < 1:
            raise ValueError(f"a sequence reserves at least one position, not {tokens}")
        with self._lock:
            if tokens > self.row_tokens or len(self._held) >= self.rows:
                self.refusals += 1
                return None
            row = next(r for r in range(self.rows) if r not in self._held)
            slot = KVSlot(row, tokens, owner)
            self._held[row] = slot
            self.peak_tokens = max(self.peak_tokens, sum(s.tokens for s in self._held.values()))
            self.peak_rows = max(self.peak_rows, len(self._held))
            return slot

    def free(self, slot: KVSlot) -> None:
        with self._lock:
            if self._held.get(slot.row) is not slot:
                raise KeyError(f"KV row {slot.row} is not held by {slot.owner!r} (freed twice?)")
            del self._held[slot.row]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            reserved = sum(s.tokens for s in self._held.values())
            return {
                "kv_dtype": self.dtype,
                "offload": self.offload_snapshot() if self.offload_snapshot is not None else None,
                "prefix_cache": self.prefix_snapshot() if self.prefix_snapshot is not None else None,
                "rows": self.rows,
                "rows_free": self.rows - len(self._held),
                "row_tokens": self.row_tokens,
                "capacity_tokens": self.capacity_tokens,
                "reserved_tokens": reserved,
                "peak_tokens": self.peak_tokens,
                "peak_rows": self.peak_rows,
                "bytes_per_token": self.bytes_per_token,
                "capacity_bytes": self.capacity_bytes,
                "reserved_bytes": reserved * self.bytes_per_token,
                "peak_bytes": self.peak_tokens * self.bytes_per_token,
                "refusals": self.refusals,
            }
