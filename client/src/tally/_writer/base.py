"""What both writer flavours share around the core: its lock, the producers' side and the accessors.

One lock guards the core; its condition wakes the threaded sender and heartbeat, producers waiting
for room and flush waiters. The asyncio flavour also resolves event-loop futures through
``_wake()``. ``apply_deltas`` is the same function in both flavours: a producer may run on any
thread, and off the event loop it waits for room like the threaded one.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tally import _calls as calls
from tally._config import ClientConfig
from tally._retry import Deadline
from tally._trace import TraceRecorder
from tally._types import Claim, CloseResult, Delta, OpenedWriter, WriterHealth, WriterSpec
from tally._writer.core import Batch, WriterCore
from tally._writer.support import CLOSE_GRACE_S, fresh, validated
from tally.errors import InvalidArgument, TallyError

logger = logging.getLogger("tally._writer")


class WriterBase:
    """The no-I/O half of :class:`tally.Writer` and :class:`tally.AsyncWriter`."""

    def __init__(
        self,
        spec: WriterSpec,
        config: ClientConfig,
        clock: Callable[[], float] = time.monotonic,
        trace: TraceRecorder | None = None,
    ) -> None:
        self._spec = spec
        # Records every call to a JSONL file (client.writer(..., trace=PATH)); None: no trace, and
        # no cost beyond this one check per call.
        self._trace = trace
        self._config = config
        self._core = WriterCore(spec.writer_id, spec.checkpoint, config, clock)
        self._policy = self._core.policy
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._blocked = 0  # producers waiting for room

    # ------------------------------------------------------------------ hooks for the flavours

    def _may_block(self) -> bool:
        """Whether ``apply_deltas`` may wait for room in the calling context."""
        return True

    def _wake(self) -> None:
        """Wake asyncio waiters (the threading condition covers the threaded flavour)."""

    def _notify_locked(self) -> None:
        self._changed.notify_all()
        self._wake()

    # ------------------------------------------------------------------ public, no I/O

    @property
    def checkpoint(self) -> str:
        """The checkpoint this writer writes to."""
        return self._spec.checkpoint

    @property
    def writer_id(self) -> str:
        """The writer id (as confirmed by the coordinator once open)."""
        return self._core.writer_id

    @property
    def handle(self) -> str | None:
        """The session handle from the coordinator, or None before ``open()``."""
        return self._core.handle

    @property
    def completed_at_open(self) -> int | None:
        """Sources the checkpoint had completed when this writer opened, or None before ``open()``."""
        opened = self._core.opened
        return opened.completed_count if opened else None

    @property
    def lease_ttl_s(self) -> float | None:
        """The lease TTL granted by the coordinator, or None before ``open()``."""
        return self._core.lease.ttl_s

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
            items = validated(deltas)
        except InvalidArgument as err:
            self._refuse(err)
            return
        except Exception as exc:  # e.g. an iterator that raised: still never raise
            self._refuse(InvalidArgument(f"apply_deltas could not read its input: {exc!r}"))
            return
        if items:
            self._enqueue(items)
        elif self._trace is not None:
            self._trace.record("apply_deltas", per_task=[])

    def save_cursor(self, source_id: str, data: bytes) -> None:
        """Remember where this run got to inside a long source (a row or byte offset...). No I/O.

        The latest cursor of each source is buffered and saved on the coordinator by the next
        ``flush()`` (durable when it returns) or ``close()``; a flush that cannot reach the
        coordinator keeps them for the next one. A saved cursor survives coordinator restarts and
        writer changes, and goes when its source completes. Read it back with :meth:`cursor`.

        Args:
            source_id: The source, as in ``apply_deltas``.
            data: At most 4096 bytes, opaque to Tally (e.g. ``str(row).encode()``).

        Raises:
            TypeError: ``source_id`` is not a string or ``data`` is not bytes-like.
            ValueError: ``source_id`` is empty or ``data`` is longer than 4096 bytes.
            FailedPrecondition: The writer is closed.
        """
        value = calls.cursor_bytes(source_id, data)
        with self._lock:
            self._core.save_cursor(source_id, value)

    def _acquire_calls(self, source_ids: Iterable[str]) -> list[calls.Acquire]:
        ids = calls.acquire_ids(source_ids)
        with self._lock:
            handle = self._core.require_handle("acquire")
        return calls.acquire_calls(handle, ids, self.writer_id)

    def _failure_call(self, source_id: str, reason: str) -> calls.ReportFailure:
        calls.failure_source_id(source_id)
        calls.failure_reason(reason)
        with self._lock:
            handle = self._core.require_handle("report_failure")
        return calls.ReportFailure(handle, source_id, reason, self.writer_id, secrets.token_hex(16))

    def _setup_calls(self) -> list[calls.Call[Any]]:
        """Calls made before opening: the budget (``client.writer(..., max_attempts=n)``) and the
        declared sources (``expected_sources=``), if any."""
        spec = self._spec
        setup: list[calls.Call[Any]] = []
        if spec.max_attempts is not None:
            setup.append(calls.SetFailureBudget(spec.checkpoint, spec.max_attempts))
        if spec.expected_sources is not None:
            setup += calls.declare_calls(spec.checkpoint, spec.expected_sources)
        return setup

    def health(self) -> WriterHealth:
        """A snapshot of the writer's client-side state (no I/O).

        Returns:
            Whether it is open, whether the lease was lost, the last error, buffered deltas and
            the sender's counters.
        """
        with self._lock:
            return self._core.health()

    def __repr__(self) -> str:
        core = self._core
        return (
            f"{type(self).__name__}(checkpoint={self.checkpoint!r}, writer_id={self.writer_id!r}, "
            f"state={core.phase.value}{', lease lost' if core.lease_lost else ''})"
        )

    # ------------------------------------------------------------------ shared by both flavours

    def _refuse(self, err: InvalidArgument) -> None:
        if self._trace is not None:
            self._trace.record("apply_deltas", per_task=[], error=err.message)
        with self._lock:
            self._core.refuse_call(err)
            self._notify_locked()

    def _enqueue(self, items: list[Delta]) -> None:
        may_block = self._may_block()
        with self._lock:
            i = 0
            while True:
                start = i
                i, wake = self._core.accept(items, i, may_block)
                if self._trace is not None:
                    # Under the lock, as accepted: the trace holds the deltas in the order they are
                    # sent (a call that waited for room is one row per part taken).
                    self._trace_accepted(items, start, i)
                if wake:
                    self._notify_locked()
                if i >= len(items):
                    return
                self._blocked += 1
                try:
                    self._changed.wait()
                finally:
                    self._blocked -= 1

    # ------------------------------------------------------------------ the trace

    def _trace_accepted(self, items: list[Delta], start: int, end: int) -> None:
        assert self._trace is not None
        part = items if start == 0 and end == len(items) else items[start:end]
        if start:
            self._trace.record("apply_deltas", per_task=part, continued=True)
        else:
            self._trace.record("apply_deltas", per_task=part)

    def _trace_row(self, method: str, **fields: Any) -> None:
        """Record one row in the trace, if there is one (never raises)."""
        if self._trace is not None:
            self._trace.record(method, **fields)

    def _opened_locked(self, opened: OpenedWriter) -> None:
        self._core.open_done(opened)
        self._trace_row(
            "open",
            checkpoint=self.checkpoint,
            writer_id=opened.writer_id,
            completed_at_open=opened.completed_count,
            settle_ms=opened.settle_ms,
        )

    def _batch_ok_locked(self, batch: Batch, answer: calls.BatchAnswer) -> None:
        done = self._core.batch_ok(batch, answer)
        if done and self._trace is not None:
            # What the coordinator reported for each batch: it applies batches, not calls, and
            # names no sources, so this (not a per-call newly_completed) is its side of the trace.
            # Rows go in the order the batches were applied, which is not always the order their
            # answers came back in (two are on the wire at once); replay relies on it.
            for b in done:
                assert b.answer is not None
                self._trace.record(
                    "batch",
                    batch_seq=b.seq,
                    deltas=len(b.deltas),
                    counts=dataclasses.asdict(b.answer.counts),
                    refused=b.answer.refused,
                    settled=b.answer.settled,
                )

    def _trace_are_completed(self, ids: list[str], result: list[bool]) -> None:
        self._trace_row("are_completed", source_ids=ids, result=result)

    def _trace_acquire(self, claims: dict[str, Claim]) -> None:
        self._trace_row(
            "acquire",
            source_ids=list(claims),
            states=[claim.state for claim in claims.values()],
        )

    def _trace_close(self, outcome: CloseResult | TallyError) -> None:
        """The close row (the writer's totals as the coordinator reported them); ends the trace."""
        trace = self._trace
        if trace is None:
            return
        if isinstance(outcome, CloseResult):
            c = outcome.counts
            trace.record(
                "close",
                counts=dataclasses.asdict(c),
                incomplete_count=outcome.incomplete_count,
                incomplete_sources=list(outcome.incomplete_sources),
            )
        else:
            trace.record("close", error=outcome.message)
        trace.close()

    def _took_batch_locked(self) -> None:
        # Taking a batch made room in the buffer: producers waiting for it may go on.
        if self._blocked:
            self._notify_locked()

    def _background_crashed(self, name: str, exc: BaseException) -> None:
        # Only a bug gets here; stop visibly so flush()/close() raise instead of waiting forever.
        with self._lock:
            self._core.crashed(name, exc)
            self._notify_locked()

    def _open_ready(self) -> bool:
        with self._lock:
            return self._core.begin_open()

    def _cached_close(self) -> CloseResult | None:
        outcome = self._core.close_outcome
        if isinstance(outcome, TallyError):
            raise fresh(outcome)
        assert outcome is None or isinstance(outcome, CloseResult)
        return outcome

    def _timeout(self, timeout: float | None) -> float:
        return self._config.timeout if timeout is None else timeout

    def _close_grace(self) -> Deadline:
        return Deadline(min(self._config.timeout, CLOSE_GRACE_S))

    def _close_after_error_failed(self, close_err: TallyError) -> None:
        """Log a close that failed after the with-block raised (the block's error propagates)."""
        logger.error(
            "tally writer %s: close after an error in the with-block failed: %s", self.writer_id, close_err
        )
