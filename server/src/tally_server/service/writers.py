"""Writers: open, heartbeat, apply deltas, flush and close, and the background steps that finish
their work (settle windows running out, leases running out, failed un-completes retried).

Ordering guarantees that matter:

* a completion becomes visible in the live set only after its completion-file commit is durable;
* completion and un-complete commits go through one FIFO group committer, and their effects on
  the live set are applied in that same order, so a late anomaly always wins over an earlier
  completion of the same source.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from tally_server.domain import fingerprint, validation
from tally_server.domain.admission import admit_writer
from tally_server.domain.checkpoint import Checkpoint, WriterState
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
from tally_server.domain.journal import (
    Applied,
    Completing,
    JournaledWriter,
    Opened,
    Persisted,
    Reverted,
    Snapshot,
    replay,
)
from tally_server.domain.leases import expired
from tally_server.domain.ledger import ApplyCounts, Delta, WriterLedger
from tally_server.domain.ports import (
    CheckpointRecord,
    CompletionOp,
    DeleteCompleted,
    ForgetWriter,
    JournalEntry,
    OpenJournal,
    PutCompleted,
    WriterRecord,
)
from tally_server.errors import InvalidArgument, NotFound, Unavailable
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.sessions import Session
from tally_server.service.views import ClosedWriter, OpenedWriter

log = logging.getLogger(__name__)

# What a writer brought back from the journal gets on top of its lease to come back.
RESTORE_GRACE_S = 10.0
# Sent back with incomplete sources on close; the full count is reported separately.
MAX_INCOMPLETE_LISTED = 1000


class Writers:
    """The writer operations of the service.

    Args:
        core: what the service's parts share.
        checkpoints: the checkpoint table.
        reset: resets a checkpoint (for a writer that asked ``on_mismatch="reset"``).
    """

    def __init__(
        self, core: Core, checkpoints: CheckpointTable, reset: Callable[[str], Awaitable[object]]
    ) -> None:
        self._core = core
        self._checkpoints = checkpoints
        self._reset = reset
        self.finalizers: set[asyncio.Task[None]] = set()
        # Handles whose registry row should be refreshed (last heartbeat) at the next flush.
        self._dirty: set[str] = set()
        # Un-completes whose commit failed, by checkpoint: retried until they are durable.
        self.undeleted: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ sessions

    def session(self, handle: str) -> Session:
        session = self._core.sessions.get(handle)
        if session is None or session.state != WriterState.OPEN:
            raise NotFound(
                f"writer handle {validation.describe(handle)} is not open (unknown, closed, or its lease "
                "expired); its pending state is gone: open a new writer (unfinished sources replay)",
            )
        return session

    def checkpoint_of(self, handle: str) -> str | None:
        """The checkpoint a writer handle was opened on, or None for an unknown handle."""
        session = self._core.sessions.get(handle)
        return session.checkpoint if session is not None else None

    def _renew(self, session: Session) -> None:
        session.lease_deadline = self._core.clock() + self._core.lease_ttl_s
        session.last_seen_at = self._core.wall()
        self._dirty.add(session.handle)

    @staticmethod
    def record(s: Session, closed_at: float | None = None) -> WriterRecord:
        """The writer's registry row."""
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

    # ------------------------------------------------------------------ operations

    async def open(
        self,
        checkpoint: str,
        *,
        writer_id: str,
        fingerprint_: dict[str, str],
        labels: dict[str, str],
        host: str,
        pid: int,
        on_mismatch: str,
        allow_reset: bool,
        session_token: str = "",
    ) -> OpenedWriter:
        """Register a writer; all or nothing: a refused or failed open leaves no trace.

        An open retried with the ``session_token`` of a live session (its answer was lost, e.g. in a
        coordinator restart) attaches to that session instead of being refused.
        """
        core = self._core
        core.check_accepting()
        try:
            mode = OnMismatch(on_mismatch)
        except ValueError:
            raise InvalidArgument(
                f"on_mismatch {validation.describe(on_mismatch)} is not one of refuse, reset, ignore"
            ) from None
        validation.checkpoint_name(checkpoint, core.limits)
        writer_id = writer_id or f"{socket.gethostname()}-tally-{uuid.uuid4().hex[:8]}"
        validation.writer_id(writer_id, core.limits)
        validation.labels(labels, core.limits)
        validation.labels(fingerprint_, core.limits)
        validation.host(host, core.limits)
        validation.pid(pid)
        validation.session_token(session_token)
        live = core.sessions.live(checkpoint).get(writer_id)
        if live is not None and session_token and live.session_token == session_token:
            self._renew(live)
            return self._opened(live)
        if checkpoint in self._checkpoints.resetting:
            raise Unavailable(f"checkpoint {checkpoint!r} is being reset; retry in a moment")
        cp = await self._checkpoints.find(checkpoint, create=True)
        assert cp is not None
        cp.pins += 1
        try:
            await self._checkpoints.completed(cp)
            await self._guard_fingerprint(cp, writer_id, fingerprint_, mode, allow_reset)
            completed = await self._checkpoints.completed(cp)  # a reset replaced it
        finally:
            cp.pins -= 1
        # From here to adding the session nothing awaits, so the admission holds.
        admit_writer(checkpoint, writer_id, core.sessions.live(checkpoint), core.limits, core.lease_ttl_s)
        now = core.wall()
        session = Session(
            handle=uuid.uuid4().hex,
            writer_id=writer_id,
            checkpoint=checkpoint,
            host=host,
            pid=pid,
            labels=labels,
            fingerprint=fingerprint_,
            opened_at=now,
            last_seen_at=now,
            lease_deadline=core.clock() + core.lease_ttl_s,
            ledger=WriterLedger(completed.as_of_now(), core.settle_ms / 1000),
            session_token=session_token,
        )
        # The writer id is taken from here on; undone below if the journal or registry refuses it.
        core.sessions.add(session)
        records_fingerprint = bool(fingerprint_) and not cp.fingerprint
        if records_fingerprint:
            cp.fingerprint = dict(fingerprint_)
        journaled = False
        try:
            await core.committer.submit(OpenJournal(self._who(session)))
            journaled = True
            await core.registry_write(
                lambda: core.registry.write_batch(
                    checkpoints=[CheckpointRecord(cp.name, cp.created_at, now, dict(cp.fingerprint))],
                    writers=[self.record(session)],
                )
            )
        except BaseException:
            core.sessions.remove(session)
            if records_fingerprint and cp.fingerprint == fingerprint_:
                cp.fingerprint = {}
            if journaled:
                await self._forget(session)
            raise
        core.stats.writers_opened += 1
        cp.last_activity_at = now
        core.event(
            checkpoint,
            EventKind.WRITER_OPENED,
            f"writer {writer_id} opened (host {host or '?'}, pid {pid or '?'})",
            writer_id,
            labels=labels,
        )
        return self._opened(session)

    def _opened(self, session: Session) -> OpenedWriter:
        cp = self._checkpoints[session.checkpoint]
        core = self._core
        return OpenedWriter(
            session.handle, session.writer_id, core.lease_ttl_s, cp.completed_count, core.settle_ms
        )

    @staticmethod
    def _who(session: Session) -> Opened:
        return Opened(
            handle=session.handle,
            checkpoint=session.checkpoint,
            writer_id=session.writer_id,
            host=session.host,
            pid=session.pid,
            labels=dict(session.labels),
            fingerprint=dict(session.fingerprint),
            opened_at=session.opened_at,
            session_token=session.session_token,
        )

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
            return  # the first fingerprint is recorded by open
        if fingerprint.decide(cp.name, mismatch, on_mismatch, may_reset=may_reset) is OnMismatch.IGNORE:
            self._core.event(
                cp.name,
                EventKind.FINGERPRINT_MISMATCH_IGNORED,
                f"writer {writer_id} opened with a different fingerprint ({mismatch.detail}); ignored as "
                "it asked",
                writer_id,
                differing=mismatch.differing,
            )
            return
        # Refused while other writers are live (the reset says so); the new fingerprint is recorded
        # by open once the checkpoint is empty again.
        await self._reset(cp.name)

    async def keep_alive(self, handle: str) -> float:
        """Renew a lease: memory only, no I/O, so a heartbeat never waits for storage."""
        self._core.check_accepting()
        self._renew(self.session(handle))
        return self._core.lease_ttl_s

    async def apply(self, handle: str, batch: Sequence[Delta], batch_seq: int = 0) -> ApplyCounts:
        """Apply a batch under the rules; answered once it is in the journal (and, at settle 0,
        once what it completed is in the completion files).

        A batch sent again with the ``batch_seq`` of the last one applied (the client did not hear
        the answer) is recognised and not applied twice; it gets the same answer.
        """
        core = self._core
        core.check_accepting()
        # Transports check big batches off the event loop already; then this returns at once.
        batch = validation.deltas(batch, core.limits)
        validation.batch_seq(batch_seq)
        session = self.session(handle)
        async with session.lock:
            session = self.session(handle)  # may have closed while we waited
            self._renew(session)
            if batch_seq and batch_seq <= session.applied_seq:
                core.stats.batches_resent += 1
                await self._commit(session)  # applied already; make sure it is durable
                last = session.last_counts if batch_seq == session.applied_seq else ApplyCounts()
                return replace(last)
            cp = self._checkpoints[session.checkpoint]
            effects = apply_batch(session.ledger, cp.ids(), batch, core.clock())
            core.stats.count(effects.counts)
            cp.last_activity_at = session.last_seen_at
            session.journal_queue.append(Applied(batch_seq, batch, effects.hits))
            if effects.complete:
                self._completing(session, effects.complete)
            session.applied_seq = batch_seq or session.applied_seq
            session.last_counts = effects.counts
            self._maybe_snapshot(session, len(batch))
            changes: list[CompletionOp] = []
            if effects.anomalies:
                self._record_anomalies(cp, session, effects)
                changes.append(DeleteCompleted(cp.name, effects.uncomplete))
            if effects.complete:
                changes.append(PutCompleted(cp.name, session.writer_id, effects.complete))
                session.commits_in_flight += 1
            try:
                results = await self._commit(session, changes)
            except Exception:
                self._changes_failed(session, effects)
                raise
            finally:
                if effects.complete:
                    session.commits_in_flight -= 1
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                self._changes_failed(session, effects, results)
                await session.notify()
                raise failed
            if effects.uncomplete:
                uncomplete_durable(cp.ids(), effects.uncomplete)
            if effects.complete:
                made_durable(cp.ids(), effects.complete, session.writer_id)
                self._persisted(session, effects.complete)
                core.stats.completions += len(effects.complete)
                effects.counts.completed = len(effects.complete)
            await session.notify()
            return replace(effects.counts)

    def _changes_failed(
        self, session: Session, effects: BatchEffects, results: Sequence[BaseException | None] | None = None
    ) -> None:
        """Some of a batch's commits failed: retry un-completes, let completions settle again."""
        uncomplete_failed = bool(effects.uncomplete) and (results is None or results[0] is not None)
        complete_failed = bool(effects.complete) and (results is None or results[-1] is not None)
        if uncomplete_failed:
            # A completion left in a file would come back at the next start: retried until durable.
            self.undeleted.setdefault(session.checkpoint, set()).update(effects.uncomplete)
        if complete_failed:
            self._revert(session, effects.complete)
        if uncomplete_failed or complete_failed:
            session.failed_commits += 1

    async def _commit(
        self, session: Session, changes: Sequence[CompletionOp] = ()
    ) -> list[BaseException | None]:
        """Make the session's queued journal entries durable, and ``changes`` after them in the
        same group; returns, per change, its error or None.

        Raises:
            Unavailable: the journal could not be written; the entries stay queued, in order, for
                the next try, and none of ``changes`` was committed.
        """
        committer = self._core.committer
        async with session.journal_lock:
            entries, session.journal_queue = session.journal_queue, []
            first = session.journal_index + 1
            written = [
                committer.enqueue(JournalEntry(session.handle, first + i, e)) for i, e in enumerate(entries)
            ]
            committed = [committer.enqueue(change) for change in changes]
            journal = await asyncio.gather(*written, return_exceptions=True)
            results = await asyncio.gather(*committed, return_exceptions=True)
            failed = next((r for r in journal if isinstance(r, BaseException)), None)
            if failed is not None:
                session.journal_queue[:0] = entries
                raise failed
            session.journal_index += len(entries)
            return [r if isinstance(r, BaseException) else None for r in results]

    def _revert(self, session: Session, sources: list[str]) -> None:
        """Completions whose commit failed are not completed: they settle again (and the journal
        says so)."""
        commit_failed(session.ledger, sources, self._core.clock())
        session.unconfirmed.difference_update(sources)
        session.journal_queue.append(Reverted(sources))

    @staticmethod
    def _completing(session: Session, sources: list[str]) -> None:
        """The ledger completed ``sources``: journaled before their commit, so replay sees them
        complete exactly where the writer did (unconfirmed until the commit is durable)."""
        session.unconfirmed.update(sources)
        session.journal_queue.append(Completing(sources))

    @staticmethod
    def _persisted(session: Session, sources: list[str]) -> None:
        """Their commit is durable (journaled with the session's next entries)."""
        session.unconfirmed.difference_update(sources)
        session.journal_queue.append(Persisted(sources))

    def _maybe_snapshot(self, session: Session, deltas: int) -> None:
        """Now and then the journal's entries give way to a snapshot of the ledger, so a writer's
        journal never holds much more than its ledger, however long it runs."""
        session.deltas_since_snapshot += deltas
        ledger = session.ledger
        if session.deltas_since_snapshot < max(
            self._core.journal_snapshot_deltas, 2 * (len(ledger.applied) + len(ledger.pending))
        ):
            return
        session.deltas_since_snapshot = 0
        session.journal_queue.append(
            Snapshot(
                ledger.state(), session.applied_seq, replace(session.last_counts), sorted(session.unconfirmed)
            )
        )

    async def _persist(
        self, cp: Checkpoint, session: Session, sources: list[str], *, counted: bool = False
    ) -> None:
        """Commit ``sources`` as completed (their Completing entry is queued), then make them visible.

        ``counted``: the caller already raised ``commits_in_flight`` synchronously, when it marked
        the sources completing; a flush or close arriving before this coroutine runs must wait.
        On failure the sources settle again.
        """
        if not counted:
            session.commits_in_flight += 1
        try:
            undeleted = self.undeleted.get(cp.name)
            if undeleted:
                undeleted.difference_update(sources)  # completed again: the newer state wins
            (result,) = await self._commit(session, [PutCompleted(cp.name, session.writer_id, sources)])
            if result is not None:
                raise result
            made_durable(cp.ids(), sources, session.writer_id)
            self._persisted(session, sources)
            self._core.stats.completions += len(sources)
        except Exception:
            session.failed_commits += 1
            self._revert(session, sources)
            raise
        finally:
            session.commits_in_flight -= 1
            await session.notify()

    def _record_anomalies(self, cp: Checkpoint, session: Session, effects: BatchEffects) -> None:
        """Count and report the batch's anomalies (their sources already left the live set)."""
        cp.anomalies += len(effects.anomalies)
        for a in effects.anomalies:
            change = "a new task" if a.old_delta is None else f"delta {a.old_delta} -> {a.new_delta}"
            self._core.event(
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

    async def flush(self, handle: str) -> int:
        """Return once every completion resulting from deltas applied so far is durable.

        Sources still settling are waited for (their window runs out or a delta cancels it); the
        window is never cut short, so a flush cannot make a completion early.
        """
        self._core.check_accepting()
        session = self.session(handle)
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
        if session.state == WriterState.OPEN:
            await self._commit(session)  # every entry so far durable (e.g. after a journal failure)
        if session.state == WriterState.EXPIRED:
            raise NotFound(
                f"writer {session.writer_id!r} expired while flushing; its pending state is gone: "
                "open a new writer (unfinished sources replay)",
            )
        if session.failed_commits != failures:
            cause = self._core.committer.failing or "see the coordinator log for the storage error"
            raise Unavailable(
                f"persisting completions failed while flushing ({cause}); they are being retried, so "
                "flush again",
            )
        return session.ledger.totals.completed

    async def close_writer(self, handle: str) -> ClosedWriter:
        self._core.check_accepting()
        return await self.close(self.session(handle), WriterState.CLOSED, "closed by its client")

    async def close(self, session: Session, state: WriterState, why: str) -> ClosedWriter:
        """End a session: a client's close completes its settling sources; the others drop them."""
        core = self._core
        async with session.lock:
            if session.state != WriterState.OPEN:
                raise NotFound(f"writer {session.writer_id!r} is already closed")
            cp = self._checkpoints[session.checkpoint]
            if state == WriterState.CLOSED:
                completing = settle_all(session.ledger)
                if completing:
                    self._completing(session, completing)
                    await self._persist(cp, session, completing)
            async with session.changed:
                await session.changed.wait_for(lambda: session.commits_in_flight == 0)
            session.state = state
            if state == WriterState.EXPIRED:
                core.stats.writers_expired += 1
            incomplete = list(session.ledger.pending)
            core.sessions.remove(session)
            self._dirty.discard(session.handle)
            now = core.wall()
            cp.last_activity_at = now
            core.bookkeeping.writer(self.record(session, now))
            core.event(
                cp.name,
                EventKind(f"writer_{state}"),
                f"writer {session.writer_id} {why}; {len(incomplete)} sources left incomplete will replay",
                session.writer_id,
                incomplete=len(incomplete),
            )
            await session.notify()
        await self._forget(session)
        totals = session.ledger.totals
        return ClosedWriter(
            ApplyCounts(totals.applied, totals.skipped, totals.rewritten, totals.anomalies, totals.completed),
            incomplete[:MAX_INCOMPLETE_LISTED],
            len(incomplete),
        )

    async def _forget(self, session: Session) -> None:
        """Drop the journal of a session that ended (best effort: a journal left behind brings the
        writer back at the next start, where its lease then runs out)."""
        try:
            await self._core.committer.submit(ForgetWriter(session.handle))
        except Exception as exc:
            log.warning("could not drop the journal of writer %s: %s", session.writer_id, exc)

    async def restore(self, journaled: Sequence[JournaledWriter]) -> list[Session]:
        """Bring back every writer the journal holds, under its handle, exactly where it was."""
        core = self._core
        restored = []
        for writer in journaled:
            who = writer.opened
            cp = await self._checkpoints.find(who.checkpoint, create=True)
            assert cp is not None
            completed = await self._checkpoints.completed(cp)
            rebuilt = replay(writer.entries, completed.as_of_now(), core.settle_ms / 1000, core.clock())
            session = Session(
                handle=who.handle,
                writer_id=who.writer_id,
                checkpoint=who.checkpoint,
                host=who.host,
                pid=who.pid,
                labels=dict(who.labels),
                fingerprint=dict(who.fingerprint),
                opened_at=who.opened_at,
                last_seen_at=core.wall(),
                # The lease starts over, with a grace: the writer's client has to notice the
                # coordinator is back (reconnect backoff) before its first heartbeat lands.
                lease_deadline=core.clock() + core.lease_ttl_s + RESTORE_GRACE_S,
                ledger=rebuilt.ledger,
                session_token=who.session_token,
                journal_index=writer.last_index,
                applied_seq=rebuilt.last_seq,
                last_counts=rebuilt.last_counts,
            )
            session.unconfirmed = set(rebuilt.unconfirmed)
            core.sessions.add(session)
            restored.append(session)
            # Completions journaled but perhaps never committed: those the files lack are committed
            # now, before anyone hears from this writer (a flush may have acknowledged them).
            redo = sorted(sid for sid in rebuilt.unconfirmed if sid not in completed)
            if redo:
                await core.committer.submit(PutCompleted(cp.name, session.writer_id, redo))
                made_durable(completed, redo, session.writer_id)
            if rebuilt.unconfirmed:
                self._persisted(session, sorted(rebuilt.unconfirmed))
            # Un-completes of its anomalies may not have reached the files before the stop.
            ledger = rebuilt.ledger
            doubtful = sorted(ledger.uncompleted - ledger.own_completed)
            stale = [
                sid for sid, done in zip(doubtful, completed.contains_many(doubtful), strict=True) if done
            ]
            if stale:
                for sid in stale:
                    completed.discard(sid)
                self.undeleted.setdefault(cp.name, set()).update(stale)
            core.event(
                cp.name,
                EventKind.WRITER_RESTORED,
                f"writer {who.writer_id} restored from the journal after a restart ({ledger.in_flight} "
                f"sources in flight, {len(ledger.settling)} settling); it carries on where it was",
                who.writer_id,
                pending=ledger.in_flight,
            )
        return restored

    async def settle_journals(self) -> None:
        """On a graceful stop: make every queued journal entry durable (best effort)."""
        for session in self._core.sessions:
            try:
                await self._commit(session)
            except Exception as exc:
                log.warning(
                    "could not write the journal of writer %s on shutdown: %s", session.writer_id, exc
                )

    # ------------------------------------------------------------------ background steps

    async def settle_step(self) -> None:
        """Complete settling sources whose window passed; retry un-completes that failed."""
        core = self._core
        now = core.clock()
        for session in core.sessions:
            if not session.ledger.settling or session.state != WriterState.OPEN:
                continue
            completing = settle_due(session.ledger, now)
            if completing:
                self._completing(session, completing)
                session.commits_in_flight += 1
                task = asyncio.get_running_loop().create_task(self._finalize(session, completing))
                self.finalizers.add(task)
                task.add_done_callback(self.finalizers.discard)
        for name, sources in list(self.undeleted.items()):
            if not sources:
                del self.undeleted[name]
                continue
            retry = sorted(sources)
            await core.committer.submit(DeleteCompleted(name, retry))
            sources.difference_update(retry)
            cp = self._checkpoints.known.get(name)
            if cp is not None and cp.completed is not None:
                uncomplete_durable(cp.completed, retry)

    async def _finalize(self, session: Session, sources: list[str]) -> None:
        cp = self._checkpoints[session.checkpoint]
        with contextlib.suppress(Exception):
            # On failure the sources settle again and this loop retries them; the committer logged
            # the cause (once per cause).
            await self._persist(cp, session, sources, counted=True)

    async def lease_step(self) -> None:
        """Close the writers whose lease ran out (each on its own: one failure stops no other)."""
        failures: list[Exception] = []
        for session in expired(self._core.sessions, self._core.clock()):
            try:
                await self.close(
                    session,
                    WriterState.EXPIRED,
                    f"sent nothing for {self._core.lease_ttl_s:g} s: lease expired, pending state dropped",
                )
            except NotFound:
                pass  # closed meanwhile
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def queue_heartbeats(self) -> None:
        """Queue the registry rows of writers seen since the last flush (their last heartbeat)."""
        dirty, self._dirty = self._dirty, set()
        for handle in dirty:
            session = self._core.sessions.get(handle)
            if session is not None and session.state == WriterState.OPEN:
                self._core.bookkeeping.writer(self.record(session))

    def forget_undeleted(self, checkpoint: str) -> None:
        """A reset moved every file away: nothing is left to un-complete."""
        self.undeleted.pop(checkpoint, None)
