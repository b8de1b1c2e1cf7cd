"""The asyncio writer: the core driven by a sender task and a heartbeat task on the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Self, TypeVar

from tally import _calls as calls
from tally._config import ClientConfig
from tally._retry import Deadline, async_send
from tally._trace import TraceRecorder
from tally._transport.base import AsyncTransport
from tally._types import Claim, CloseResult, FailureReport, WriterSpec
from tally._writer.base import WriterBase
from tally._writer.core import Batch, Wait
from tally._writer.support import as_tally_error, fresh, log_close_anyway_failed
from tally.errors import InvalidArgument, LeaseLost, NotFound, TallyError

logger = logging.getLogger("tally._writer")

T = TypeVar("T")


class AsyncWriter(WriterBase):
    """asyncio flavour of :class:`Writer`: the sender and heartbeat run as tasks on the event loop.

    ``apply_deltas`` stays a plain call. On the event loop it cannot wait for room without
    blocking the sender it waits for, so there the buffer may exceed ``max_buffered`` (a warning is
    logged once) rather than drop deltas; ``await flush()`` is the back-pressure point. Called from
    another thread it waits for room like the sync writer.
    """

    def __init__(
        self,
        transport: AsyncTransport,
        spec: WriterSpec,
        config: ClientConfig,
        trace: TraceRecorder | None = None,
    ) -> None:
        """Create an unopened writer (prefer :meth:`tally.AsyncClient.writer`)."""
        super().__init__(spec, config, trace=trace)
        self._transport = transport
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._waiters: list[asyncio.Future[None]] = []  # touched only on the loop thread
        self._tasks: list[asyncio.Task[None]] = []
        self._lifecycle = asyncio.Lock()
        # One SaveCursors at a time: an older value must never land after a newer one.
        self._cursor_send = asyncio.Lock()

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
            self._close_after_error_failed(close_err)

    # ------------------------------------------------------------------ waking the loop

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

    # ------------------------------------------------------------------ public I/O

    async def open(self) -> None:
        """Register the writer with the coordinator and start the background tasks.

        See :meth:`Writer.open`.
        """
        async with self._lifecycle:
            if not self._open_ready():
                return
            # Each call its own timeout: a big declaration is many calls.
            for setup in self._setup_calls():
                await self._call(setup, Deadline(self._config.timeout))
            opened = await self._call(calls.OpenWriter(self._spec), Deadline(self._config.timeout))
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            with self._lock:
                self._opened_locked(opened)
                self._notify_locked()
            # One sender task per batch allowed on the wire at once.
            self._tasks = [
                *(
                    asyncio.create_task(self._send_loop(), name=f"tally-sender{i or ''}-{self.writer_id}")
                    for i in range(self._core.in_flight_limit())
                ),
                asyncio.create_task(self._heartbeat_loop(), name=f"tally-heartbeat-{self.writer_id}"),
            ]
            for task in self._tasks:
                task.add_done_callback(self._task_done)

    async def are_completed(self, ids: Iterable[str]) -> list[bool]:
        """Which of ``ids`` the checkpoint has completed. See :meth:`Writer.are_completed`."""
        if self._trace is not None:
            ids = list(ids)
        plan = calls.are_completed(self.checkpoint, ids)
        done = await calls.async_drive(plan, lambda call: self._call(call, Deadline(self._config.timeout)))
        if self._trace is not None:
            self._trace_are_completed(list(ids), done)
        return done

    async def declare(self, ids: Iterable[str] | None = None, *, count: int | None = None) -> int:
        """Declare the checkpoint's sources (or how many). See :meth:`Writer.declare`."""
        plan = calls.declare_plan(self.checkpoint, ids, count)
        return await calls.async_drive(plan, lambda call: self._call(call, Deadline(self._config.timeout)))

    async def cursor(self, source_id: str) -> bytes | None:
        """The buffered cursor of ``source_id``, else the saved one. See :meth:`Writer.cursor`."""
        plan = calls.get_cursor(self.checkpoint, source_id)
        with self._lock:
            pending = self._core.cursors.get(source_id)
        if pending is not None:
            plan.close()
            return pending
        return await calls.async_drive(plan, lambda call: self._call(call, Deadline(self._config.timeout)))

    async def acquire(self, source_ids: Iterable[str]) -> dict[str, Claim]:
        """Claim sources for this writer. See :meth:`Writer.acquire`."""
        claims: dict[str, Claim] = {}
        deadline = Deadline(self._config.timeout)
        for call in self._acquire_calls(source_ids):
            for claim in await self._call_as_writer(call, deadline, "acquiring sources"):
                claims[claim.source_id] = claim
        if self._trace is not None:
            self._trace_acquire(claims)
        return claims

    async def report_failure(self, source_id: str, reason: str = "") -> FailureReport:
        """Record a failed attempt at a source, durably before this returns.

        See :meth:`Writer.report_failure`.
        """
        call = self._failure_call(source_id, reason)
        return await self._call_as_writer(call, Deadline(self._config.timeout), "reporting a failure")

    async def flush(self, timeout: float | None = None) -> None:
        """Barrier over everything applied so far; saves the cursors. See :meth:`Writer.flush`."""
        deadline = Deadline(self._timeout(timeout))
        with self._lock:
            handle = self._core.require_handle("flush")
            target = self._core.begin_flush()
            self._notify_locked()
        if not await self._wait_until(lambda: self._core.barrier_reached(target), deadline.remaining()):
            with self._lock:
                raise self._core.barrier_timeout(target, deadline.timeout, "flush")
        with self._lock:
            self._core.raise_if_stopped()
            settled = self._core.settled_through(target)
        if not settled:  # else the answer to the last batch said all of it is durable
            await self._call_as_writer(calls.Flush(handle, self.writer_id), deadline, "flushing")
        await self._save_cursors(handle, deadline, "flushing")

    async def close(self, timeout: float | None = None) -> CloseResult:
        """Deliver buffered deltas, close on the coordinator, stop the tasks. See :meth:`Writer.close`."""
        async with self._lifecycle:
            cached = self._cached_close()
            if cached is not None:
                return cached
            try:
                result = await self._close(Deadline(self._timeout(timeout)))
            except TallyError as err:
                self._core.close_outcome = err
                self._trace_close(err)
                raise
            finally:
                await self._stop_tasks()
            self._core.close_outcome = result
            self._trace_close(result)
            return result

    async def _close(self, deadline: Deadline) -> CloseResult:
        with self._lock:
            handle = self._core.begin_close()
            if handle is None:
                self._notify_locked()
                return CloseResult()
            target = self._core.begin_flush()
            self._notify_locked()
        close = calls.CloseWriter(handle, self.writer_id)
        if not await self._wait_until(lambda: self._core.barrier_reached(target), deadline.remaining()):
            with self._lock:
                abandoned = self._core.close_abandoned(target, deadline.timeout)
                self._notify_locked()
            try:  # best effort: free the writer id now rather than when its lease runs out
                await self._call(close, self._close_grace())
            except TallyError as err:
                log_close_anyway_failed(self.writer_id, err)
            raise abandoned
        with self._lock:
            if self._core.lease_lost:
                self._core.raise_if_stopped()
            refused = self._core.stop_error
        try:
            await self._save_cursors(handle, deadline, "closing")
        except LeaseLost:
            raise
        except TallyError as err:
            with self._lock:
                self._core.drop_cursors(f"close could not save them: {err.message}")
            try:  # the deltas are delivered: free the writer id now all the same
                await self._call(close, self._close_grace())
            except TallyError as close_err:
                log_close_anyway_failed(self.writer_id, close_err)
            raise
        result = await self._call_as_writer(close, deadline, "closing")
        if refused is not None:
            raise fresh(refused)
        return result

    async def _save_cursors(self, handle: str, deadline: Deadline, during: str) -> None:
        """Send the buffered cursors. See :meth:`Writer._save_cursors`."""
        async with self._cursor_send:
            with self._lock:
                pending = self._core.pending_cursors()
            for chunk in calls.cursor_chunks(pending):
                call = calls.SaveCursors(handle, chunk, self.writer_id)
                try:
                    await self._call_as_writer(call, deadline, during)
                except InvalidArgument as err:
                    with self._lock:
                        self._core.cursors_refused(chunk, err)
                    raise
                with self._lock:
                    self._core.cursors_saved(chunk)

    async def _call(self, call: calls.Call[T], deadline: Deadline) -> T:
        return await async_send(self._transport, call, self._policy, deadline)

    async def _call_as_writer(self, call: calls.Call[T], deadline: Deadline, during: str) -> T:
        try:
            return await self._call(call, deadline)
        except NotFound as err:
            with self._lock:
                lost = self._core.lose_lease(err, during)
                self._notify_locked()
            raise fresh(lost) from None

    # ------------------------------------------------------------------ background tasks

    async def _stop_tasks(self) -> None:
        with self._lock:
            self._core.finish_close()
            self._notify_locked()
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
                step = self._core.next_send()
                if isinstance(step, Batch):
                    self._took_batch_locked()
            if step is None:
                self._drop_waiter(waiter)
                return
            if isinstance(step, Wait):
                await self._await_waiter(waiter, step.seconds)
                continue
            self._drop_waiter(waiter)
            await self._send(step)

    async def _send(self, batch: Batch) -> None:
        handle = self.handle
        assert handle is not None
        call = self._core.apply_call(handle, batch)
        try:
            answer = await self._transport.send(call, self._config.timeout)
        except Exception as exc:
            with self._lock:
                self._core.batch_failed(batch, as_tally_error(exc))
                self._notify_locked()
        else:
            with self._lock:
                self._batch_ok_locked(batch, answer)
                self._notify_locked()

    async def _heartbeat_loop(self) -> None:
        while True:
            waiter = self._new_waiter()
            with self._lock:
                wait = self._core.next_heartbeat()
                handle, timeout = self._core.handle, self._core.lease.timeout()
            if wait is None:
                self._drop_waiter(waiter)
                return
            if wait > 0:
                await self._await_waiter(waiter, wait)
                continue
            self._drop_waiter(waiter)
            assert handle is not None
            try:
                ttl = await self._transport.send(calls.KeepAlive(handle), timeout)
            except Exception as exc:
                with self._lock:
                    self._core.heartbeat_failed(as_tally_error(exc))
                    self._notify_locked()
            else:
                with self._lock:
                    self._core.heartbeat_ok(ttl)
