"""The coordinator service: the one async API both transports call.

A façade over the service's parts (``checkpoints``, ``writers``, ``status``, ``admin``, sharing a
``core``), with its lifecycle and background loops. Runs on one asyncio event loop; domain state is
only touched on that loop, blocking store calls run on dedicated threads.

Requests never wait for the registry's bookkeeping (writer rows, events, samples: see
``registry_writer``), except for the two writes that must succeed before a request may: a new
checkpoint's record and a new writer's row (with the fingerprint it records). Leases and settle
windows run on a :class:`~tally_server.domain.leases.StallClock`, so a coordinator too busy to hear
heartbeats does not expire the writers that sent them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint, WriterState
from tally_server.domain.events import EventKind
from tally_server.domain.leases import StallClock
from tally_server.domain.ledger import Delta
from tally_server.domain.ports import CompletionStore, CompletionWriteError, JointCommit, Journal, Registry
from tally_server.domain.validation import Limits
from tally_server.domain.words import count
from tally_server.service.admin import Admin
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.claims import Claims
from tally_server.service.committer import GroupCommitter
from tally_server.service.core import Core
from tally_server.service.durability import Durability
from tally_server.service.failures import Failures
from tally_server.service.loops import Loop, Sleep
from tally_server.service.opening import Opening
from tally_server.service.registry_writer import RegistryWriter
from tally_server.service.sessions import Session
from tally_server.service.stats import ServiceStats
from tally_server.service.status import CheckpointGauges, Status, counted
from tally_server.service.totals import Totals
from tally_server.service.views import (
    AppliedBatch,
    CheckpointPage,
    CheckpointView,
    ClaimView,
    ClosedWriter,
    CompletedPage,
    CursorView,
    EventPage,
    FailurePage,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    ReplicasView,
    ReportedFailure,
    ResetResult,
    SavedCursors,
    TokenCheck,
    WriterPage,
)
from tally_server.service.writers import Writers

log = logging.getLogger(__name__)
T = TypeVar("T")

# Background loop periods, in seconds.
_CLOCK_TICK_S = 0.1
_REGISTRY_FLUSH_S = 0.5
# How often the checkpoints' statuses are checked for a change and published for replicas.
_STATUS_PUBLISH_S = 0.5
_STORAGE_PROBE_S = 1.0
# How long a checkpoint given up in place (``release``) waits for its calls and commits at work.
RELEASE_WAIT_S = 10.0
# A stall of the event loop this long is worth a warning in the log.
_STALL_WARNING_S = 1.0


class CoordinatorService:
    """Checkpoints, writers and the counting rules behind one async API.

    Args:
        completions: the completion files.
        registry: checkpoints, writers, events and samples in SQL.
        journal: the writers' journals, which bring live writers back after a restart.
        limits: refusal limits.
        settle_ms: the settle window (0: complete at once, as NeMo Curator does).
        lease_ttl_s: how long a writer that sends nothing stays open.
        progress_interval_s: how often completed counts are sampled.
        memory_budget_bytes: loaded completed sets beyond this (less the memory the writers' journal
            holds) are unloaded while idle.
        journal_snapshot_deltas: how many deltas of a writer's journal give way to a snapshot.
        clock: real monotonic seconds (leases and settling run on a stall clock over it).
        wall_clock: epoch seconds, for what people read.
        sleep: what background loops sleep with.
        loop_idle: per event loop that hears heartbeats, its cumulative seconds waiting for I/O (see
            ``loop_load``), so lease time slows while one is saturated; empty: only stalls pause it.
        joint_commit: commits a group's journal entries and completions in one transaction, where
            both live in one database (the PostgreSQL store); None: the journal first, then the files.
        owns: which checkpoints (by name) this coordinator owns, where several share one store
            (each owning some shards); None: every checkpoint of the store. Only owned checkpoints
            are restored at start (their writers from the journal; only their stale open writers
            are marked lost) and known: a call naming another is refused with ``NotOwned``
            (UNAVAILABLE, retried), and store-wide lists (checkpoints, status, gauges) show owned
            checkpoints only. Another's writer handles are simply unknown here; a writer restored
            by :meth:`adopt`, which widens ``owns`` at run time (a shard taken over) once it has
            restored what it adds, is refused alike until then.
        not_held: where several share one store, the error a commit carrying a checkpoint (by
            name) would be refused with now (its shard not held: handed over or lost), else None.
            The group committer fails such ops at once, and commits the others of their group
            without them (``GroupCommitter``); None: every op is committed.
    """

    def __init__(
        self,
        *,
        completions: CompletionStore,
        registry: Registry,
        journal: Journal,
        limits: Limits,
        settle_ms: int,
        lease_ttl_s: float,
        progress_interval_s: float = 5.0,
        memory_budget_bytes: int = 1 << 30,
        journal_snapshot_deltas: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        loop_idle: Sequence[Callable[[], float]] = (),
        joint_commit: JointCommit | None = None,
        owns: Callable[[str], bool] | None = None,
        not_held: Callable[[str], CompletionWriteError | None] | None = None,
    ) -> None:
        self.limits = limits
        self.settle_ms = settle_ms
        self.lease_ttl_s = lease_ttl_s
        self.progress_interval_s = progress_interval_s
        self.stall_clock = StallClock(clock, loop_idle)
        self.stats = ServiceStats()
        self._sleep = sleep
        self._journal = journal
        committer = GroupCommitter(
            completions,
            journal,
            self.stats,
            lambda q: self._checkpoints.quarantined(q),
            joint_commit,
            not_held,
        )
        self._core = core = Core(
            limits=limits,
            settle_ms=settle_ms,
            lease_ttl_s=lease_ttl_s,
            clock=self.stall_clock.now,
            real_clock=clock,
            wall=wall_clock,
            completions=completions,
            registry=registry,
            committer=committer,
            bookkeeping=RegistryWriter(registry, lambda fn: core.registry_write(fn)),
            stats=self.stats,
            journal_snapshot_deltas=journal_snapshot_deltas,
            owns=owns,
        )
        self._checkpoints = CheckpointTable(core, memory_budget_bytes, also_held=journal.memory_bytes)
        self._durability = Durability(core, self._checkpoints)
        self._claims = Claims(core, self._checkpoints)
        self._writers = Writers(core, self._checkpoints, self._durability, self._claims)
        self._opening = Opening(
            core, self._checkpoints, self._writers, lambda name: self._admin.reset_checkpoint(name)
        )
        self._admin = Admin(core, self._checkpoints, self._writers)
        self._failures = Failures(core, self._checkpoints)
        self._totals = Totals(core, self._checkpoints)
        self._durability.on_failures_completed = self._failures.completed
        self._durability.on_claims_completed = self._claims.completed
        self._status = Status(core, self._checkpoints, lambda: core.accepting)
        self._loops: list[Loop] = []
        self._published_status: dict[str, dict[str, Any]] = {}
        self._status_published_once = False
        self._background: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Restore the known checkpoints and every journaled writer, then start the loops.

        Only the checkpoints this coordinator owns (``owns``): what the registry holds of others
        is left alone, their writers stay open and their claims held. The checkpoints' id sets are
        not loaded here.
        """
        core = self._core
        core.committer.start()
        census = await self._restore(core.owns)
        settle_interval = min(max(self.settle_ms / 1000 / 5, 0.005), 0.05) if self.settle_ms else 0.05
        lease_interval = min(max(self.lease_ttl_s / 4, 0.05), 1.0)
        self._loops = [
            Loop("clock", self._tick, _CLOCK_TICK_S, sleep=self._sleep),
            Loop("settle", self._durability.settle_step, settle_interval, sleep=self._sleep),
            Loop("lease", self._writers.lease_step, lease_interval, sleep=self._sleep),
            Loop("registry", self._flush_bookkeeping, _REGISTRY_FLUSH_S, sleep=self._sleep),
            Loop("status", self._publish_status, _STATUS_PUBLISH_S, sleep=self._sleep),
            Loop("progress", self._progress_step, self.progress_interval_s, sleep=self._sleep),
            Loop("storage", self._probe_storage, _STORAGE_PROBE_S, sleep=self._sleep),
        ]
        loop = asyncio.get_running_loop()
        self._background = [loop.create_task(x.run(), name=f"tally-{x.name}") for x in self._loops]
        self._start_census(census)
        core.accepting = True

    async def adopt(self, more: Callable[[str], bool], *, owns: Callable[[str], bool] | None = None) -> int:
        """Own the checkpoints ``more`` accepts too, from now on, restored as :meth:`start` restores.

        For a shard of the store taken over while this service runs (``serve_shards``): its
        checkpoints, their failures, budgets, declared sources and claims, and their writers from
        the journal come back beside what is served, and only their stale open writers are marked
        lost. Calls go on meanwhile: those naming the adopted checkpoints (or their restored
        writers' handles) are refused with ``NotOwned`` (UNAVAILABLE, retried) until the end, when
        ``owns`` widens. Returns how many writers the journal brought back.

        Args:
            more: the checkpoints to adopt (none of them owned yet).
            owns: what this coordinator owns from then on (default: what it owned, or ``more``);
                give one plain predicate rather than a chain growing with every adoption.

        Raises:
            ValueError: this service owns every checkpoint already (no ``owns`` predicate).
        """
        core = self._core
        owned = core.owns
        if owned is None:
            raise ValueError("this coordinator owns every checkpoint of its store: there is nothing to adopt")
        before = self.stats.writers_restored
        self._start_census(await self._restore(more))
        core.owns = owns if owns is not None else lambda name: owned(name) or more(name)
        return self.stats.writers_restored - before

    async def release(
        self, gone: Callable[[str], bool], *, owns: Callable[[str], bool], wait_s: float = RELEASE_WAIT_S
    ) -> int:
        """Give up the checkpoints ``gone`` accepts while the service runs: the inverse of :meth:`adopt`.

        For a shard of the store handed over to another coordinator (``serve_shards``). From the
        start their calls are refused with ``NotOwned`` (UNAVAILABLE, retried: their next owner
        answers them); the calls at work on them finish; their writers' journals and the
        un-completes left to retry are made durable (their next owner restores them from there, as
        after a restart); the registry's rows queued so far are written; then the checkpoints, their
        writers, claims and settling sources leave memory. Their writers stay open in the journal
        and the registry: they are neither closed nor lost. The other checkpoints are served all
        along, as they were. Returns how many writers were let go.

        Nothing may write for them once this returns; their shard's fence is the caller's to drop
        (a commit still carrying one is then refused: ``ShardFence``).

        Args:
            gone: the checkpoints to give up.
            owns: what this coordinator owns from then on (none of ``gone``).
            wait_s: how long their calls at work and their commits may take to finish.

        Raises:
            TimeoutError: calls or commits of theirs still at work after ``wait_s``.
            Unavailable: a journal or an un-complete could not be written.
            ValueError: this service owns every checkpoint (no ``owns`` predicate).
            In each case the service is left serving what it has (``gone`` refused) and the caller
            restarts it instead: nothing acknowledged is lost, as at any stop.
        """
        core = self._core
        if core.owns is None:
            raise ValueError("this coordinator owns every checkpoint of its store: it gives none up")
        core.owns = owns
        let_go: list[Session] = []
        try:
            async with asyncio.timeout(wait_s):
                await core.calls.drained(gone)
                self._writers.queue_heartbeats()  # their last heartbeats, written below
                for session in [s for s in core.sessions if gone(s.checkpoint)]:
                    async with session.lock:  # no batch, flush or close of it is at work
                        if core.sessions.get(session.handle) is not session:
                            continue  # closed meanwhile (its lease ran out)
                        self._writers.let_go(session)
                        let_go.append(session)
                await asyncio.gather(*(_journaled(self._durability, s) for s in let_go))
                await self._durability.settle_undeleted(gone)
                self._checkpoints.sample_progress()
                await core.settle_behind()
        except BaseException:
            for session in let_go:  # the restart that follows flushes their journals on its stop
                self._writers.take_back(session)
            raise
        try:  # rows not written now stay queued for the next flush
            await core.bookkeeping.flush()
        except Exception as exc:
            log.warning("could not write the registry's rows while giving checkpoints up: %s", exc)
        self._forget(gone)
        return len(let_go)

    async def lose(
        self, gone: Callable[[str], bool], *, owns: Callable[[str], bool], wait_s: float = RELEASE_WAIT_S
    ) -> int:
        """Forget the checkpoints ``gone`` accepts: another coordinator took them over (a shard lost).

        Their shard's epoch moved on, so nothing of theirs can be written here any more (the caller
        takes the shard out of the fence first: their commits are refused) and their next owner
        restored them from what the store held when it took them, as after a crash. So nothing is
        flushed: their calls are refused from the start (``NotOwned``), their writers leave the
        table at once (a flush waiting on one fails as UNAVAILABLE: nothing of it can be durable
        here), the calls at work on them finish (their commits refused), and they leave memory.
        The other checkpoints are served all along. Returns how many writers were dropped.

        Raises:
            TimeoutError: calls of theirs still at work after ``wait_s`` (the caller restarts).
            ValueError: this service owns every checkpoint (no ``owns`` predicate).
        """
        core = self._core
        if core.owns is None:
            raise ValueError("this coordinator owns every checkpoint of its store: it loses none")
        core.owns = owns
        dropped = [s for s in core.sessions if gone(s.checkpoint)]
        for session in dropped:
            self._writers.let_go(session)
            session.state = WriterState.LOST  # in memory only: it is open at its next owner
            await session.notify()  # flushes and ordered batches waiting on it end
        async with asyncio.timeout(wait_s):
            await core.calls.drained(gone)
        for name in [n for n in self._durability.undeleted if gone(n)]:
            self._durability.forget_undeleted(name)  # its next owner finds them in the journal
        self._forget(gone)
        return len(dropped)

    def _forget(self, gone: Callable[[str], bool]) -> None:
        """The checkpoints given up or lost leave memory (their writers left the table already)."""
        names = [name for name in self._checkpoints.known if gone(name)]
        self._checkpoints.drop(names)
        self._totals.forget(names)
        for name in names:
            self._published_status.pop(name, None)

    async def _restore(self, owns: Callable[[str], bool] | None) -> list[Checkpoint]:
        """Restore the checkpoints ``owns`` accepts (None: all), none of them known yet.

        Returns those whose counts may be stale, for a census.
        """
        core = self._core
        mine: Callable[[str], bool] = owns if owns is not None else lambda name: True
        known = self._checkpoints.known
        before = set(known)
        records = [r for r in await core.registry_read(core.registry.list_checkpoints) if mine(r.name)]
        counts = _owned(await core.registry_read(core.registry.latest_counts), mine)
        added = self._checkpoints.restore(records, counts)
        failures: dict[str, dict[str, int]] = {}
        for failed in await core.registry_read(core.registry.list_failures):
            if mine(failed.checkpoint):
                failures.setdefault(failed.checkpoint, {})[failed.source_id] = failed.attempts
        budgets = _owned(await core.registry_read(core.registry.list_budgets), mine)
        self._failures.restore(added, failures, budgets)
        declared, declared_counts = await core.registry_read(core.registry.list_declared)
        self._totals.restore(added, _owned(declared, mine), _owned(declared_counts, mine))
        journaled = await core.committer.run(self._journal.load, owns)
        restored = await self._opening.restore(journaled)
        self.stats.writers_restored += len(restored)
        # Another coordinator's claims must not be released here (their writers are not restored).
        claims = [c for c in await core.registry_read(core.registry.live_claims) if mine(c.checkpoint)]
        await self._claims.restore(claims, restored)
        if restored:
            log.info(
                "restored %s from the journal; each has a whole lease to come back",
                count(len(restored), "writer"),
            )
        keep = [session.handle for session in restored]
        # Another coordinator's open writers are live there: only this one's are marked.
        lost = await core.registry_write(
            core.registry.mark_open_writers, WriterState.LOST, core.wall(), keep, owns
        )
        for record in lost:
            core.event(
                record.checkpoint,
                EventKind.WRITER_LOST,
                f"writer {record.writer_id} was open when the coordinator stopped and is not in the "
                "journal; its pending state is gone and its unfinished sources will replay",
                record.writer_id,
            )
        # Counts that may be stale are made exact in the background, never on a status read: those
        # of checkpoints never sampled, and of those that had writers when the coordinator stopped
        # (it may have been killed between two samples).
        stale = {r.checkpoint for r in lost} | (known.keys() - before - counts.keys())
        return [known[name] for name in sorted(stale) if name in known]

    def _start_census(self, census: list[Checkpoint]) -> None:
        if census:
            census_task = self._checkpoints.census(census)
            self._background.append(asyncio.get_running_loop().create_task(census_task, name="tally-census"))

    def store_contact(self, unconfirmed: str | None) -> None:
        """Whether the store's ownership is confirmed (None) or why not: reads of completions wait."""
        if unconfirmed != self._core.store_unconfirmed:
            if unconfirmed is None:
                log.info("contact with the store is back and it is still ours: answering reads again")
            else:
                log.warning("refusing reads of completions: %s", unconfirmed)
        self._core.store_unconfirmed = unconfirmed

    def stop_accepting(self) -> None:
        """Refuse new work (UNAVAILABLE, so clients retry elsewhere or later) and end watch streams."""
        self._core.accepting = False

    async def shutdown(self) -> None:
        """Stop: finish the commits in flight and close the stores.

        Writers stay open: their journals bring them back when the coordinator starts again (a stop
        for an upgrade is not a goodbye); settling sources settle again then.
        """
        core = self._core
        core.accepting = False
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._durability.finalizers:
            await asyncio.gather(*self._durability.finalizers, return_exceptions=True)
        await core.settle_behind()
        await self._checkpoints.settle_merges()
        await self._durability.settle_journals()
        self._checkpoints.sample_progress()
        try:
            await core.bookkeeping.flush()
        except Exception:
            log.exception("writing %s during shutdown failed", count(core.bookkeeping.queued, "registry row"))
        await core.committer.close()
        core.completions.close()
        self._journal.close()
        core.registry.close()
        self._checkpoints.close()
        for executor in (core.registry_writes, core.registry_reads):
            executor.shutdown(wait=True)

    def problems(self) -> list[str]:
        """Why the coordinator is not ready, in words; empty when it is."""
        found = [] if self._core.accepting else ["starting or shutting down"]
        if self._core.store_unconfirmed is not None:
            found.append(self._core.store_unconfirmed)
        if self._core.committer.failing:
            found.append(f"completions cannot be persisted: {self._core.committer.failing}")
        found.extend(f"the {x.name} loop is failing: {x.failing}" for x in self._loops if x.failing)
        return found

    @property
    def ready(self) -> bool:
        """Whether the coordinator accepts work and nothing keeps it from making completions durable."""
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

    def journal_bytes(self) -> int:
        """Bytes the writers' journal takes on disk."""
        return self._journal.size_bytes()

    def journal_entries(self) -> int:
        """Entries the writers' journal holds."""
        return self._journal.entries()

    def journal_memory_bytes(self) -> int:
        """Memory the writers' journal holds (counted against the checkpoints' memory budget)."""
        return self._journal.memory_bytes()

    @property
    def registry_events_dropped(self) -> int:
        """Events the registry's write-behind dropped because its queue was full."""
        return self._core.bookkeeping.dropped_events

    def gauges(self) -> dict[str, CheckpointGauges]:
        """Per known checkpoint, read at scrape time (never loads an id set)."""
        return self._status.gauges()

    # ------------------------------------------------------------------ background steps

    async def _tick(self) -> None:
        paused = self.stall_clock.tick()
        if paused >= _STALL_WARNING_S:
            log.warning(
                "the coordinator could not run for %.1f s (overloaded, paused or swapped out); that "
                "time does not count against writers' leases or settle windows",
                paused,
            )

    async def _flush_bookkeeping(self) -> None:
        self._writers.queue_heartbeats()
        await self._core.bookkeeping.flush()

    async def _publish_status(self) -> None:
        """Publish the checkpoints' statuses that changed, for the store's replicas (PostgreSQL only).

        A coordinator owning only some checkpoints never drops the other rows: they are other
        coordinators' to publish.
        """
        publish = self._core.publish_status
        if publish is None:
            return
        views = self._status.snapshot()
        published = self._published_status
        changed = {name: view for name, view in views.items() if published.get(name) != view}
        renamed = published.keys() != views.keys() or not self._status_published_once
        if not changed and not renamed:
            return
        keep = list(views) if renamed and self._core.owns is None else None
        if await self._core.registry_write(publish, changed, keep):
            self._published_status, self._status_published_once = views, True

    async def _progress_step(self) -> None:
        self._checkpoints.sample_progress()
        await self._checkpoints.merge_overlays()
        self._checkpoints.unload_idle()

    async def _probe_storage(self) -> None:
        if self._core.committer.failing:
            await self._core.committer.probe()

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
        session_token: str = "",
    ) -> OpenedWriter:
        """Register a writer; all or nothing: a refused or failed open leaves no trace.

        ``allow_reset=False`` (a caller without the admin role) refuses an ``on_mismatch="reset"``
        that would have to reset the checkpoint. An open retried with the ``session_token`` of a
        live session attaches to it.
        """
        with self._core.calls.on(checkpoint):
            return await self._opening.open(
                checkpoint,
                writer_id=writer_id,
                fingerprint_=dict(fingerprint or {}),
                labels=dict(labels or {}),
                host=host,
                pid=pid,
                on_mismatch=on_mismatch,
                allow_reset=allow_reset,
                session_token=session_token,
            )

    async def keep_alive(self, handle: str) -> float:
        """Renew a lease: memory only, no I/O, so a heartbeat never waits for storage."""
        return await self._writers.keep_alive(handle)

    async def apply_deltas(
        self, handle: str, batch: Sequence[Delta], batch_seq: int = 0, *, ordered: bool = False
    ) -> AppliedBatch:
        """Apply ``(task_id, source_id, delta)`` in order under the counting rules.

        A batch resent with the ``batch_seq`` of the last one applied is recognised and answered
        again. ``ordered``: the batch follows batch ``batch_seq - 1`` (see ``Writers.apply``). The
        answer says whether the writer is settled (a flush would return at once).
        """
        with self._on_writer(handle):
            counts, refused = await self._writers.apply(handle, batch, batch_seq, ordered=ordered)
            return AppliedBatch(counts, self._writers.settled(handle), refused)

    async def save_cursors(self, handle: str, cursors: Sequence[tuple[str, bytes]]) -> SavedCursors:
        """Save where the writer got to inside sources (each at most 4 KiB): durable on return."""
        with self._on_writer(handle):
            return await self._writers.save_cursors(handle, cursors)

    async def get_cursor(self, checkpoint: str, source_id: str) -> CursorView:
        """The cursor last saved for a source by any writer; none once the source is completed."""
        return await self._status.get_cursor(checkpoint, source_id)

    # ------------------------------------------------------------------ failure budgets

    async def report_failure(
        self, handle: str, source_id: str, reason: str, attempt_id: str = ""
    ) -> ReportedFailure:
        """Count a failed attempt at a source (durable on return); failed at the checkpoint's budget.

        A repeat with the same non-empty ``attempt_id`` is answered without counting again.
        """
        with self._on_writer(handle):
            cp, writer_id = self._writers.checkpoint_for(handle)
            return await self._failures.report(cp, writer_id, source_id, reason, attempt_id)

    async def list_failures(
        self,
        checkpoint: str,
        *,
        source_ids: Sequence[str] = (),
        failed_only: bool = False,
        after: str = "",
        limit: int = 0,
    ) -> FailurePage:
        """Sources with failed attempts, by source id: those asked about, or a page of all."""
        return await self._failures.listing(
            checkpoint, source_ids=source_ids, failed_only=failed_only, after=after, limit=limit
        )

    async def retry_failed(self, checkpoint: str, source_ids: Sequence[str] = ()) -> int:
        """Clear failed attempts (every source's with no ids); how many sources were cleared."""
        with self._core.calls.on(checkpoint):
            return await self._failures.retry(checkpoint, source_ids)

    async def set_failure_budget(self, checkpoint: str, max_attempts: int) -> tuple[int, int]:
        """Set a checkpoint's failure budget (0: unlimited); the budget and the sources failed now."""
        with self._core.calls.on(checkpoint):
            return await self._failures.set_budget(checkpoint, max_attempts)

    # ------------------------------------------------------------------ claims

    async def acquire(self, handle: str, source_ids: Sequence[str]) -> list[ClaimView]:
        """Claim sources for a writer: acquired (with a fencing token), held, completed or failed."""
        with self._on_writer(handle):
            cp, _ = self._writers.checkpoint_for(handle)
            return await self._claims.acquire(cp, self._writers.session(handle), source_ids)

    async def token_is_current(self, checkpoint: str, source_id: str, token: int) -> TokenCheck:
        """Whether a fencing token is the live claim on a source (its writer still holds it)."""
        return await self._claims.token_is_current(checkpoint, source_id, token)

    # ------------------------------------------------------------------ declared totals

    async def declare_sources(
        self, checkpoint: str, source_ids: Sequence[str], count: int = 0
    ) -> tuple[int, int]:
        """Declare sources (idempotent, additive) or only how many: the total and remaining now."""
        with self._core.calls.on(checkpoint):
            return await self._totals.declare(checkpoint, source_ids, count)

    async def list_remaining(self, checkpoint: str, *, after: str = "", limit: int = 0) -> CompletedPage:
        """A page of declared sources not completed yet, in byte order."""
        return await self._totals.remaining(checkpoint, after=after, limit=limit)

    async def flush(self, handle: str) -> int:
        """Return once every completion from deltas applied so far is durable."""
        with self._on_writer(handle):
            return await self._writers.flush(handle)

    async def close_writer(self, handle: str) -> ClosedWriter:
        """Flush, complete settling sources, drop pending state; lists what was left incomplete."""
        with self._on_writer(handle):
            return await self._writers.close_writer(handle)

    def checkpoint_of(self, handle: str) -> str | None:
        """The checkpoint a writer handle was opened on, or None for an unknown handle."""
        return self._writers.checkpoint_of(handle)

    def _on_writer(self, handle: str) -> contextlib.AbstractContextManager[None]:
        """Count a call of a writer as at work on its checkpoint (see :meth:`release`)."""
        return self._core.calls.on(self._writers.checkpoint_of(handle))

    # ------------------------------------------------------------------ reads and status

    async def are_completed(self, checkpoint: str, source_ids: Sequence[str]) -> list[bool]:
        """Parallel booleans from the checkpoint's live completed set."""
        return await self._status.are_completed(checkpoint, source_ids)

    async def get_checkpoint(self, name: str) -> CheckpointView:
        """One checkpoint's status, from memory."""
        return await self._status.get_checkpoint(name)

    async def list_checkpoints(
        self,
        *,
        after: str = "",
        limit: int = 0,
        visible: Callable[[str], bool] = lambda name: True,
        writers: bool = True,
    ) -> CheckpointPage:
        """A page of the checkpoints ``visible`` lets through (a scoped token's), by name, from memory.

        On a store of several shards (``list_elsewhere``), the checkpoints of the shards other
        coordinators own are listed too, from the statuses they publish. ``writers`` False: without
        their live writers (counted only).
        """
        elsewhere = self._core.list_elsewhere
        if elsewhere is None:
            return await self._status.list_checkpoints(
                after=after, limit=limit, visible=visible, writers=writers
            )
        limit = validation.status_page_limit(limit, "checkpoints")
        validation.checkpoint_after(after, self.limits)
        names_of, statuses_of = elsewhere
        known = self._checkpoints.known
        start = after.encode()
        published = await self._core.registry_read(names_of)
        names = sorted(
            {n for n in (*known, *published) if n.encode() > start and visible(n)},
            key=str.encode,
        )
        wanted = names[:limit]
        others = await self._core.registry_read(statuses_of, [n for n in wanted if n not in known])
        page = [
            self._status.view(known[n], writers=writers) if n in known else counted(others[n], writers)
            for n in wanted
            if n in known or n in others
        ]
        return CheckpointPage(page, page[-1].name if len(names) > limit and page else "")

    def list_elsewhere(
        self,
        names: Callable[[], list[str]],
        statuses: Callable[[Sequence[str]], Mapping[str, CheckpointView]],
    ) -> None:
        """On a store of several shards: list other coordinators' checkpoints too, as they publish them.

        ``names`` and ``statuses`` are blocking reads of the published statuses (``pg_status``).
        """
        self._core.list_elsewhere = (names, statuses)

    def tag_handles(self, tag: Callable[[str], str]) -> None:
        """New writer handles of a checkpoint end with ``tag(checkpoint)`` (its shard; ``sharding``)."""
        self._core.handle_tag = tag

    async def list_writers(
        self, checkpoint: str, *, include_closed: bool = False, after: str = "", limit: int = 0
    ) -> WriterPage:
        """A page of writers: live ones by writer id, then (``include_closed``) past ones, newest first."""
        return await self._status.list_writers(
            checkpoint, include_closed=include_closed, after=after, limit=limit
        )

    async def list_events(self, checkpoint: str, *, limit: int = 50, before_id: int = 0) -> EventPage:
        """Events newest first, paged with ``before_id``."""
        return await self._status.list_events(checkpoint, limit=limit, before_id=before_id)

    async def progress(self, checkpoint: str, *, since: float = 0.0) -> list[ProgressSample]:
        """Completed count over time, ending at the present."""
        return await self._status.progress(checkpoint, since=since)

    async def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> AsyncIterator[CheckpointView]:
        """A status snapshot now and then whenever it changes."""
        async for view in self._status.watch(checkpoint, interval_s=interval_s):
            yield view

    def serve_replicas(
        self,
        name: str,
        listing: Callable[[], ReplicasView],
        publish_status: Callable[[Mapping[str, Any], Sequence[str] | None], bool] | None = None,
    ) -> None:
        """On a PostgreSQL store: this coordinator's name among the replicas, and their needs.

        ``listing`` lists the store's replicas; ``publish_status`` publishes the checkpoints'
        statuses the replicas answer status reads from.
        """
        self._core.owner_name = name
        self._core.list_replicas = listing
        self._core.publish_status = publish_status

    async def list_replicas(self) -> ReplicasView:
        """The coordinators serving the store (none on the LMDB store), read from the database."""
        listing = self._core.list_replicas
        if listing is None:
            return ReplicasView([], 0, answered_by="")
        return await self._core.registry_read(listing)

    async def list_completed(self, checkpoint: str, *, after: str = "", limit: int = 10_000) -> CompletedPage:
        """Completed ids in byte order after ``after``, at most ``limit``."""
        return await self._status.list_completed(checkpoint, after=after, limit=limit)

    # ------------------------------------------------------------------ admin

    async def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], *, import_id: str
    ) -> ImportResult:
        """Adopt completions made elsewhere into ``<import_id>.mdb``."""
        with self._core.calls.on(checkpoint):
            return await self._admin.import_completed(checkpoint, source_ids, import_id=import_id)

    async def reset_checkpoint(self, name: str, *, force: bool = False) -> ResetResult:
        """Start a checkpoint over; its files go to the trash folder."""
        with self._core.calls.on(name):
            return await self._admin.reset_checkpoint(name, force=force)


async def _journaled(durability: Durability, session: Session) -> None:
    """Once the completions being committed for ``session`` are through, its journal made durable."""
    async with session.changed:
        await session.changed.wait_for(lambda: session.commits_in_flight == 0)
    await durability.commit(session)


def _owned(by_checkpoint: dict[str, T], owns: Callable[[str], bool]) -> dict[str, T]:
    """The entries of the checkpoints ``owns`` accepts."""
    return {name: value for name, value in by_checkpoint.items() if owns(name)}
