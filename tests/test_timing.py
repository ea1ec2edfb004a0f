"""Stage clocks (edge/timing.py): host stages add up, CUDA event pairs are read once the
last has run, and a host session's staged run counts all of it as "model"."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

from edge.backends.base import InferenceSession
from edge.timing import StageClock, events_ms


class _Event:
    """A CUDA event's two calls, for what reads them (the times are the event's own)."""

    def __init__(self, at_ms: float, log: list[str]) -> None:
        self.at_ms, self.log = at_ms, log

    def synchronize(self) -> None:
        self.log.append(f"sync {self.at_ms}")

    def elapsed_time(self, end: _Event) -> float:
        return end.at_ms - self.at_ms


def test_event_pairs_sum_once_the_last_has_run() -> None:
    log: list[str] = []
    pairs = [(_Event(0.0, log), _Event(2.5, log)), (_Event(10.0, log), _Event(11.0, log))]
    assert events_ms(pairs) == 3.5
    assert log == ["sync 11.0"]  # only the last: events on one stream complete in order
    assert events_ms([]) is None


def test_a_stage_entered_twice_counts_both_times_and_a_raise_is_timed() -> None:
    clock = StageClock()
    clock.add("model", 1.0)
    clock.add("model", 2.0)
    try:
        with clock.stage("postprocess"):
            raise ValueError("bad")
    except ValueError:
        pass
    assert clock.ms["model"] == 3.0 and set(clock.ms) == {"model", "postprocess"}
    other = StageClock()
    other.merge(clock)
    assert other.ms == clock.ms


class _HostSession(InferenceSession):
    @property
    def input_names(self) -> list[str]:
        return ["x"]

    @property
    def output_names(self) -> list[str]:
        return ["y"]

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [inputs["x"] * 2]

    def metadata(self) -> dict[str, str]:
        return {}


def test_a_host_sessions_staged_run_is_all_model_on_the_hosts_clock() -> None:
    clock = StageClock()
    (out,) = _HostSession().run_staged({"x": np.ones(3, np.float32)}, clock)
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert list(clock.ms) == ["model"] and clock.ms["model"] >= 0.0


def test_a_gpu_sessions_stages_end_where_its_events_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_backend.staged_on_stream (the torch-cuda and TensorRT sessions' runs) with the
    CUDA events faked at their seam: the upload ends "preprocess" where named, the model
    and copy back end "model", and the outputs come back as arrays."""
    import torch

    from edge.backends import torch_backend

    log: list[str] = []

    class _Marks:
        def __init__(self, stream: object) -> None:
            log.append("start")

        def end(self, name: str) -> None:
            log.append(f"end {name}")

        def add_to(self, clock: StageClock) -> None:
            for name in ("preprocess", "model"):
                if f"end {name}" in log:
                    clock.add(name, 1.0)

    monkeypatch.setattr(torch_backend, "DeviceStages", _Marks)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def upload() -> torch.Tensor:
        log.append("upload")
        return torch.ones(2, 3)

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        log.append("forward")
        return [x * 2, x.sum(1)]

    stream: Any = object()  # only handed to the faked events and stream context
    clock = StageClock()
    out = torch_backend.staged_on_stream(stream, clock, upload, forward, upload_stage="preprocess")
    assert log == ["start", "upload", "end preprocess", "forward", "end model"]
    assert [o.tolist() for o in out] == [[[2.0] * 3] * 2, [3.0, 3.0]]
    assert clock.ms == {"preprocess": 1.0, "model": 1.0}
    log.clear()
    clock = StageClock()
    torch_backend.staged_on_stream(stream, clock, upload, forward)
    assert log == ["start", "upload", "forward", "end model"] and clock.ms == {"model": 1.0}
