"""Writers: buffering, batching, background sending and heartbeats.

``_WriterBase`` holds everything that does no I/O and is shared by both flavours: the bounded
buffer, batch assembly and sequence numbers, the retry/backoff decisions, lease-loss and refusal
handling, the flush barrier bookkeeping and the health counters. :class:`Writer` (threads) and
:class:`AsyncWriter` (asyncio tasks) only add the loops that call the transport.

Ordering: one batch is in flight at a time and a failed batch is resent unchanged before any later
delta, so the coordinator sees deltas in exactly the order ``apply_deltas`` accepted them. Any
prefix of that stream is a state the coordinator could have seen anyway, which is why it is
always safe to stop sending at a batch boundary but never safe to skip a batch and go on: a lost
``+1`` can make a count reach zero early, a false completion.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import operator
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from tally._config import ClientConfig
from tally._ops import are_completed, async_are_completed
from tally._retry import Deadline, RetryPolicy, async_call_with_retry, call_with_retry
from tally._transport import AsyncTransport, Transport
from tally._types import ApplyCounts, CloseResult, Delta, OpenedWriter, WriterHealth, WriterSpec
from tally.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LeaseLost,
    NotFound,
    TallyError,
    Unavailable,
)

logger = logging.getLogger(__name__)

# Heartbeat period when the server reported no lease TTL.
_FALLBACK_HEARTBEAT_S = 10.0
# After close() gave up delivering the buffer, this long more (at most the client's timeout) is
# spent telling the coordinator the writer is gone, so that its id is free now and not only when
# the lease runs out.
_CLOSE_GRACE_S = 5.0


class _Phase(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass
class _Batch:
    seq: int
    deltas: list[Delta]


def _validated(deltas: Iterable[Delta]) -> list[Delta]:
    try:
        items = list(deltas)
    except TypeError:
        raise InvalidArgument(f"apply_deltas expects a list of tuples, got {type(deltas).__name__}") from None
    out: list[Delta] = []
    for i, item in enumerate(items):
        try:
            task_id, source_id, raw = item
            # operator.index accepts numpy integers but not floats; bool is an int we refuse.
            delta = operator.index(raw)
            ok = isinstance(task_id, str) and isinstance(source_id, str) and not isinstance(raw, bool)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidArgument(
                f"deltas[{i}] = {item!r} is not a (task_id: str, source_id: str, delta: int) tuple"
            )
        out.append((task_id, source_id, delta))
    return out


def _as_tally_error(exc: Exception) -> TallyError:
    if isinstance(exc, TallyError):
        return exc
    # A transport must raise TallyError only; anything else is a bug, but it must still stop the
    # writer visibly instead of killing the sender and leaving flush() waiting forever.
    logger.error("unexpected error from the Tally transport", exc_info=exc)
    return Internal(f"unexpected error in the Tally client transport: {exc!r}")


def _fresh(err: TallyError) -> TallyError:
    # Re-raising one stored instance from several calls would pile up tracebacks on it.
    return type(err)(err.message, err.code, err.details)


class _WriterBase:
    """The no-I/O core shared by :class:`Writer` and :class:`AsyncWriter`."""

    def __init__(
        self, spec: WriterSpec, config: ClientConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._spec = spec
        self._config = config
        self._policy = RetryPolicy(config.retry_initial_s, config.retry_max_s)
        self._clock = clock
        # One lock guards all state below; the condition wakes the sync sender, blocked producers
        # and flush waiters. The asyncio flavour also resolves loop futures through _wake().
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._phase = _Phase.NEW
        self._opened: OpenedWriter | None = None
        self._lease_ttl_s: float | None = None
        self._pending: deque[Delta] = deque()
        self._inflight: _Batch | None = None
        self._oldest_at: float | None = None  # when the oldest pending delta was accepted
        self._accepted = 0  # deltas accepted so far
        self._taken = 0  # deltas moved into batches
        self._done = 0  # deltas acknowledged or discarded: the flush barrier's counter
        self._flush_target = 0  # the sender skips lingering until _taken reaches this
        self._next_seq = 1
        self._accepting = True
        self._io_exit = False  # background loops must stop
        self._stop_error: TallyError | None = None
        self._lease_lost = False
        self._last_error: str | None = None
        self._batches_sent = 0
        self._retries = 0
        self._dropped = 0
        self._send_failures = 0  # consecutive; drives the backoff
        self._heartbeat_failures = 0
        self._blocked = 0  # producers waiting for room
        self._overflow_warned = False
        self._drop_warned = False
        self._close_outcome: CloseResult | TallyError | None = None

    # ------------------------------------------------------------------ hooks for the I/O flavours

    def _may_block(self) -> bool:
        """Whether ``apply_deltas`` may wait for room in the calling context."""
        return True

    def _wake(self) -> None:
        """Wake asyncio waiters (the threading condition covers the sync flavour)."""

    def _signal_io_exit(self) -> None:
        """Interrupt the background loops' timed waits (heartbeat period, backoff)."""

    # ------------------------------------------------------------------ public, no I/O

    @property
    def checkpoint(self) -> str:
        """The checkpoint this writer writes to."""
        return self._spec.checkpoint

    @property
    def writer_id(self) -> str:
        """The writer id (as confirmed by the coordinator once open)."""
        return self._opened.writer_id if self._opened and self._opened.writer_id else self._spec.writer_id

    @property
    def handle(self) -> str | None:
        """The session handle from the coordinator, or None before ``open()``."""
        return self._opened.handle if self._opened else None

    @property
    def completed_at_open(self) -> int | None:
        """Sources the checkpoint had completed when this writer opened, or None before ``open()``."""
        return self._opened.completed_count if self._opened else None

    @property
    def lease_ttl_s(self) -> float | None:
        """The lease TTL granted by the coordinator, or None before ``open()``."""
        return self._lease_ttl_s

    def apply_deltas(self, deltas: Iterable[Delta]) -> None:
        """Queue ``(task_id, source_id, delta)`` tuples for the coordinator. Never raises.

        The deltas are appended to a bounded buffer and sent in order by the background sender,
        in batches, retried while the coordinator is unreachable. When the buffer is full this
        call waits for room: deltas are never dropped while the writer is healthy, because a lost
        delta could make a source look complete too early. Problems surface through the log,
        :meth:`health` and the next ``flush()`` / ``close()``.

        Args:
            deltas: ``(task_id, source_id, delta)`` tuples, in the order they happened.
        """
        try:
            items = _validated(deltas)
        except InvalidArgument as err:
            with self._lock:
                self._refuse_call_locked(err)
            return
        except Exception as exc:  # e.g. an iterator that raised: still never raise
            with self._lock:
                self._refuse_call_locked(InvalidArgument(f"apply_deltas could not read its input: {exc!r}"))
            return
        if items:
            self._enqueue(items)

    def health(self) -> WriterHealth:
        """A snapshot of the writer's client-side state (no I/O).

        Returns:
            Whether it is open, whether the lease was lost, the last error, buffered deltas and
            the sender's counters.
        """
        with self._lock:
            return WriterHealth(
                open=self._phase is _Phase.OPEN and not self._lease_lost,
                lease_lost=self._lease_lost,
                last_error=self._last_error,
                buffered=self._buffered_locked(),
                batches_sent=self._batches_sent,
                retries=self._retries,
                dropped=self._dropped,
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(checkpoint={self.checkpoint!r}, writer_id={self.writer_id!r}, "
            f"state={self._phase.value}{', lease lost' if self._lease_lost else ''})"
        )

    # ------------------------------------------------------------------ buffering

    def _buffered_locked(self) -> int:
        return len(self._pending) + (len(self._inflight.deltas) if self._inflight else 0)

    def _enqueue(self, items: list[Delta]) -> None:
        may_block = self._may_block()
        with self._lock:
            i, n = 0, len(items)
            while i < n:
                if not self._accepting:
                    self._drop_late_locked(n - i)
                    break
                room = self._config.max_buffered - len(self._pending)
                if room <= 0:
                    if may_block and self._phase is _Phase.OPEN:
                        self._blocked += 1
                        self._notify_locked()
                        try:
                            self._changed.wait()
                        finally:
                            self._blocked -= 1
                        continue
                    # Before open() nothing drains the buffer, and an event-loop caller must not
                    # block the loop the sender runs on: exceed the bound rather than drop.
                    room = n - i
                    self._warn_overflow_locked()
                chunk = items[i : i + room]
                was_empty = not self._pending
                if was_empty:
                    self._oldest_at = self._clock()
                self._pending.extend(chunk)
                self._accepted += len(chunk)
                i += len(chunk)
                # Wake the sender only when it has something new to decide about.
                if was_empty or len(self._pending) >= self._config.max_batch:
                    self._notify_locked()

    def _notify_locked(self) -> None:
        self._changed.notify_all()
        self._wake()

    def _warn_overflow_locked(self) -> None:
        if self._overflow_warned:
            return
        self._overflow_warned = True
        if self._phase is _Phase.NEW:
            reason = "the writer is not open yet, so nothing drains it; open it before applying deltas"
        else:
            reason = "apply_deltas on the event loop cannot wait for room; await flush() for back-pressure"
        logger.warning(
            "tally writer %s buffers more than max_buffered=%d deltas: %s",
            self.writer_id,
            self._config.max_buffered,
            reason,
        )

    def _drop_late_locked(self, count: int) -> None:
        self._dropped += count
        if not self._drop_warned:
            self._drop_warned = True
            why = self._stop_error.message if self._stop_error else "the writer is closed"
            logger.warning(
                "tally writer %s discards %d deltas given to apply_deltas after it stopped (%s); "
                "further discards are counted in health().dropped",
                self.writer_id,
                count,
                why,
            )

    def _refuse_call_locked(self, err: InvalidArgument) -> None:
        # Deltas accepted before this call are still sent (a prefix of the stream is safe); this
        # call and everything after it are not, so the writer stops accepting.
        logger.error(
            "tally writer %s refused an apply_deltas call: %s; the writer stops accepting deltas "
            "and flush()/close() will raise this error",
            self.writer_id,
            err.message,
        )
        self._last_error = f"{err.code.value}: {err.message}"
        self._stop_locked(err, discard=False)

    def _stop_locked(self, err: TallyError, *, discard: bool) -> None:
        if self._stop_error is None or isinstance(err, LeaseLost):
            self._stop_error = err
        self._accepting = False
        if discard:
            lost = self._buffered_locked()
            self._pending.clear()
            self._inflight = None
            self._oldest_at = None
            self._done += lost
            self._dropped += lost
        self._notify_locked()

    # ------------------------------------------------------------------ the sender's decisions

    def _take_batch_locked(self) -> tuple[_Batch | None, float | None]:
        """The next batch to send, or (None, seconds to wait; None = until woken)."""
        if not self._pending or self._io_exit:
            return None, None
        now = self._clock()
        oldest = self._oldest_at if self._oldest_at is not None else now
        ready = (
            len(self._pending) >= self._config.max_batch
            or self._flush_target > self._taken
            or now - oldest >= self._config.flush_interval_s
        )
        if not ready:
            return None, oldest + self._config.flush_interval_s - now
        count = min(self._config.max_batch, len(self._pending))
        batch = _Batch(self._next_seq, [self._pending.popleft() for _ in range(count)])
        self._next_seq += 1
        self._taken += count
        self._inflight = batch
        if not self._pending:
            self._oldest_at = None
        # Leftovers keep the old timestamp: they are at least that old, so they go out next.
        if self._blocked:
            self._notify_locked()
        return batch, None

    def _batch_ok_locked(self, batch: _Batch, counts: ApplyCounts) -> None:
        if self._inflight is not batch:  # discarded meanwhile (lease lost)
            return
        self._inflight = None
        self._done += len(batch.deltas)
        self._batches_sent += 1
        if self._send_failures:
            logger.info(
                "tally writer %s: coordinator reachable again; batch %d delivered after %d retries",
                self.writer_id,
                batch.seq,
                self._send_failures,
            )
            self._send_failures = 0
        self._notify_locked()

    def _batch_failed_locked(self, batch: _Batch, err: TallyError) -> float | None:
        """Decide what a failed batch means: seconds until the resend, or None to give it up."""
        if self._inflight is not batch:
            return None
        self._last_error = f"{err.code.value}: {err.message}"
        if isinstance(err, Unavailable):
            if self._io_exit:
                return None
            self._retries += 1
            self._send_failures += 1
            delay = self._policy.delay(self._send_failures)
            log = logger.warning if self._send_failures == 1 else logger.debug
            log(
                "tally writer %s: batch %d (%d deltas) not delivered, retry %d in %.2fs: %s",
                self.writer_id,
                batch.seq,
                len(batch.deltas),
                self._send_failures,
                delay,
                err.message,
            )
            return delay
        if isinstance(err, NotFound):
            self._lose_lease_locked(err, "sending deltas")
            return None
        # Skipping this batch and sending later ones could fake a completion, so the writer
        # stops: this batch and everything after it are dropped, earlier ones were applied.
        logger.error(
            "tally writer %s: the coordinator refused batch %d (%s: %s); the writer stops sending "
            "and discards %d buffered deltas (their sources replay on the next run); "
            "flush()/close() will raise this error",
            self.writer_id,
            batch.seq,
            err.code.value,
            err.message,
            self._buffered_locked(),
        )
        self._stop_locked(err, discard=True)
        return None

    def _lose_lease_locked(self, err: TallyError, during: str) -> LeaseLost:
        if not self._lease_lost:
            self._lease_lost = True
            self._last_error = f"{err.code.value}: {err.message}"
            buffered = self._buffered_locked()
            logger.error(
                "tally writer %s lost its lease on checkpoint %r (the coordinator answered %s while %s: "
                "%s); discarding %d buffered deltas. Its pending counts are gone, so its unfinished "
                "sources replay on the next run",
                self.writer_id,
                self.checkpoint,
                err.code.value,
                during,
                err.message,
                buffered,
            )
            lost = LeaseLost(
                f"tally writer {self.writer_id!r} lost its lease on checkpoint {self.checkpoint!r}: the "
                f"coordinator no longer knows it ({err.message}). {buffered} buffered deltas were "
                "discarded; unfinished sources replay on the next run. Open a new writer to continue.",
                details=err.details,
            )
            self._stop_locked(lost, discard=True)
            self._io_exit = True
            self._signal_io_exit()
            self._notify_locked()
        assert isinstance(self._stop_error, LeaseLost)
        return self._stop_error

    def _background_crashed(self, name: str, exc: BaseException) -> None:
        # Only a bug gets here; stop visibly so flush()/close() raise instead of waiting forever.
        logger.error("tally writer %s: background %s crashed", self.writer_id, name, exc_info=exc)
        with self._lock:
            self._last_error = f"INTERNAL: {name} crashed: {exc!r}"
            self._stop_locked(
                Internal(f"tally writer {self.writer_id!r}: {name} crashed: {exc!r}"), discard=True
            )
            self._io_exit = True
            self._signal_io_exit()
            self._notify_locked()

    # ------------------------------------------------------------------ heartbeat decisions

    def _heartbeat_interval(self) -> float:
        ttl = self._lease_ttl_s
        return ttl / 3.0 if ttl and ttl > 0 else _FALLBACK_HEARTBEAT_S

    def _heartbeat_timeout(self) -> float:
        # A keep-alive that takes longer than a third of the TTL would miss its purpose.
        return min(self._config.timeout, self._heartbeat_interval())

    def _heartbeat_ok_locked(self, ttl: float) -> None:
        if ttl > 0:
            self._lease_ttl_s = ttl
        if self._heartbeat_failures:
            logger.info("tally writer %s: heartbeat succeeded again", self.writer_id)
        self._heartbeat_failures = 0

    def _heartbeat_failed_locked(self, err: TallyError) -> float | None:
        """Seconds until the next heartbeat, or None when heartbeats must stop."""
        if self._io_exit:
            return None
        self._last_error = f"{err.code.value}: {err.message}"
        if isinstance(err, NotFound):
            self._lose_lease_locked(err, "renewing its lease")
            return None
        self._heartbeat_failures += 1
        if isinstance(err, Unavailable):
            # Retry sooner than the period so one blip does not eat a third of the lease.
            delay = min(self._heartbeat_interval(), self._policy.delay(self._heartbeat_failures))
            logger.warning(
                "tally writer %s: heartbeat failed (%s), retrying in %.2fs; the lease expires %.0fs "
                "after the last successful one",
                self.writer_id,
                err.message,
                delay,
                self._lease_ttl_s or 0.0,
            )
            return delay
        logger.error(
            "tally writer %s: heartbeat refused: %s: %s", self.writer_id, err.code.value, err.message
        )
        return self._heartbeat_interval()

    # ------------------------------------------------------------------ lifecycle decisions

    def _begin_open_locked(self) -> bool:
        """True if an open is needed, False if already open."""
        if self._phase is _Phase.OPEN:
            return False
        if self._phase is not _Phase.NEW:
            raise FailedPrecondition(
                f"tally writer {self.writer_id!r} is closed; create a new one with client.writer(...)"
            )
        return True

    def _opened_locked(self, opened: OpenedWriter) -> None:
        self._opened = opened
        self._lease_ttl_s = opened.lease_ttl_s if opened.lease_ttl_s > 0 else None
        self._phase = _Phase.OPEN
        settle_s = opened.settle_ms / 1000.0
        if settle_s > 0 and self._config.flush_interval_s > settle_s / 2:
            logger.warning(
                "tally writer %s: flush_interval_s=%.3f is not well below the coordinator's settle "
                "window of %d ms; deltas of one source may arrive after its count touched zero",
                self.writer_id,
                self._config.flush_interval_s,
                opened.settle_ms,
            )
        logger.debug(
            "tally writer %s opened on checkpoint %r (lease %.1fs, %d sources already completed)",
            opened.writer_id,
            self.checkpoint,
            opened.lease_ttl_s,
            opened.completed_count,
        )
        self._notify_locked()

    def _require_handle_locked(self, operation: str) -> str:
        if self._phase is _Phase.NEW or self._opened is None:
            raise FailedPrecondition(
                f"tally writer {self.writer_id!r} is not open; call open() or use it as a context "
                f"manager before {operation}()"
            )
        if self._phase is _Phase.CLOSED:
            raise FailedPrecondition(
                f"tally writer {self.writer_id!r} is closed; {operation}() is not possible"
            )
        return self._opened.handle

    def _begin_flush_locked(self) -> int:
        target = self._accepted
        if target > self._flush_target:
            self._flush_target = target
            self._notify_locked()
        return target

    def _barrier_reached_locked(self, target: int) -> bool:
        return self._done >= target or self._lease_lost

    def _raise_if_stopped_locked(self) -> None:
        if self._stop_error is not None:
            raise _fresh(self._stop_error)

    def _barrier_timeout_locked(self, target: int, deadline: Deadline, operation: str) -> Unavailable:
        missing = target - self._done
        return Unavailable(
            f"tally writer {self.writer_id!r}: {operation} timed out after {deadline.timeout:g}s with "
            f"{missing} deltas not yet acknowledged by the coordinator (last error: {self._last_error})"
        )

    def _begin_close_locked(self) -> str | None:
        """Stop accepting deltas; returns the handle, or None if the writer never opened."""
        if self._phase is _Phase.NEW:
            if self._pending:
                logger.warning(
                    "tally writer %s closed without being opened; discarding %d buffered deltas",
                    self.writer_id,
                    len(self._pending),
                )
                self._stop_locked(FailedPrecondition("writer closed before it was opened"), discard=True)
            return None
        self._phase = _Phase.CLOSING
        self._accepting = False
        assert self._opened is not None
        return self._opened.handle

    def _close_abandoned_locked(self, target: int, deadline: Deadline) -> Unavailable:
        err = self._barrier_timeout_locked(target, deadline, "close")
        logger.error(
            "tally writer %s: %s; discarding them (their sources replay on the next run)",
            self.writer_id,
            err.message,
        )
        self._stop_locked(err, discard=True)
        return err

    def _close_grace(self) -> Deadline:
        return Deadline(min(self._config.timeout, _CLOSE_GRACE_S))

    def _close_anyway_failed(self, err: TallyError) -> None:
        if isinstance(err, NotFound):
            return  # the coordinator had already let it go
        logger.warning(
            "tally writer %s: could not close it on the coordinator either (%s); it stays live there "
            "until its lease expires",
            self.writer_id,
            err,
        )

    def _finish_close_locked(self) -> None:
        self._phase = _Phase.CLOSED
        self._accepting = False
        self._io_exit = True
        self._signal_io_exit()
        self._notify_locked()

    def _cached_close(self) -> CloseResult | None:
        outcome = self._close_outcome
        if isinstance(outcome, TallyError):
            raise _fresh(outcome)
        return outcome

    def _timeout(self, timeout: float | None) -> float:
        return self._config.timeout if timeout is None else timeout


class Writer(_WriterBase):
    """A writer of one checkpoint, driven by a background sender thread and a heartbeat thread.

    Create it with :meth:`tally.Client.writer` and use it as a context manager::

        with client.writer("curation/run-42") as w:
            w.apply_deltas([(task_id, source_id, +1)])
            w.flush()
    """

    def __init__(self, transport: Transport, spec: WriterSpec, config: ClientConfig) -> None:
        """Create an unopened writer (prefer :meth:`tally.Client.writer`)."""
        super().__init__(spec, config)
        self._transport = transport
        self._io_stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lifecycle = threading.Lock()  # serializes open() and close()

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        # The body failed: still deliver what it reported (that progress is real), but never let a
        # close error hide the body's exception.
        try:
            self.close()
        except TallyError as close_err:
            logger.error(
                "tally writer %s: close after an error in the with-block failed: %s",
                self.writer_id,
                close_err,
            )

    def open(self) -> None:
        """Register the writer with the coordinator and start the background threads.

        Idempotent while open. Connection failures are retried within the client's timeout.

        Raises:
            AlreadyExists: A writer with this id is live on the checkpoint.
            FailedPrecondition: Fingerprint mismatch, or the writer was closed.
            Unavailable: The coordinator could not be reached within the timeout.
        """
        with self._lifecycle:
            with self._lock:
                if not self._begin_open_locked():
                    return
            opened = call_with_retry(
                lambda t: self._transport.open_writer(self._spec, t),
                self._policy,
                Deadline(self._config.timeout),
                f"open writer {self._spec.writer_id!r} on checkpoint {self.checkpoint!r}",
            )
            with self._lock:
                self._opened_locked(opened)
            for name, loop in (("sender", self._send_loop), ("heartbeat", self._heartbeat_loop)):
                thread = threading.Thread(
                    target=self._guarded,
                    args=(name, loop),
                    name=f"tally-{name}-{self.writer_id}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def are_completed(self, ids: Iterable[str]) -> list[bool]:
        """Which of ``ids`` the checkpoint has completed (live, across all writers).

        Args:
            ids: Source ids.

        Returns:
            One bool per id, in order.

        Raises:
            Unavailable: No answer within the client's timeout.
        """
        return are_completed(self._transport, self._policy, self._config.timeout, self.checkpoint, ids)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every delta given before this call is applied and its completions are durable.

        Args:
            timeout: Seconds to wait; defaults to the client's timeout.

        Raises:
            LeaseLost: The coordinator dropped this writer.
            InvalidArgument: A batch (or an ``apply_deltas`` call) was refused; the writer stopped.
            Unavailable: Not done within the timeout; the sender keeps retrying in the background.
        """
        deadline = Deadline(self._timeout(timeout))
        with self._lock:
            handle = self._require_handle_locked("flush")
            target = self._begin_flush_locked()
            if not self._changed.wait_for(lambda: self._barrier_reached_locked(target), deadline.remaining()):
                raise self._barrier_timeout_locked(target, deadline, "flush")
            self._raise_if_stopped_locked()
        try:
            call_with_retry(
                lambda t: self._transport.flush(handle, t),
                self._policy,
                deadline,
                f"flush writer {self.writer_id!r}",
            )
        except NotFound as err:
            with self._lock:
                raise _fresh(self._lose_lease_locked(err, "flushing")) from None

    def close(self, timeout: float | None = None) -> CloseResult:
        """Deliver buffered deltas, close the writer on the coordinator and stop the threads.

        Idempotent: later calls return the first call's result (or raise its error).

        Args:
            timeout: Seconds for delivering the buffer and closing; defaults to the client's timeout.

        Returns:
            The writer's totals and the sources it left incomplete.

        Raises:
            LeaseLost: The coordinator dropped this writer before it closed.
            InvalidArgument: A batch was refused earlier (the writer is closed nevertheless).
            Unavailable: The buffer could not be delivered in time. It was discarded (its sources
                replay on the next run), and the writer is still closed on the coordinator if it
                answers within a few more seconds, so that its id is free at once.
        """
        with self._lifecycle:
            cached = self._cached_close()
            if cached is not None:
                return cached
            try:
                result = self._close(Deadline(self._timeout(timeout)))
            except TallyError as err:
                self._close_outcome = err
                raise
            finally:
                self._stop_threads()
            self._close_outcome = result
            return result

    def _close(self, deadline: Deadline) -> CloseResult:
        with self._lock:
            handle = self._begin_close_locked()
            if handle is None:
                return CloseResult()
            target = self._begin_flush_locked()
            abandoned = None
            if not self._changed.wait_for(lambda: self._barrier_reached_locked(target), deadline.remaining()):
                abandoned = self._close_abandoned_locked(target, deadline)
            elif self._lease_lost:
                self._raise_if_stopped_locked()
            refused = self._stop_error
        if abandoned is not None:
            self._close_anyway(handle)
            raise abandoned
        try:
            result = call_with_retry(
                lambda t: self._transport.close_writer(handle, t),
                self._policy,
                deadline,
                f"close writer {self.writer_id!r}",
            )
        except NotFound as err:
            with self._lock:
                raise _fresh(self._lose_lease_locked(err, "closing")) from None
        if refused is not None:
            raise _fresh(refused)
        return result

    def _close_anyway(self, handle: str) -> None:
        """Best effort CloseWriter after the buffer could not be delivered (see ``_CLOSE_GRACE_S``)."""
        try:
            call_with_retry(
                lambda t: self._transport.close_writer(handle, t),
                self._policy,
                self._close_grace(),
                f"close writer {self.writer_id!r}",
            )
        except TallyError as err:
            self._close_anyway_failed(err)

    def _signal_io_exit(self) -> None:
        self._io_stop.set()

    def _guarded(self, name: str, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:
            self._background_crashed(name, exc)

    def _stop_threads(self) -> None:
        with self._lock:
            self._finish_close_locked()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(self._config.timeout)
                if thread.is_alive():
                    logger.warning("tally writer %s: %s did not stop in time", self.writer_id, thread.name)
        self._threads.clear()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._io_exit:
                        return
                    batch, wait = self._take_batch_locked()
                    if batch is not None:
                        break
                    self._changed.wait(wait)
            self._send(batch)

    def _send(self, batch: _Batch) -> None:
        handle = self.handle
        assert handle is not None
        while True:
            try:
                counts = self._transport.apply_deltas(handle, batch.deltas, batch.seq, self._config.timeout)
            except Exception as exc:
                with self._lock:
                    delay = self._batch_failed_locked(batch, _as_tally_error(exc))
                if delay is None or self._io_stop.wait(delay):
                    return
            else:
                with self._lock:
                    self._batch_ok_locked(batch, counts)
                return

    def _heartbeat_loop(self) -> None:
        handle = self.handle
        assert handle is not None
        wait: float | None = self._heartbeat_interval()
        while wait is not None and not self._io_stop.wait(wait):
            try:
                ttl = self._transport.keep_alive(handle, self._heartbeat_timeout())
            except Exception as exc:
                with self._lock:
                    wait = self._heartbeat_failed_locked(_as_tally_error(exc))
            else:
                with self._lock:
                    self._heartbeat_ok_locked(ttl)
                    wait = None if self._io_exit else self._heartbeat_interval()


class AsyncWriter(_WriterBase):
    """asyncio flavour of :class:`Writer`: the sender and heartbeat run as tasks on the event loop.

    ``apply_deltas`` stays a plain call. On the event loop it cannot wait for room without
    blocking the sender it waits for, so there the buffer may exceed ``max_buffered`` (a warning is
    logged once) rather than drop deltas; ``await flush()`` is the back-pressure point. Called from
    another thread it waits for room like the sync writer.
    """

    def __init__(self, transport: AsyncTransport, spec: WriterSpec, config: ClientConfig) -> None:
        """Create an unopened writer (prefer :meth:`tally.AsyncClient.writer`)."""
        super().__init__(spec, config)
        self._transport = transport
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._waiters: list[asyncio.Future[None]] = []  # touched only on the loop thread
        self._tasks: list[asyncio.Task[None]] = []
        self._lifecycle = asyncio.Lock()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.close()
            return
        try:
            await self.close()
        except TallyError as close_err:
            logger.error(
                "tally writer %s: close after an error in the with-block failed: %s",
                self.writer_id,
                close_err,
            )

    def _may_block(self) -> bool:
        return threading.get_ident() != self._loop_thread

    def _wake(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._wake_waiters()
            return
        try:
            loop.call_soon_threadsafe(self._wake_waiters)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            pass

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _new_waiter(self) -> asyncio.Future[None]:
        # Registered before the waiter checks its condition, so a wake-up that lands between the
        # check and the await is not lost. (A shared asyncio.Event cleared by one task can swallow
        # another task's wake-up.)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    async def _await_waiter(self, waiter: asyncio.Future[None], timeout: float | None) -> None:
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            self._drop_waiter(waiter)

    def _drop_waiter(self, waiter: asyncio.Future[None]) -> None:
        # A wake-up may already have taken it off the list.
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    async def _wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            waiter = self._new_waiter()
            with self._lock:
                done = predicate()
            remaining = None if deadline is None else deadline - time.monotonic()
            if done or (remaining is not None and remaining <= 0):
                self._drop_waiter(waiter)
                return done
            await self._await_waiter(waiter, remaining)

    async def open(self) -> None:
        """Register the writer with the coordinator and start the background tasks.

        See :meth:`Writer.open`.
        """
        async with self._lifecycle:
            with self._lock:
                if not self._begin_open_locked():
                    return
            opened = await async_call_with_retry(
                lambda t: self._transport.open_writer(self._spec, t),
                self._policy,
                Deadline(self._config.timeout),
                f"open writer {self._spec.writer_id!r} on checkpoint {self.checkpoint!r}",
            )
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            with self._lock:
                self._opened_locked(opened)
            self._tasks = [
                asyncio.create_task(self._send_loop(), name=f"tally-sender-{self.writer_id}"),
                asyncio.create_task(self._heartbeat_loop(), name=f"tally-heartbeat-{self.writer_id}"),
            ]
            for task in self._tasks:
                task.add_done_callback(self._task_done)

    async def are_completed(self, ids: Iterable[str]) -> list[bool]:
        """Which of ``ids`` the checkpoint has completed. See :meth:`Writer.are_completed`."""
        return await async_are_completed(
            self._transport, self._policy, self._config.timeout, self.checkpoint, ids
        )

    async def flush(self, timeout: float | None = None) -> None:
        """Barrier over everything applied so far. See :meth:`Writer.flush`."""
        deadline = Deadline(self._timeout(timeout))
        with self._lock:
            handle = self._require_handle_locked("flush")
            target = self._begin_flush_locked()
        if not await self._wait_until(lambda: self._barrier_reached_locked(target), deadline.remaining()):
            with self._lock:
                raise self._barrier_timeout_locked(target, deadline, "flush")
        with self._lock:
            self._raise_if_stopped_locked()
        try:
            await async_call_with_retry(
                lambda t: self._transport.flush(handle, t),
                self._policy,
                deadline,
                f"flush writer {self.writer_id!r}",
            )
        except NotFound as err:
            with self._lock:
                raise _fresh(self._lose_lease_locked(err, "flushing")) from None

    async def close(self, timeout: float | None = None) -> CloseResult:
        """Deliver buffered deltas, close on the coordinator, stop the tasks. See :meth:`Writer.close`."""
        async with self._lifecycle:
            cached = self._cached_close()
            if cached is not None:
                return cached
            try:
                result = await self._close(Deadline(self._timeout(timeout)))
            except TallyError as err:
                self._close_outcome = err
                raise
            finally:
                await self._stop_tasks()
            self._close_outcome = result
            return result

    async def _close(self, deadline: Deadline) -> CloseResult:
        with self._lock:
            handle = self._begin_close_locked()
            if handle is None:
                return CloseResult()
            target = self._begin_flush_locked()
        if not await self._wait_until(lambda: self._barrier_reached_locked(target), deadline.remaining()):
            with self._lock:
                abandoned = self._close_abandoned_locked(target, deadline)
            await self._close_anyway(handle)
            raise abandoned
        with self._lock:
            if self._lease_lost:
                self._raise_if_stopped_locked()
            refused = self._stop_error
        try:
            result = await async_call_with_retry(
                lambda t: self._transport.close_writer(handle, t),
                self._policy,
                deadline,
                f"close writer {self.writer_id!r}",
            )
        except NotFound as err:
            with self._lock:
                raise _fresh(self._lose_lease_locked(err, "closing")) from None
        if refused is not None:
            raise _fresh(refused)
        return result

    async def _close_anyway(self, handle: str) -> None:
        """Best effort CloseWriter after the buffer could not be delivered (see ``_CLOSE_GRACE_S``)."""
        try:
            await async_call_with_retry(
                lambda t: self._transport.close_writer(handle, t),
                self._policy,
                self._close_grace(),
                f"close writer {self.writer_id!r}",
            )
        except TallyError as err:
            self._close_anyway_failed(err)

    async def _stop_tasks(self) -> None:
        with self._lock:
            self._finish_close_locked()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._background_crashed(task.get_name(), exc)

    async def _send_loop(self) -> None:
        while True:
            waiter = self._new_waiter()
            with self._lock:
                if self._io_exit:
                    return
                batch, wait = self._take_batch_locked()
            if batch is None:
                await self._await_waiter(waiter, wait)
            else:
                self._drop_waiter(waiter)
                await self._send(batch)

    async def _send(self, batch: _Batch) -> None:
        handle = self.handle
        assert handle is not None
        while True:
            try:
                counts = await self._transport.apply_deltas(
                    handle, batch.deltas, batch.seq, self._config.timeout
                )
            except Exception as exc:
                with self._lock:
                    delay = self._batch_failed_locked(batch, _as_tally_error(exc))
                if delay is None:
                    return
                await asyncio.sleep(delay)
            else:
                with self._lock:
                    self._batch_ok_locked(batch, counts)
                return

    async def _heartbeat_loop(self) -> None:
        handle = self.handle
        assert handle is not None
        wait: float | None = self._heartbeat_interval()
        while wait is not None:
            await asyncio.sleep(wait)
            if self._io_exit:
                return
            try:
                ttl = await self._transport.keep_alive(handle, self._heartbeat_timeout())
            except Exception as exc:
                with self._lock:
                    wait = self._heartbeat_failed_locked(_as_tally_error(exc))
            else:
                with self._lock:
                    self._heartbeat_ok_locked(ttl)
                    wait = None if self._io_exit else self._heartbeat_interval()


def default_writer_id() -> str:
    """NeMo Curator's writer id: ``<hostname>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"
