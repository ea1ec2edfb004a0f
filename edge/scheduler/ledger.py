"""The memory ledger: one budget in integer bytes for every model and every job.

Models enter with the footprint measured while they loaded (a probe's before/after, never
a guess); jobs reserve what they need before they run, all or nothing, and give it back
after. The ledger refuses whatever would take it past budget minus headroom, so the sum
it holds can never exceed the budget, and says so in figures; choosing what to do about
a refusal (wait, evict, pause, answer over_budget) is the scheduler's business. Idle
models are offered for eviction least recently used first, and only once their
keep-alive has run out (Ollama's order, with measured sizes instead of its estimates).

Memory a model allocated once as part of its measured footprint and hands out to jobs
piece by piece (the text branch's KV cache) is not booked here a second time: its one
owner is the KV cache manager (edge/text/kv/kv_cache.py); the ledger holds the whole
cache inside the model's entry.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETAINED = "retained"  # memory evicted models left behind in the process (allocator caches)


class MemoryProbe(Protocol):
    """Bytes the process holds in the memory the budget covers (RSS on a CPU box, the
    GPU's memory on a discrete GPU, both on a Jetson's unified memory): edge/memory.py."""

    def used_bytes(self) -> int: ...


def measure(probe: MemoryProbe, load: Callable[[], T]) -> tuple[T, int]:
    """Run `load` and return what it built with the bytes it added, as the probe saw."""
    before = probe.used_bytes()
    obj = load()
    return obj, max(0, probe.used_bytes() - before)


@dataclass
class ModelEntry:
    name: str
    branch: str
    nbytes: int
    keep_alive_s: float
    last_used: float
    active: int = 0  # reservations that use it now


@dataclass(frozen=True)
class Reservation:
    id: int
    owner: str  # the job id
    job_class: str  # the task, for the status figures
    model: str | None
    nbytes: int  # from the free budget


@dataclass
class LedgerStats:
    peak_bytes: int = 0
    refusals: int = 0
    evictions: int = 0


@dataclass
class MemoryLedger:
    budget_bytes: int
    headroom_bytes: int = 0
    clock: Callable[[], float] = time.monotonic
    _models: dict[str, ModelEntry] = field(default_factory=dict)
    _reservations: dict[int, Reservation] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    stats: LedgerStats = field(default_factory=LedgerStats)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or not 0 <= self.headroom_bytes < self.budget_bytes:
            raise ValueError(f"budget {self.budget_bytes} and headroom {self.headroom_bytes} leave nothing to use")

    def lower_budget(self, budget_bytes: int) -> bool:
        """Shrink the budget to what the box can really give (never below what is held,
        nor to where the headroom would leave nothing); True if it changed."""
        with self._lock:
            floor = max(self._used() + self.headroom_bytes, self.headroom_bytes + 1)
            target = max(floor, budget_bytes)
            if target >= self.budget_bytes:
                return False
            self.budget_bytes = target
            return True

    @property
    def capacity_bytes(self) -> int:
        return self.budget_bytes - self.headroom_bytes

    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return sum(m.nbytes for m in self._models.values()) + sum(r.nbytes for r in self._reservations.values())

    def _admit(self, nbytes: int) -> bool:
        if nbytes < 0:
            raise ValueError(f"cannot hold a negative size ({nbytes})")
        if self._used() + nbytes > self.capacity_bytes:
            self.stats.refusals += 1
            return False
        return True

    def _note_peak(self) -> None:
        used = self._used()
        assert used <= self.capacity_bytes, f"ledger over capacity: {used} > {self.capacity_bytes}"
        self.stats.peak_bytes = max(self.stats.peak_bytes, used)

    def can_ever_fit(self, nbytes: int) -> bool:
        """Whether nbytes fits with every evictable model gone and no other job running:
        a job for which this is False is refused at once rather than queued."""
        with self._lock:
            pinned = sum(m.nbytes for m in self._models.values() if m.keep_alive_s == float("inf"))
            return nbytes <= self.capacity_bytes - pinned

    def set_keep_alive(self, name: str, keep_alive_s: float) -> None:
        with self._lock:
            entry = self._models.get(name)
            if entry is not None:
                entry.keep_alive_s = keep_alive_s

    def add_model(self, name: str, branch: str, nbytes: int, keep_alive_s: float = 300.0) -> bool:
        """Account for a loaded model (its measured size); False, changing nothing, if it
        does not fit now. keep_alive_s = inf pins it (never offered for eviction)."""
        with self._lock:
            if name in self._models:
                raise ValueError(f"model {name!r} is already in the ledger")
            if not self._admit(nbytes):
                return False
            self._models[name] = ModelEntry(name, branch, nbytes, keep_alive_s, self.clock())
            self._note_peak()
            return True

    def evict(self, name: str, retained_bytes: int) -> int:
        """Drop an unloaded model, keeping `retained_bytes` of it that the process still
        holds (measured: what unloading did not give back) on the pinned "retained"
        entry, in one step; returns the bytes freed. Refused while jobs use it."""
        with self._lock:
            entry = self._models[name]
            if entry.active:
                raise RuntimeError(f"model {name!r} is in use by {entry.active} job(s)")
            kept = min(max(0, retained_bytes), entry.nbytes)
            del self._models[name]
            if kept:
                held = self._models.get(RETAINED)
                if held is None:
                    self._models[RETAINED] = ModelEntry(RETAINED, "daemon", kept, float("inf"), self.clock())
                else:
                    held.nbytes += kept
            self.stats.evictions += 1
            return entry.nbytes - kept

    def reclaim_retained(self, nbytes: int) -> int:
        """A load took up to nbytes less from the system than its model's known size:
        it reused memory an earlier unload left in the process, so that much of the
        retained figure is now inside the model's entry. Returns the bytes moved."""
        with self._lock:
            held = self._models.get(RETAINED)
            if held is None or nbytes <= 0:
                return 0
            moved = min(held.nbytes, nbytes)
            held.nbytes -= moved
            if held.nbytes == 0:
                del self._models[RETAINED]
            return moved

    def touch(self, *names: str) -> None:
        """Mark models as just used (their keep-alive counts from now)."""
        now = self.clock()
        with self._lock:
            for name in names:
                if name in self._models:
                    self._models[name].last_used = now

    def remove_model(self, name: str) -> int:
        """Drop an unloaded model; returns the bytes freed. Refused while jobs use it."""
        return self.evict(name, 0)

    def reserve(
        self,
        owner: str,
        job_class: str,
        nbytes: int,
        model: str | None = None,
    ) -> Reservation | None:
        """All or nothing: nbytes of the free budget, or None and nothing changed."""
        with self._lock:
            if model is not None and model not in self._models:
                raise KeyError(f"model {model!r} is not loaded")
            if not self._admit(nbytes):
                return None
            res = Reservation(next(self._ids), owner, job_class, model, nbytes)
            self._reservations[res.id] = res
            if model is not None:
                entry = self._models[model]
                entry.active += 1
                entry.last_used = self.clock()
            self._note_peak()
            return res

    def release(self, res: Reservation) -> None:
        with self._lock:
            if self._reservations.pop(res.id, None) is None:
                raise KeyError(f"reservation {res.id} is not held (released twice?)")
            if res.model is not None and res.model in self._models:
                entry = self._models[res.model]
                entry.active -= 1
                entry.last_used = self.clock()

    def eviction_candidates(self) -> list[str]:
        """Models no job is using whose keep-alive has run out, least recently used first."""
        now = self.clock()
        with self._lock:
            idle = [m for m in self._models.values() if m.active == 0 and now - m.last_used >= m.keep_alive_s]
            return [m.name for m in sorted(idle, key=lambda m: m.last_used)]

    def free_bytes(self) -> int:
        """What a reservation could take now."""
        with self._lock:
            return max(0, self.capacity_bytes - self._used())

    def shortfall(self, nbytes: int) -> int:
        """Bytes that would have to be freed for nbytes to fit now (0 if it fits)."""
        with self._lock:
            return max(0, self._used() + nbytes - self.capacity_bytes)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            per_class: dict[str, int] = {}
            for r in self._reservations.values():
                per_class[r.job_class] = per_class.get(r.job_class, 0) + r.nbytes
            return {
                "budget_bytes": self.budget_bytes,
                "headroom_bytes": self.headroom_bytes,
                "used_bytes": self._used(),
                "reserved_bytes": sum(r.nbytes for r in self._reservations.values()),
                "peak_bytes": self.stats.peak_bytes,
                "refusals": self.stats.refusals,
                "evictions": self.stats.evictions,
                "models": {
                    m.name: {"branch": m.branch, "bytes": m.nbytes, "active_jobs": m.active}
                    for m in self._models.values()
                },
                "jobs_by_class": per_class,
            }
