"""Where a job's time goes: named stages, each a duration in milliseconds.

A `StageClock` adds up the time spent in each named stage of one piece of work (a stage
entered twice, the recognizer's batches say, counts once with both times). Work done for
a whole batch is timed once and given to every job in it: that is the time each of them
waited on it. Results carry the stages as `timings.stages` (docs/protocol.md).

Work on a GPU is timed on the GPU's own clock: CUDA events recorded on the work's stream
(`DeviceStages`, `events_ms`), not the host's clock around a launch, which measures when
the host got the result back, queueing behind other work included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

# Who watches stages as they end (`edgectl profile`, to lay them on its timeline): called
# with the stage's name and its start and end on the perf_counter clock. None while no
# profile records, which costs serving one test per stage.
watcher: Callable[[str, float, float], None] | None = None


class _Event(Protocol):
    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


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
        end = time.perf_counter()
        self._clock.add(self._name, (end - self._t0) * 1000.0)
        if watcher is not None:
            watcher(self._name, self._t0, end)


def events_ms(pairs: Sequence[tuple[_Event, _Event]]) -> float | None:
    """Milliseconds between each (start, end) pair of CUDA events, summed, once the last
    has run; None for no pairs (the work did not run on a GPU)."""
    if not pairs:
        return None
    pairs[-1][1].synchronize()
    return float(sum(start.elapsed_time(end) for start, end in pairs))


class DeviceStages:
    """Consecutive stages of one run on a CUDA stream: `end(name)` records an event where
    stage `name` ends on the stream (the first starts where this was made); `add_to`
    waits for the last and adds each stage's time on the device's clock to a clock."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._start = self._record()
        self._ends: list[tuple[str, Any]] = []

    def _record(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def end(self, name: str) -> None:
        self._ends.append((name, self._record()))

    def add_to(self, clock: StageClock) -> None:
        if not self._ends:
            return
        self._ends[-1][1].synchronize()
        previous = self._start
        for name, event in self._ends:
            clock.add(name, previous.elapsed_time(event))
            previous = event
