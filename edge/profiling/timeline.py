"""Timed records (kernels, copies, operators, stages, steps) gathered into rows, each row
cut into the same columns of time: a heat map's cells.

A record lands in every column it overlaps, its time and its bytes shared out by the
overlap (a kernel of 2 ms half in one column gives each 1 ms and half its bytes). All
times are seconds on one clock (the profile's: the monotonic clock, from its start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# In the order rows are listed and drawn: the GPU's records first, then the host's.
KINDS = ("kernel", "memcpy", "step", "stage", "op")
# Rows kept per kind, the longest first; the rest are added into one "other" row of it.
# Operators are many and each small: a few rows of them say where the host's time went.
MAX_ROWS = {"kernel": 32, "memcpy": 8, "step": 8, "stage": 16, "op": 12}


@dataclass
class Row:
    name: str
    kind: str
    columns: int
    calls: int = 0
    seconds: float = 0.0
    # Bytes of the calls whose bytes are known, and those calls' time: the share of the
    # copy bandwidth is over those alone.
    known_bytes: float = 0.0
    known_seconds: float = 0.0
    # est. achieved occupancy, weighted by each call's time, over the calls that had one.
    occupancy_sum: float = 0.0
    occupancy_seconds: float = 0.0
    busy: list[float] = field(default_factory=list)  # seconds in each column
    moved: list[float] = field(default_factory=list)  # known bytes in each column

    def __post_init__(self) -> None:
        self.busy = self.busy or [0.0] * self.columns
        self.moved = self.moved or [0.0] * self.columns

    @property
    def has_bytes(self) -> bool:
        return self.known_seconds > 0

    @property
    def occupancy(self) -> float | None:
        return self.occupancy_sum / self.occupancy_seconds if self.occupancy_seconds > 0 else None

    def absorb(self, other: Row) -> None:
        self.calls += other.calls
        self.seconds += other.seconds
        self.known_bytes += other.known_bytes
        self.known_seconds += other.known_seconds
        self.occupancy_sum += other.occupancy_sum
        self.occupancy_seconds += other.occupancy_seconds
        self.busy = [a + b for a, b in zip(self.busy, other.busy, strict=True)]
        self.moved = [a + b for a, b in zip(self.moved, other.moved, strict=True)]


class Timeline:
    """Rows over `columns` equal columns from `start` to `end` (seconds)."""

    def __init__(self, start: float, end: float, columns: int) -> None:
        if columns < 1:
            raise ValueError(f"a timeline of {columns} columns")
        if not end > start:
            raise ValueError(f"a timeline from {start} s to {end} s")
        self.start, self.end, self.columns = start, end, columns
        self.width = (end - start) / columns
        self._rows: dict[tuple[str, str], Row] = {}

    def add(
        self,
        name: str,
        kind: str,
        start: float,
        seconds: float,
        nbytes: float | None = None,
        occupancy: float | None = None,
    ) -> None:
        """One call of `name` from `start` for `seconds`; `nbytes` it moved, where known;
        `occupancy` (0..1) where the driver gave one."""
        if kind not in KINDS:
            raise ValueError(f"record kind {kind!r}; one of {', '.join(KINDS)}")
        row = self._rows.get((kind, name))
        if row is None:
            row = self._rows[(kind, name)] = Row(name, kind, self.columns)
        seconds = max(0.0, seconds)
        row.calls += 1
        row.seconds += seconds
        if nbytes is not None:
            row.known_bytes += nbytes
            row.known_seconds += seconds
        if occupancy is not None:
            row.occupancy_sum += occupancy * seconds
            row.occupancy_seconds += seconds
        end = start + seconds
        if seconds == 0 or end <= self.start or start >= self.end:
            return
        first = max(0, int((start - self.start) / self.width))
        last = min(self.columns - 1, math.ceil((end - self.start) / self.width) - 1)
        for c in range(first, last + 1):
            lo = self.start + c * self.width
            overlap = min(end, lo + self.width) - max(start, lo)
            if overlap <= 0:
                continue
            row.busy[c] += overlap
            if nbytes is not None:
                row.moved[c] += nbytes * overlap / seconds

    def add_total(self, name: str, kind: str, at: float, seconds: float, calls: int) -> None:
        """`calls` calls of `name` whose time, `seconds` in all, is known only as a total
        read at `at` (a daemon's metrics): all of it in the column holding `at`."""
        row = self._rows.get((kind, name))
        if row is None:
            row = self._rows[(kind, name)] = Row(name, kind, self.columns)
        row.calls += calls
        row.seconds += max(0.0, seconds)
        c = min(self.columns - 1, max(0, int((at - self.start) / self.width)))
        row.busy[c] += max(0.0, seconds)

    def rows(self, max_rows: dict[str, int] = MAX_ROWS) -> list[Row]:
        """Rows by kind (KINDS' order), each kind's longest first, at most `max_rows[kind]`
        of a kind: the rest become one row named "other <kind>s"."""
        out: list[Row] = []
        for kind in KINDS:
            rows = sorted((r for r in self._rows.values() if r.kind == kind), key=lambda r: (-r.seconds, r.name))
            limit = max_rows[kind]
            if len(rows) > limit:
                kept, rest = rows[: limit - 1], rows[limit - 1 :]
                other = Row(f"other {kind}s", kind, self.columns)
                for row in rest:
                    other.absorb(row)
                rows = [*kept, other]
            out.extend(rows)
        return out
