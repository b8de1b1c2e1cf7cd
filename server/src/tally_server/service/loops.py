"""Background loops that never die: each step's failure is logged once per cause, counted and retried."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tally_server.logs import FailureLog

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class Loop:
    """Runs ``step`` every ``interval_s`` until cancelled.

    A step that raises is logged (the traceback once per distinct cause, then a reminder now and
    then), counted in ``errors`` and tried again at the next interval; while the latest step
    failed, ``failing`` holds the cause and the coordinator reports itself not ready.
    """

    def __init__(
        self,
        name: str,
        step: Callable[[], Awaitable[None]],
        interval_s: float,
        *,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self.errors = 0
        self._step = step
        self._sleep = sleep
        self._failures = FailureLog(log, f"the {name} loop")

    @property
    def failing(self) -> str | None:
        """The cause of the latest failure while steps keep failing; None once a step succeeds."""
        return self._failures.failing

    async def run(self) -> None:
        """Sleep, then run a step, until cancelled."""
        while True:
            await self._sleep(self.interval_s)
            await self.run_once()

    async def run_once(self) -> None:
        """Run one step; a failure is counted and logged (once per cause), never raised."""
        try:
            await self._step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.errors += 1
            self._failures.failed(exc)
        else:
            self._failures.succeeded()
