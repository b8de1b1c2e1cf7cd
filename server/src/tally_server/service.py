"""The coordinator service: the one API both transports call.

Orchestrates the pure domain (``tally_server.domain``) and the stores behind its ports. Runs on one
asyncio event loop; domain state is only touched on that loop, blocking store calls run on
dedicated threads. Ordering guarantees that matter:

* a completion becomes visible in the live set only after its LMDB commit is durable;
* completion and un-complete commits go through one FIFO group committer, and their effects on
  the live set are applied in that same order, so a late anomaly always wins over an earlier
  completion of the same source.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint, CompletedSet, WriterSession, WriterState
from tally_server.domain.ledger import ApplyCounts, Delta, WriterLedger
from tally_server.domain.ports import (
    CheckpointRecord,
    CompletionOp,
    CompletionStore,
    DeleteCompleted,
    EventRecord,
    ProgressRecord,
    PutCompleted,
    Registry,
    WriterRecord,
)
from tally_server.domain.validation import Limits
from tally_server.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class OpenedWriter:
    handle: str
    writer_id: str
    lease_ttl_s: float
    completed_count: int
    settle_ms: int


@dataclass(frozen=True)
class ClosedWriter:
    counts: ApplyCounts
    incomplete_sources: list[str]
    incomplete_count: int


@dataclass(frozen=True)
class WriterView:
    writer_id: str
    host: str
    pid: int
    labels: dict[str, str]
    state: str
    pending_sources: int
    counts: ApplyCounts
    opened_at: float
    last_seen_at: float
    closed_at: float = 0.0


@dataclass(frozen=True)
class EventView:
    id: int
    checkpoint: str
    kind: str
    message: str
    at: float
    writer_id: str
    data: dict[str, Any]


@dataclass(frozen=True)
class EventPage:
    events: list[EventView]
    next_before_id: int  # 0: no older events


@dataclass(frozen=True)
class ProgressSample:
    at: float
    completed_count: int


@dataclass(frozen=True)
class CompletedPage:
    source_ids: list[str]
    next_after: str  # "": last page


@dataclass(frozen=True)
class ImportResult:
    imported: int
    completed_count: int


@dataclass(frozen=True)
class ResetResult:
    moved_to: str
    files_moved: int
    writers_closed: int


@dataclass(frozen=True)
class CheckpointView:
    name: str
    completed_count: int
    live_writers: int
    pending_sources: int
    settling_sources: int
    anomalies: int
    unreadable_files: int
    created_at: float
    last_activity_at: float
    writers: list[WriterView]
    fingerprint: dict[str, str]


@dataclass
class ServiceStats:
    """Cumulative counters since the process started, read by the metrics collector at scrape time.

    ``commit_observers`` are called after every group commit with (seconds, ops, sources).
    """

    deltas_applied: int = 0
    deltas_skipped: int = 0
    deltas_rewritten: int = 0
    anomalies: int = 0
    completions: int = 0
    writers_opened: int = 0
    writers_expired: int = 0
    commit_observers: list[Callable[[float, int, int], None]] = field(default_factory=list)

    def count(self, counts: ApplyCounts) -> None:
        self.deltas_applied += counts.applied
        self.deltas_skipped += counts.skipped
        self.deltas_rewritten += counts.rewritten
        self.anomalies += counts.anomalies


# Sent back with incomplete sources on close; the full count is reported separately.
_MAX_INCOMPLETE_LISTED = 1000


class GroupCommitter:
    """Group commit: everything submitted while a commit runs goes into the next one.

    One synced transaction per touched file per group, never one per delta. Submitters are
    resumed in submission order, which is what keeps live-set effects in commit order.
    """

    def __init__(self, store: CompletionStore, stats: ServiceStats) -> None:
        self._store = store
        self._stats = stats
        self._queue: list[tuple[CompletionOp, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        # Also runs other file operations (reset) so they never interleave with a commit.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tally-commit")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tally-group-commit")

    async def submit(self, op: CompletionOp) -> None:
        if self._closing and self._task is None:
            raise Unavailable("the coordinator is shutting down; retry against the restarted coordinator")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((op, future))
        self._wake.set()
        await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                if self._closing:
                    return
                continue
            group, self._queue = self._queue, []
            started = time.perf_counter()
            try:
                await loop.run_in_executor(self.executor, self._store.commit, [op for op, _ in group])
            except Exception as exc:
                log.exception("completion commit of %d ops failed", len(group))
                for _, future in group:
                    if not future.done():
                        future.set_exception(
                            Unavailable(f"could not persist completions ({exc}); retry", cause=str(exc))
                        )
            else:
                elapsed = time.perf_counter() - started
                sources = sum(len(op.sources) for op, _ in group)
                for observe in self._stats.commit_observers:
                    observe(elapsed, len(group), sources)
                for _, future in group:
                    if not future.done():
                        future.set_result(None)
            if self._queue:
                self._wake.set()

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        self.executor.shutdown(wait=True)


@dataclass
class _Runtime:
    """Async companions of one writer session (kept out of the pure domain)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    commits_in_flight: int = 0
    # Completion commits that failed (their sources are re-settled and retried); a flush that saw
    # one fail while it waited must not report durability.
    failed_commits: int = 0


class CoordinatorService:
    """Checkpoints, writers and the counting rules behind one async API."""

    def __init__(
        self,
        *,
        completions: CompletionStore,
        registry: Registry,
        limits: Limits,
        settle_ms: int,
        lease_ttl_s: float,
        progress_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._completions = completions
        self._registry = registry
        self.limits = limits
        self.settle_ms = settle_ms
        self.lease_ttl_s = lease_ttl_s
        self.progress_interval_s = progress_interval_s
        self._clock = clock
        self._wall = wall_clock
        self._checkpoints: dict[str, Checkpoint] = {}
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._sessions: dict[str, WriterSession] = {}
        self._runtimes: dict[str, _Runtime] = {}
        self._registry_executor = ThreadPoolExecutor(1, thread_name_prefix="tally-registry")
        self._load_executor = ThreadPoolExecutor(1, thread_name_prefix="tally-load")
        self.stats = ServiceStats()
        self._committer = GroupCommitter(completions, self.stats)
        self._background: list[asyncio.Task[None]] = []
        self._finalizers: set[asyncio.Task[None]] = set()
        self._accepting = False
        self._resetting: set[str] = set()
        # Completed count last written as a progress sample, per checkpoint.
        self._sampled: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._committer.start()
        now = self._wall()
        lost = await self._in_registry(self._registry.mark_open_writers, WriterState.LOST, now)
        for record in lost:
            await self._event(
                record.checkpoint,
                "writer_lost",
                f"writer {record.writer_id} was open when the coordinator stopped; its pending "
                "state is gone and its unfinished sources will replay",
                record.writer_id,
            )
        loop = asyncio.get_running_loop()
        self._background = [
            loop.create_task(self._settle_loop(), name="tally-settle"),
            loop.create_task(self._lease_loop(), name="tally-leases"),
            loop.create_task(self._progress_loop(), name="tally-progress"),
        ]
        self._accepting = True

    def stop_accepting(self) -> None:
        """Refuse new work (UNAVAILABLE, so clients retry elsewhere or later) and end watch streams."""
        self._accepting = False

    async def shutdown(self) -> None:
        """Close every writer (finalizing settling sources), drain commits, close the stores."""
        self._accepting = False
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for handle in list(self._sessions):
            try:
                await self._close(self._sessions[handle], WriterState.CLOSED, "coordinator shutdown")
            except Exception:
                log.exception("closing writer %s during shutdown failed", handle)
        if self._finalizers:
            await asyncio.gather(*self._finalizers, return_exceptions=True)
        await self._sample_progress()
        await self._committer.close()
        self._completions.close()
        self._registry.close()
        self._registry_executor.shutdown(wait=True)
        self._load_executor.shutdown(wait=True)

    @property
    def ready(self) -> bool:
        return self._accepting

    def gauges(self) -> dict[str, tuple[int, int, int]]:
        """Per loaded checkpoint: (live writers, pending sources, completed sources)."""
        return {
            name: (len(cp.writers), cp.pending_sources(), len(cp.completed))
            for name, cp in self._checkpoints.items()
        }

    # ------------------------------------------------------------------ helpers

    async def _in_registry(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._registry_executor, fn, *args)

    async def _event(
        self, checkpoint: str, kind: str, message: str, writer_id: str | None = None, **data: Any
    ) -> None:
        log.info("%s [%s] %s", checkpoint, kind, message)
        await self._in_registry(
            self._registry.add_event,
            EventRecord(checkpoint, kind, message, self._wall(), writer_id, dict(data)),
        )

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise Unavailable("the coordinator is shutting down; retry against the restarted coordinator")

    async def _checkpoint(self, name: str, *, create: bool) -> Checkpoint | None:
        cp = self._checkpoints.get(name)
        if cp is not None:
            return cp
        lock = self._load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            cp = self._checkpoints.get(name)
            if cp is not None:
                return cp
            record = await self._in_registry(self._registry.get_checkpoint, name)
            loop = asyncio.get_running_loop()
            on_disk = await loop.run_in_executor(self._load_executor, self._completions.exists, name)
            if record is None and not on_disk and not create:
                return None
            loaded = await loop.run_in_executor(self._load_executor, self._completions.load, name)
            now = self._wall()
            if record is None:
                record = CheckpointRecord(name, created_at=now, last_activity_at=now)
                await self._in_registry(self._registry.upsert_checkpoint, record)
                await self._event(name, "checkpoint_created", f"checkpoint {name} created")
            cp = Checkpoint(
                name=name,
                completed=CompletedSet(loaded.completed),
                created_at=record.created_at,
                last_activity_at=record.last_activity_at,
                fingerprint=dict(record.fingerprint),
                unreadable_files=[u.path for u in loaded.unreadable],
            )
            for bad in loaded.unreadable:
                await self._event(
                    name,
                    "unreadable_file",
                    f"completion file {bad.path} is unreadable and was skipped (its sources count as "
                    f"not completed): {bad.error}",
                    path=bad.path,
                    error=bad.error,
                )
            self._checkpoints[name] = cp
            return cp

    def _session(self, handle: str) -> WriterSession:
        session = self._sessions.get(handle)
        if session is None or session.state != WriterState.OPEN:
            raise NotFound(
                f"writer handle {validation.describe(handle)} is not open (unknown, closed, or its lease "
                "expired); its pending state is gone: open a new writer (unfinished sources replay)",
            )
        return session

    def _renew(self, session: WriterSession) -> None:
        session.lease_deadline = self._clock() + self.lease_ttl_s
        session.last_seen_at = self._wall()

    def _writer_record(self, s: WriterSession, closed_at: float | None = None) -> WriterRecord:
        t = s.ledger.totals
        return WriterRecord(
            handle=s.handle,
            checkpoint=s.checkpoint,
            writer_id=s.writer_id,
            host=s.host,
            pid=s.pid,
            labels=dict(s.labels),
            fingerprint=dict(s.fingerprint),
            state=s.state,
            opened_at=s.opened_at,
            last_seen_at=s.last_seen_at,
            closed_at=closed_at,
            pending_sources=len(s.ledger.pending),
            applied=t.applied,
            skipped=t.skipped,
            rewritten=t.rewritten,
            anomalies=t.anomalies,
            completed=t.completed,
        )

    # ------------------------------------------------------------------ writers

    async def open_writer(
        self,
        checkpoint: str,
        *,
        writer_id: str = "",
        fingerprint: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        host: str = "",
        pid: int = 0,
        on_mismatch: str = "refuse",
    ) -> OpenedWriter:
        self._check_accepting()
        if on_mismatch not in ("refuse", "reset", "ignore"):
            raise InvalidArgument(f"on_mismatch {on_mismatch!r} is not one of refuse, reset, ignore")
        validation.checkpoint_name(checkpoint, self.limits)
        writer_id = writer_id or f"{socket.gethostname()}-tally-{uuid.uuid4().hex[:8]}"
        validation.writer_id(writer_id, self.limits)
        labels = dict(labels or {})
        fingerprint = dict(fingerprint or {})
        validation.labels(labels, self.limits)
        validation.labels(fingerprint, self.limits)
        validation.host(host, self.limits)
        if checkpoint in self._resetting:
            raise Unavailable(f"checkpoint {checkpoint!r} is being reset; retry in a moment")
        cp = await self._checkpoint(checkpoint, create=True)
        assert cp is not None
        await self._guard_fingerprint(cp, writer_id, fingerprint, on_mismatch)
        live = cp.writers.get(writer_id)
        if live is not None:
            raise AlreadyExists(
                f"writer {writer_id!r} is already live on checkpoint {checkpoint!r} (host {live.host!r}, "
                f"pid {live.pid}); close it, wait for its lease to expire ({self.lease_ttl_s:g} s), or "
                "choose another writer_id",
                writer_id=writer_id,
            )
        if len(cp.writers) >= self.limits.max_writers_per_checkpoint:
            raise ResourceExhausted(
                f"checkpoint {checkpoint!r} already has {len(cp.writers)} live writers, the limit "
                f"(setting max_writers_per_checkpoint={self.limits.max_writers_per_checkpoint}); close "
                "some writers or raise the limit",
            )
        now = self._wall()
        session = WriterSession(
            handle=uuid.uuid4().hex,
            writer_id=writer_id,
            checkpoint=checkpoint,
            host=host,
            pid=pid,
            labels=labels,
            fingerprint=fingerprint,
            opened_at=now,
            last_seen_at=now,
            lease_deadline=self._clock() + self.lease_ttl_s,
            ledger=WriterLedger(cp.completed.as_of_now(), self.settle_ms / 1000),
        )
        cp.writers[writer_id] = session
        self._sessions[session.handle] = session
        self.stats.writers_opened += 1
        self._runtimes[session.handle] = _Runtime()
        cp.last_activity_at = now
        if fingerprint and not cp.fingerprint:
            cp.fingerprint = dict(fingerprint)
        await self._in_registry(
            self._registry.upsert_checkpoint,
            CheckpointRecord(cp.name, cp.created_at, cp.last_activity_at, dict(cp.fingerprint)),
        )
        await self._in_registry(self._registry.upsert_writer, self._writer_record(session))
        await self._event(
            checkpoint,
            "writer_opened",
            f"writer {writer_id} opened (host {host or '?'}, pid {pid or '?'})",
            writer_id,
            labels=labels,
        )
        return OpenedWriter(session.handle, writer_id, self.lease_ttl_s, len(cp.completed), self.settle_ms)

    async def _guard_fingerprint(
        self, cp: Checkpoint, writer_id: str, fingerprint: dict[str, str], on_mismatch: str
    ) -> None:
        """DESIGN §2.5: refuse to resume a checkpoint with different inputs unless told otherwise."""
        if not fingerprint or not cp.fingerprint:
            return  # nothing to compare: the first fingerprint is recorded by open_writer
        recorded = cp.fingerprint
        differing = sorted(
            k for k in recorded.keys() | fingerprint.keys() if recorded.get(k) != fingerprint.get(k)
        )
        if not differing:
            return
        absent = "(absent)"
        detail = "; ".join(
            f"{k}: recorded {validation.describe(recorded.get(k, absent))}, "
            f"this writer {validation.describe(fingerprint.get(k, absent))}"
            for k in differing
        )
        if on_mismatch == "ignore":
            await self._event(
                cp.name,
                "fingerprint_mismatch_ignored",
                f"writer {writer_id} opened with a different fingerprint ({detail}); ignored as it asked",
                writer_id,
                differing=differing,
            )
            return
        if on_mismatch == "reset":
            # Refused while other writers are live (reset_checkpoint says so); the new fingerprint
            # is recorded by open_writer once the checkpoint is empty again.
            await self.reset_checkpoint(cp.name)
            return
        raise FailedPrecondition(
            f"checkpoint {cp.name!r} was started with a different fingerprint: {detail}. Resuming it "
            "with other inputs could skip work that was never done for them. Use a new checkpoint name, "
            "or open with on_mismatch='reset' to start this one over (its files go to the trash) or "
            "on_mismatch='ignore' if the difference does not matter",
            differing=differing,
        )

    async def keep_alive(self, handle: str) -> float:
        self._check_accepting()
        session = self._session(handle)
        self._renew(session)
        await self._in_registry(self._registry.upsert_writer, self._writer_record(session))
        return self.lease_ttl_s

    async def apply_deltas(self, handle: str, batch: Sequence[Delta]) -> ApplyCounts:
        self._check_accepting()
        validation.deltas(batch, self.limits)
        session = self._session(handle)
        runtime = self._runtimes[session.handle]
        async with runtime.lock:
            session = self._session(handle)  # may have closed while we waited
            self._renew(session)
            cp = self._checkpoints[session.checkpoint]
            result = session.ledger.apply(batch, self._clock())
            self.stats.count(result.counts)
            completing = session.ledger.mark_completing(result.complete_now)
            cp.last_activity_at = session.last_seen_at
            counts = result.counts
            if result.anomalies:
                await self._uncomplete(cp, session, result.anomalies)
            if completing:
                try:
                    await self._persist(cp, session, completing)
                except Exception:
                    session.ledger.revert_completing(completing, self._clock())
                    raise
                counts.completed = len(completing)
            async with runtime.changed:
                runtime.changed.notify_all()
            return counts

    async def _persist(
        self, cp: Checkpoint, session: WriterSession, sources: list[str], *, counted: bool = False
    ) -> None:
        """Commit ``sources`` as completed, then make them visible.

        ``counted``: the caller already raised ``commits_in_flight`` synchronously, when it marked
        the sources completing; a flush or close arriving before this coroutine runs must wait.
        """
        runtime = self._runtimes[session.handle]
        if not counted:
            runtime.commits_in_flight += 1
        try:
            await self._committer.submit(PutCompleted(cp.name, session.writer_id, sources))
            # Durable now; only from here on may anyone see it.
            cp.completed.add(sources)
            self.stats.completions += len(sources)
        except Exception:
            runtime.failed_commits += 1
            raise
        finally:
            runtime.commits_in_flight -= 1
            async with runtime.changed:
                runtime.changed.notify_all()

    async def _uncomplete(self, cp: Checkpoint, session: WriterSession, anomalies: Sequence[Any]) -> None:
        sources = list(dict.fromkeys(a.source_id for a in anomalies))
        for sid in sources:
            cp.completed.discard(sid)  # invisible at once; never report a doubtful completion
        cp.anomalies += len(anomalies)
        await self._committer.submit(DeleteCompleted(cp.name, sources))
        for sid in sources:
            cp.completed.discard(sid)  # again, after any completion committed before this delete
        for a in anomalies:
            change = "a new task" if a.old_delta is None else f"delta {a.old_delta} -> {a.new_delta}"
            await self._event(
                cp.name,
                "anomaly",
                f"source {a.source_id} got {change} (task {a.task_id}) after it was completed; it was "
                "un-completed in every writer file and will be reprocessed next run",
                session.writer_id,
                task_id=a.task_id,
                source_id=a.source_id,
                old_delta=a.old_delta,
                new_delta=a.new_delta,
            )

    async def flush(self, handle: str) -> int:
        """Return once every completion resulting from deltas applied so far is durable.

        Sources still settling are waited for (their window runs out or a delta cancels it); the
        window is never cut short, so a flush cannot make a completion early.
        """
        self._check_accepting()
        session = self._session(handle)
        runtime = self._runtimes[session.handle]
        async with runtime.lock:
            self._renew(session)
            waiting = dict(session.ledger.settling)
            failures = runtime.failed_commits

        def settled() -> bool:
            if session.state != WriterState.OPEN:
                return True
            settling = session.ledger.settling
            return runtime.commits_in_flight == 0 and all(
                settling.get(sid) != deadline for sid, deadline in waiting.items()
            )

        async with runtime.changed:
            await runtime.changed.wait_for(settled)
        if session.state == WriterState.EXPIRED:
            raise NotFound(
                f"writer {session.writer_id!r} expired while flushing; its pending state is gone: "
                "open a new writer (unfinished sources replay)",
            )
        if runtime.failed_commits != failures:
            raise Unavailable(
                "persisting completions failed while flushing; they are being retried, so flush again "
                "(see the coordinator log for the storage error)",
            )
        return session.ledger.totals.completed

    async def close_writer(self, handle: str) -> ClosedWriter:
        self._check_accepting()
        session = self._session(handle)
        return await self._close(session, WriterState.CLOSED, "closed by its client")

    async def _close(self, session: WriterSession, state: str, why: str) -> ClosedWriter:
        runtime = self._runtimes[session.handle]
        async with runtime.lock:
            if session.state != WriterState.OPEN:
                raise NotFound(f"writer {session.writer_id!r} is already closed")
            cp = self._checkpoints[session.checkpoint]
            if state == WriterState.CLOSED:
                # No more deltas can come: everything settling has all its deltas, so it completes.
                completing = session.ledger.mark_completing(session.ledger.take_all_settling())
                if completing:
                    await self._persist(cp, session, completing)
            async with runtime.changed:
                await runtime.changed.wait_for(lambda: runtime.commits_in_flight == 0)
            session.state = state
            if state == WriterState.EXPIRED:
                self.stats.writers_expired += 1
            incomplete = list(session.ledger.pending)
            del cp.writers[session.writer_id]
            del self._sessions[session.handle]
            now = self._wall()
            cp.last_activity_at = now
            await self._in_registry(self._registry.upsert_writer, self._writer_record(session, now))
            await self._event(
                cp.name,
                f"writer_{state}",
                f"writer {session.writer_id} {why}; {len(incomplete)} sources left incomplete will replay",
                session.writer_id,
                incomplete=len(incomplete),
            )
            async with runtime.changed:
                runtime.changed.notify_all()
        self._runtimes.pop(session.handle, None)
        totals = session.ledger.totals
        return ClosedWriter(
            ApplyCounts(totals.applied, totals.skipped, totals.rewritten, totals.anomalies, totals.completed),
            incomplete[:_MAX_INCOMPLETE_LISTED],
            len(incomplete),
        )

    # ------------------------------------------------------------------ background

    async def _settle_loop(self) -> None:
        # Completes settling sources whose window passed, and retries completions whose commit failed.
        interval = min(max(self.settle_ms / 1000 / 5, 0.005), 0.05) if self.settle_ms else 0.05
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            for session in list(self._sessions.values()):
                if not session.ledger.settling or session.state != WriterState.OPEN:
                    continue
                completing = session.ledger.mark_completing(session.ledger.due(now))
                if completing:
                    self._runtimes[session.handle].commits_in_flight += 1
                    task = asyncio.get_running_loop().create_task(self._finalize(session, completing))
                    self._finalizers.add(task)
                    task.add_done_callback(self._finalizers.discard)

    async def _finalize(self, session: WriterSession, sources: list[str]) -> None:
        cp = self._checkpoints[session.checkpoint]
        try:
            await self._persist(cp, session, sources, counted=True)
        except Exception:
            log.warning("persisting %d completions of %s failed; will retry", len(sources), session.writer_id)
            session.ledger.revert_completing(sources, self._clock())

    async def _lease_loop(self) -> None:
        interval = min(max(self.lease_ttl_s / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            for session in list(self._sessions.values()):
                if session.lease_deadline < now and session.state == WriterState.OPEN:
                    try:
                        await self._close(
                            session,
                            WriterState.EXPIRED,
                            f"sent nothing for {self.lease_ttl_s:g} s: lease expired, pending state dropped",
                        )
                    except NotFound:
                        pass

    async def _progress_loop(self) -> None:
        while True:
            await asyncio.sleep(self.progress_interval_s)
            try:
                await self._sample_progress()
            except Exception:
                log.exception("writing progress samples failed; will retry")

    async def _sample_progress(self) -> None:
        """Persist the completed count of every checkpoint whose count changed since its last sample."""
        now = self._wall()
        samples = []
        for name, cp in self._checkpoints.items():
            count = len(cp.completed)
            if self._sampled.get(name) != count:
                samples.append(ProgressRecord(name, now, count))
        if samples:
            await self._in_registry(self._registry.add_samples, samples)
            for sample in samples:
                self._sampled[sample.checkpoint] = sample.completed_count

    # ------------------------------------------------------------------ status

    async def _existing(self, name: str) -> Checkpoint:
        validation.checkpoint_name(name, self.limits)
        cp = await self._checkpoint(name, create=False)
        if cp is None:
            raise NotFound(f"checkpoint {name!r} does not exist; it is created when its first writer opens")
        return cp

    async def list_writers(
        self, checkpoint: str, *, include_closed: bool = False, limit: int = 100
    ) -> list[WriterView]:
        """Live writers (fresh counters from memory), then past ones from the registry, newest first."""
        cp = await self._existing(checkpoint)
        live = self._view(cp).writers
        if not include_closed:
            return live[: max(limit, 0)]
        records = await self._in_registry(self._registry.list_writers, checkpoint)
        live_ids = {w.writer_id for w in live}
        past = [
            WriterView(
                writer_id=r.writer_id,
                host=r.host,
                pid=r.pid,
                labels=dict(r.labels),
                state=r.state,
                pending_sources=r.pending_sources,
                counts=ApplyCounts(r.applied, r.skipped, r.rewritten, r.anomalies, r.completed),
                opened_at=r.opened_at,
                last_seen_at=r.last_seen_at,
                closed_at=r.closed_at or 0.0,
            )
            for r in sorted(records, key=lambda r: r.opened_at, reverse=True)
            if r.state != WriterState.OPEN or r.writer_id not in live_ids
        ]
        return (live + past)[: max(limit, 0)]

    async def list_events(self, checkpoint: str, *, limit: int = 50, before_id: int = 0) -> EventPage:
        await self._existing(checkpoint)
        if not 0 < limit <= 1000:
            raise InvalidArgument(f"limit {limit} is out of range; ask for 1 to 1000 events per page")
        records = await self._in_registry(
            lambda: self._registry.list_events(checkpoint, limit=limit + 1, before_id=before_id or None)
        )
        page = records[:limit]
        events = [
            EventView(r.id or 0, r.checkpoint, r.kind, r.message, r.at, r.writer_id or "", dict(r.data))
            for r in page
        ]
        more = len(records) > limit
        return EventPage(events, events[-1].id if more and events else 0)

    async def progress(self, checkpoint: str, *, since: float = 0.0) -> list[ProgressSample]:
        """Persisted samples, plus the live count now, so a plot always ends at the present."""
        cp = await self._existing(checkpoint)
        records = await self._in_registry(lambda: self._registry.list_samples(checkpoint, since=since))
        samples = [ProgressSample(r.at, r.completed_count) for r in records]
        samples.append(ProgressSample(self._wall(), len(cp.completed)))
        return samples

    async def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> AsyncIterator[CheckpointView]:
        """A status snapshot now and then whenever it changes, checked every ``interval_s``."""
        cp = await self._existing(checkpoint)
        interval_s = min(max(interval_s, 0.05), 60.0)
        last: tuple[Any, ...] | None = None
        # Re-send an unchanged snapshot now and then, so idle streams are not cut by proxies.
        heartbeat_every = max(1, round(15.0 / interval_s))
        quiet = 0
        while self._accepting:
            view = self._view(cp)
            key = (
                view.completed_count,
                view.pending_sources,
                view.settling_sources,
                view.live_writers,
                view.anomalies,
                view.unreadable_files,
            )
            quiet += 1
            if key != last or quiet >= heartbeat_every:
                last, quiet = key, 0
                yield view
            await asyncio.sleep(interval_s)

    async def list_completed(self, checkpoint: str, *, after: str = "", limit: int = 10_000) -> CompletedPage:
        cp = await self._existing(checkpoint)
        if not 0 < limit <= self.limits.max_ids_per_query:
            raise InvalidArgument(
                f"limit {limit} is out of range; ask for 1 to {self.limits.max_ids_per_query} ids per page "
                "(setting max_ids_per_query)"
            )
        ordered = cp.completed.in_byte_order()
        start = bisect.bisect_right(ordered, after.encode()) if after else 0
        page = [sid.decode() for sid in ordered[start : start + limit]]
        more = start + limit < len(ordered)
        return CompletedPage(page, page[-1] if more and page else "")

    async def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], *, import_id: str
    ) -> ImportResult:
        """Adopt completions made elsewhere, written to their own file ``<import_id>.mdb``."""
        self._check_accepting()
        validation.checkpoint_name(checkpoint, self.limits)
        validation.writer_id(import_id, self.limits)
        validation.source_ids(source_ids, self.limits)
        if checkpoint in self._resetting:
            raise Unavailable(f"checkpoint {checkpoint!r} is being reset; retry in a moment")
        cp = await self._checkpoint(checkpoint, create=True)
        assert cp is not None
        if import_id in cp.writers:
            raise AlreadyExists(f"{import_id!r} is a live writer of {checkpoint!r}; choose another import_id")
        if not source_ids:
            return ImportResult(0, len(cp.completed))
        new = [sid for sid in dict.fromkeys(source_ids) if sid not in cp.completed]
        if new:
            await self._committer.submit(PutCompleted(cp.name, import_id, new))
            cp.completed.add(new)
            self.stats.completions += len(new)
        cp.last_activity_at = self._wall()
        await self._event(
            checkpoint,
            "imported",
            f"{len(new)} completed sources imported into {import_id}.mdb "
            f"({len(source_ids) - len(new)} were already completed)",
            import_id,
            imported=len(new),
            offered=len(source_ids),
        )
        return ImportResult(len(new), len(cp.completed))

    async def reset_checkpoint(self, name: str, *, force: bool = False) -> ResetResult:
        """Start a checkpoint over: its files go to the trash folder (never deleted)."""
        self._check_accepting()
        cp = await self._existing(name)
        if cp.writers and not force:
            ids = ", ".join(sorted(cp.writers)[:10])
            raise FailedPrecondition(
                f"checkpoint {name!r} has {len(cp.writers)} live writers ({ids}); stop them first, or force "
                "the reset (their pending state is dropped and their clients get NOT_FOUND)",
                live_writers=len(cp.writers),
            )
        if name in self._resetting:
            raise Unavailable(f"checkpoint {name!r} is already being reset")
        self._resetting.add(name)
        try:
            closed = 0
            for session in list(cp.writers.values()):
                try:
                    await self._close(session, WriterState.RESET, "closed by a forced checkpoint reset")
                    closed += 1
                except NotFound:
                    pass
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._wall())) + f"-{uuid.uuid4().hex[:6]}"
            loop = asyncio.get_running_loop()
            moved_to, files = await loop.run_in_executor(
                self._committer.executor, self._completions.trash, name, stamp
            )
            cp.completed = CompletedSet()
            cp.anomalies = 0
            cp.unreadable_files = []
            cp.fingerprint = {}
            cp.last_activity_at = self._wall()
            self._sampled.pop(name, None)
            await self._in_registry(self._registry.delete_samples, name)
            await self._in_registry(
                self._registry.upsert_checkpoint,
                CheckpointRecord(name, cp.created_at, cp.last_activity_at, {}),
            )
            await self._event(
                name,
                "checkpoint_reset",
                f"checkpoint reset: {files} files moved to {moved_to or '(nothing to move)'}; "
                f"{closed} live writers closed",
                moved_to=moved_to,
                files_moved=files,
                writers_closed=closed,
            )
            return ResetResult(moved_to, files, closed)
        finally:
            self._resetting.discard(name)

    # ------------------------------------------------------------------ reads

    async def are_completed(self, checkpoint: str, source_ids: Sequence[str]) -> list[bool]:
        self._check_accepting()
        validation.checkpoint_name(checkpoint, self.limits)
        validation.source_ids(source_ids, self.limits)
        cp = await self._checkpoint(checkpoint, create=False)
        if cp is None:
            return [False] * len(source_ids)
        completed = cp.completed
        return [sid in completed for sid in source_ids]

    def _view(self, cp: Checkpoint) -> CheckpointView:
        writers = [
            WriterView(
                writer_id=s.writer_id,
                host=s.host,
                pid=s.pid,
                labels=dict(s.labels),
                state=s.state,
                pending_sources=len(s.ledger.pending),
                counts=ApplyCounts(**vars(s.ledger.totals)),
                opened_at=s.opened_at,
                last_seen_at=s.last_seen_at,
            )
            for s in cp.writers.values()
        ]
        return CheckpointView(
            name=cp.name,
            completed_count=len(cp.completed),
            live_writers=len(cp.writers),
            pending_sources=cp.pending_sources(),
            settling_sources=cp.settling_sources(),
            anomalies=cp.anomalies,
            unreadable_files=len(cp.unreadable_files),
            created_at=cp.created_at,
            last_activity_at=cp.last_activity_at,
            writers=writers,
            fingerprint=dict(cp.fingerprint),
        )

    async def get_checkpoint(self, name: str) -> CheckpointView:
        return self._view(await self._existing(name))

    async def list_checkpoints(self) -> list[CheckpointView]:
        records = await self._in_registry(self._registry.list_checkpoints)
        names = sorted({r.name for r in records} | set(self._checkpoints))
        views = []
        for name in names:
            cp = await self._checkpoint(name, create=False)
            if cp is not None:
                views.append(self._view(cp))
        return views
