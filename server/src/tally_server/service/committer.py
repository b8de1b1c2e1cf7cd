"""Group commit of writers' journal entries and completions: one synced transaction per file per group."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tally_server.domain.ports import (
    CommitReport,
    CompletionOp,
    CompletionStore,
    CompletionWriteError,
    DeleteCompleted,
    JointCommit,
    Journal,
    JournalOp,
    PutCompleted,
    QuarantinedFile,
    checkpoint_of,
)
from tally_server.errors import Unavailable
from tally_server.logs import FailureLog
from tally_server.service.lane import Lane
from tally_server.service.stats import ServiceStats

log = logging.getLogger(__name__)
T = TypeVar("T")
Op = CompletionOp | JournalOp
Pending = tuple[Op, asyncio.Future[None]]
#: The futures of ops left out of their group's commit (their checkpoint's shard not held), with
#: the op that was refused and why.
Refused = dict[asyncio.Future[None], tuple[Op, CompletionWriteError]]
#: How many times a group is committed again without the checkpoints its commit was refused for
#: (``CompletionWriteError.refuses``: a shard handed over or lost meanwhile); a further refusal
#: fails what is left of the group.
_MAX_SPLITS = 4


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

    A group may carry ops of checkpoints this coordinator no longer owns in the store (of a shard
    handed over or lost). ``not_held`` says so of a checkpoint up front (with the error to fail its
    ops with), so those ops are failed rather than committed; and a commit refused for some
    checkpoints only (``CompletionWriteError.refuses``: their shard left meanwhile) is committed
    again without their ops. Either way only their submitters fail (a submitter's ops sharing one
    future fail together); the others' ops are written as if alone, and every submitter is still
    answered in group order.
    """

    def __init__(
        self,
        store: CompletionStore,
        journal: Journal,
        stats: ServiceStats,
        on_quarantined: Callable[[QuarantinedFile], None] = lambda q: None,
        joint: JointCommit | None = None,
        not_held: Callable[[str], CompletionWriteError | None] | None = None,
    ) -> None:
        self._store = store
        self._joint = joint
        self._not_held = not_held
        self._journal = journal
        self._stats = stats
        self._on_quarantined = on_quarantined
        self._queue: list[Pending] = []
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
        self, group: Sequence[Pending], after: asyncio.Task[None] | None
    ) -> asyncio.Task[None] | None:
        """Write the group's journal entries and start committing its completion files.

        Returns the task committing the files (it waits for the ``after`` stage first), or
        ``after`` itself when the group has no files to commit or its journal failed.
        """
        loop = asyncio.get_running_loop()
        journal = [(op, f) for op, f in group if not isinstance(op, PutCompleted | DeleteCompleted)]
        completions = [(op, f) for op, f in group if isinstance(op, PutCompleted | DeleteCompleted)]
        started = time.perf_counter()
        refused: Refused = {}

        def write(part: Sequence[Pending]) -> Awaitable[None]:
            entries = [op for op, _ in part if not isinstance(op, PutCompleted | DeleteCompleted)]
            # Its submitters are answered as soon as the entries are durable.
            answer = functools.partial(_settle, journal, refused)
            return self._journal_lane.run(self._journal.commit, entries, then=answer)

        try:
            written, _ = await self._commit_held(journal, refused, write)
        except Exception as exc:
            self._fail(group, exc, self._journal_failures, "could not write the writers' journal", refused)
            return after
        if written:
            self._journal_failures.succeeded()
        _settle(journal, refused)
        if not completions:
            return after
        # A completion is never durable before its journal: none of a checkpoint whose entries were left out.
        left_out = {checkpoint_of(op): why for op, why in refused.values()}
        for op, future in completions:
            if checkpoint_of(op) in left_out:
                refused.setdefault(future, (op, left_out[checkpoint_of(op)]))
        files = self._commit_files(completions, after, started, refused)
        return loop.create_task(files, name="tally-commit-files")

    async def _commit_joint(self, group: list[Pending]) -> None:
        """Commit the group's journal entries and completions in one transaction (see ``joint``)."""
        joint = self._joint
        assert joint is not None
        started = time.perf_counter()
        refused: Refused = {}

        def commit(part: Sequence[Pending]) -> Awaitable[CommitReport]:
            entries = [op for op, _ in part if not isinstance(op, PutCompleted | DeleteCompleted)]
            changes = [op for op, _ in part if isinstance(op, PutCompleted | DeleteCompleted)]
            return self._files_lane.run(joint, entries, changes)

        try:
            part, report = await self._commit_held(group, refused, commit)
        except Exception as exc:
            # Neither part is durable: the journal's submitters re-queue their entries, and the
            # completions settle again, as when the journal alone fails.
            files = any(isinstance(op, PutCompleted | DeleteCompleted) for op, f in group if f not in refused)
            what = "could not write the writers' journal" if not files else "could not persist completions"
            self._fail(group, exc, self._failures if files else self._journal_failures, what, refused)
            return
        changes = [op for op, _ in part if isinstance(op, PutCompleted | DeleteCompleted)]
        if len(changes) < len(part):
            self._journal_failures.succeeded()
        if changes:
            self._failures.succeeded()
        for quarantined in report.quarantined if report is not None else ():
            self._on_quarantined(quarantined)
        if changes:
            elapsed = time.perf_counter() - started
            sources = sum(len(op.sources) for op in changes)
            for observe in self._stats.commit_observers:
                observe(elapsed, len(changes), sources)
        # In the group's order, journal entries and completions alike: submitters resume in the
        # order they queued (a submitter with no journal entry queued first resumes first).
        _settle(group, refused)

    async def _commit_files(
        self,
        completions: Sequence[Pending],
        after: asyncio.Task[None] | None,
        started: float,
        refused: Refused,
    ) -> None:
        if after is not None:
            await after  # never raises: failures resolve the futures instead

        def commit(part: Sequence[Pending]) -> Awaitable[CommitReport]:
            changes = [op for op, _ in part if isinstance(op, PutCompleted | DeleteCompleted)]
            return self._files_lane.run(self._store.commit, changes)

        try:
            part, report = await self._commit_held(completions, refused, commit)
        except Exception as exc:
            self._fail(completions, exc, self._failures, "could not persist completions", refused)
            return
        if part:
            self._failures.succeeded()
            for quarantined in report.quarantined if report is not None else ():
                self._on_quarantined(quarantined)
            elapsed = time.perf_counter() - started
            sources = sum(len(op.sources) for op, _ in part if isinstance(op, PutCompleted | DeleteCompleted))
            for observe in self._stats.commit_observers:
                observe(elapsed, len(part), sources)
        _settle(completions, refused)

    async def _commit_held(
        self, part: Sequence[Pending], refused: Refused, commit: Callable[[Sequence[Pending]], Awaitable[T]]
    ) -> tuple[Sequence[Pending], T | None]:
        """``commit`` the ops of ``part`` but those of checkpoints not held; returns those committed.

        Ops ``not_held`` refuses (and those ``refused`` already) are left out first; a commit
        refused for some checkpoints only (``CompletionWriteError.refuses``) runs again without
        their ops (up to ``_MAX_SPLITS`` times). The futures left out go to ``refused``, with why.
        Nothing is committed (and None returned with no ops) when every op is left out.

        Raises:
            Exception: what ``commit`` raised (a refusal too, after ``_MAX_SPLITS`` of them).
        """
        if refused:
            part = [(op, future) for op, future in part if future not in refused]
        splits = 0
        while True:
            if self._not_held is not None:
                part = _leave_out(part, refused, self._not_held)
            if not part:
                return part, None
            try:
                return part, await commit(part)
            except CompletionWriteError as exc:
                if exc.refuses is None or splits == _MAX_SPLITS:
                    raise
                rest = _leave_out(part, refused, functools.partial(_refused_by, exc))
                if len(rest) == len(part):
                    raise  # refused for none of its ops: it would be refused again
                splits += 1
                self._stats.commit_failures += 1
                log.info(
                    "a group commit was refused for some of its checkpoints (%s); committing the rest", exc
                )
                part = rest

    def _fail(
        self,
        group: Sequence[Pending],
        exc: Exception,
        failures: FailureLog,
        what: str,
        refused: Refused,
    ) -> None:
        """Fail the group's submitters in its order: with ``exc``, or their refusal if ``refused``."""
        self._stats.commit_failures += 1
        failures.failed(exc)
        for _, future in group:
            if not future.done():
                future.set_exception(
                    _refusal(*refused[future]) if future in refused else _unavailable(what, exc)
                )

    async def close(self) -> None:
        """Commit what is queued, then stop the commit loop and its thread."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._files_lane.shutdown()
        self._journal_lane.shutdown()


def _settle(group: Sequence[Pending], refused: Refused) -> None:
    """Answer the group's submitters in its order: durable, or UNAVAILABLE for those ``refused``."""
    for _, future in group:
        if not future.done():
            if future in refused:
                future.set_exception(_refusal(*refused[future]))
            else:
                future.set_result(None)


def _leave_out(
    part: Sequence[Pending], refused: Refused, refusal: Callable[[str], CompletionWriteError | None]
) -> list[Pending]:
    """``part`` without the ops of checkpoints ``refusal`` refuses, and the ops sharing their futures.

    A future's ops are durable together or not at all. The futures left out go to ``refused``.
    """
    why: dict[str, CompletionWriteError | None] = {}
    for op, future in part:
        name = checkpoint_of(op)
        if name and future not in refused:
            if name not in why:
                why[name] = refusal(name)
            error = why[name]
            if error is not None:
                refused[future] = (op, error)
    return [(op, future) for op, future in part if future not in refused]


def _refused_by(exc: CompletionWriteError, checkpoint: str) -> CompletionWriteError | None:
    """``exc`` if it refused ``checkpoint``'s rows (``CompletionWriteError.refuses``), else None."""
    return exc if exc.refuses is not None and exc.refuses(checkpoint) else None


def _refusal(op: Op, exc: CompletionWriteError) -> Unavailable:
    """What a submitter whose ``op`` was left out of its commit gets (the shard moved: retry)."""
    if isinstance(op, PutCompleted | DeleteCompleted):
        return _unavailable("could not persist completions", exc)
    return _unavailable("could not write the writers' journal", exc)


def _unavailable(what: str, exc: Exception) -> Unavailable:
    if isinstance(exc, CompletionWriteError):
        message = f"{what}: {exc}"  # says what to do
    else:
        message = f"{what} ({exc}); retry"
    return Unavailable(message, cause=str(exc)[:500])
