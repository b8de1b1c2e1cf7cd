"""Group commit of writers' journal entries and completions: one synced transaction per file per group."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tally_server.domain.ports import (
    CompletionOp,
    CompletionStore,
    CompletionWriteError,
    DeleteCompleted,
    JointCommit,
    Journal,
    JournalOp,
    PutCompleted,
    QuarantinedFile,
)
from tally_server.errors import Unavailable
from tally_server.logs import FailureLog
from tally_server.service.stats import ServiceStats

log = logging.getLogger(__name__)
T = TypeVar("T")
Op = CompletionOp | JournalOp


class Lane:
    """One thread running blocking calls in the order given, each answered as an asyncio future.

    What ``loop.run_in_executor`` on a one-thread ``ThreadPoolExecutor`` does, without its
    per-submit semaphore: that one is released by the worker thread after each call, so the loop
    often stops on it until that thread is scheduled again (tens of microseconds per commit, ten
    times that at the tail on a busy machine). A queue and a callback into the loop are all a
    commit needs.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._stopped = False
        # A daemon: close() stops it; a process that dies without close() loses no acknowledged
        # work, since nothing is answered before its commit returned.
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run(
        self, fn: Callable[..., T], *args: object, then: Callable[[], None] | None = None
    ) -> asyncio.Future[T]:
        """Queue ``fn(*args)``; the future has its result or exception.

        ``then`` runs on the loop as soon as ``fn`` returned (not if it raised), before the
        awaiting coroutine resumes: what it wakes runs one turn of the loop earlier.
        """
        if self._stopped:  # as an executor after shutdown: nothing would ever run it
            raise RuntimeError(f"{self._thread.name} is shut down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args, then))
        return future

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread."""
        self._stopped = True
        self._queue.put(None)
        self._thread.join()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, fn, args, then = item
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting coroutine, as an executor does
                _answer(loop, future.set_exception, future, exc, None)
            else:
                _answer(loop, future.set_result, future, result, then)
            del item, future, args, then  # hold no reference to the last call while waiting


def _answer(
    loop: asyncio.AbstractEventLoop,
    setter: Callable[[Any], None],
    future: Any,
    value: Any,
    then: Callable[[], None] | None,
) -> None:
    def settle() -> None:
        if not future.done():  # cancelled meanwhile
            setter(value)
        if then is not None:
            then()

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        loop.call_soon_threadsafe(settle)


class GroupCommitter:
    """Group commit: everything submitted while a commit runs goes into the next one.

    A group commits the journal first (one synced transaction for every writer's entries), then
    the completion files (one synced transaction per file touched), never one per delta. If the
    journal cannot be written, nothing of the group is: a completion is never durable before the
    journal entry that records it. The two stages run on two threads, so the next group's journal
    is written while this group's files are committed; each stage keeps group order, so completion
    submitters are resumed in submission order, which is what keeps live-set effects in commit
    order. Other file operations (a reset's move to the trash) go through :meth:`run` on the
    completion files' thread, so they never interleave with a commit of files.

    With ``joint`` (the PostgreSQL store, where both live in one database), a group's journal
    entries and its completions are one transaction instead, on the completion files' thread: one
    WAL flush and one fence per group rather than two, and a failure fails the whole group.
    """

    def __init__(
        self,
        store: CompletionStore,
        journal: Journal,
        stats: ServiceStats,
        on_quarantined: Callable[[QuarantinedFile], None] = lambda q: None,
        joint: JointCommit | None = None,
    ) -> None:
        self._store = store
        self._joint = joint
        self._journal = journal
        self._stats = stats
        self._on_quarantined = on_quarantined
        self._queue: list[tuple[Op, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        # Completion files (and other file operations, see run) on one thread, the journal on another.
        self._files_lane = Lane("tally-commit")
        self._journal_lane = Lane("tally-journal")
        self._task: asyncio.Task[None] | None = None
        # Retries come every few milliseconds while storage fails: log each cause once, for the
        # journal and the completion files apart (one may fail while the other works).
        self._journal_failures = FailureLog(log, "writing the writers' journal")
        self._failures = FailureLog(log, "committing completions")

    @property
    def failing(self) -> str | None:
        """Why storage is failing, or None.

        The cause while the latest journal write or completion commit (or storage probe) failed.
        """
        return self._journal_failures.failing or self._failures.failing

    async def probe(self) -> None:
        """Check that the store can write again (after failures), between two commits."""
        await self.run(self._store.probe)
        self._failures.succeeded()

    def start(self) -> None:
        """Start the commit loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tally-group-commit")

    def enqueue(self, op: Op) -> asyncio.Future[None]:
        """Queue ``op`` for the next group; the future resolves once it is durable (or failed)."""
        if self._closing and self._task is None:
            raise Unavailable("the coordinator is shutting down; retry against the restarted coordinator")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((op, future))
        self._wake.set()
        return future

    def enqueue_all(self, ops: Sequence[Op]) -> asyncio.Future[None]:
        """Queue ``ops`` together for the next group; one future, resolved once all are durable.

        It fails if any of them fails (a group's journal entries fail or succeed together).
        """
        if self._closing and self._task is None:
            raise Unavailable("the coordinator is shutting down; retry against the restarted coordinator")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue += [(op, future) for op in ops]
        self._wake.set()
        return future

    async def submit(self, op: Op) -> None:
        """Queue ``op`` and wait until it is durable; raises what made it fail."""
        await self.enqueue(op)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run a blocking file operation on the commit thread, between two commits."""
        return await self._files_lane.run(fn, *args)

    async def _run(self) -> None:
        files: asyncio.Task[None] | None = None  # the latest group's completion-file stage
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                if self._closing:
                    if files is not None:
                        await files
                    return
                continue
            group, self._queue = self._queue, []
            if self._joint is not None:
                await self._commit_joint(group)
                if self._queue:
                    self._wake.set()
                continue
            # Two stages on two threads, each in group order: this group's journal is written while
            # the previous group's completion files are still being committed.
            files = await self._commit(group, after=files)
            if self._queue:
                self._wake.set()

    async def _commit(
        self, group: Sequence[tuple[Op, asyncio.Future[None]]], after: asyncio.Task[None] | None
    ) -> asyncio.Task[None] | None:
        """Write the group's journal entries and start committing its completion files.

        Returns the task committing the files (it waits for the ``after`` stage first), or
        ``after`` itself when the group has no files to commit or its journal failed.
        """
        loop = asyncio.get_running_loop()
        journal = [(op, f) for op, f in group if not isinstance(op, PutCompleted | DeleteCompleted)]
        completions = [(op, f) for op, f in group if isinstance(op, PutCompleted | DeleteCompleted)]
        started = time.perf_counter()
        try:
            if journal:
                entries = [op for op, _ in journal if not isinstance(op, PutCompleted | DeleteCompleted)]
                # Its submitters are answered as soon as the entries are durable.
                await self._journal_lane.run(self._journal.commit, entries, then=lambda: _resolve(journal))
        except Exception as exc:
            self._fail(group, exc, self._journal_failures, "could not write the writers' journal")
            return after
        if journal:
            self._journal_failures.succeeded()
        if not completions:
            return after
        return loop.create_task(self._commit_files(completions, after, started), name="tally-commit-files")

    async def _commit_joint(self, group: Sequence[tuple[Op, asyncio.Future[None]]]) -> None:
        """Commit the group's journal entries and completions in one transaction (see ``joint``)."""
        assert self._joint is not None
        journal = [(op, f) for op, f in group if not isinstance(op, PutCompleted | DeleteCompleted)]
        completions = [(op, f) for op, f in group if isinstance(op, PutCompleted | DeleteCompleted)]
        entries = [op for op, _ in journal if not isinstance(op, PutCompleted | DeleteCompleted)]
        changes = [op for op, _ in completions if isinstance(op, PutCompleted | DeleteCompleted)]
        started = time.perf_counter()
        try:
            report = await self._files_lane.run(self._joint, entries, changes)
        except Exception as exc:
            # Neither part is durable: the journal's submitters re-queue their entries, and the
            # completions settle again, as when the journal alone fails.
            what = "could not write the writers' journal" if not changes else "could not persist completions"
            self._fail(group, exc, self._failures if changes else self._journal_failures, what)
            return
        if journal:
            self._journal_failures.succeeded()
        if completions:
            self._failures.succeeded()
        for quarantined in report.quarantined:
            self._on_quarantined(quarantined)
        if completions:
            elapsed = time.perf_counter() - started
            sources = sum(len(op.sources) for op in changes)
            for observe in self._stats.commit_observers:
                observe(elapsed, len(completions), sources)
        # In the group's order, journal entries and completions alike: submitters resume in the
        # order they queued (a submitter with no journal entry queued first resumes first).
        _resolve(group)

    async def _commit_files(
        self,
        completions: Sequence[tuple[Op, asyncio.Future[None]]],
        after: asyncio.Task[None] | None,
        started: float,
    ) -> None:
        if after is not None:
            await after  # never raises: failures resolve the futures instead
        try:
            changes = [op for op, _ in completions if isinstance(op, PutCompleted | DeleteCompleted)]
            report = await self._files_lane.run(self._store.commit, changes)
        except Exception as exc:
            self._fail(completions, exc, self._failures, "could not persist completions")
            return
        self._failures.succeeded()
        for quarantined in report.quarantined:
            self._on_quarantined(quarantined)
        elapsed = time.perf_counter() - started
        sources = sum(len(op.sources) for op in changes)
        for observe in self._stats.commit_observers:
            observe(elapsed, len(completions), sources)
        _resolve(completions)

    def _fail(
        self,
        group: Sequence[tuple[Op, asyncio.Future[None]]],
        exc: Exception,
        failures: FailureLog,
        what: str,
    ) -> None:
        self._stats.commit_failures += 1
        failures.failed(exc)
        if isinstance(exc, CompletionWriteError):
            message = f"{what}: {exc}"  # says what to do
        else:
            message = f"{what} ({exc}); retry"
        for _, future in group:
            if not future.done():
                future.set_exception(Unavailable(message, cause=str(exc)[:500]))

    async def close(self) -> None:
        """Commit what is queued, then stop the commit loop and its thread."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._files_lane.shutdown()
        self._journal_lane.shutdown()


def _resolve(group: Sequence[tuple[Op, asyncio.Future[None]]]) -> None:
    for _, future in group:
        if not future.done():
            future.set_result(None)
