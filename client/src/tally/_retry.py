"""Retry policy (no I/O), the two tiny loops that apply it, and the one send path per flavour.

Only :class:`tally.Unavailable` (connection failures, timeouts, UNAVAILABLE) is retried: every
other status means the request itself was refused and resending it cannot help. Whether a call may
be retried at all is its description's business (``Call.retry``). A refused connection to a
coordinator that never answered is not retried either (``tally._transport.contact``): nothing runs
there. The first retry of a call logs a warning naming the coordinator, so a caller that waits
knows what for.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from tally._transport.contact import NeverReached
from tally.errors import Unavailable

if TYPE_CHECKING:
    from tally._calls import Call
    from tally._transport.base import AsyncTransport, Transport

T = TypeVar("T")

logger = logging.getLogger(__name__)

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


def _timed_out(err: Unavailable, first: Unavailable, what: str, deadline: Deadline) -> Unavailable:
    """The error of a call out of time: the last attempt's, and the first one's when it differs.

    The last attempt often fails only because the time ran out (a connect or handshake cut short),
    while the first says what is wrong (a refused certificate, a coordinator that went away).
    """
    message = f"{what}: no answer within {deadline.timeout:g}s; last error: {err.message}"
    if first.message != err.message:
        message += f"; first error: {first.message}"
    return Unavailable(message, err.code, err.details)


def _retrying(err: Unavailable, what: str, deadline: Deadline) -> None:
    logger.warning("%s: %s; retrying for up to %.0fs", what, err.message, deadline.remaining())


# A floor for the per-attempt timeout: a zero timeout would fail without even trying.
_MIN_ATTEMPT_S = 0.001


def call_with_retry(fn: Callable[[float], T], policy: RetryPolicy, deadline: Deadline, what: str) -> T:
    """Call ``fn(timeout)`` until it succeeds, raises a non-retryable error, or the deadline passes.

    Raises:
        Unavailable: The deadline passed; the message names the operation and the last error.
    """
    attempt = 0
    first: Unavailable | None = None
    while True:
        try:
            return fn(max(deadline.remaining(), _MIN_ATTEMPT_S))
        except NeverReached:
            raise
        except Unavailable as err:
            attempt += 1
            first = first or err
            delay = policy.delay(attempt)
            if deadline.remaining() <= delay:
                raise _timed_out(err, first, what, deadline) from None
            if attempt == 1:
                _retrying(err, what, deadline)
            time.sleep(delay)


async def async_call_with_retry(
    fn: Callable[[float], Awaitable[T]], policy: RetryPolicy, deadline: Deadline, what: str
) -> T:
    """asyncio twin of :func:`call_with_retry`."""
    attempt = 0
    first: Unavailable | None = None
    while True:
        try:
            return await fn(max(deadline.remaining(), _MIN_ATTEMPT_S))
        except NeverReached:
            raise
        except Unavailable as err:
            attempt += 1
            first = first or err
            delay = policy.delay(attempt)
            if deadline.remaining() <= delay:
                raise _timed_out(err, first, what, deadline) from None
            if attempt == 1:
                _retrying(err, what, deadline)
            await asyncio.sleep(delay)


def send(transport: Transport, call: Call[T], policy: RetryPolicy, deadline: Deadline) -> T:
    """Send ``call`` within ``deadline``: the blocking flavour's one way to call the coordinator.

    Raises:
        Unavailable: The deadline passed (retryable calls), or the one attempt failed.
        TallyError: The coordinator refused the call.
    """
    if not call.retry:
        return transport.send(call, max(deadline.remaining(), _MIN_ATTEMPT_S))
    return call_with_retry(lambda timeout: transport.send(call, timeout), policy, deadline, call.what)


async def async_send(transport: AsyncTransport, call: Call[T], policy: RetryPolicy, deadline: Deadline) -> T:
    """asyncio twin of :func:`send`."""
    if not call.retry:
        return await transport.send(call, max(deadline.remaining(), _MIN_ATTEMPT_S))
    return await async_call_with_retry(
        lambda timeout: transport.send(call, timeout), policy, deadline, call.what
    )
