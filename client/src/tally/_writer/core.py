"""The writer's state machine: decisions only. No threads, no sleeps, no I/O; time from a clock.

:class:`WriterCore` holds everything a writer knows (the bounded buffer, the batch in flight, the
flush barrier's counters, the lease, the health counters) and answers the questions its drivers
ask: what to send next and when, what a failure means, whether a barrier is reached, when the next
heartbeat is due. The drivers (``threaded.Writer``, ``aio.AsyncWriter``) own the lock, the waiting
and the transport; they call the core under their lock and wake their waiters afterwards.

Ordering: batches are numbered in the order ``apply_deltas`` accepted their deltas. One is on the
wire at a time, or up to ``max_batches_in_flight`` when the coordinator allows it: each is then
sent as ``ordered``, and the coordinator applies it only after the one numbered before it, in
whatever order they arrive. A failed batch is resent unchanged, under its first ``batch_seq``,
alone and before any later batch, so the coordinator sees deltas in exactly the order
``apply_deltas`` accepted them. Any prefix of that stream is a state the coordinator could have
seen anyway, which is why it is always safe to stop sending at a batch boundary but never safe to
skip a batch and go on: a lost ``+1`` can make a count reach zero early, a false completion.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tally import _calls as calls
from tally import _words
from tally._config import ClientConfig
from tally._retry import RetryPolicy
from tally._types import Delta, OpenedWriter, WriterHealth
from tally._writer.lease import Lease
from tally._writer.support import (
    describe,
    fresh,
    lease_lost_error,
    log_batch_refused,
    log_opened,
    log_retry,
    warn_dropped,
    warn_overflow,
)
from tally.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LeaseLost,
    NotFound,
    TallyError,
    Unavailable,
)

logger = logging.getLogger("tally._writer")


class Phase(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(eq=False)
class Batch:
    """Deltas sent in one ApplyDeltas call; ``seq`` stays the same however often it is resent."""

    seq: int
    deltas: list[Delta]
    # Sent as ordered: it may be on the wire together with the batch before it.
    ordered: bool = False
    sending: bool = False  # out on the wire: its answer will wake the sender
    resend_at: float | None = None  # failed: resend it (alone, once those before it are answered)
    answer: calls.BatchAnswer | None = None  # answered while one before it was not yet


@dataclass(frozen=True)
class Wait:
    """Nothing to do now: ask again after ``seconds``, or when woken (None)."""

    seconds: float | None


class WriterCore:
    """One writer's state and the decisions its drivers act on.

    Args:
        writer_id: The id the writer asks for (the coordinator may confirm another at open).
        checkpoint: The checkpoint it writes to.
        config: Batch size, buffer bound, linger, timeout and backoff.
        clock: Monotonic seconds; the only source of time.
        policy: Backoff; defaults to the config's, with jitter.
    """

    def __init__(
        self,
        writer_id: str,
        checkpoint: str,
        config: ClientConfig,
        clock: Callable[[], float],
        policy: RetryPolicy | None = None,
    ) -> None:
        self.requested_id = writer_id
        self.checkpoint = checkpoint
        self.config = config
        self.clock = clock
        self.policy = policy or RetryPolicy(config.retry_initial_s, config.retry_max_s)
        self.phase = Phase.NEW
        self.opened: OpenedWriter | None = None
        self.lease = Lease(lambda: self.writer_id, config.timeout, clock, self.policy)
        self.pending: deque[Delta] = deque()
        # Batches taken from ``pending`` and not yet answered in order, lowest ``seq`` first (one
        # answered while one before it was not stays here until that one is answered).
        self.window: deque[Batch] = deque()
        self._oldest_at: float | None = None  # when the oldest pending delta was accepted
        self.accepted = 0  # deltas accepted so far
        self._taken = 0  # deltas moved into batches
        self.done = 0  # deltas acknowledged or discarded: the flush barrier's counter
        # ``done`` when the latest answer said the writer was settled (everything applied durable),
        # else -1: a flush whose barrier this covers needs no Flush call.
        self._settled_done = -1
        self.refused = 0  # deltas the coordinator refused: another writer held their source
        self._flush_target = 0  # the sender skips lingering until _taken reaches this
        self._next_seq = 1
        self._accepting = True
        self.stopping = False  # background loops must stop
        # False once a keep-alive crossed this writer's close (``heartbeat_failed``): beats stop.
        self._beating = True
        # The sender waits for a time that ends within flush_interval_s (set by a sender that
        # waits so): it looks at the buffer by then on its own, so a delta put in an empty buffer
        # need not wake it, as it must when the sender waits for a wake-up only.
        self.sender_looks_soon = False
        self.stop_error: TallyError | None = None
        self.lease_lost = False
        self.last_error: str | None = None
        self.batches_sent = 0
        self.retries = 0
        self.dropped = 0
        self._send_failures = 0  # consecutive; drives the backoff
        self._overflow_warned = False
        self._drop_warned = False
        self.close_outcome: object = None  # the CloseResult or TallyError of the first close()
        # The latest cursor of each source not yet saved on the coordinator (flush and close send
        # them); an entry goes once the value saved is still the latest.
        self.cursors: dict[str, bytes] = {}

    # ------------------------------------------------------------------ identity and health

    @property
    def writer_id(self) -> str:
        return self.opened.writer_id if self.opened and self.opened.writer_id else self.requested_id

    @property
    def handle(self) -> str | None:
        return self.opened.handle if self.opened else None

    def buffered(self) -> int:
        return len(self.pending) + sum(len(b.deltas) for b in self.window if b.answer is None)

    def in_flight_limit(self) -> int:
        """How many batches may be on the wire at once: the config's, within the coordinator's."""
        allowed = self.opened.max_batches_in_flight if self.opened is not None else 1
        return max(1, min(self.config.max_batches_in_flight, allowed))

    def health(self) -> WriterHealth:
        return WriterHealth(
            open=self.phase is Phase.OPEN and not self.lease_lost,
            lease_lost=self.lease_lost,
            last_error=self.last_error,
            buffered=self.buffered(),
            batches_sent=self.batches_sent,
            retries=self.retries,
            dropped=self.dropped,
            refused=self.refused,
        )

    # ------------------------------------------------------------------ producers

    def accept(self, items: Sequence[Delta], start: int, may_wait: bool) -> tuple[int, bool]:
        """Buffer ``items[start:]`` as far as there is room.

        Returns the index of the first item not taken (``len(items)`` when all were taken or
        dropped; less only when the caller may wait for room and should call again once woken),
        and whether the sender has something new to decide about.
        """
        i, n, wake = start, len(items), False
        while i < n:
            if not self._accepting:
                self._drop_late(n - i)
                return n, wake
            room = self.config.max_buffered - len(self.pending)
            if room <= 0:
                if may_wait and self.phase is Phase.OPEN:
                    return i, True  # the sender must drain: wake it
                # Before open() nothing drains the buffer, and an event-loop caller must not
                # block the loop the sender runs on: exceed the bound rather than drop.
                room = n - i
                self._warn_overflow()
            chunk = items[i : i + room]
            was_empty = not self.pending
            if was_empty:
                self._oldest_at = self.clock()
            self.pending.extend(chunk)
            self.accepted += len(chunk)
            i += len(chunk)
            # Wake the sender only when it has something new to decide about, and would not
            # look in time on its own.
            wake = (
                wake
                or (was_empty and not self.sender_looks_soon)
                or len(self.pending) >= self.config.max_batch
            )
        return n, wake

    def refuse_call(self, err: InvalidArgument) -> None:
        """An ``apply_deltas`` call was unreadable: the writer stops accepting (earlier deltas go)."""
        logger.error(
            "tally writer %s refused an apply_deltas call: %s; it stops accepting deltas and "
            "flush()/close() will raise this error",
            self.writer_id,
            err.message,
        )
        self.last_error = describe(err)
        self._stop(err, discard=False)

    def _warn_overflow(self) -> None:
        if self._overflow_warned:
            return
        self._overflow_warned = True
        warn_overflow(self.writer_id, self.config.max_buffered, before_open=self.phase is Phase.NEW)

    def _drop_late(self, count: int) -> None:
        self.dropped += count
        if not self._drop_warned:
            self._drop_warned = True
            warn_dropped(self.writer_id, count, self.stop_error.message if self.stop_error else "")

    def _stop(self, err: TallyError, *, discard: bool) -> None:
        if self.stop_error is None or isinstance(err, LeaseLost):
            self.stop_error = err
        self._accepting = False
        if discard:
            lost = self.buffered()
            # Batches answered while one before them was not are applied: not dropped, but done.
            self.done += lost + sum(len(b.deltas) for b in self.window if b.answer is not None)
            self.pending.clear()
            self.window.clear()
            self._oldest_at = None
            self.dropped += lost
        # Everything after this is an exit: background loops stop at their next question.

    # ------------------------------------------------------------------ the sender

    def next_send(self) -> Batch | Wait | None:
        """The batch to send now, how long to wait before asking again, or None: stop sending."""
        if self.stopping:
            return None
        now = self.clock()
        window = self.window
        on_wire = sum(1 for b in window if b.sending)
        if any(b.resend_at is not None for b in window):
            # A failed batch goes again alone, once every batch out has its answer: then the first
            # one not answered is a failed one, and nothing sent after it can pass it.
            if on_wire:
                return Wait(None)
            first = next(b for b in window if b.answer is None)
            assert first.resend_at is not None
            if now < first.resend_at:
                return Wait(first.resend_at - now)
            first.resend_at = None
            first.sending = True
            return first  # the same batch, the same seq
        limit = self.in_flight_limit()
        if on_wire >= limit or not self.pending:
            return Wait(None)  # an answer will wake us
        oldest = self._oldest_at if self._oldest_at is not None else now
        ready = (
            len(self.pending) >= self.config.max_batch
            or self._flush_target > self._taken
            or now - oldest >= self.config.flush_interval_s
        )
        if not ready:
            return Wait(oldest + self.config.flush_interval_s - now)
        count = min(self.config.max_batch, len(self.pending))
        batch = Batch(self._next_seq, [self.pending.popleft() for _ in range(count)], ordered=limit > 1)
        batch.sending = True
        self._next_seq += 1
        self._taken += count
        window.append(batch)
        if not self.pending:
            self._oldest_at = None
        # Leftovers keep the old timestamp: they are at least that old, so they go out next.
        return batch

    def _current(self, batch: Batch) -> bool:
        """Whether ``batch`` is still waiting for its answer (not discarded meanwhile)."""
        return batch.answer is None and any(b is batch for b in self.window)

    def batch_ok(self, batch: Batch, answer: calls.BatchAnswer) -> list[Batch] | None:
        """Its answer came: the batches now done, in the order the coordinator applied them.

        That is ``[]`` when one sent before it is still unanswered (the two answers may come back
        in either order), and None if the batch was discarded meanwhile (lease lost).
        """
        if not self._current(batch):
            return None
        batch.sending = False
        batch.answer = answer
        self.batches_sent += 1
        window = self.window
        done_now: list[Batch] = []
        # Batches apply in order: an answered batch is done once every one before it is, and the
        # latest of those says whether the writer was settled when it applied.
        while window and window[0].answer is not None:
            done = window.popleft()
            done_now.append(done)
            self.done += len(done.deltas)
            self._settled_done = self.done if done.answer is not None and done.answer.settled else -1
        if answer.refused:
            self.refused += answer.refused
            logger.warning(
                "tally writer %s: the coordinator refused %s of batch %d: another live writer holds "
                "a claim on %s (acquire sources before working on them)",
                self.writer_id,
                _words.count(answer.refused, "delta"),
                batch.seq,
                "its source" if answer.refused == 1 else "their sources",
            )
        if self._send_failures:
            logger.info(
                "tally writer %s: coordinator reachable again; batch %d delivered after %s",
                self.writer_id,
                batch.seq,
                _words.count(self._send_failures, "retry", "retries"),
            )
            self._send_failures = 0
        return done_now

    def batch_interrupted(self, batch: Batch) -> None:
        """The thread sending ``batch`` was interrupted before its answer: send it again now."""
        if self._current(batch):
            batch.sending = False
            batch.resend_at = self.clock()

    def batch_failed(self, batch: Batch, err: TallyError) -> None:
        """A failed batch: resent after a backoff (Unavailable), a lost lease, or a stop."""
        if not self._current(batch):
            return
        batch.sending = False
        self.last_error = describe(err)
        if isinstance(err, Unavailable):
            if self.stopping:
                return
            self.retries += 1
            self._send_failures += 1
            delay = self.policy.delay(self._send_failures)
            batch.resend_at = self.clock() + delay
            log_retry(self.writer_id, batch.seq, len(batch.deltas), self._send_failures, delay, err)
            return
        if isinstance(err, NotFound):
            self.lose_lease(err, "sending deltas")
            return
        # Skipping this batch and sending later ones could fake a completion, so the writer
        # stops: this batch and everything after it are dropped, earlier ones were applied.
        log_batch_refused(self.writer_id, batch.seq, err, self.buffered())
        self._stop(err, discard=True)

    def lose_lease(self, err: TallyError, during: str) -> LeaseLost:
        """The coordinator no longer knows this writer: drop the buffer, stop the loops."""
        if not self.lease_lost:
            self.lease_lost = True
            self.last_error = describe(err)
            lost = lease_lost_error(self.writer_id, self.checkpoint, err, during, self.buffered())
            self._stop(lost, discard=True)
            self.stopping = True
            self.drop_cursors("lease lost")
        assert isinstance(self.stop_error, LeaseLost)
        return self.stop_error

    def crashed(self, name: str, exc: BaseException) -> None:
        """A background loop died of a bug; stop visibly so flush()/close() raise, never hang."""
        logger.error("tally writer %s: background %s crashed", self.writer_id, name, exc_info=exc)
        self.last_error = f"INTERNAL: {name} crashed: {exc!r}"
        self._stop(Internal(f"tally writer {self.writer_id!r}: {name} crashed: {exc!r}"), discard=True)
        self.stopping = True

    # ------------------------------------------------------------------ cursors

    def save_cursor(self, source_id: str, data: bytes) -> None:
        """Buffer ``data`` (checked already) as the latest cursor of ``source_id``."""
        if self.phase in (Phase.CLOSING, Phase.CLOSED):
            raise FailedPrecondition(
                f"tally writer {self.writer_id!r} is closed; save_cursor() is not possible"
            )
        self.cursors[source_id] = data

    def pending_cursors(self) -> list[tuple[str, bytes]]:
        return list(self.cursors.items())

    def cursors_saved(self, sent: Sequence[tuple[str, bytes]]) -> None:
        """``sent`` is durable: forget each cursor not replaced since it was sent."""
        for source_id, data in sent:
            if self.cursors.get(source_id) == data:
                del self.cursors[source_id]

    def cursors_refused(self, sent: Sequence[tuple[str, bytes]], err: TallyError) -> None:
        """The coordinator refused ``sent`` (not a lost connection): resending would fail again."""
        self.last_error = describe(err)
        logger.error(
            "tally writer %s: the coordinator refused %s (%s); %s dropped",
            self.writer_id,
            _words.count(len(sent), "cursor"),
            err.message,
            "it is" if len(sent) == 1 else "they are",
        )
        self.cursors_saved(sent)

    def drop_cursors(self, why: str) -> None:
        if self.cursors:
            logger.warning(
                "tally writer %s: %s; %s not saved (%s from %s last saved cursor)",
                self.writer_id,
                why,
                _words.count(len(self.cursors), "cursor"),
                "its source resumes" if len(self.cursors) == 1 else "those sources resume",
                "its" if len(self.cursors) == 1 else "their",
            )
            self.cursors.clear()

    # ------------------------------------------------------------------ heartbeats

    def next_heartbeat(self) -> float | None:
        """Seconds until the next keep-alive is due (0: now), or None: heartbeats stop."""
        return None if self.stopping or not self._beating else self.lease.due_in()

    def heartbeat_ok(self, ttl: float) -> None:
        self.lease.renewed(ttl)

    def heartbeat_failed(self, err: TallyError) -> None:
        if self.stopping:
            return
        if isinstance(err, NotFound) and self.phase is Phase.CLOSING:
            # A keep-alive that crossed this writer's close: the close ended the session on the
            # coordinator, so the writer is unknown there now. No lease was lost; had it been,
            # the close's own calls (its last batches, CloseWriter) say so. Beats stop here.
            self._beating = False
            return
        self.last_error = describe(err)
        if isinstance(err, NotFound):
            self.lose_lease(err, "renewing its lease")
        else:
            self.lease.renewal_failed(err)

    # ------------------------------------------------------------------ open, flush, close

    def begin_open(self) -> bool:
        """True if an open is needed, False if already open."""
        if self.phase is Phase.OPEN:
            return False
        if self.phase is not Phase.NEW:
            raise FailedPrecondition(
                f"tally writer {self.writer_id!r} is closed; create a new one with client.writer(...)"
            )
        return True

    def open_done(self, opened: OpenedWriter) -> None:
        self.opened = opened
        self.phase = Phase.OPEN
        self.lease.granted(opened.lease_ttl_s)
        log_opened(opened, self.checkpoint, self.config.flush_interval_s)

    def apply_call(self, handle: str, batch: Batch) -> calls.ApplyDeltas:
        """The call that sends ``batch``: as columns when the coordinator said it reads them."""
        columns = self.opened is not None and self.opened.delta_columns
        return calls.ApplyDeltas(handle, batch.deltas, batch.seq, columns=columns, ordered=batch.ordered)

    def require_handle(self, operation: str) -> str:
        if self.phase is Phase.NEW or self.opened is None:
            raise FailedPrecondition(
                f"tally writer {self.writer_id!r} is not open; call open() or use it as a context "
                f"manager before {operation}()"
            )
        if self.phase is Phase.CLOSED:
            raise FailedPrecondition(
                f"tally writer {self.writer_id!r} is closed; {operation}() is not possible"
            )
        return self.opened.handle

    def begin_flush(self) -> int:
        """The barrier's target: every delta accepted so far; the sender stops lingering until then."""
        self._flush_target = max(self._flush_target, self.accepted)
        return self.accepted

    def barrier_reached(self, target: int) -> bool:
        return self.done >= target or self.lease_lost

    def settled_through(self, target: int) -> bool:
        """Whether the latest answer said every delta up to ``target`` is durable already.

        Then the flush ends there; otherwise it asks the coordinator (Flush), which waits for
        settling sources and commits in flight.
        """
        return self._settled_done >= target and self.stop_error is None

    def raise_if_stopped(self) -> None:
        if self.stop_error is not None:
            raise fresh(self.stop_error)

    def barrier_timeout(self, target: int, timeout: float, operation: str) -> Unavailable:
        return Unavailable(
            f"tally writer {self.writer_id!r}: {operation} timed out after {timeout:g}s with "
            f"{_words.count(target - self.done, 'delta')} not yet acknowledged by the coordinator "
            f"(last error: {self.last_error})"
        )

    def begin_close(self) -> str | None:
        """Stop accepting deltas; returns the handle, or None if the writer never opened."""
        if self.phase is Phase.NEW:
            if self.pending:
                logger.warning(
                    "tally writer %s closed unopened; discarding %s",
                    self.writer_id,
                    _words.count(len(self.pending), "delta"),
                )
                self._stop(FailedPrecondition("writer closed before it was opened"), discard=True)
            self.drop_cursors("closed unopened")
            return None
        self.phase = Phase.CLOSING
        self._accepting = False
        assert self.opened is not None
        return self.opened.handle

    def close_abandoned(self, target: int, timeout: float) -> Unavailable:
        """close() could not deliver the buffer in time: discard it (its sources replay)."""
        err = self.barrier_timeout(target, timeout, "close")
        logger.error(
            "tally writer %s: %s; discarding them (their sources replay next run)",
            self.writer_id,
            err.message,
        )
        self._stop(err, discard=True)
        self.drop_cursors("close timed out")
        return err

    def finish_close(self) -> None:
        self.phase = Phase.CLOSED
        self._accepting = False
        self.stopping = True
