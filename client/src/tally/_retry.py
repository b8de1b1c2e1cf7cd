"""Retry policy (no I/O) and the two tiny loops that apply it, blocking and asyncio.

Only :class:`tally.Unavailable` (connection failures, timeouts, UNAVAILABLE) is retried: every
other status means the request itself was refused and resending it cannot help.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tally.errors import Unavailable

T = TypeVar("T")

# Attempts beyond this no longer grow the delay; it also keeps the power below float overflow.
_MAX_EXPONENT = 32


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter.

    Jitter takes up to ``jitter`` of each delay away so that many writers that lost the same
    coordinator do not reconnect in lock-step.
    """

    initial_s: float
    max_s: float
    multiplier: float = 2.0
    jitter: float = 0.2

    def delay(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based)."""
        exponent = min(max(attempt, 1) - 1, _MAX_EXPONENT)
        base = min(self.max_s, self.initial_s * self.multiplier**exponent)
        return base * (1.0 - self.jitter * random.random())


class Deadline:
    """A point in monotonic time by which an operation must finish."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._at = time.monotonic() + timeout

    def remaining(self) -> float:
        return max(0.0, self._at - time.monotonic())


def _timed_out(err: Unavailable, what: str, deadline: Deadline) -> Unavailable:
    return Unavailable(
        f"{what}: no answer within {deadline.timeout:g}s; last error: {err.message}", err.code, err.details
    )


# A floor for the per-attempt timeout: a zero timeout would fail without even trying.
_MIN_ATTEMPT_S = 0.001


def call_with_retry(fn: Callable[[float], T], policy: RetryPolicy, deadline: Deadline, what: str) -> T:
    """Call ``fn(timeout)`` until it succeeds, raises a non-retryable error, or the deadline passes.

    Raises:
        Unavailable: The deadline passed; the message names the operation and the last error.
    """
    attempt = 0
    while True:
        try:
            return fn(max(deadline.remaining(), _MIN_ATTEMPT_S))
        except Unavailable as err:
            attempt += 1
            delay = policy.delay(attempt)
            if deadline.remaining() <= delay:
                raise _timed_out(err, what, deadline) from None
            time.sleep(delay)


async def async_call_with_retry(
    fn: Callable[[float], Awaitable[T]], policy: RetryPolicy, deadline: Deadline, what: str
) -> T:
    """asyncio twin of :func:`call_with_retry`."""
    attempt = 0
    while True:
        try:
            return await fn(max(deadline.remaining(), _MIN_ATTEMPT_S))
        except Unavailable as err:
            attempt += 1
            delay = policy.delay(attempt)
            if deadline.remaining() <= delay:
                raise _timed_out(err, what, deadline) from None
            await asyncio.sleep(delay)
