"""How busy the event loop is: the time it spends waiting for I/O, measured in its selector."""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Any


class TimedSelector(selectors.DefaultSelector):
    """The platform's default selector, adding up the seconds spent waiting in ``select``.

    A loop that never waits is saturated: everything it has to do (gRPC accepts new calls one per
    loop turn) waits behind everything else. :class:`tally_server.domain.leases.StallClock` reads
    ``idle_s`` to stop lease time while that is so.
    """

    def __init__(self) -> None:
        super().__init__()
        self.idle_s = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        """Wait for I/O like the default selector, adding the time waited to ``idle_s``."""
        started = time.perf_counter()
        try:
            return super().select(timeout)
        finally:
            self.idle_s += time.perf_counter() - started


def new_event_loop() -> tuple[asyncio.AbstractEventLoop, TimedSelector]:
    """An event loop whose idle time is measured."""
    selector = TimedSelector()
    return asyncio.SelectorEventLoop(selector), selector
