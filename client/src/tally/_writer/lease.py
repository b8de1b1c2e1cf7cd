"""The writer's side of its lease: the TTL the coordinator granted and when to renew it. No I/O."""

from __future__ import annotations

import logging
from collections.abc import Callable

from tally._retry import RetryPolicy
from tally._writer.support import FALLBACK_HEARTBEAT_S, log_heartbeat_failed
from tally.errors import TallyError, Unavailable

logger = logging.getLogger("tally._writer")


class Lease:
    """Heartbeat schedule: every third of the TTL, sooner after a failure (never a lost lease:
    that is the core's decision, since it drops the writer's state)."""

    def __init__(
        self, writer_id: Callable[[], str], timeout: float, clock: Callable[[], float], policy: RetryPolicy
    ):
        self._writer_id = writer_id
        self._timeout = timeout
        self._clock = clock
        self._policy = policy
        self.ttl_s: float | None = None
        self._due: float | None = None  # None until granted
        self._failures = 0

    def granted(self, ttl_s: float) -> None:
        """The coordinator opened the writer with this TTL (0: it reported none)."""
        self.ttl_s = ttl_s if ttl_s > 0 else None
        self._due = self._clock() + self.interval()

    def interval(self) -> float:
        ttl = self.ttl_s
        return ttl / 3.0 if ttl and ttl > 0 else FALLBACK_HEARTBEAT_S

    def timeout(self) -> float:
        # A keep-alive that takes longer than a third of the TTL would miss its purpose.
        return min(self._timeout, self.interval())

    def due_in(self) -> float | None:
        """Seconds until the next keep-alive (0: now); None before the lease was granted."""
        return None if self._due is None else max(0.0, self._due - self._clock())

    def renewed(self, ttl_s: float) -> None:
        if ttl_s > 0:
            self.ttl_s = ttl_s
        if self._failures:
            logger.info("tally writer %s: heartbeat succeeded again", self._writer_id())
        self._failures = 0
        self._due = self._clock() + self.interval()

    def renewal_failed(self, err: TallyError) -> None:
        """A keep-alive failed without the coordinator forgetting the writer: try again."""
        self._failures += 1
        delay = self.interval()
        if isinstance(err, Unavailable):
            # Retry sooner than the period so one blip does not eat a third of the lease.
            delay = min(delay, self._policy.delay(self._failures))
        log_heartbeat_failed(self._writer_id(), err, delay, self.ttl_s)
        self._due = self._clock() + delay
