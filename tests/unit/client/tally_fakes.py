"""Test doubles for the SDK's own Transport interface (no grpc mocking).

``FakeTransport`` implements ``tally._transport.base.Transport``: ``send`` hands each call
description to the method of the same operation below, where tests script failures and hold calls
at a gate to control exactly what is in flight. ``AsyncFakeTransport`` runs the same fake in worker
threads so that a held call never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

from tally import _calls as calls
from tally._client import AsyncClient, Client
from tally._config import ClientConfig
from tally._types import (
    ApplyCounts,
    CheckpointPage,
    CheckpointStatus,
    CloseResult,
    CompletedPage,
    Delta,
    Event,
    EventPage,
    FailedAttempt,
    FailurePage,
    FailureReport,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    ResetResult,
    SourceFailures,
    WriterPage,
    WriterSpec,
    WriterStatus,
)
from tally._writer import WriterBase
from tally.errors import FailedPrecondition, NotFound, TallyError

T = TypeVar("T")

# Generous bound for waits on events that should happen promptly; never a synchronization sleep.
WAIT_S = 10.0


def make_status(name: str, completed: int = 0) -> CheckpointStatus:
    return CheckpointStatus(
        name=name,
        completed_count=completed,
        live_writers=0,
        pending_sources=0,
        settling_sources=0,
        anomalies=0,
        unreadable_files=0,
        created_at=1.0,
        last_activity_at=2.0,
        writers=(),
        fingerprint={},
    )


def make_writer(writer_id: str) -> WriterStatus:
    return WriterStatus(writer_id, "host", 1, {"slurm_job_id": "9"}, "open", 0, ApplyCounts(), 1.0, 2.0)


class FakeTransport:
    """An in-memory coordinator behind the Transport protocol."""

    def __init__(self, *, lease_ttl_s: float = 30.0, settle_ms: int = 250) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.settle_ms = settle_ms
        # What ApplyDeltas answers say of the writer: True lets a flush end without a call.
        self.settled = False
        self._cond = threading.Condition()
        self.calls: list[str] = []  # method names, in call order
        self.attempts: list[tuple[int, list[Delta]]] = []  # every ApplyDeltas attempt
        self.applied: list[Delta] = []  # deltas of successful attempts, in order
        self.specs: list[WriterSpec] = []
        self.completed: set[str] = set()
        self.checkpoint_names: list[str] = []
        self.writer_ids: list[str] = ["w0", "w1"]  # live writers ListWriters pages through
        self._failures: dict[str, deque[TallyError]] = defaultdict(deque)
        self._gates: dict[str, threading.Event] = {}
        self.closed = False
        # Status RPCs: every call's arguments, and what the watch streams send.
        self.args: dict[str, list[tuple[object, ...]]] = defaultdict(list)
        # One list per watch connection: statuses to send, then the stream ends; an error in the
        # list is raised at that point instead.
        self.watch_script: deque[list[CheckpointStatus | TallyError]] = deque()
        self.watch_closed = 0
        # Cursors saved: source id -> (data, writer handle); every SaveCursors call's cursors.
        self.cursors: dict[str, tuple[bytes, str]] = {}
        self.cursor_calls: list[list[tuple[str, bytes]]] = []
        # Failure budgets: source id -> reasons of its failed attempts (oldest first); the budget
        # (0: unlimited); every ListFailures / RetryFailed call (see ``args``).
        self.failed_attempts: dict[str, list[str]] = {}
        self.attempt_ids: list[str] = []  # of each ReportFailure received, retries included
        self.max_attempts = 0
        self.failures_page = 1000  # most sources per page when a listing names none
        # Declared totals: declared ids, and the most any count said (the total is the larger).
        self.declared: set[str] = set()
        self.declared_count = 0

    # ---------------------------------------------------------------- scripting

    def fail(self, method: str, *errors: TallyError) -> None:
        """The next calls of ``method`` raise ``errors``, one per call."""
        with self._cond:
            self._failures[method].extend(errors)

    def hold(self, method: str) -> threading.Event:
        """Calls of ``method`` wait until the returned event is set."""
        gate = threading.Event()
        self._gates[method] = gate
        return gate

    def count(self, method: str) -> int:
        with self._cond:
            return self.calls.count(method)

    def wait_calls(self, method: str, n: int) -> None:
        """Block until ``method`` was called at least ``n`` times."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.calls.count(method) >= n, WAIT_S), (
                f"{method} called {self.calls.count(method)} times, expected {n}"
            )

    def _enter(self, method: str) -> None:
        with self._cond:
            self.calls.append(method)
            self._cond.notify_all()
        gate = self._gates.get(method)
        if gate is not None:
            assert gate.wait(WAIT_S), f"{method} held at its gate for too long"
        with self._cond:
            if self._failures[method]:
                raise self._failures[method].popleft()

    # ---------------------------------------------------------------- Transport

    def send(self, call: calls.Call[T], timeout: float) -> T:
        # Looked up at call time, so a test may replace one operation's method.
        operations: dict[type[Any], Callable[[Any], Any]] = {
            calls.OpenWriter: lambda c: self.open_writer(c.spec, timeout),
            calls.KeepAlive: lambda c: self.keep_alive(c.handle, timeout),
            calls.ApplyDeltas: lambda c: self.apply_deltas(c.handle, c.deltas, c.batch_seq, timeout),
            calls.AreCompleted: lambda c: self.are_completed(c.checkpoint, c.source_ids, timeout),
            calls.Flush: lambda c: self.flush(c.handle, timeout),
            calls.CloseWriter: lambda c: self.close_writer(c.handle, timeout),
            calls.GetCheckpoint: lambda c: self.get_checkpoint(c.name, timeout),
            calls.ListCheckpoints: lambda c: self.list_checkpoints(c.after, c.limit, timeout),
            calls.ListWriters: lambda c: self.list_writers(
                c.checkpoint, c.include_closed, c.limit, c.after, timeout
            ),
            calls.ListEvents: lambda c: self.list_events(c.checkpoint, c.limit, c.before_id, timeout),
            calls.GetProgress: lambda c: self.get_progress(c.checkpoint, c.since, timeout),
            calls.ListCompleted: lambda c: self.list_completed(c.checkpoint, c.after, c.limit, timeout),
            calls.ImportCompleted: lambda c: self.import_completed(
                c.checkpoint, c.source_ids, c.import_id, timeout
            ),
            calls.ResetCheckpoint: lambda c: self.reset_checkpoint(c.name, c.force, timeout),
            calls.SaveCursors: lambda c: self.save_cursors(c.handle, c.cursors, timeout),
            calls.GetCursor: lambda c: self.get_cursor(c.checkpoint, c.source_id, timeout),
            calls.ReportFailure: lambda c: self.report_failure(
                c.handle, c.source_id, c.reason, timeout, c.attempt_id
            ),
            calls.ListFailures: lambda c: self.list_failures(c, timeout),
            calls.RetryFailed: lambda c: self.retry_failed(c.checkpoint, c.source_ids, timeout),
            calls.SetFailureBudget: lambda c: self.set_failure_budget(c.checkpoint, c.max_attempts, timeout),
            calls.DeclareSources: lambda c: self.declare_sources(
                c.checkpoint, c.source_ids, c.count, timeout
            ),
            calls.ListRemaining: lambda c: self.list_remaining(c.checkpoint, c.after, c.limit, timeout),
        }
        return cast(T, operations[type(call)](call))

    def watch(self, call: calls.WatchCheckpoint, timeout: float) -> Generator[CheckpointStatus, None, None]:
        return self.watch_stream(call.checkpoint, call.interval_ms, timeout)

    # ---------------------------------------------------------------- one method per operation

    def open_writer(self, spec: WriterSpec, timeout: float) -> OpenedWriter:
        self._enter("open_writer")
        self.specs.append(spec)
        return OpenedWriter(
            handle=f"h-{len(self.specs)}",
            writer_id=spec.writer_id,
            lease_ttl_s=self.lease_ttl_s,
            completed_count=len(self.completed),
            settle_ms=self.settle_ms,
        )

    def keep_alive(self, handle: str, timeout: float) -> float:
        self._enter("keep_alive")
        return self.lease_ttl_s

    def apply_deltas(
        self, handle: str, deltas: Sequence[Delta], batch_seq: int, timeout: float
    ) -> calls.BatchAnswer:
        with self._cond:
            self.attempts.append((batch_seq, list(deltas)))
        self._enter("apply_deltas")
        with self._cond:
            self.applied.extend(deltas)
        return calls.BatchAnswer(ApplyCounts(applied=len(deltas)), settled=self.settled)

    def are_completed(self, checkpoint: str, source_ids: Sequence[str], timeout: float) -> list[bool]:
        self._enter("are_completed")
        return [sid in self.completed for sid in source_ids]

    def flush(self, handle: str, timeout: float) -> int:
        self._enter("flush")
        return len(self.completed)

    def close_writer(self, handle: str, timeout: float) -> CloseResult:
        self._enter("close_writer")
        return CloseResult(
            counts=ApplyCounts(applied=len(self.applied)), incomplete_sources=("s9",), incomplete_count=1
        )

    def get_checkpoint(self, name: str, timeout: float) -> CheckpointStatus:
        self._enter("get_checkpoint")
        if name not in self.checkpoint_names:
            raise NotFound(f"checkpoint {name!r} does not exist")
        return make_status(name)

    def list_checkpoints(self, after: str, limit: int, timeout: float) -> CheckpointPage:
        self.args["list_checkpoints"].append((after, limit))
        self._enter("list_checkpoints")
        names = sorted(n for n in self.checkpoint_names if n > after)
        page = names[: limit or 1000]
        return CheckpointPage(tuple(make_status(n) for n in page), page[-1] if len(names) > len(page) else "")

    def list_writers(
        self, checkpoint: str, include_closed: bool, limit: int, after: str, timeout: float
    ) -> WriterPage:
        self.args["list_writers"].append((checkpoint, include_closed, limit, after))
        self._enter("list_writers")
        ids = [w for w in self.writer_ids if f"live/{w}" > after]
        page = ids[: limit or 1000]
        return WriterPage(
            tuple(make_writer(w) for w in page), f"live/{page[-1]}" if len(ids) > len(page) else ""
        )

    def list_events(self, checkpoint: str, limit: int, before_id: int | None, timeout: float) -> EventPage:
        self.args["list_events"].append((checkpoint, limit, before_id))
        self._enter("list_events")
        top = (before_id or 11) - 1
        ids = [i for i in range(top, max(top - limit, 0), -1)]
        events = tuple(Event(i, checkpoint, "k", f"event {i}", float(i), "", {"n": i}) for i in ids)
        return EventPage(events, ids[-1] if ids and ids[-1] > 1 else None)

    def get_progress(self, checkpoint: str, since: float | None, timeout: float) -> list[ProgressSample]:
        self.args["get_progress"].append((checkpoint, since))
        self._enter("get_progress")
        return [ProgressSample(1.0, 1), ProgressSample(2.0, 3)]

    def list_completed(self, checkpoint: str, after: str, limit: int, timeout: float) -> CompletedPage:
        self.args["list_completed"].append((checkpoint, after, limit))
        self._enter("list_completed")
        ids = sorted(s for s in self.completed if s > after)[:limit]
        rest = [s for s in self.completed if ids and s > ids[-1]]
        return CompletedPage(tuple(ids), ids[-1] if rest else "")

    def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], import_id: str, timeout: float
    ) -> ImportResult:
        self.args["import_completed"].append((checkpoint, list(source_ids), import_id))
        self._enter("import_completed")
        new = set(source_ids) - self.completed
        self.completed |= new
        return ImportResult(len(new), len(self.completed))

    def reset_checkpoint(self, name: str, force: bool, timeout: float) -> ResetResult:
        self.args["reset_checkpoint"].append((name, force))
        self._enter("reset_checkpoint")
        return ResetResult(f".trash/{name}/t", 2, 1 if force else 0)

    def save_cursors(
        self, handle: str, cursors: Sequence[tuple[str, bytes]], timeout: float
    ) -> calls.CursorsSaved:
        with self._cond:
            self.cursor_calls.append(list(cursors))
        self._enter("save_cursors")
        saved = completed = 0
        with self._cond:
            for source_id, data in cursors:
                if source_id in self.completed:  # a completed source has no cursor
                    completed += 1
                    continue
                self.cursors[source_id] = (bytes(data), handle)
                saved += 1
        return calls.CursorsSaved(saved, completed)

    def get_cursor(self, checkpoint: str, source_id: str, timeout: float) -> calls.SavedCursor | None:
        self.args["get_cursor"].append((checkpoint, source_id))
        self._enter("get_cursor")
        with self._cond:
            if source_id in self.completed or source_id not in self.cursors:
                return None
            data, handle = self.cursors[source_id]
        return calls.SavedCursor(data, 1.0, handle)

    def _source_failures(self, source_id: str) -> SourceFailures:
        reasons = self.failed_attempts[source_id]
        failed = bool(self.max_attempts) and len(reasons) >= self.max_attempts
        recent = tuple(FailedAttempt(r, 1.0, "w") for r in reasons[-10:])
        return SourceFailures(source_id, len(reasons), failed, recent)

    def report_failure(
        self, handle: str, source_id: str, reason: str, timeout: float, attempt_id: str = ""
    ) -> FailureReport:
        self.args["report_failure"].append((handle, source_id, reason))
        self.attempt_ids.append(attempt_id)
        self._enter("report_failure")
        with self._cond:
            if source_id in self.completed:
                raise FailedPrecondition(f"source {source_id!r} is completed")
            self.failed_attempts.setdefault(source_id, []).append(reason)
            found = self._source_failures(source_id)
        return FailureReport(found.attempts, found.failed, self.max_attempts)

    def list_failures(self, call: calls.ListFailures, timeout: float) -> FailurePage:
        self.args["list_failures"].append(
            (call.checkpoint, tuple(call.source_ids), call.failed_only, call.after)
        )
        self._enter("list_failures")
        with self._cond:
            asked = list(call.source_ids)
            names = sorted(
                s
                for s in (asked or self.failed_attempts)
                if s in self.failed_attempts and (asked or s > call.after)
            )
            found = [self._source_failures(s) for s in names]
        if call.failed_only:
            found = [f for f in found if f.failed]
        limit = call.limit or self.failures_page
        if asked or len(found) <= limit:
            return FailurePage(tuple(found), "", self.max_attempts)
        page = found[:limit]
        return FailurePage(tuple(page), page[-1].source_id, self.max_attempts)

    def retry_failed(self, checkpoint: str, source_ids: Sequence[str], timeout: float) -> int:
        self.args["retry_failed"].append((checkpoint, tuple(source_ids)))
        self._enter("retry_failed")
        with self._cond:
            cleared = [s for s in (source_ids or list(self.failed_attempts)) if s in self.failed_attempts]
            for s in cleared:
                del self.failed_attempts[s]
        return len(cleared)

    def set_failure_budget(self, checkpoint: str, max_attempts: int, timeout: float) -> calls.FailureBudget:
        self.args["set_failure_budget"].append((checkpoint, max_attempts))
        self._enter("set_failure_budget")
        with self._cond:
            self.max_attempts = max_attempts
            failed = sum(self._source_failures(s).failed for s in self.failed_attempts)
        return calls.FailureBudget(max_attempts, failed)

    def declare_sources(
        self, checkpoint: str, source_ids: Sequence[str], count: int, timeout: float
    ) -> calls.Declared:
        self.args["declare_sources"].append((checkpoint, tuple(source_ids), count))
        self._enter("declare_sources")
        with self._cond:
            self.declared |= set(source_ids)
            self.declared_count = max(self.declared_count, count)
            total = max(len(self.declared), self.declared_count)
            remaining = len(self.declared - self.completed) if len(self.declared) >= total else -1
        return calls.Declared(total, remaining)

    def list_remaining(self, checkpoint: str, after: str, limit: int, timeout: float) -> CompletedPage:
        self.args["list_remaining"].append((checkpoint, after, limit))
        self._enter("list_remaining")
        left = sorted(self.declared - self.completed)
        ids = [s for s in left if s > after][: limit or 1000]
        rest = [s for s in left if ids and s > ids[-1]]
        return CompletedPage(tuple(ids), ids[-1] if rest else "")

    def watch_stream(
        self, checkpoint: str, interval_ms: int, timeout: float
    ) -> Generator[CheckpointStatus, None, None]:
        self.args["watch"].append((checkpoint, interval_ms))
        self._enter("watch")
        script = self.watch_script.popleft() if self.watch_script else []
        try:
            for item in script:
                if isinstance(item, TallyError):
                    raise item
                yield item
        finally:
            self.watch_closed += 1

    def close(self) -> None:
        self.closed = True


class AsyncFakeTransport:
    """The AsyncTransport face of a FakeTransport: each call runs in a worker thread."""

    def __init__(self, fake: FakeTransport) -> None:
        self.fake = fake

    async def send(self, call: calls.Call[T], timeout: float) -> T:
        return await asyncio.to_thread(self.fake.send, call, timeout)

    async def close(self) -> None:
        self.fake.close()

    async def watch(
        self, call: calls.WatchCheckpoint, timeout: float
    ) -> AsyncGenerator[CheckpointStatus, None]:
        stream = self.fake.watch(call, timeout)
        try:
            for status in stream:
                yield status
        finally:
            stream.close()


# Zero backoff keeps retry tests instant; small batches make coalescing visible.
TEST_CONFIG = ClientConfig(
    address="fake:1", timeout=WAIT_S, max_batch=100, retry_initial_s=0.0, retry_max_s=0.0
)


def make_client(fake: FakeTransport, **overrides: object) -> Client:
    client = Client.__new__(Client)
    client._init(replace(TEST_CONFIG, **overrides), fake)  # type: ignore[arg-type]
    return client


def make_async_client(fake: FakeTransport, **overrides: object) -> AsyncClient:
    client = AsyncClient.__new__(AsyncClient)
    client._init(replace(TEST_CONFIG, **overrides), AsyncFakeTransport(fake))  # type: ignore[arg-type]
    return client


def wait_state(writer: WriterBase, predicate: Callable[[], bool]) -> None:
    """Block until ``predicate`` (which reads writer internals, lock held) is true."""
    with writer._changed:
        assert writer._changed.wait_for(predicate, WAIT_S), "writer state not reached in time"


def deltas(n: int, prefix: str = "t", source: str = "s") -> list[Delta]:
    return [(f"{prefix}{i}", f"{source}{i % 7}", 1) for i in range(n)]


def no_tally_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("tally-")]
