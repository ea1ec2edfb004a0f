"""Where a job's time goes: named stages, each a duration in milliseconds.

A `StageClock` adds up the time spent in each named stage of one piece of work (a stage
entered twice, the recognizer's batches say, counts once with both times). Work done for
a whole batch is timed once and given to every job in it: that is the time each of them
waited on it. Results carry the stages as `timings.stages` (docs/protocol.md).
"""

from __future__ import annotations

import time
from types import TracebackType


class StageClock:
    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def add(self, name: str, ms: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + ms

    def stage(self, name: str) -> _Stage:
        """Time a `with` block as (part of) stage `name`, on the host's monotonic clock,
        whether it returns or raises."""
        return _Stage(self, name)

    def merge(self, other: StageClock) -> None:
        for name, ms in other.ms.items():
            self.add(name, ms)


class _Stage:
    # A class, not contextlib's generator: that one re-raises by setting the exception's
    # __traceback__, which a frozen dataclass exception (JobError) refuses.
    def __init__(self, clock: StageClock, name: str) -> None:
        self._clock, self._name, self._t0 = clock, name, 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._clock.add(self._name, (time.perf_counter() - self._t0) * 1000.0)
