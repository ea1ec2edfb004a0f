"""The duplicate-identity watch on its own, with a clock the test moves."""

from __future__ import annotations

from edge.comms.identity import BACKOFF_FIRST_S, BACKOFF_MAX_S, QUIET_S, TAKEOVER_WINDOW_S, IdentityWatch


def _watch() -> tuple[IdentityWatch, list[float]]:
    clock = [1000.0]
    return IdentityWatch("press-7", "edge-press-7", clock=lambda: clock[0]), clock


def test_one_takeover_is_a_blip_and_takeovers_far_apart_never_alarm() -> None:
    watch, clock = _watch()
    for _ in range(5):
        assert watch.taken_over() is None
        clock[0] += TAKEOVER_WINDOW_S + 1
    assert watch.problem() is None and watch.snapshot()["takeovers"] == 5


def test_repeated_takeovers_alarm_back_off_longer_each_time_and_clear_when_quiet() -> None:
    watch, clock = _watch()
    assert watch.taken_over() is None
    clock[0] += 2
    assert watch.taken_over() == BACKOFF_FIRST_S
    problem = watch.problem()
    assert problem is not None and "client id 'edge-press-7'" in problem and "device id 'press-7'" in problem
    waits = []
    for _ in range(8):
        clock[0] += 20
        waits.append(watch.taken_over())
    assert waits[:3] == [2 * BACKOFF_FIRST_S, 4 * BACKOFF_FIRST_S, 8 * BACKOFF_FIRST_S] and waits[-1] == BACKOFF_MAX_S
    clock[0] += QUIET_S - 1
    assert watch.problem() is not None  # not quiet long enough yet
    clock[0] += 2
    assert watch.problem() is None and watch.snapshot()["backoff_s"] == 0
    assert watch.taken_over() is None  # a fresh start: one takeover is a blip again


def test_another_instances_notice_alarms_at_once() -> None:
    watch, _ = _watch()
    watch.foreign_notice("0123456789abcdef0123")
    problem = watch.problem()
    assert problem is not None and "announces itself as device 'press-7'" in problem and "0123456789abcdef" in problem
    assert watch.snapshot()["foreign_notices"] == 1
