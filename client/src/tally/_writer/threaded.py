"""The blocking writer: the core driven by a sender thread and a heartbeat thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Self, TypeVar

from tally import _calls as calls
from tally._config import ClientConfig
from tally._retry import Deadline, send
from tally._trace import TraceRecorder
from tally._transport.base import Transport
from tally._types import Claim, CloseResult, FailureReport, WriterSpec
from tally._writer.base import WriterBase
from tally._writer.core import Batch, Wait
from tally._writer.support import as_tally_error, fresh, log_close_anyway_failed
from tally.errors import InvalidArgument, LeaseLost, NotFound, TallyError

logger = logging.getLogger("tally._writer")

T = TypeVar("T")


class Writer(WriterBase):
    """A writer of one checkpoint, driven by a background sender thread and a heartbeat thread.

    Create it with :meth:`tally.Client.writer` and use it as a context manager::

        with client.writer("curation/run-42") as w:
            w.apply_deltas([(task_id, source_id, +1)])
            w.flush()
    """

    def __init__(
        self, transport: Transport, spec: WriterSpec, config: ClientConfig, trace: TraceRecorder | None = None
    ) -> None:
        """Create an unopened writer (prefer :meth:`tally.Client.writer`)."""
        super().__init__(spec, config, trace=trace)
        self._transport = transport
        self._threads: list[threading.Thread] = []
        # The background threads wait on conditions of their own (on the same lock), so that a
        # change only they care about wakes only them, and flush waiters do not wake them: each
        # wake-up is a thread switch, as long as a small call's own work.
        self._sending = threading.Condition(self._lock)  # the sender: something to send or stop
        self._beating = threading.Condition(self._lock)  # the heartbeat: only to stop
        self._lifecycle = threading.Lock()  # serializes open() and close()
        # One SaveCursors at a time: an older value must never land after a newer one.
        self._cursor_send = threading.Lock()

    def _wake(self) -> None:
        self._sending.notify_all()
        if self._core.stopping:  # the heartbeat's schedule changes only when it renews or stops
            self._beating.notify_all()

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
            self._close_after_error_failed(close_err)

    def open(self) -> None:
        """Register the writer with the coordinator and start the background threads.

        Idempotent while open. Connection failures are retried within the client's timeout.

        Raises:
            AlreadyExists: A writer with this id is live on the checkpoint.
            FailedPrecondition: Fingerprint mismatch, or the writer was closed.
            Unavailable: The coordinator could not be reached within the timeout.
        """
        with self._lifecycle:
            if not self._open_ready():
                return
            # Each call its own timeout: a big declaration is many calls.
            for setup in self._setup_calls():
                self._call(setup, Deadline(self._config.timeout))
            opened = self._call(calls.OpenWriter(self._spec), Deadline(self._config.timeout))
            with self._lock:
                self._opened_locked(opened)
                self._notify_locked()
            # One sender thread per batch allowed on the wire at once.
            senders = [(f"sender{i or ''}", self._send_loop) for i in range(self._core.in_flight_limit())]
            for name, loop in (*senders, ("heartbeat", self._heartbeat_loop)):
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
        if self._trace is not None:
            ids = list(ids)
        plan = calls.are_completed(self.checkpoint, ids)
        done = calls.drive(plan, lambda call: self._call(call, Deadline(self._config.timeout)))
        if self._trace is not None:
            self._trace_are_completed(list(ids), done)
        return done

    def declare(self, ids: Iterable[str] | None = None, *, count: int | None = None) -> int:
        """Declare the checkpoint's sources (or how many there are): see :meth:`tally.Client.declare`.

        Returns:
            The checkpoint's declared total afterwards.
        """
        plan = calls.declare_plan(self.checkpoint, ids, count)
        return calls.drive(plan, lambda call: self._call(call, Deadline(self._config.timeout)))

    def cursor(self, source_id: str) -> bytes | None:
        """The cursor of ``source_id``: the one buffered by :meth:`save_cursor` if not saved yet,
        else the one last saved on the checkpoint by any writer.

        Returns:
            The cursor's bytes, or None: never saved, or the source is completed.

        Raises:
            InvalidArgument: ``source_id`` is not a non-empty string.
            Unavailable: No answer within the client's timeout.
        """
        plan = calls.get_cursor(self.checkpoint, source_id)
        with self._lock:
            pending = self._core.cursors.get(source_id)
        if pending is not None:
            plan.close()
            return pending
        return calls.drive(plan, lambda call: self._call(call, Deadline(self._config.timeout)))

    def acquire(self, source_ids: Iterable[str]) -> dict[str, Claim]:
        """Claim sources for this writer, so that no other live writer works on them meanwhile.

        A direct call: it sends nothing buffered and waits for no flush. Each source is answered
        with a :class:`tally.Claim` whose ``state`` says what to do:

        - ``"acquired"``: this writer holds it now (or held it already: the same token again); do
          its work. ``token`` is the fencing token, larger than any earlier claim's on the source:
          an output store can refuse a late write whose token :meth:`tally.Client.token_is_current`
          says is no longer current.
        - ``"held"``: another live writer holds it (``holder``, until ``until`` unless renewed):
          skip it for now; ask again later, it may come free.
        - ``"completed"``: done already; skip it.
        - ``"failed"``: it used up the checkpoint's failure budget; skip it until retried.

        A claim ends when the source completes (its completion is durable), this writer closes, or
        its lease runs out; another writer can then acquire it, with a larger token. While this
        writer holds a source, the coordinator refuses other writers' deltas for it (counted in
        their :meth:`health`, recorded as an event). Claims survive a coordinator restart with the
        writer.

        Args:
            source_ids: The sources (an iterable of non-empty strings; repeats are asked once).

        Returns:
            One claim per distinct source, by source id, in the order asked.

        Raises:
            InvalidArgument: ``source_ids`` is a single string, or holds an empty or non-string id.
            FailedPrecondition: The writer is not open.
            LeaseLost: The coordinator dropped this writer.
            Unavailable: No answer within the client's timeout.
        """
        claims: dict[str, Claim] = {}
        deadline = Deadline(self._config.timeout)
        for call in self._acquire_calls(source_ids):
            for claim in self._call_as_writer(call, deadline, "acquiring sources"):
                claims[claim.source_id] = claim
        if self._trace is not None:
            self._trace_acquire(claims)
        return claims

    def report_failure(self, source_id: str, reason: str = "") -> FailureReport:
        """Record a failed attempt at a source, durably on the coordinator before this returns.

        A direct call: it sends nothing buffered and waits for no flush. When the checkpoint has a
        failure budget (``max_attempts``, see :meth:`tally.Client.set_max_attempts`) and the source
        has now failed that many times, it is *failed*: listed by :meth:`tally.Client.failures` and
        ``tally failed``, counted in status, skipped by the NeMo Curator drop-in, until
        :meth:`tally.Client.retry_failed` clears it. Completing the source clears its failures too.

        Retried within the client's timeout like other calls; an attempt whose answer was lost may
        be counted twice.

        Args:
            source_id: The source, as in ``apply_deltas``.
            reason: What went wrong, for people (the coordinator keeps 1000 characters).

        Returns:
            The source's failed attempts so far, and whether it is failed now.

        Raises:
            InvalidArgument: ``source_id`` is empty or not a string, or ``reason`` not a string.
            FailedPrecondition: The source is completed already (its failure is not counted), or
                the writer is not open.
            LeaseLost: The coordinator dropped this writer.
            Unavailable: No answer within the client's timeout.
        """
        call = self._failure_call(source_id, reason)
        return self._call_as_writer(call, Deadline(self._config.timeout), "reporting a failure")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every delta given before this call is applied and its completions are durable,
        and save the cursors given before it (:meth:`save_cursor`).

        Args:
            timeout: Seconds to wait; defaults to the client's timeout.

        Raises:
            LeaseLost: The coordinator dropped this writer.
            InvalidArgument: A batch (or an ``apply_deltas`` call) was refused; the writer stopped.
                Or the coordinator refused the cursors: they are dropped, the writer goes on.
            Unavailable: Not done within the timeout; the sender keeps retrying in the background.
                Cursors not saved stay buffered for the next flush.
        """
        deadline = Deadline(self._timeout(timeout))
        with self._lock:
            handle = self._core.require_handle("flush")
            target = self._core.begin_flush()
            batch = self._batch_to_send_here(deadline)
            if batch is None:
                self._notify_locked()  # the sender stops lingering (waking it costs a thread switch)
        if batch is not None:
            self._send_here(batch)
        with self._lock:
            if not self._changed.wait_for(lambda: self._core.barrier_reached(target), deadline.remaining()):
                raise self._core.barrier_timeout(target, deadline.timeout, "flush")
            self._core.raise_if_stopped()
            settled = self._core.settled_through(target)
        if not settled:  # else the answer to the last batch said all of it is durable
            self._call_as_writer(calls.Flush(handle, self.writer_id), deadline, "flushing")
        self._save_cursors(handle, deadline, "flushing")

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
                self._core.close_outcome = err
                self._trace_close(err)
                raise
            finally:
                self._stop_threads()
            self._core.close_outcome = result
            self._trace_close(result)
            return result

    def _close(self, deadline: Deadline) -> CloseResult:
        with self._lock:
            handle = self._core.begin_close()
            if handle is None:
                self._notify_locked()
                return CloseResult()
            target = self._core.begin_flush()
            self._notify_locked()
            abandoned = None
            if not self._changed.wait_for(lambda: self._core.barrier_reached(target), deadline.remaining()):
                abandoned = self._core.close_abandoned(target, deadline.timeout)
                self._notify_locked()
            elif self._core.lease_lost:
                self._core.raise_if_stopped()
            refused = self._core.stop_error
        close = calls.CloseWriter(handle, self.writer_id)
        if abandoned is not None:
            try:  # best effort: free the writer id now rather than when its lease runs out
                self._call(close, self._close_grace())
            except TallyError as err:
                log_close_anyway_failed(self.writer_id, err)
            raise abandoned
        try:
            self._save_cursors(handle, deadline, "closing")
        except LeaseLost:
            raise
        except TallyError as err:
            with self._lock:
                self._core.drop_cursors(f"close could not save them: {err.message}")
            try:  # the deltas are delivered: free the writer id now all the same
                self._call(close, self._close_grace())
            except TallyError as close_err:
                log_close_anyway_failed(self.writer_id, close_err)
            raise
        result = self._call_as_writer(close, deadline, "closing")
        if refused is not None:
            raise fresh(refused)
        return result

    def _save_cursors(self, handle: str, deadline: Deadline, during: str) -> None:
        """Send the buffered cursors (one call unless there are very many); they stay buffered
        unless the coordinator saved them or refused them."""
        with self._cursor_send:
            with self._lock:
                pending = self._core.pending_cursors()
            for chunk in calls.cursor_chunks(pending):
                try:
                    self._call_as_writer(calls.SaveCursors(handle, chunk, self.writer_id), deadline, during)
                except InvalidArgument as err:
                    with self._lock:
                        self._core.cursors_refused(chunk, err)
                    raise
                with self._lock:
                    self._core.cursors_saved(chunk)

    def _batch_to_send_here(self, deadline: Deadline) -> Batch | None:
        """The batch a flush sends from its own thread, if the sender has none out; else None.

        Handing the last batch to the sender thread and its answer back costs two thread
        wake-ups, as long as the call itself for one small batch. Only when the flush may wait as
        long as the sender would for an answer (the client's timeout), so that a short flush
        timeout never cuts a batch's call short.
        """
        if deadline.timeout < self._config.timeout:
            return None
        step = self._core.next_send()
        if not isinstance(step, Batch):
            return None
        self._took_batch_locked()
        return step

    def _send_here(self, batch: Batch) -> None:
        try:
            self._send(batch)
        except Exception as exc:  # a bug, as it would be in the sender thread: the writer stops visibly
            self._background_crashed("sender", exc)
        except BaseException:  # interrupted (KeyboardInterrupt): the sender thread sends it again
            with self._lock:
                self._core.batch_interrupted(batch)
                self._notify_locked()
            raise

    def _call(self, call: calls.Call[T], deadline: Deadline) -> T:
        return send(self._transport, call, self._policy, deadline)

    def _call_as_writer(self, call: calls.Call[T], deadline: Deadline, during: str) -> T:
        # NOT_FOUND on a writer's own call means the coordinator no longer knows it.
        try:
            return self._call(call, deadline)
        except NotFound as err:
            with self._lock:
                lost = self._core.lose_lease(err, during)
                self._notify_locked()
            raise fresh(lost) from None

    def _guarded(self, name: str, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:
            self._background_crashed(name, exc)

    def _stop_threads(self) -> None:
        with self._lock:
            self._core.finish_close()
            self._notify_locked()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(self._config.timeout)
                if thread.is_alive():
                    logger.warning("tally writer %s: %s did not stop in time", self.writer_id, thread.name)
        self._threads.clear()

    def _send_loop(self) -> None:
        core, interval = self._core, self._config.flush_interval_s
        idle_at = -1  # deltas accepted when the sender last looked and found nothing to do
        while True:
            with self._lock:
                step = core.next_send()
                if step is None:
                    return
                if isinstance(step, Wait):
                    seconds = step.seconds
                    if seconds is None and core.accepted != idle_at:
                        # Nothing to do, but deltas came since it last found nothing: look again
                        # within a flush interval rather than be woken by the next delta. In a run
                        # of small apply_deltas + flush, where each flush sends its own batch, the
                        # sender then wakes once per flush interval instead of once per call; once
                        # deltas stop coming, it waits to be woken.
                        idle_at, seconds = core.accepted, interval
                    # While it looks within a flush interval on its own, no delta need wake it.
                    core.sender_looks_soon = seconds is not None and seconds <= interval
                    try:
                        self._sending.wait(seconds)
                    finally:
                        core.sender_looks_soon = False
                    continue
                self._took_batch_locked()
            self._send(step)

    def _send(self, batch: Batch) -> None:
        handle = self.handle
        assert handle is not None
        call = self._core.apply_call(handle, batch)
        try:
            answer = self._transport.send(call, self._config.timeout)
        except Exception as exc:
            with self._lock:
                self._core.batch_failed(batch, as_tally_error(exc))
                self._notify_locked()
        else:
            with self._lock:
                self._batch_ok_locked(batch, answer)
                self._changed.notify_all()
                core = self._core
                # A flush that sent the batch itself leaves the senders nothing to do when nothing
                # else is buffered or waits to be resent: they would only wake to wait again. (An
                # answer frees a place on the wire, or lets a failed batch go again alone.)
                if core.pending or core.stopping or any(b.resend_at is not None for b in core.window):
                    self._wake()

    def _heartbeat_loop(self) -> None:
        while True:
            with self._lock:
                wait = self._core.next_heartbeat()
                if wait is None:
                    return
                if wait > 0:
                    self._beating.wait(wait)
                    continue
                handle, timeout = self._core.handle, self._core.lease.timeout()
            assert handle is not None
            try:
                ttl = self._transport.send(calls.KeepAlive(handle), timeout)
            except Exception as exc:
                with self._lock:
                    self._core.heartbeat_failed(as_tally_error(exc))
                    self._notify_locked()
            else:
                with self._lock:
                    self._core.heartbeat_ok(ttl)
