"""The lease clock: pauses while the coordinator could not run, slows while it is saturated."""

from __future__ import annotations

import pytest

from tally_server.domain.leases import StallClock


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.idle = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_runs_normally_while_the_loop_ticks_on_time() -> None:
    clock = Clock()
    lease = StallClock(clock, max_step_s=0.5)
    start = lease.now()
    for _ in range(50):
        clock.now += 0.1
        assert lease.tick() == 0.0
    assert lease.now() - start == pytest.approx(5.0)


def test_a_stall_counts_as_one_step_at_most() -> None:
    clock = Clock()
    lease = StallClock(clock, max_step_s=0.5)
    start = lease.now()
    clock.now += 30.0  # the process was stopped for 30 s
    assert lease.now() - start == pytest.approx(0.5)  # even before the tick notices
    assert lease.tick() == pytest.approx(29.5)
    assert lease.now() - start == pytest.approx(0.5)
    assert lease.paused_s == pytest.approx(29.5)


def test_time_slows_while_the_loop_is_saturated_and_stops_at_full_load() -> None:
    clock = Clock()
    lease = StallClock(clock, idle=[lambda: clock.idle], max_step_s=0.5)
    start = lease.now()
    clock.now += 0.1
    clock.idle += 0.05  # half busy: full speed
    lease.tick()
    assert lease.now() - start == pytest.approx(0.1)
    clock.now += 0.1
    clock.idle += 0.01  # 90 % busy: half speed
    lease.tick()
    assert lease.now() - start == pytest.approx(0.15)
    clock.now += 0.1  # 100 % busy: lease time stands still
    lease.tick()
    assert lease.now() - start == pytest.approx(0.15)


def test_the_busiest_loop_decides() -> None:
    clock = Clock()
    quiet = [0.0]
    lease = StallClock(clock, idle=[lambda: clock.idle, lambda: quiet[0]], max_step_s=0.5)
    start = lease.now()
    clock.now += 0.1
    clock.idle += 0.1  # the first loop waits the whole time, the second never does
    lease.tick()
    assert lease.now() - start == pytest.approx(0.0)
