"""Lease time: a clock that runs only while the coordinator could have heard a heartbeat (issue 7.6).

A writer's lease is renewed by its heartbeats. While the coordinator's event loop is stalled (the
process stopped, swapped out, a long computation) or saturated (a read storm keeps it busy without
a pause; gRPC then accepts new calls, heartbeats included, only one per loop turn), heartbeats wait
unheard in socket buffers. Measuring their age on the wall clock would expire healthy writers for
the server's own slowness. :class:`StallClock` counts only the time the coordinator had room to
listen: it pauses during stalls and slows down while the loop is saturated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from tally_server.domain.checkpoint import WriterSession, WriterState

S = TypeVar("S", bound=WriterSession)

# Below this busy fraction of the loop, lease time runs at full speed; above it, it slows down
# linearly and stops at 100 % busy.
SATURATED = 0.8


class StallClock:
    """Monotonic seconds that advance only while the coordinator can listen.

    The loop calls :meth:`tick` every ``tick_s`` or so. A gap between two ticks longer than
    ``max_step_s`` (the loop could not run at all) counts as ``max_step_s``. Of the rest, a fraction
    counts that falls from 1 to 0 as the busiest event loop's busy fraction (time not spent waiting
    for I/O, as told by ``idle``, each loop's cumulative idle seconds) goes from
    :data:`SATURATED` to 1.

    Args:
        clock: the real monotonic clock.
        idle: per event loop that hears heartbeats, its cumulative seconds waiting for I/O.
        max_step_s: the most one gap between ticks may count.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        idle: Sequence[Callable[[], float]] = (),
        max_step_s: float = 0.5,
    ) -> None:
        self._clock = clock
        self._idle = list(idle)
        self.max_step_s = max_step_s
        self._last_tick = clock()
        self._last_idle = [source() for source in self._idle]
        self._counted = 0.0
        self.paused_s = 0.0  # total time not counted, for metrics and logs

    def now(self) -> float:
        """Lease time now: counted time plus the real time since the last tick, at most one step."""
        return self._counted + min(self._clock() - self._last_tick, self.max_step_s)

    def tick(self) -> float:
        """Advance; returns the seconds since the previous tick that did not count."""
        real = self._clock()
        gap = max(0.0, real - self._last_tick)
        step = min(gap, self.max_step_s)
        if self._idle and gap > 0:
            idle = [source() for source in self._idle]
            least_idle = min(now - before for now, before in zip(idle, self._last_idle, strict=True))
            busy = 1.0 - min(max(least_idle / gap, 0.0), 1.0)
            self._last_idle = idle
            if busy > SATURATED:
                step *= (1.0 - busy) / (1.0 - SATURATED)
        self._counted += step
        self._last_tick = real
        paused = gap - step
        self.paused_s += paused
        return paused


def expired(sessions: Iterable[S], now: float) -> list[S]:
    """Open writers whose lease deadline (on a :class:`StallClock`) has passed."""
    return [s for s in sessions if s.state == WriterState.OPEN and s.lease_deadline < now]
