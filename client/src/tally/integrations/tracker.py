"""A generic tracker: correct Tally deltas for pipelines that are not NeMo Curator.

Every task of a source's work tree ends with exactly one *outcome*, and the tracker turns outcomes
into deltas by the counting rules (DESIGN §2), from ids derived deterministically from the source
id, so a rerun or a retry sends the same deltas again and the coordinator skips them::

    from tally.integrations.tracker import Tracker

    with tally.Client(address) as client, client.writer("etl/run-1") as writer:
        tracker = Tracker(writer)
        for source in tracker.todo(sources):      # declared; those not completed yet
            task = tracker.start(source)           # the source task: +1
            for part in task.split(len(chunks)):   # fan-out: one delta n - 1
                if keep(part):
                    write(part)
                    part.done()                    # sink: -1
                else:
                    part.drop()                    # filtered: -1

Outcomes and their deltas (DESIGN §2):

- ``tracker.start(source)``: ``+1`` keyed on the source's root task id; returns the root task.
- ``task.split(n)``: fan-out, ``n - 1``; returns ``n`` children ``<id>_0`` ... ``<id>_<n-1>``.
- ``task.then()``: a 1:1 stage, ``0`` (``split(1)``); returns the one child ``<id>_0``.
- ``task.done()``: a sink, ``-1`` (``split(0)``).
- ``task.drop()``: filtered, ``-1``.
- ``task.failed()``: ``0``; the task stays open, so the source is not completed and replays.

Long sources. ``tracker.save_cursor(source, data)`` remembers where the run got to inside a source
(a row or byte offset, at most 4 KiB) and the next ``writer.flush()`` makes it durable;
``tracker.cursor(source)`` reads it back, in this run or a later one (None once the source is
completed), so a rerun resumes mid-source instead of redoing it::

    for source in tracker.todo(sources):
        task = tracker.start(source)
        start = int(tracker.cursor(source) or b"0")
        for row in range(start, total_rows(source)):
            write_row(source, row)
            if row % 10_000 == 0:
                tracker.save_cursor(source, str(row + 1).encode())
                writer.flush()
        task.done()

A task's outcome delta is keyed on ``<id>_0``, the id of its first child slot (NeMo Curator keys a
fan-out on its first child's id), so one task has one key whatever its outcome: a task that
``failed()`` and is then retried within the run re-keys the same slot, which the coordinator
rewrites (``pending += new - old``) instead of counting twice.

Overlapping runs. ``tracker.claim(sources)`` hands out only the sources this run could claim (see
:meth:`tally.Writer.acquire`) as it reaches them, so two runs of one pipeline over the same sources
(a SLURM array resubmitted while the first is still running, two arrays on one checkpoint) split
the work instead of doing it twice: a source another live run holds is skipped, and asked about
once more at the end (its run may have died meanwhile)::

    for source in tracker.claim(tracker.todo(sources)):
        process(tracker.start(source))

A claim ends when its source completes or the run's writer closes or loses its lease; the
coordinator refuses another run's deltas for a claimed source.

Failures. ``tracker.report_failure(source, reason)`` counts a failed attempt at a source on the
coordinator at once; with a failure budget (``client.writer(..., max_attempts=3)``) a source that
failed that many times is *failed*: ``tally failed CHECKPOINT`` lists it with its reasons and
``tally retry CHECKPOINT`` clears it. Completing the source clears its failures too.

Worker processes. A :class:`Task` pickles as its two ids and nothing else, so it can be shipped to
a ``multiprocessing`` / ``concurrent.futures`` / Ray worker. There, a :class:`Report` adopts it and
buffers its outcomes; the worker returns the report and the parent applies it with
:meth:`Tracker.apply`. All deltas of a run thus go through the parent's single writer: one run is
one writer, as in NeMo Curator, so the run's pending counts live in one place, a crashed run's
partial trees vanish with its writer, and workers need no coordinator connection. The tracker
checks that every outcome concerns a task it knows to be open, which catches a report applied
twice or before the report that created its tasks (that order matters: a child's ``-1`` counted
before its parent's fan-out can make a source look complete too early).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from tally._types import Claim, FailureReport
from tally._words import count
from tally.errors import TallyError

__all__ = ["Report", "Task", "Tracker"]

logger = logging.getLogger(__name__)

Delta = tuple[str, str, int]

# (outcome, task id, source id, continuing children); "failed" has none and keeps the task open.
_Record = tuple[str, str, str, int]


class _Writer(Protocol):
    """What the tracker needs of a :class:`tally.Writer`."""

    def apply_deltas(self, deltas: Iterable[Delta]) -> None: ...

    def are_completed(self, ids: Iterable[str]) -> list[bool]: ...

    def save_cursor(self, source_id: str, data: bytes) -> None: ...

    def cursor(self, source_id: str) -> bytes | None: ...

    def report_failure(self, source_id: str, reason: str = "") -> FailureReport: ...


class _Acquire(Protocol):
    def __call__(self, source_ids: Iterable[str], /) -> dict[str, Claim]: ...


def root_task_id(source_id: str) -> str:
    """The id of a source's root task.

    Prefixed with the source id's length, so that no task of one source can share an id with a
    task of another (the coordinator's dedup map is keyed on the task id alone): source ``a``'s
    child ``2:a_0`` differs from source ``a_0``'s root ``3:a_0``.
    """
    return f"{len(source_id)}:{source_id}"


class _Book:
    """The open tasks and the outcomes recorded against them: shared by Tracker and Report."""

    def __init__(self) -> None:
        self._open: dict[str, str] = {}  # task id -> source id

    def _bind(self, task_id: str, source_id: str) -> Task:
        self._open[task_id] = source_id
        return Task(task_id, source_id, self)

    def _outcome(self, task_id: str, source_id: str, kind: str, n: int) -> list[Task]:
        if self._open.get(task_id) != source_id:
            raise ValueError(
                f"task {task_id!r} of source {source_id!r} is not open here: each task has exactly one "
                f"outcome (done, drop, split, then; failed may be followed by one), and a Report must be "
                f"applied once, after the report that created its tasks"
            )
        children = [f"{task_id}_{i}" for i in range(n)]
        if kind != "failed":
            del self._open[task_id]
        self._record((kind, task_id, source_id, n), (f"{task_id}_0", source_id, _delta(kind, n)))
        return [self._bind(child, source_id) for child in children]

    def _record(self, record: _Record, delta: Delta) -> None:
        raise NotImplementedError

    @property
    def open_tasks(self) -> int:
        """How many tasks have been created and not given an outcome (failed ones stay open)."""
        return len(self._open)


def _distinct_ids(sources: Iterable[str]) -> list[str]:
    """The source ids in order without repeats; each must be a non-empty string."""
    ids = list(dict.fromkeys(sources))
    for sid in ids:
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"source ids must be non-empty strings, got {sid!r}")
    return ids


def _delta(kind: str, n: int) -> int:
    # DESIGN §2: fan-out `continuing + failed - 1`; 1:1 stage 0; sink and filtered -1; FailedTask 0.
    return 0 if kind == "failed" else n - 1


class Task:
    """One unit of work of a source's tree; its outcome is reported exactly once.

    A task is a pair of stable ids. Created by :meth:`Tracker.start`, :meth:`split` or
    :meth:`then`, it reports to the tracker (or :class:`Report`) that created it. It pickles as its
    ids only; a worker process adopts an unpickled task into a :class:`Report`.

    Attributes:
        id: The task id, derived deterministically from the source id and the tree's shape.
        source_id: The source this task belongs to.
    """

    __slots__ = ("_book", "id", "source_id")

    def __init__(self, id: str, source_id: str, _book: _Book | None = None) -> None:
        """A task handle; prefer :meth:`Tracker.start`, :meth:`split` and :meth:`then`."""
        self.id = id
        self.source_id = source_id
        self._book = _book

    def __reduce__(self) -> tuple[type[Task], tuple[str, str]]:
        return (Task, (self.id, self.source_id))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Task):
            return NotImplemented
        return (self.id, self.source_id) == (other.id, other.source_id)

    def __hash__(self) -> int:
        return hash((self.id, self.source_id))

    def __repr__(self) -> str:
        return f"Task(id={self.id!r}, source_id={self.source_id!r})"

    def _report(self, kind: str, n: int) -> list[Task]:
        if self._book is None:
            raise RuntimeError(
                f"{self!r} is not attached to a Tracker or a Report (it was pickled): in a worker "
                f"process, `report = Report(); task = report.adopt(task)`, return the report and "
                f"`tracker.apply(report)` in the parent"
            )
        return self._book._outcome(self.id, self.source_id, kind, n)

    def split(self, n: int) -> list[Task]:
        """Fan out into ``n`` children ``<id>_0`` … ``<id>_<n-1>``: one delta ``n - 1``.

        ``split(1)`` is :meth:`then`, ``split(0)`` is :meth:`done`.

        Raises:
            ValueError: ``n`` is negative, or this task already has an outcome.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"split(n) needs an integer n >= 0, got {n!r}")
        return self._report("split", n)

    def then(self) -> Task:
        """Continue as one new task ``<id>_0`` (a 1:1 stage): delta ``0``."""
        return self._report("split", 1)[0]

    def done(self) -> None:
        """This branch is finished, its output written (a sink): delta ``-1``."""
        self._report("split", 0)

    def drop(self) -> None:
        """This branch is filtered out, nothing to write: delta ``-1``."""
        self._report("drop", 0)

    def failed(self) -> None:
        """This branch failed: delta ``0``; the source stays open, so the next run replays it.

        The task stays open: a retry within the run may still give it another outcome.
        """
        self._report("failed", 0)


class Report(_Book):
    """Outcomes recorded in a worker process, to be applied by the parent's :class:`Tracker`.

    Picklable: return it from the worker function. Example::

        def work(task: Task) -> Report:
            report = Report()
            task = report.adopt(task)
            for part in task.split(3):
                part.done()
            return report

        # in the parent
        tracker.apply(executor.submit(work, task).result())
    """

    def __init__(self) -> None:
        """An empty report."""
        super().__init__()
        self._records: list[_Record] = []

    def adopt(self, task: Task) -> Task:
        """Attach a task received from the parent to this report.

        Returns:
            The same task, reporting its outcomes (and its children's) into this report.
        """
        return self._bind(task.id, task.source_id)

    def _record(self, record: _Record, delta: Delta) -> None:
        self._records.append(record)

    @property
    def deltas(self) -> list[Delta]:
        """The deltas the recorded outcomes stand for, in order."""
        return [(f"{tid}_0", sid, _delta(kind, n)) for kind, tid, sid, n in self._records]

    def __len__(self) -> int:
        return len(self._records)

    def __getstate__(self) -> dict[str, object]:
        return {"records": self._records}

    def __setstate__(self, state: dict[str, object]) -> None:
        records = state["records"]
        assert isinstance(records, list)
        self._records = records
        self._open = {}


class Tracker(_Book):
    """Turns a run's task outcomes into the deltas of one :class:`tally.Writer`.

    One run is one writer and one tracker, in the process that opened the writer. Its methods
    raise ``ValueError`` on misuse and otherwise only call the writer's ``apply_deltas``, which
    never raises (``flush()`` / ``close()`` report delivery problems).

    Args:
        writer: An open writer (or anything with its ``apply_deltas`` and ``are_completed``,
            ``save_cursor`` and ``cursor`` for cursors, ``report_failure`` for failures, and
            ``declare`` for a total; without it :meth:`todo` declares nothing).
    """

    def __init__(self, writer: _Writer) -> None:
        """Track outcomes for ``writer``."""
        super().__init__()
        self.writer = writer
        self._batch: list[Delta] | None = None
        self._declaring = True  # False after a refused declaration (an older coordinator)

    def todo(self, sources: Iterable[str]) -> list[str]:
        """The sources the checkpoint has not completed, in order, without duplicates.

        Completions by any writer of the checkpoint count, including other SLURM array tasks that
        are still running. ``sources`` are first declared as the checkpoint's sources (the
        writer's ``declare``: idempotent and additive, so each array task adds its share), which
        gives status views a total, a percent and an ETA; a declaration that fails is logged and
        changes nothing else.
        """
        ids = _distinct_ids(sources)
        self._declare(ids)
        return [sid for sid, done in zip(ids, self.writer.are_completed(ids), strict=True) if not done]

    def claim(self, sources: Iterable[str], *, ahead: int = 1) -> Iterator[str]:
        """The sources this run may work on, claimed for its writer as the iteration reaches them.

        Each source is acquired (:meth:`tally.Writer.acquire`) just before it is yielded, ``ahead``
        at a time: those another live writer holds, and those completed or failed, are skipped.
        Once through, the held ones are asked about again and those that came free (their writer
        closed or lost its lease without completing them) are yielded too. Work on each source
        yielded (:meth:`start` it) before taking the next: a claim lasts until the source
        completes, or this writer closes or loses its lease.

        Args:
            sources: Source ids, e.g. from :meth:`todo`; repeats are taken once.
            ahead: Sources acquired per call (1: the fairest split between overlapping runs).

        Raises:
            TypeError: The writer has no ``acquire`` (a stand-in writer).
            ValueError: A source id is empty or not a string, or ``ahead`` is below 1.
        """
        acquire = getattr(self.writer, "acquire", None)
        if acquire is None:
            raise TypeError(f"{type(self.writer).__name__} has no acquire(): claims need a tally.Writer")
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead must be an integer >= 1, got {ahead!r}")
        ids = _distinct_ids(sources)
        return self._claimed(acquire, ids, ahead)

    @staticmethod
    def _claimed(acquire: _Acquire, ids: list[str], ahead: int) -> Iterator[str]:
        held: list[str] = []
        for start in range(0, len(ids), ahead):
            claims = acquire(ids[start : start + ahead])
            for sid in ids[start : start + ahead]:
                state = claims[sid].state
                if state == "acquired":
                    yield sid
                elif state == "held":
                    held.append(sid)
        if held:
            logger.info(
                "%s %s held by other writers; asking once more",
                count(len(held), "source"),
                "was" if len(held) == 1 else "were",
            )
            for start in range(0, len(held), ahead):
                claims = acquire(held[start : start + ahead])
                for sid in held[start : start + ahead]:
                    if claims[sid].state == "acquired":
                        yield sid

    def _declare(self, ids: list[str]) -> None:
        declare = getattr(self.writer, "declare", None)  # optional: a stand-in writer may lack it
        if declare is None or not ids or not self._declaring:
            return
        try:
            declare(ids)
        except TallyError as err:
            self._declaring = False
            logger.warning(
                "could not declare %s (no total in status views): %s", count(len(ids), "source"), err
            )

    def save_cursor(self, source_id: str, data: bytes) -> None:
        """Remember where the run got to inside ``source_id`` (at most 4096 bytes, e.g. a row offset).

        Buffered by the writer and durable once ``writer.flush()`` returns (``close()`` saves it
        too); it survives coordinator restarts and writer changes and goes when the source
        completes. No I/O.

        Raises:
            ValueError: ``source_id`` is empty or ``data`` is longer than 4096 bytes.
            TypeError: ``data`` is not bytes-like.
        """
        if not isinstance(source_id, str) or not source_id:
            raise ValueError(f"a source id must be a non-empty string, got {source_id!r}")
        self.writer.save_cursor(source_id, data)

    def cursor(self, source_id: str) -> bytes | None:
        """Where a run got to inside ``source_id``: the latest cursor saved by this run or an
        earlier one, or None (never saved, or the source is completed)."""
        if not isinstance(source_id, str) or not source_id:
            raise ValueError(f"a source id must be a non-empty string, got {source_id!r}")
        return self.writer.cursor(source_id)

    def report_failure(self, source_id: str, reason: str = "") -> FailureReport:
        """Record a failed attempt at ``source_id`` on the coordinator (durable on return), for the
        checkpoint's failure budget (``max_attempts``): a source that failed that many times is
        *failed*, listed by ``tally failed`` and skipped by the NeMo Curator drop-in until
        ``tally retry``. Unlike :meth:`Task.failed` (a delta of 0) it is a call, made at once.

        Typically once per source attempt that gave up, after its tasks' ``failed()``.

        Returns:
            The source's failed attempts so far, and whether it is failed now.

        Raises:
            ValueError: ``source_id`` is empty.
            tally.FailedPrecondition: The source is completed already.
        """
        if not isinstance(source_id, str) or not source_id:
            raise ValueError(f"a source id must be a non-empty string, got {source_id!r}")
        return self.writer.report_failure(source_id, reason)

    def start(self, source_id: str) -> Task:
        """Begin a source: its root task (delta ``+1``, keyed on the root task's id).

        Starting a source again (a retry) returns the same task and sends the same delta, which the
        coordinator skips.
        """
        if not isinstance(source_id, str) or not source_id:
            raise ValueError(f"a source id must be a non-empty string, got {source_id!r}")
        root = root_task_id(source_id)
        self.writer.apply_deltas([(root, source_id, 1)])
        return self._bind(root, source_id)

    def adopt(self, task: Task) -> Task:
        """Attach a task that came back from a worker (e.g. a child of a split) to this tracker.

        Raises:
            ValueError: The task is not open here (its report was not applied yet, or it has an
                outcome already).
        """
        if self._open.get(task.id) != task.source_id:
            raise ValueError(f"{task!r} is not open here: apply the report that created it first")
        return Task(task.id, task.source_id, self)

    def apply(self, report: Report | Sequence[Report]) -> None:
        """Apply the outcomes a worker recorded, in order, as one ``apply_deltas`` call.

        Raises:
            ValueError: An outcome concerns a task that is not open here (the report was applied
                already, or before the report that created its tasks). The outcomes before it
                are applied.
        """
        reports = [report] if isinstance(report, Report) else list(report)
        self._batch = []
        try:
            for rep in reports:
                for kind, task_id, source_id, n in rep._records:
                    self._outcome(task_id, source_id, kind, n)
        finally:
            batch, self._batch = self._batch, None
            if batch:
                self.writer.apply_deltas(batch)

    def _record(self, record: _Record, delta: Delta) -> None:
        if self._batch is not None:
            self._batch.append(delta)
        else:
            self.writer.apply_deltas([delta])
