"""The coordinator service: the one API both transports call.

Orchestrates the pure domain (``tally_server.domain``) and the stores behind its ports. Runs on one
asyncio event loop; domain state is only touched on that loop, blocking store calls run on
dedicated threads. Ordering guarantees that matter:

* a completion becomes visible in the live set only after its completion-file commit is durable;
* completion and un-complete commits go through one FIFO group committer, and their effects on
  the live set are applied in that same order, so a late anomaly always wins over an earlier
  completion of the same source.

Requests never wait for the registry's bookkeeping (writer rows, events, samples: see
``registry_writer``), except for the two writes that must succeed before a request may: a new
checkpoint's record and a new writer's row (with the fingerprint it records). Leases and settle
windows run on a :class:`~tally_server.domain.leases.StallClock`, so a coordinator too busy to hear
heartbeats does not expire the writers that sent them.
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
from dataclasses import dataclass
from typing import Any, TypeVar

from tally_server.domain import fingerprint, validation
from tally_server.domain.admission import admit_writer, check_reset
from tally_server.domain.checkpoint import Checkpoint, CompletedSet, WriterState, choose_unloads
from tally_server.domain.effects import (
    BatchEffects,
    apply_batch,
    commit_failed,
    made_durable,
    settle_all,
    settle_due,
    uncomplete_durable,
)
from tally_server.domain.events import EventKind
from tally_server.domain.fingerprint import OnMismatch
from tally_server.domain.leases import StallClock, expired
from tally_server.domain.ledger import ApplyCounts, Delta, WriterLedger
from tally_server.domain.ports import (
    CheckpointRecord,
    CompletionStore,
    DeleteCompleted,
    EventRecord,
    LoadedCheckpoint,
    ProgressRecord,
    PutCompleted,
    QuarantinedFile,
    Registry,
    WriterRecord,
)
from tally_server.domain.validation import Limits
from tally_server.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from tally_server.service.committer import GroupCommitter
from tally_server.service.loops import Loop, Sleep
from tally_server.service.registry_writer import RegistryWriter
from tally_server.service.sessions import Session, SessionTable
from tally_server.service.stats import ServiceStats
from tally_server.service.views import (
    CheckpointView,
    ClosedWriter,
    CompletedPage,
    EventPage,
    EventView,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    ResetResult,
    WriterView,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Sent back with incomplete sources on close; the full count is reported separately.
_MAX_INCOMPLETE_LISTED = 1000
# An idle checkpoint used within this many seconds is not unloaded (no thrashing under a reader).
_UNLOAD_IDLE_S = 2.0
# How often bookkeeping rows are written, and the storage is probed while commits fail.
_REGISTRY_FLUSH_S = 0.5
_STORAGE_PROBE_S = 1.0
_CLOCK_TICK_S = 0.1
# A stall of the event loop this long is worth a warning in the log.
_STALL_WARNING_S = 1.0


@dataclass(frozen=True)
class CheckpointGauges:
    """What the metrics collector reads per checkpoint at scrape time."""

    live_writers: int
    pending_sources: int
    completed_sources: int
    unreadable_files: int
    loaded_bytes: int


class CoordinatorService:
    """Checkpoints, writers and the counting rules behind one async API.

    Args:
        completions: the completion files.
        registry: checkpoints, writers, events and samples in SQL.
        limits: refusal limits.
        settle_ms: the settle window (0: complete at once, as NeMo Curator does).
        lease_ttl_s: how long a writer that sends nothing stays open.
        progress_interval_s: how often completed counts are sampled.
        memory_budget_bytes: loaded completed sets beyond this are unloaded while idle.
        clock: real monotonic seconds (leases and settling run on a stall clock over it).
        wall_clock: epoch seconds, for what people read.
        sleep: what background loops sleep with.
        loop_idle: per event loop that hears heartbeats, its cumulative seconds waiting for I/O (see
            ``loop_load``), so lease time slows while one is saturated; empty: only stalls pause it.
    """

    def __init__(
        self,
        *,
        completions: CompletionStore,
        registry: Registry,
        limits: Limits,
        settle_ms: int,
        lease_ttl_s: float,
        progress_interval_s: float = 5.0,
        memory_budget_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        loop_idle: Sequence[Callable[[], float]] = (),
    ) -> None:
        self._completions = completions
        self._registry = registry
        self.limits = limits
        self.settle_ms = settle_ms
        self.lease_ttl_s = lease_ttl_s
        self.progress_interval_s = progress_interval_s
        self.memory_budget_bytes = memory_budget_bytes
        self._real_clock = clock
        self.stall_clock = StallClock(clock, loop_idle)
        self._clock = self.stall_clock.now
        self._wall = wall_clock
        self._sleep = sleep
        self._checkpoints: dict[str, Checkpoint] = {}
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._sessions = SessionTable()
        # Writes (the two that requests wait for, and the bookkeeping flushes) never queue behind
        # status reads, which get threads of their own.
        self._registry_writes = ThreadPoolExecutor(1, thread_name_prefix="tally-registry-write")
        self._registry_reads = ThreadPoolExecutor(2, thread_name_prefix="tally-registry-read")
        self._load_executor = ThreadPoolExecutor(1, thread_name_prefix="tally-load")
        self._bookkeeping = RegistryWriter(registry, self._registry_write)
        self.stats = ServiceStats()
        self._committer = GroupCommitter(completions, self.stats, self._quarantined)
        self._loops: list[Loop] = []
        self._background: list[asyncio.Task[None]] = []
        self._finalizers: set[asyncio.Task[None]] = set()
        self._accepting = False
        self._resetting: set[str] = set()
        # Handles whose registry row should be refreshed (last heartbeat) at the next flush.
        self._dirty: set[str] = set()
        # Un-completes whose commit failed, by checkpoint: retried until they are durable.
        self._undeleted: dict[str, set[str]] = {}
        # Completed count last written as a progress sample, per checkpoint.
        self._sampled: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Restore the known checkpoints (without loading their id sets) and start the loops."""
        self._committer.start()
        now = self._wall()
        lost = await self._registry_write(self._registry.mark_open_writers, WriterState.LOST, now)
        for record in lost:
            self._event(
                record.checkpoint,
                EventKind.WRITER_LOST,
                f"writer {record.writer_id} was open when the coordinator stopped; its pending "
                "state is gone and its unfinished sources will replay",
                record.writer_id,
            )
        records = await self._registry_read(self._registry.list_checkpoints)
        counts = await self._registry_read(self._registry.latest_counts)
        for known in records:
            self._checkpoints[known.name] = Checkpoint(
                name=known.name,
                created_at=known.created_at,
                last_activity_at=known.last_activity_at,
                fingerprint=dict(known.fingerprint),
                known_count=counts.get(known.name, 0),
            )
        self._sampled.update(counts)
        settle_interval = min(max(self.settle_ms / 1000 / 5, 0.005), 0.05) if self.settle_ms else 0.05
        self._loops = [
            Loop("clock", self._tick, _CLOCK_TICK_S, sleep=self._sleep),
            # Completes settling sources whose window passed, and retries commits that failed.
            Loop("settle", self._settle_due, settle_interval, sleep=self._sleep),
            Loop("lease", self._expire_leases, min(max(self.lease_ttl_s / 4, 0.05), 1.0), sleep=self._sleep),
            Loop("registry", self._flush_bookkeeping, _REGISTRY_FLUSH_S, sleep=self._sleep),
            Loop("progress", self._progress_step, self.progress_interval_s, sleep=self._sleep),
            Loop("storage", self._probe_storage, _STORAGE_PROBE_S, sleep=self._sleep),
        ]
        loop = asyncio.get_running_loop()
        self._background = [loop.create_task(x.run(), name=f"tally-{x.name}") for x in self._loops]
        # Counts that may be stale are made exact in the background, never on a status read: those
        # of checkpoints never sampled, and of those that had writers when the coordinator stopped
        # (it may have been killed between two samples).
        stale = {r.checkpoint for r in lost} | (self._checkpoints.keys() - counts.keys())
        census = [self._checkpoints[name] for name in sorted(stale) if name in self._checkpoints]
        if census:
            self._background.append(loop.create_task(self._census(census), name="tally-census"))
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
        for session in self._sessions:
            try:
                await self._close(session, WriterState.CLOSED, "coordinator shutdown")
            except Exception:
                log.exception("closing writer %s during shutdown failed", session.writer_id)
        if self._finalizers:
            await asyncio.gather(*self._finalizers, return_exceptions=True)
        self._sample_progress()
        try:
            await self._bookkeeping.flush()
        except Exception:
            log.exception("writing %d registry rows during shutdown failed", self._bookkeeping.queued)
        await self._committer.close()
        self._completions.close()
        self._registry.close()
        for executor in (self._registry_writes, self._registry_reads, self._load_executor):
            executor.shutdown(wait=True)

    def problems(self) -> list[str]:
        """Why the coordinator is not ready, in words; empty when it is."""
        found = [] if self._accepting else ["starting or shutting down"]
        if self._committer.failing:
            found.append(f"completions cannot be persisted: {self._committer.failing}")
        found.extend(f"the {x.name} loop is failing: {x.failing}" for x in self._loops if x.failing)
        return found

    @property
    def ready(self) -> bool:
        return not self.problems()

    def loop(self, name: str) -> Loop:
        """The background loop called ``name`` (tests drive its steps by hand)."""
        for candidate in self._loops:
            if candidate.name == name:
                return candidate
        raise KeyError(name)

    def loop_errors(self) -> dict[str, int]:
        """Failed steps per background loop since start."""
        return {x.name: x.errors for x in self._loops}

    @property
    def registry_events_dropped(self) -> int:
        return self._bookkeeping.dropped_events

    def gauges(self) -> dict[str, CheckpointGauges]:
        """Per known checkpoint, read at scrape time (never loads an id set)."""
        return {
            name: CheckpointGauges(
                live_writers=len(self._sessions.live(name)),
                pending_sources=self._sessions.pending_sources(name),
                completed_sources=cp.completed_count,
                unreadable_files=len(cp.unreadable_files),
                loaded_bytes=cp.completed.estimated_bytes() if cp.completed is not None else 0,
            )
            for name, cp in self._checkpoints.items()
        }

    # ------------------------------------------------------------------ helpers

    async def _registry_write(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._registry_writes, fn, *args)

    async def _registry_read(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._registry_reads, fn, *args)

    def _event(
        self, checkpoint: str, kind: str, message: str, writer_id: str | None = None, **data: Any
    ) -> None:
        """Log an event now and queue it for the registry (written by the registry loop)."""
        log.info("%s [%s] %s", checkpoint, kind, message)
        self._bookkeeping.event(EventRecord(checkpoint, kind, message, self._wall(), writer_id, dict(data)))

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise Unavailable("the coordinator is shutting down; retry against the restarted coordinator")

    async def _find(self, name: str, *, create: bool) -> Checkpoint | None:
        """The checkpoint named ``name`` (its id set not necessarily loaded), or None.

        A folder on disk that the registry does not know yet (one NeMo Curator wrote, placed in
        the data directory) is adopted and read at once, so its first status is exact; with
        ``create`` a new checkpoint is registered.
        """
        cp = self._checkpoints.get(name)
        if cp is not None:
            return cp
        async with self._load_locks.setdefault(name, asyncio.Lock()):
            cp = self._checkpoints.get(name)
            if cp is not None:
                return cp
            on_disk = await self._in_load_thread(self._completions.exists, name)
            if not on_disk and not create:
                return None
            now = self._wall()
            loaded = await self._in_load_thread(self._completions.load, name) if on_disk else None
            record = CheckpointRecord(name, created_at=now, last_activity_at=now)
            await self._registry_write(lambda: self._registry.write_batch(checkpoints=[record]))
            cp = Checkpoint(name=name, created_at=now, last_activity_at=now, last_used=self._real_clock())
            self._checkpoints[name] = cp
            self._event(name, EventKind.CHECKPOINT_CREATED, f"checkpoint {name} created")
            if loaded is not None:
                self._take_loaded(cp, loaded)
        self._unload_idle()
        return cp

    async def _completed(self, cp: Checkpoint, *, use: bool = True) -> CompletedSet:
        """The checkpoint's live completed set, loaded from its files if it is not in memory.

        ``use=False`` (a background census) leaves it first in line to be unloaded again.
        """
        if use:
            cp.last_used = self._real_clock()
        if cp.completed is not None:
            return cp.completed
        async with self._load_locks.setdefault(cp.name, asyncio.Lock()):
            if cp.completed is None:
                self._take_loaded(cp, await self._in_load_thread(self._completions.load, cp.name))
                self._unload_idle()
            completed = cp.ids()
        if use:
            cp.last_used = self._real_clock()
        return completed

    def _take_loaded(self, cp: Checkpoint, loaded: LoadedCheckpoint) -> None:
        """Install what the store read; unreadable files not reported before become events."""
        reported = set(cp.unreadable_files)
        cp.completed = CompletedSet(loaded.completed)
        cp.known_count = len(cp.completed)
        cp.unreadable_files = [u.path for u in loaded.unreadable]
        for bad in loaded.unreadable:
            if bad.path not in reported:
                self._event(
                    cp.name,
                    EventKind.UNREADABLE_FILE,
                    f"completion file {bad.path} is unreadable and was skipped (its sources count as not "
                    f"completed): {bad.error}",
                    path=bad.path,
                    error=bad.error,
                )

    def _quarantined(self, q: QuarantinedFile) -> None:
        """The store moved a writer's damaged own file aside and went on in a fresh one."""
        self.stats.files_quarantined += 1
        cp = self._checkpoints.get(q.checkpoint)
        if cp is not None and q.path in cp.unreadable_files:
            cp.unreadable_files.remove(q.path)  # the path now holds a fresh, readable file
        self._event(
            q.checkpoint,
            EventKind.FILE_QUARANTINED,
            f"completion file {q.path} of writer {q.writer_id} could not be written ({q.error}); it was "
            f"moved to {q.moved_to} and the writer goes on in a fresh file (sources only in the old file "
            "count as not completed and replay)",
            q.writer_id,
            path=q.path,
            moved_to=q.moved_to,
            error=q.error,
        )

    async def _in_load_thread(self, fn: Callable[[str], T], name: str) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._load_executor, fn, name)
        except OSError as exc:
            raise Unavailable(
                f"cannot read the files of checkpoint {name!r} ({exc}); check the data directory's disk "
                "and permissions, then retry",
            ) from exc

    def _unload_idle(self) -> None:
        """Unload the least recently used idle checkpoints while the loaded ones exceed the budget."""

        def busy(cp: Checkpoint) -> bool:
            return bool(cp.pins or self._sessions.live(cp.name) or cp.name in self._resetting)

        for cp in choose_unloads(
            self._checkpoints.values(),
            self.memory_budget_bytes,
            busy=busy,
            used_before=self._real_clock() - _UNLOAD_IDLE_S,
        ):
            log.debug("unloading idle checkpoint %s (%d completed ids)", cp.name, cp.completed_count)
            cp.unload()

    def _session(self, handle: str) -> Session:
        session = self._sessions.get(handle)
        if session is None or session.state != WriterState.OPEN:
            raise NotFound(
                f"writer handle {validation.describe(handle)} is not open (unknown, closed, or its lease "
                "expired); its pending state is gone: open a new writer (unfinished sources replay)",
            )
        return session

    def checkpoint_of(self, handle: str) -> str | None:
        """The checkpoint a writer handle was opened on, or None for an unknown handle."""
        session = self._sessions.get(handle)
        return session.checkpoint if session is not None else None

    def _renew(self, session: Session) -> None:
        session.lease_deadline = self._clock() + self.lease_ttl_s
        session.last_seen_at = self._wall()
        self._dirty.add(session.handle)

    def _writer_record(self, s: Session, closed_at: float | None = None) -> WriterRecord:
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
            pending_sources=s.ledger.in_flight,
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
        allow_reset: bool = True,
    ) -> OpenedWriter:
        """Register a writer; all or nothing: a refused or failed open leaves no trace.

        ``allow_reset=False`` (a caller without the admin role) refuses an ``on_mismatch="reset"``
        that would have to reset the checkpoint.
        """
        self._check_accepting()
        try:
            mode = OnMismatch(on_mismatch)
        except ValueError:
            raise InvalidArgument(
                f"on_mismatch {validation.describe(on_mismatch)} is not one of refuse, reset, ignore"
            ) from None
        validation.checkpoint_name(checkpoint, self.limits)
        writer_id = writer_id or f"{socket.gethostname()}-tally-{uuid.uuid4().hex[:8]}"
        validation.writer_id(writer_id, self.limits)
        labels = dict(labels or {})
        fingerprint = dict(fingerprint or {})
        validation.labels(labels, self.limits)
        validation.labels(fingerprint, self.limits)
        validation.host(host, self.limits)
        validation.pid(pid)
        if checkpoint in self._resetting:
            raise Unavailable(f"checkpoint {checkpoint!r} is being reset; retry in a moment")
        cp = await self._find(checkpoint, create=True)
        assert cp is not None
        cp.pins += 1
        try:
            await self._completed(cp)
            await self._guard_fingerprint(cp, writer_id, fingerprint, mode, allow_reset)
            completed = await self._completed(cp)  # a reset replaced it
        finally:
            cp.pins -= 1
        # From here to adding the session nothing awaits, so the admission holds.
        admit_writer(checkpoint, writer_id, self._sessions.live(checkpoint), self.limits, self.lease_ttl_s)
        now = self._wall()
        session = Session(
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
            ledger=WriterLedger(completed.as_of_now(), self.settle_ms / 1000),
        )
        # The writer id is taken from here on; undone below if the registry refuses the writer.
        self._sessions.add(session)
        records_fingerprint = bool(fingerprint) and not cp.fingerprint
        if records_fingerprint:
            cp.fingerprint = dict(fingerprint)
        try:
            await self._registry_write(
                lambda: self._registry.write_batch(
                    checkpoints=[CheckpointRecord(cp.name, cp.created_at, now, dict(cp.fingerprint))],
                    writers=[self._writer_record(session)],
                )
            )
        except BaseException:
            self._sessions.remove(session)
            if records_fingerprint and cp.fingerprint == fingerprint:
                cp.fingerprint = {}
            raise
        self.stats.writers_opened += 1
        cp.last_activity_at = now
        self._event(
            checkpoint,
            EventKind.WRITER_OPENED,
            f"writer {writer_id} opened (host {host or '?'}, pid {pid or '?'})",
            writer_id,
            labels=labels,
        )
        return OpenedWriter(session.handle, writer_id, self.lease_ttl_s, len(completed), self.settle_ms)

    async def _guard_fingerprint(
        self,
        cp: Checkpoint,
        writer_id: str,
        presented: dict[str, str],
        on_mismatch: OnMismatch,
        may_reset: bool,
    ) -> None:
        """DESIGN §2.5: refuse to resume a checkpoint with different inputs unless told otherwise."""
        mismatch = fingerprint.compare(cp.fingerprint, presented)
        if mismatch is None:
            return  # the first fingerprint is recorded by open_writer
        if fingerprint.decide(cp.name, mismatch, on_mismatch, may_reset=may_reset) is OnMismatch.IGNORE:
            self._event(
                cp.name,
                EventKind.FINGERPRINT_MISMATCH_IGNORED,
                f"writer {writer_id} opened with a different fingerprint ({mismatch.detail}); ignored as "
                "it asked",
                writer_id,
                differing=mismatch.differing,
            )
            return
        # Refused while other writers are live (reset_checkpoint says so); the new fingerprint is
        # recorded by open_writer once the checkpoint is empty again.
        await self.reset_checkpoint(cp.name)

    async def keep_alive(self, handle: str) -> float:
        """Renew a lease: memory only, no I/O, so a heartbeat never waits for storage."""
        self._check_accepting()
        self._renew(self._session(handle))
        return self.lease_ttl_s

    async def apply_deltas(self, handle: str, batch: Sequence[Delta]) -> ApplyCounts:
        self._check_accepting()
        # Transports check big batches off the event loop already; then this returns at once.
        batch = validation.deltas(batch, self.limits)
        session = self._session(handle)
        async with session.lock:
            session = self._session(handle)  # may have closed while we waited
            self._renew(session)
            cp = self._checkpoints[session.checkpoint]
            effects = apply_batch(session.ledger, cp.ids(), batch, self._clock())
            self.stats.count(effects.counts)
            cp.last_activity_at = session.last_seen_at
            if effects.anomalies:
                await self._uncomplete(cp, session, effects)
            if effects.complete:
                try:
                    await self._persist(cp, session, effects.complete)
                except Exception:
                    commit_failed(session.ledger, effects.complete, self._clock())
                    raise
                effects.counts.completed = len(effects.complete)
            await session.notify()
            return effects.counts

    async def _persist(
        self, cp: Checkpoint, session: Session, sources: list[str], *, counted: bool = False
    ) -> None:
        """Commit ``sources`` as completed, then make them visible.

        ``counted``: the caller already raised ``commits_in_flight`` synchronously, when it marked
        the sources completing; a flush or close arriving before this coroutine runs must wait.
        """
        if not counted:
            session.commits_in_flight += 1
        try:
            undeleted = self._undeleted.get(cp.name)
            if undeleted:
                undeleted.difference_update(sources)  # completed again: the newer state wins
            await self._committer.submit(PutCompleted(cp.name, session.writer_id, sources))
            made_durable(cp.ids(), sources)
            self.stats.completions += len(sources)
        except Exception:
            session.failed_commits += 1
            raise
        finally:
            session.commits_in_flight -= 1
            await session.notify()

    async def _uncomplete(self, cp: Checkpoint, session: Session, effects: BatchEffects) -> None:
        """Commit the un-complete of the batch's anomalies (already gone from the live set)."""
        cp.anomalies += len(effects.anomalies)
        for a in effects.anomalies:
            change = "a new task" if a.old_delta is None else f"delta {a.old_delta} -> {a.new_delta}"
            self._event(
                cp.name,
                EventKind.ANOMALY,
                f"source {a.source_id} got {change} (task {a.task_id}) after it was completed; it was "
                "un-completed in every writer file and will be reprocessed next run",
                session.writer_id,
                task_id=a.task_id,
                source_id=a.source_id,
                old_delta=a.old_delta,
                new_delta=a.new_delta,
            )
        try:
            await self._committer.submit(DeleteCompleted(cp.name, effects.uncomplete))
        except Exception:
            # A completion left in a file would come back at the next start: retried until durable.
            self._undeleted.setdefault(cp.name, set()).update(effects.uncomplete)
            session.failed_commits += 1
            raise
        uncomplete_durable(cp.ids(), effects.uncomplete)

    async def flush(self, handle: str) -> int:
        """Return once every completion resulting from deltas applied so far is durable.

        Sources still settling are waited for (their window runs out or a delta cancels it); the
        window is never cut short, so a flush cannot make a completion early.
        """
        self._check_accepting()
        session = self._session(handle)
        async with session.lock:
            self._renew(session)
            waiting = dict(session.ledger.settling)
            failures = session.failed_commits

        def settled() -> bool:
            if session.state != WriterState.OPEN:
                return True
            settling = session.ledger.settling
            return session.commits_in_flight == 0 and all(
                settling.get(sid) != deadline for sid, deadline in waiting.items()
            )

        async with session.changed:
            await session.changed.wait_for(settled)
        if session.state == WriterState.EXPIRED:
            raise NotFound(
                f"writer {session.writer_id!r} expired while flushing; its pending state is gone: "
                "open a new writer (unfinished sources replay)",
            )
        if session.failed_commits != failures:
            raise Unavailable(
                "persisting completions failed while flushing; they are being retried, so flush again "
                "(see the coordinator log for the storage error)",
            )
        return session.ledger.totals.completed

    async def close_writer(self, handle: str) -> ClosedWriter:
        self._check_accepting()
        session = self._session(handle)
        return await self._close(session, WriterState.CLOSED, "closed by its client")

    async def _close(self, session: Session, state: WriterState, why: str) -> ClosedWriter:
        async with session.lock:
            if session.state != WriterState.OPEN:
                raise NotFound(f"writer {session.writer_id!r} is already closed")
            cp = self._checkpoints[session.checkpoint]
            if state == WriterState.CLOSED:
                completing = settle_all(session.ledger)
                if completing:
                    await self._persist(cp, session, completing)
            async with session.changed:
                await session.changed.wait_for(lambda: session.commits_in_flight == 0)
            session.state = state
            if state == WriterState.EXPIRED:
                self.stats.writers_expired += 1
            incomplete = list(session.ledger.pending)
            self._sessions.remove(session)
            self._dirty.discard(session.handle)
            now = self._wall()
            cp.last_activity_at = now
            self._bookkeeping.writer(self._writer_record(session, now))
            self._event(
                cp.name,
                EventKind(f"writer_{state}"),
                f"writer {session.writer_id} {why}; {len(incomplete)} sources left incomplete will replay",
                session.writer_id,
                incomplete=len(incomplete),
            )
            await session.notify()
        totals = session.ledger.totals
        return ClosedWriter(
            ApplyCounts(totals.applied, totals.skipped, totals.rewritten, totals.anomalies, totals.completed),
            incomplete[:_MAX_INCOMPLETE_LISTED],
            len(incomplete),
        )

    # ------------------------------------------------------------------ background steps

    async def _tick(self) -> None:
        paused = self.stall_clock.tick()
        if paused >= _STALL_WARNING_S:
            log.warning(
                "the coordinator could not run for %.1f s (overloaded, paused or swapped out); that "
                "time does not count against writers' leases or settle windows",
                paused,
            )

    async def _settle_due(self) -> None:
        now = self._clock()
        for session in self._sessions:
            if not session.ledger.settling or session.state != WriterState.OPEN:
                continue
            completing = settle_due(session.ledger, now)
            if completing:
                session.commits_in_flight += 1
                task = asyncio.get_running_loop().create_task(self._finalize(session, completing))
                self._finalizers.add(task)
                task.add_done_callback(self._finalizers.discard)
        for name, sources in list(self._undeleted.items()):
            if not sources:
                del self._undeleted[name]
                continue
            retry = sorted(sources)
            await self._committer.submit(DeleteCompleted(name, retry))
            sources.difference_update(retry)
            cp = self._checkpoints.get(name)
            if cp is not None and cp.completed is not None:
                for sid in retry:
                    cp.completed.discard(sid)

    async def _finalize(self, session: Session, sources: list[str]) -> None:
        cp = self._checkpoints[session.checkpoint]
        try:
            await self._persist(cp, session, sources, counted=True)
        except Exception:
            # The committer logged the cause (once per cause); the settle loop retries.
            commit_failed(session.ledger, sources, self._clock())

    async def _expire_leases(self) -> None:
        failures: list[Exception] = []
        for session in expired(self._sessions, self._clock()):
            try:
                await self._close(
                    session,
                    WriterState.EXPIRED,
                    f"sent nothing for {self.lease_ttl_s:g} s: lease expired, pending state dropped",
                )
            except NotFound:
                pass  # closed meanwhile
            except Exception as exc:
                failures.append(exc)  # the other writers still expire on time
        if failures:
            raise failures[0]

    async def _flush_bookkeeping(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for handle in dirty:
            session = self._sessions.get(handle)
            if session is not None and session.state == WriterState.OPEN:
                self._bookkeeping.writer(self._writer_record(session))
        await self._bookkeeping.flush()

    async def _progress_step(self) -> None:
        self._sample_progress()
        self._unload_idle()

    def _sample_progress(self) -> None:
        """Queue a sample of every checkpoint whose completed count changed since its last one."""
        now = self._wall()
        samples = []
        for name, cp in self._checkpoints.items():
            count = cp.completed_count
            if self._sampled.get(name) != count:
                samples.append(ProgressRecord(name, now, count))
                self._sampled[name] = count
        self._bookkeeping.samples(samples)

    async def _probe_storage(self) -> None:
        if self._committer.failing:
            await self._committer.probe()

    async def _census(self, checkpoints: list[Checkpoint]) -> None:
        """Read each checkpoint once for its count and unreadable files, then let it go again
        unless someone started using it meanwhile."""
        for cp in checkpoints:
            used = cp.last_used
            try:
                await self._completed(cp, use=False)
            except Exception:
                log.exception("reading the completion files of checkpoint %s failed", cp.name)
                continue
            if cp.last_used == used and not cp.pins and not self._sessions.live(cp.name):
                cp.unload()

    # ------------------------------------------------------------------ status

    async def _existing(self, name: str) -> Checkpoint:
        validation.checkpoint_name(name, self.limits)
        cp = await self._find(name, create=False)
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
        records = await self._registry_read(self._registry.list_writers, checkpoint)
        live_ids = {w.writer_id for w in live}
        queued = {r.handle: r for r in self._bookkeeping.queued_writers(checkpoint)}
        records = [queued.pop(r.handle, r) for r in records] + list(queued.values())
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
        validation.before_id(before_id)
        try:
            await self._bookkeeping.flush()  # so the page includes what just happened
        except Unavailable:
            pass  # the read below says so if the registry is down
        records = await self._registry_read(
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
        records = await self._registry_read(lambda: self._registry.list_samples(checkpoint, since=since))
        queued = [r for r in self._bookkeeping.queued_samples(checkpoint) if r.at >= since]
        samples = [ProgressSample(r.at, r.completed_count) for r in [*records, *queued]]
        samples.append(ProgressSample(self._wall(), cp.completed_count))
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
        ordered = (await self._completed(cp)).in_byte_order()
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
        source_ids = validation.source_ids(source_ids, self.limits)
        if checkpoint in self._resetting:
            raise Unavailable(f"checkpoint {checkpoint!r} is being reset; retry in a moment")
        cp = await self._find(checkpoint, create=True)
        assert cp is not None
        if import_id in self._sessions.live(checkpoint):
            raise AlreadyExists(f"{import_id!r} is a live writer of {checkpoint!r}; choose another import_id")
        cp.pins += 1  # the set must stay loaded until the commit made it durable
        try:
            completed = await self._completed(cp)
            if not source_ids:
                return ImportResult(0, len(completed))
            new = [sid for sid in dict.fromkeys(source_ids) if sid not in completed]
            if new:
                await self._committer.submit(PutCompleted(cp.name, import_id, new))
                completed.add(new)
                self.stats.completions += len(new)
        finally:
            cp.pins -= 1
        cp.last_activity_at = self._wall()
        self._event(
            checkpoint,
            EventKind.IMPORTED,
            f"{len(new)} completed sources imported into {import_id}.mdb "
            f"({len(source_ids) - len(new)} were already completed)",
            import_id,
            imported=len(new),
            offered=len(source_ids),
        )
        return ImportResult(len(new), len(completed))

    async def reset_checkpoint(self, name: str, *, force: bool = False) -> ResetResult:
        """Start a checkpoint over: its files go to the trash folder (never deleted)."""
        self._check_accepting()
        cp = await self._existing(name)
        live = dict(self._sessions.live(name))
        check_reset(name, live, force=force)
        if name in self._resetting:
            raise Unavailable(f"checkpoint {name!r} is already being reset")
        self._resetting.add(name)
        try:
            closed = 0
            for session in live.values():
                try:
                    await self._close(session, WriterState.RESET, "closed by a forced checkpoint reset")
                    closed += 1
                except NotFound:
                    pass
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._wall())) + f"-{uuid.uuid4().hex[:6]}"
            moved_to, files = await self._committer.run(self._completions.trash, name, stamp)
            cp.completed = CompletedSet()
            cp.known_count = 0
            cp.anomalies = 0
            cp.unreadable_files = []
            cp.fingerprint = {}
            cp.last_activity_at = self._wall()
            self._undeleted.pop(name, None)
            self._sampled.pop(name, None)
            self._bookkeeping.forget_samples(name)
            await self._registry_write(self._registry.delete_samples, name)
            await self._registry_write(
                lambda: self._registry.write_batch(
                    checkpoints=[CheckpointRecord(name, cp.created_at, cp.last_activity_at, {})]
                )
            )
            self._event(
                name,
                EventKind.CHECKPOINT_RESET,
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
        source_ids = validation.source_ids(source_ids, self.limits)
        cp = await self._find(checkpoint, create=False)
        if cp is None:
            return [False] * len(source_ids)
        completed = await self._completed(cp)
        return [sid in completed for sid in source_ids]

    def _view(self, cp: Checkpoint) -> CheckpointView:
        writers = [
            WriterView(
                writer_id=s.writer_id,
                host=s.host,
                pid=s.pid,
                labels=dict(s.labels),
                state=s.state,
                pending_sources=s.ledger.in_flight,
                counts=ApplyCounts(**vars(s.ledger.totals)),
                opened_at=s.opened_at,
                last_seen_at=s.last_seen_at,
            )
            for s in self._sessions.live(cp.name).values()
        ]
        return CheckpointView(
            name=cp.name,
            completed_count=cp.completed_count,
            live_writers=len(writers),
            pending_sources=self._sessions.pending_sources(cp.name),
            settling_sources=self._sessions.settling_sources(cp.name),
            anomalies=cp.anomalies,
            unreadable_files=len(cp.unreadable_files),
            created_at=cp.created_at,
            last_activity_at=cp.last_activity_at,
            writers=writers,
            fingerprint=dict(cp.fingerprint),
        )

    async def get_checkpoint(self, name: str) -> CheckpointView:
        """One checkpoint's status, from memory (its id set is not loaded for this)."""
        return self._view(await self._existing(name))

    async def list_checkpoints(self) -> list[CheckpointView]:
        """Every known checkpoint's status, from memory: no registry query, no id set loaded."""
        return [self._view(cp) for _, cp in sorted(self._checkpoints.items())]
