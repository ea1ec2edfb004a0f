"""The memory ledger: measured model sizes, all-or-nothing reservations, eviction order,
and the invariant that what it holds never exceeds the budget."""

from __future__ import annotations

import random
import threading

import pytest

from edge.scheduler.ledger import MemoryLedger, Reservation, measure

MIB = 1 << 20


class FakeProbe:
    """Stands in for the hardware counter (RSS, CUDA allocator): a number we move."""

    def __init__(self) -> None:
        self.value = 100 * MIB

    def used_bytes(self) -> int:
        return self.value


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_model_size_is_what_the_probe_saw_while_loading() -> None:
    probe = FakeProbe()

    def load() -> str:
        probe.value += 37 * MIB  # what the load really allocated
        return "model"

    obj, nbytes = measure(probe, load)
    assert obj == "model" and nbytes == 37 * MIB


def test_reservation_is_all_or_nothing() -> None:
    ledger = MemoryLedger(budget_bytes=1000, headroom_bytes=100)
    assert ledger.add_model("vit", "vision", 300)
    a = ledger.reserve("j1", "inspect", 500, model="vit")
    assert a is not None and ledger.used_bytes() == 800
    assert ledger.reserve("j2", "qa", 101) is None  # 901 > 900: refused whole
    assert ledger.used_bytes() == 800 and ledger.stats.refusals == 1
    b = ledger.reserve("j2", "qa", 100)
    assert b is not None and ledger.used_bytes() == 900
    ledger.release(a)
    ledger.release(b)
    assert ledger.used_bytes() == 300
    with pytest.raises(KeyError, match="released twice"):
        ledger.release(a)


def test_model_that_does_not_fit_is_refused_and_nothing_changes() -> None:
    ledger = MemoryLedger(budget_bytes=1000)
    assert ledger.add_model("llm", "text", 700)
    assert not ledger.add_model("vit", "vision", 301)
    assert ledger.snapshot()["models"].keys() == {"llm"}


def test_eviction_order_is_idle_least_recently_used_after_keep_alive() -> None:
    clock = FakeClock()
    ledger = MemoryLedger(budget_bytes=10_000, clock=clock)
    ledger.add_model("a", "vision", 100, keep_alive_s=10)
    clock.now += 1
    ledger.add_model("b", "vision", 100, keep_alive_s=10)
    clock.now += 1
    ledger.add_model("pinned", "text", 100, keep_alive_s=float("inf"))
    assert ledger.eviction_candidates() == []  # keep-alive not run out yet
    clock.now += 20
    assert ledger.eviction_candidates() == ["a", "b"]
    res = ledger.reserve("j", "inspect", 10, model="a")  # a is busy and now most recent
    assert res is not None
    assert ledger.eviction_candidates() == ["b"]
    with pytest.raises(RuntimeError, match="in use"):
        ledger.remove_model("a")
    ledger.release(res)
    clock.now += 20
    assert ledger.eviction_candidates() == ["b", "a"]
    assert ledger.remove_model("b") == 100 and ledger.stats.evictions == 1


def test_a_job_that_can_never_fit_is_known_at_once() -> None:
    ledger = MemoryLedger(budget_bytes=1000, headroom_bytes=100)
    ledger.add_model("pinned", "text", 600, keep_alive_s=float("inf"))
    ledger.add_model("idle", "vision", 200, keep_alive_s=0)
    assert ledger.can_ever_fit(300)  # after evicting the idle model
    assert not ledger.can_ever_fit(301)
    assert ledger.shortfall(300) == 200


def test_snapshot_reports_per_model_and_per_class() -> None:
    ledger = MemoryLedger(budget_bytes=10 * MIB, headroom_bytes=MIB)
    ledger.add_model("vit", "vision", 2 * MIB)
    ledger.reserve("j1", "inspect", MIB, model="vit")
    ledger.reserve("j2", "inspect", MIB, model="vit")
    ledger.reserve("j3", "qa", 3 * MIB)
    snap = ledger.snapshot()
    assert snap["used_bytes"] == 7 * MIB and snap["reserved_bytes"] == 5 * MIB
    assert snap["jobs_by_class"] == {"inspect": 2 * MIB, "qa": 3 * MIB}
    assert snap["models"]["vit"] == {"branch": "vision", "bytes": 2 * MIB, "active_jobs": 2}


def test_thousands_of_random_concurrent_operations_never_exceed_the_budget() -> None:
    """Four threads reserve, release, load and evict at random; the ledger's own check
    (an assertion inside every admission) and the peak both stay within capacity."""
    ledger = MemoryLedger(budget_bytes=64 * MIB, headroom_bytes=4 * MIB)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[Reservation] = []
        models: list[str] = []
        try:
            for step in range(2500):
                op = rng.random()
                if op < 0.5:
                    res = ledger.reserve(
                        f"w{seed}-{step}", rng.choice(["ocr", "inspect", "qa"]), rng.randint(0, 20 * MIB)
                    )
                    if res is not None:
                        held.append(res)
                elif op < 0.85 and held:
                    ledger.release(held.pop(rng.randrange(len(held))))
                elif op < 0.93:
                    name = f"m{seed}-{step}"
                    if ledger.add_model(name, "vision", rng.randint(MIB, 16 * MIB), keep_alive_s=0):
                        models.append(name)
                elif models:
                    ledger.remove_model(models.pop(0))
                assert ledger.used_bytes() <= ledger.capacity_bytes
        except BaseException as err:  # surfaced in the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert 0 < ledger.stats.peak_bytes <= ledger.capacity_bytes
    assert ledger.stats.refusals > 0  # the load was heavy enough to be refused at times
