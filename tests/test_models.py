"""Eviction and reload of idle models under the ledger. The memory probe is the hardware
seam faked here (it reports what the loaders say they hold); the ledger and the manager
are the real ones."""

from __future__ import annotations

import gc

import pytest

from edge.memory import MemoryUse
from edge.protocol.errors import ErrorCode, JobError
from edge.scheduler.ledger import RETAINED, MemoryLedger
from edge.scheduler.models import ModelManager

MIB = 2**20


class FakeProbe:
    def __init__(self) -> None:
        self.held = 0

    def used_bytes(self) -> int:
        return self.held


class Weights:
    """A loaded model as the probe sees it: it holds `size` bytes until dropped, of which
    the process gives back all but `sticky` (an allocator that keeps freed pages)."""

    def __init__(self, probe: FakeProbe, size: int, sticky: int = 0) -> None:
        self.probe, self.size, self.sticky = probe, size, sticky
        probe.held += size

    def __del__(self) -> None:
        self.probe.held -= self.size - self.sticky


def _manager(budget_mib: int, clock: list[float]) -> tuple[ModelManager, FakeProbe]:
    probe = FakeProbe()
    ledger = MemoryLedger(budget_mib * MIB, 0, clock=lambda: clock[0])
    return ModelManager(ledger, probe), probe


def test_idle_models_are_evicted_least_recently_used_first_and_reloaded() -> None:
    clock = [0.0]
    mm, probe = _manager(300, clock)
    mm.register("ocr", "vision", "cpu", lambda: Weights(probe, 100 * MIB), keep_alive_s=10)
    mm.register("inspect", "vision", "cpu", lambda: Weights(probe, 100 * MIB), keep_alive_s=10)
    mm.register("text", "text", "cpu", lambda: Weights(probe, 80 * MIB), keep_alive_s=float("inf"))
    for name in ("ocr", "inspect", "text"):
        mm.load(name)
        clock[0] += 1
    clock[0] = 5.0
    assert not mm.make_room(60 * MIB)  # keep-alive not over: nothing may go
    assert mm.ledger.eviction_candidates() == []
    clock[0] = 20.0
    assert mm.make_room(60 * MIB)
    assert not mm.loaded("ocr") and mm.loaded("inspect") and mm.loaded("text")  # oldest first, only as needed
    assert mm.ledger.used_bytes() == 180 * MIB and probe.held == 180 * MIB
    res = mm.ledger.reserve("job", "inspect", 60 * MIB, model="inspect")
    assert res is not None
    # The OCR job that follows needs its model back: inspect is in use, text pinned,
    # so nothing can go and it is refused with the figures.
    with pytest.raises(JobError) as err:
        mm.get("ocr")
    assert err.value.code == ErrorCode.OVER_BUDGET and "nothing idle can be evicted" in err.value.message
    assert probe.held == 180 * MIB  # the refused load was dropped again
    mm.ledger.release(res)
    held = mm.ledger.reserve("buffers", "ocr", 60 * MIB)  # the OCR job's own buffers
    assert held is not None
    clock[0] = 40.0
    assert isinstance(mm.get("ocr"), Weights)  # inspect is idle again: it goes, ocr comes back
    assert mm.loaded("ocr") and not mm.loaded("inspect")
    assert mm.ledger.stats.evictions == 2 and mm.models()[0].loads == 2


def test_keep_alive_counts_from_the_last_use() -> None:
    clock = [0.0]
    mm, probe = _manager(256, clock)
    mm.register("ocr", "vision", "cpu", lambda: Weights(probe, 100 * MIB), keep_alive_s=10)
    mm.register("inspect", "vision", "cpu", lambda: Weights(probe, 100 * MIB), keep_alive_s=10)
    mm.load("ocr")
    mm.load("inspect")
    clock[0] = 8.0
    mm.ledger.touch("ocr")  # an OCR job just finished
    clock[0] = 15.0
    assert mm.ledger.eviction_candidates() == ["inspect"]  # idle 15 s; ocr only 7 s
    clock[0] = 30.0
    assert mm.ledger.eviction_candidates() == ["inspect", "ocr"]


def test_what_an_unload_does_not_give_back_stays_counted() -> None:
    clock = [0.0]
    mm, probe = _manager(256, clock)
    mm.register("ocr", "vision", "cpu", lambda: Weights(probe, 100 * MIB, sticky=30 * MIB), keep_alive_s=0)
    mm.load("ocr")
    freed = mm.evict("ocr")
    assert freed == 70 * MIB
    snap = mm.ledger.snapshot()
    assert snap["models"][RETAINED]["bytes"] == 30 * MIB
    assert mm.ledger.used_bytes() == probe.held == 30 * MIB  # the ledger matches the process


def test_a_model_too_big_at_start_is_refused_with_figures() -> None:
    mm, probe = _manager(256, [0.0])
    mm.register("big", "text", "cpu", lambda: Weights(probe, 300 * MIB), keep_alive_s=0)
    with pytest.raises(MemoryError, match="needs 314572800 bytes"):
        mm.load("big")
    assert probe.held == 0 and not mm.loaded("big")


def test_freed_heap_memory_goes_back_to_the_system() -> None:
    """What an unloaded model's many small buffers held is handed back: without the trim
    the process keeps those pages resident and an eviction frees memory only on paper."""
    import numpy as np

    from edge.memory import return_free_memory, rss_bytes

    blocks = [np.full(1000, i, np.float64) for i in range(20000)]  # ~160 MB of heap chunks
    held = rss_bytes()
    del blocks
    gc.collect()
    if not return_free_memory():
        pytest.skip("this C library has no malloc_trim")
    assert held - rss_bytes() > 100 * 2**20


def test_a_reload_makes_room_first_and_keeps_the_first_loads_figure() -> None:
    clock = [0.0]
    mm, probe = _manager(200, clock)
    sizes = iter([100 * MIB, 30 * MIB])  # the reload's probe sees less: another thread freed memory meanwhile
    calls: list[int] = []

    def load() -> Weights:
        calls.append(1)
        return Weights(probe, next(sizes))

    mm.register("ocr", "vision", "cpu", load, keep_alive_s=0)
    mm.load("ocr")
    clock[0] = 1.0
    assert mm.make_room(150 * MIB) and not mm.loaded("ocr")
    res = mm.ledger.reserve("batch", "inspect", 150 * MIB)
    assert res is not None
    # 100 MiB cannot fit beside the batch: refused before loading, so the load never
    # takes the process past the budget.
    with pytest.raises(JobError) as err:
        mm.get("ocr")
    assert err.value.code == ErrorCode.OVER_BUDGET and f"needs {100 * MIB} bytes" in err.value.message
    assert len(calls) == 1 and probe.held == 0
    mm.ledger.release(res)
    mm.get("ocr")
    assert len(calls) == 2
    assert mm.ledger.snapshot()["models"]["ocr"]["bytes"] == 100 * MIB  # not the 30 MiB the reload showed


def test_a_reload_that_reuses_retained_memory_is_not_counted_twice() -> None:
    clock = [0.0]
    mm, probe = _manager(300, clock)
    # The unload leaves 20 MiB in the process; the reload takes only 80 MiB more from the
    # system because it reuses them.
    sizes = iter([(100 * MIB, 20 * MIB), (80 * MIB, 0)])

    def load() -> Weights:
        size, sticky = next(sizes)
        return Weights(probe, size, sticky)

    mm.register("ocr", "vision", "cpu", load, keep_alive_s=0)
    mm.load("ocr")
    clock[0] = 1.0
    mm.evict("ocr")
    assert mm.ledger.snapshot()["models"][RETAINED]["bytes"] == 20 * MIB
    mm.get("ocr")
    models = mm.ledger.snapshot()["models"]
    assert RETAINED not in models and models["ocr"]["bytes"] == 100 * MIB
    assert mm.ledger.used_bytes() == probe.held == 100 * MIB  # the ledger agrees with the process again


def test_a_reload_never_evicts_a_model_the_same_job_needs() -> None:
    clock = [0.0]
    mm, probe = _manager(150, clock)
    mm.register("ocr", "vision", "cpu", lambda: Weights(probe, 100 * MIB), keep_alive_s=0)
    mm.register("inspect", "vision", "cpu", lambda: Weights(probe, 40 * MIB), keep_alive_s=0)
    mm.load("ocr")
    mm.load("inspect")
    clock[0] = 1.0
    mm.evict("ocr")
    assert mm.ledger.reserve("buffers", "inspect", 20 * MIB) is not None
    # Loading OCR back would need the idle inspect model gone; the job needs both.
    with pytest.raises(JobError) as err:
        mm.get("ocr", keep={"ocr", "inspect"})
    assert err.value.code == ErrorCode.OVER_BUDGET and mm.loaded("inspect")
    mm.get("ocr")  # with nothing to keep, inspect goes
    assert mm.loaded("ocr") and not mm.loaded("inspect")


def test_a_load_into_reused_memory_is_counted_at_least_its_files() -> None:
    # The process already holds pages an earlier owner freed: the load grows nothing the
    # probe sees, yet the model holds its weights. On the CPU it is counted at its files;
    # on a GPU the floor is not applied (its weights are not in host memory).
    mm, probe = _manager(1024, [0.0])
    mm.register("ocr", "vision", "cpu", lambda: object(), keep_alive_s=0, host_floor_bytes=40 * MIB)
    mm.register("student", "vision", "cpu", lambda: Weights(probe, 90 * MIB), 0, host_floor_bytes=40 * MIB)
    mm.register("gpu", "vision", "cpu", lambda: object(), 0, device="cuda", host_floor_bytes=40 * MIB)
    for name in ("ocr", "student", "gpu"):
        mm.load(name)
    models = mm.ledger.snapshot()["models"]
    assert models["ocr"]["bytes"] == 40 * MIB  # measured 0
    assert models["student"]["bytes"] == 90 * MIB  # measured more than its files: the measure stands
    assert models["gpu"]["bytes"] == 0


class EngineReported:
    """A loaded model whose runtime says what it holds on the device (a TensorRT plan's
    context memory), which the host probe cannot see."""

    device_floor_bytes = 64 * MIB


class DeviceProbe(FakeProbe):
    """A unified-memory box: device bytes are counted with the host's."""

    def counted(self, use: MemoryUse) -> int:
        return use.host + use.device


def test_a_runtimes_own_device_figure_is_counted_when_the_probe_sees_less() -> None:
    ledger = MemoryLedger(1024 * MIB, 0, clock=lambda: 0.0)
    probe = DeviceProbe()
    mm = ModelManager(ledger, probe)
    mm.register("plan", "vision", "tensorrt", EngineReported, 0, device="cuda")
    mm.register("grown", "vision", "tensorrt", lambda: Weights(probe, 100 * MIB), 0, device="cuda")
    mm.load("plan")
    mm.load("grown")
    models = mm.ledger.snapshot()["models"]
    assert models["plan"]["bytes"] == 64 * MIB  # measured 0: the engine's figure stands
    assert models["grown"]["bytes"] == 100 * MIB  # measured more than nothing reported
