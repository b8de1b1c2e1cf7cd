"""Writers at work.

Heartbeats, batches applied under the counting rules, flushes, closes, and the lease step that
closes writers that went quiet (opening one is in ``opening``, the commit path in
``durability``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint, WriterState
from tally_server.domain.effects import (
    BatchEffects,
    apply_batch,
    made_durable,
    settle_all,
    uncomplete_durable,
)
from tally_server.domain.events import EventKind
from tally_server.domain.journal import Applied, Persisted
from tally_server.domain.leases import expired
from tally_server.domain.ledger import ApplyCounts, Delta
from tally_server.domain.ports import CompletionOp, CursorRecord, DeleteCompleted, PutCompleted, WriterRecord
from tally_server.domain.words import count
from tally_server.errors import FailedPrecondition, NotFound, Unavailable
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.claims import Claims
from tally_server.service.core import Core
from tally_server.service.durability import Durability
from tally_server.service.sessions import Session
from tally_server.service.views import ClosedWriter, SavedCursors

# Sent back with incomplete sources on close; the full count is reported separately.
MAX_INCOMPLETE_LISTED = 1000
# Batches of one writer that may be on the wire at once, each sent as ``ordered`` (told to
# clients at open, gRPC and HTTP): the next batch travels and is read while the one before it is applied.
MAX_BATCHES_IN_FLIGHT = 2
# How long an ordered batch waits for the one before it to be applied; then it is refused as
# UNAVAILABLE and sent again (the one before it was lost on the way, or is being resent).
PREVIOUS_BATCH_WAIT_S = 1.0
# How long the handle of a writer let go with its checkpoint is remembered (``Writers.let_go``).
RELEASED_KEPT_S = 600.0
# Anomalies of one batch that are events of their own; the rest of the batch's are one event.
ANOMALY_EVENTS_PER_BATCH = 20
# Answers of the latest closes kept in memory, so that a close sent again (its answer was lost) is
# answered as the first was; after a restart, or once dropped from here, the writer's registry row
# answers instead. At most this many answers, listing at most this many sources in all.
CLOSED_ANSWERS_KEPT = 10_000
CLOSED_ANSWERS_SOURCES_KEPT = 100_000
# How long a client's close waits for the registry to record the writer closed before answering
# (the row a close sent again after a restart is answered from); then the row is written behind.
CLOSED_ROW_WAIT_S = 2.0
# Handles longer than this are never looked up in the registry (one is 32 hex digits and a shard tag).
HANDLE_LOOKUP_MAX_CHARS = 256

log = logging.getLogger(__name__)


class Writers:
    """The writer operations of the service, once a writer is open.

    Args:
        core: what the service's parts share.
        checkpoints: the checkpoint table.
        durability: the commit path (journal entries and completion commits).
        claims: the claims on sources (deltas for a source another writer holds are refused).
    """

    def __init__(
        self, core: Core, checkpoints: CheckpointTable, durability: Durability, claims: Claims
    ) -> None:
        self._core = core
        self._checkpoints = checkpoints
        self.durability = durability
        self._claims = claims
        # Handles whose registry row should be refreshed (last heartbeat) at the next flush.
        self._dirty: set[str] = set()
        # The answers of the latest closes by their clients, by handle, oldest first.
        self._closed: dict[str, ClosedWriter] = {}
        self._closed_listed = 0  # incomplete sources their answers list, in all
        # The checkpoints of writers let go with them (``CoordinatorService.release``), by handle,
        # with when (``real_clock``), oldest first.
        self._released: dict[str, tuple[str, float]] = {}

    # ------------------------------------------------------------------ sessions

    def session(self, handle: str) -> Session:
        """The open session behind a handle; NOT_FOUND if it is unknown, closed or expired."""
        session = self._core.sessions.get(handle)
        if session is None and handle in self._released:
            # Let go with its checkpoint, open at its next owner: UNAVAILABLE (retried there), never
            # NOT_FOUND, for a call that passed the router before its shard left (``release``).
            self._core.check_owned(self._released[handle][0])
        if session is None or session.state != WriterState.OPEN:
            raise NotFound(
                f"writer handle {validation.describe(handle)} is not open (unknown, closed, or its lease "
                "expired); its pending state is gone: open a new writer (unfinished sources replay)",
            )
        # A writer the journal brought back for a shard still being adopted waits (UNAVAILABLE).
        self._core.check_owned(session.checkpoint)
        return session

    def checkpoint_of(self, handle: str) -> str | None:
        """The checkpoint a writer handle was opened on, or None for an unknown handle."""
        session = self._core.sessions.get(handle)
        return session.checkpoint if session is not None else None

    def renew(self, session: Session) -> None:
        """Restart the session's lease from now; its registry row is refreshed at the next flush."""
        session.lease_deadline = self._core.clock() + self._core.lease_ttl_s
        session.last_seen_at = self._core.wall()
        self._dirty.add(session.handle)

    # ------------------------------------------------------------------ operations

    async def keep_alive(self, handle: str) -> float:
        """Renew a lease: memory only, no I/O, so a heartbeat never waits for storage."""
        self._core.check_accepting()
        self.renew(self.session(handle))
        return self._core.lease_ttl_s

    async def apply(
        self, handle: str, batch: Sequence[Delta], batch_seq: int = 0, *, ordered: bool = False
    ) -> tuple[ApplyCounts, int]:
        """Apply a batch under the rules: its counts, and how many of its deltas were refused.

        Answered once it is in the journal (and, at settle 0, once what it completed is in the
        completion files).

        A batch sent again with the ``batch_seq`` of the last one applied (the client did not hear
        the answer) is recognised and not applied twice; it gets the same answer. A numbered batch
        below that is refused (FAILED_PRECONDITION): it was resent out of turn or overtaken.

        ``ordered`` (with ``batch_seq``): the batch follows batch ``batch_seq - 1``, which may still be
        on its way (a client with several batches in flight). It waits for that one to be applied
        (UNAVAILABLE after ``PREVIOUS_BATCH_WAIT_S``), so batches apply in their order whatever
        order they arrive in; and a number below the last one applied then names a batch applied
        already, answered again instead of refused.

        Deltas for a source another live writer holds a claim on are left out (neither applied nor
        journaled) and counted as refused.
        """
        core = self._core
        core.check_accepting()
        # Transports check big batches off the event loop already; then this returns at once.
        batch = validation.deltas(batch, core.limits)
        validation.batch_seq(batch_seq)
        ordered = ordered and batch_seq > 0
        session = self.session(handle)
        if ordered and session.applied_seq < batch_seq - 1:
            await self._wait_for_previous(session, batch_seq - 1)
        async with session.lock:
            session = self.session(handle)  # may have closed while we waited
            self.renew(session)
            if ordered and batch_seq < session.applied_seq:
                # Batches apply in order, so this one was applied before the later one was.
                core.stats.batches_resent += 1
                await self.durability.commit(session)  # applied already; make sure it is durable
                counts, refused = session.answers.get(batch_seq, (ApplyCounts(), 0))
                return replace(counts), refused
            if batch_seq and batch_seq < session.applied_seq:
                # Either an old batch sent again or one overtaken by a later one: no way to tell,
                # and applying it could count it twice. Say so rather than answer as if applied.
                raise FailedPrecondition(
                    f"batch_seq {batch_seq} is below the last batch this writer applied "
                    f"({session.applied_seq}); nothing was applied. A writer's batches must be sent one "
                    "at a time, in order, and only the last one may be sent again; if this batch was "
                    "never answered before, its deltas are missing: close the writer and rerun its work"
                )
            if batch_seq and batch_seq == session.applied_seq:
                core.stats.batches_resent += 1
                await self.durability.commit(session)  # applied already; make sure it is durable
                return replace(session.last_counts), session.last_refused
            cp = self._checkpoints[session.checkpoint]
            if cp.claims:
                kept = self._claims.refuse_held(cp, session, batch)
                session.last_refused, batch = len(batch) - len(kept), validation.CheckedDeltas.of_rows(kept)
            else:
                session.last_refused = 0
            effects = apply_batch(session.ledger, cp.ids(), batch, core.clock())
            # Sources un-completed whose completion the settle loop is still committing (not this
            # batch's own): their un-complete must be committed after that completion.
            in_flight = session.unconfirmed.intersection(effects.uncomplete) if effects.uncomplete else None
            core.stats.count(cp.name, effects.counts)
            cp.last_activity_at = session.last_seen_at
            session.journal_queue.append(Applied(batch_seq, batch, effects.hits))
            if effects.complete:
                self.durability.completing(session, effects.complete)
            session.applied_seq = batch_seq or session.applied_seq
            session.last_counts = effects.counts
            if batch_seq:  # the same object: it gets its completed count below
                answers = session.answers
                answers[batch_seq] = (effects.counts, session.last_refused)
                while len(answers) > MAX_BATCHES_IN_FLIGHT:
                    del answers[next(iter(answers))]  # the oldest
            self.durability.maybe_snapshot(session, len(batch))
            changes: list[CompletionOp] = []
            if effects.anomalies:
                self._record_anomalies(cp, session, effects)
                changes.append(DeleteCompleted(cp.name, effects.uncomplete))
            if effects.complete:
                changes.append(PutCompleted(cp.name, session.writer_id, effects.complete))
                session.commits_in_flight += 1
            if in_flight:
                # Else this un-complete could be committed first and the completion land after it:
                # the source would stand completed, in the file and the live set, after the anomaly.
                async with session.changed:
                    await session.changed.wait_for(lambda: session.unconfirmed.isdisjoint(in_flight))
            try:
                results = await self.durability.commit(session, changes)
            except Exception:
                self.durability.changes_failed(session, effects)
                raise
            finally:
                if effects.complete:
                    session.commits_in_flight -= 1
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                self.durability.changes_failed(session, effects, results)
                await session.notify()
                raise failed
            if effects.uncomplete:
                uncomplete_durable(cp.ids(), effects.uncomplete)
            if effects.complete:
                made_durable(cp.ids(), effects.complete, session.writer_id, distinct=True)
                self.durability.persisted(session, effects.complete)
                if cp.cursored or cp.failures or cp.claims:
                    self.durability.completed_cleanup(cp, effects.complete)
                core.stats.completions[cp.name] += len(effects.complete)
                effects.counts.completed = len(effects.complete)
            await session.notify()
            return replace(effects.counts), session.last_refused

    def _record_anomalies(self, cp: Checkpoint, session: Session, effects: BatchEffects) -> None:
        """Count and report the batch's anomalies (their sources already left the live set).

        Every anomaly is counted; the first ``ANOMALY_EVENTS_PER_BATCH`` of a batch are events of
        their own, the rest one event with their number. A rerun over sources all completed
        already (a resume that does not skip them) makes an anomaly of every source: an event,
        a log line and a registry row each would flood the log and the registry and hold up the
        coordinator's loop, heartbeats included.
        """
        anomalies = effects.anomalies
        cp.anomalies += len(anomalies)
        for a in anomalies[:ANOMALY_EVENTS_PER_BATCH]:
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
        rest = anomalies[ANOMALY_EVENTS_PER_BATCH:]
        if rest:
            self._core.event(
                cp.name,
                EventKind.ANOMALY,
                f"{count(len(rest), 'more source')} of the same batch got deltas after they were completed "
                f"(sources {rest[0].source_id} to {rest[-1].source_id}); each was un-completed in every "
                "writer file and will be reprocessed next run (the checkpoint's anomaly count has them all; "
                "the first "
                f"{ANOMALY_EVENTS_PER_BATCH} of a batch are events of their own)",
                session.writer_id,
                more=len(rest),
                first_source_id=rest[0].source_id,
                last_source_id=rest[-1].source_id,
            )

    async def save_cursors(self, handle: str, cursors: Sequence[tuple[str, bytes]]) -> SavedCursors:
        """Save where the writer got to inside sources: durable on return.

        Cursors of sources already completed are not saved (a completed source has none).
        """
        core = self._core
        core.check_accepting()
        latest = validation.cursors(cursors, core.limits)
        session = self.session(handle)
        self.renew(session)
        cp = self._checkpoints[session.checkpoint]
        completed = cp.ids()
        live = {sid: data for sid, data in latest.items() if sid not in completed}
        if live:
            now = core.wall()
            records = [CursorRecord(cp.name, sid, data, now, session.writer_id) for sid, data in live.items()]
            await core.registry_write(core.registry.save_cursors, records)
            cp.cursored.update(live)
        return SavedCursors(saved=len(live), completed=len(latest) - len(live))

    def checkpoint_for(self, handle: str) -> tuple[Checkpoint, str]:
        """The checkpoint of a live writer (its set loaded) and the writer's id; renews its lease."""
        self._core.check_accepting()
        session = self.session(handle)
        self.renew(session)
        return self._checkpoints[session.checkpoint], session.writer_id

    def settled(self, handle: str) -> bool:
        """Whether everything the writer applied is durable now: nothing settling or being committed.

        Asked right after :meth:`apply` answers (no await in between), it tells the client that a
        flush would return at once. False when unsure: the flush then asks. Journal entries still
        queued may only be ``Persisted`` ones: bookkeeping written behind (a replay checks the
        completion files for what they would have said), never something a flush waits for.
        """
        session = self._core.sessions.get(handle)
        return (
            session is not None
            and session.state == WriterState.OPEN
            and session.commits_in_flight == 0
            and not session.ledger.settling
            and all(isinstance(entry, Persisted) for entry in session.journal_queue)
            and not session.journal_lock.locked()
        )

    async def _wait_for_previous(self, session: Session, previous: int) -> None:
        """Wait until batch ``previous`` of the session is applied (or the session ends)."""

        def arrived() -> bool:
            return session.applied_seq >= previous or session.state != WriterState.OPEN

        try:
            async with session.changed:
                await asyncio.wait_for(session.changed.wait_for(arrived), PREVIOUS_BATCH_WAIT_S)
        except TimeoutError:
            raise Unavailable(
                f"batch {previous + 1} of writer {session.writer_id!r} came before batch {previous}, "
                f"which was not applied within {PREVIOUS_BATCH_WAIT_S:g}s; nothing was applied: send "
                f"batch {previous + 1} again once batch {previous} is answered"
            ) from None

    async def flush(self, handle: str) -> int:
        """Return once every completion resulting from deltas applied so far is durable.

        Sources still settling are waited for (their window runs out or a delta cancels it); the
        window is never cut short, so a flush cannot make a completion early.
        """
        self._core.check_accepting()
        session = self.session(handle)
        async with session.lock:
            self.renew(session)
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
        if session.state == WriterState.LOST:  # its checkpoint was taken over: nothing is durable here
            raise Unavailable(
                f"writer {session.writer_id!r} moved to another coordinator while flushing (its "
                "checkpoint's shard was taken over); flush again: it is answered there"
            )
        if session.state == WriterState.OPEN:
            await self.durability.commit(session)  # every entry so far durable (e.g. after a journal failure)
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
        """Close a writer at its client's request.

        A close sent again once the writer is closed (its answer was lost: a connection cut, a
        coordinator restart) is answered as the first one was, not refused as unknown: the client
        would otherwise report a lost lease for a writer that closed cleanly. From memory while this
        coordinator runs; after a restart from the writer's registry row (its counts and how many
        sources it left incomplete; the list of them is not kept).
        """
        self._core.check_accepting()
        answered = self._closed.get(handle)
        if answered is not None:
            return _copy(answered)
        try:
            session = self.session(handle)
        except NotFound:
            closed = await self._closed_before(handle)
            if closed is None:
                raise
            return closed
        return await self.close(session, WriterState.CLOSED, "closed by its client")

    async def _closed_before(self, handle: str) -> ClosedWriter | None:
        """The answer to a close of ``handle`` from its registry row, if its client closed it."""
        if not 0 < len(handle) <= HANDLE_LOOKUP_MAX_CHARS:
            return None
        try:
            record = await self._core.registry_read(self._core.registry.find_writer, handle)
        except Exception as exc:  # the registry is down: the handle is unknown here, as before
            log.warning("could not look up closed writer handle %s in the registry: %s", handle, exc)
            return None
        if record is None or record.state != WriterState.CLOSED:
            return None
        counts = ApplyCounts(
            record.applied, record.skipped, record.rewritten, record.anomalies, record.completed
        )
        return ClosedWriter(counts, [], record.pending_sources)

    async def close(self, session: Session, state: WriterState, why: str) -> ClosedWriter:
        """End a session: a client's close completes its settling sources; the others drop them."""
        core = self._core
        async with session.lock:
            # Not in the table: closed meanwhile, or let go with its checkpoint (``release``).
            if session.state != WriterState.OPEN or core.sessions.get(session.handle) is not session:
                answered = self._closed.get(session.handle) if state == WriterState.CLOSED else None
                if answered is not None:  # the same close twice at once: both get its answer
                    return _copy(answered)
                raise NotFound(f"writer {session.writer_id!r} is already closed")
            cp = self._checkpoints[session.checkpoint]
            if state == WriterState.CLOSED:
                completing = settle_all(session.ledger)
                if completing:
                    self.durability.completing(session, completing)
                    await self.durability.persist(cp, session, completing)
            async with session.changed:
                await session.changed.wait_for(lambda: session.commits_in_flight == 0)
            session.state = state
            if state == WriterState.EXPIRED:
                core.stats.writers_expired += 1
            incomplete = list(session.ledger.pending)
            core.sessions.remove(session)
            self._claims.writer_ended(cp, session)
            self._dirty.discard(session.handle)
            now = core.wall()
            cp.last_activity_at = now
            record = session.record(now)
            core.bookkeeping.writer(record)
            core.event(
                cp.name,
                EventKind(f"writer_{state}"),
                f"writer {session.writer_id} {why}; "
                f"{count(len(incomplete), 'source')} left incomplete will replay",
                session.writer_id,
                incomplete=len(incomplete),
            )
            closed = ClosedWriter(
                replace(session.ledger.totals), incomplete[:MAX_INCOMPLETE_LISTED], len(incomplete)
            )
            if state == WriterState.CLOSED:
                self._keep_answer(session.handle, closed)
            await session.notify()
        if state == WriterState.CLOSED:
            # Before its journal goes: once a restart no longer brings the writer back, its row
            # says it was closed, and a close sent again is answered from there.
            await self._record_closed(record)
        await self.durability.forget(session)
        # Its files closed before a merge behind the close starts competing for the GIL.
        last = not core.sessions.live(cp.name)
        await self.durability.release_files(session, last=last)
        if last and not core.sessions.live(cp.name):
            self._checkpoints.merge_at_rest(cp)
        return _copy(closed)

    def _keep_answer(self, handle: str, closed: ClosedWriter) -> None:
        """Keep a close's answer for a close sent again; the oldest go beyond the bounds."""
        self._closed[handle] = closed
        self._closed_listed += len(closed.incomplete_sources)
        while len(self._closed) > CLOSED_ANSWERS_KEPT or self._closed_listed > CLOSED_ANSWERS_SOURCES_KEPT:
            oldest = self._closed.pop(next(iter(self._closed)))
            self._closed_listed -= len(oldest.incomplete_sources)

    async def _record_closed(self, record: WriterRecord) -> None:
        """Write a closed writer's registry row now (it stays queued behind too, should this fail)."""
        core = self._core
        try:
            await asyncio.wait_for(
                core.registry_write(lambda: core.registry.write_batch(writers=[record])), CLOSED_ROW_WAIT_S
            )
        except Exception as exc:
            log.warning(
                "could not record writer %s closed in the registry before answering its close (%s); "
                "the row is written behind, and until then a close sent again after a restart is "
                "told the writer is unknown",
                record.writer_id,
                exc or type(exc).__name__,
            )

    # ------------------------------------------------------------------ background steps

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

    def let_go(self, session: Session) -> None:
        """Take a session out of the table with its checkpoint (``CoordinatorService.release``).

        Neither closed nor journaled as ended: it is open at the checkpoint's next owner. Its handle
        is kept for ``RELEASED_KEPT_S`` (a few dozen bytes): a late call naming it is refused as not
        owned here (UNAVAILABLE) rather than as an unknown writer (NOT_FOUND: its pending state
        gone). Only calls that passed the router before the shard left can be that late; later ones
        are routed to the shard's new owner by the handle's tag.
        """
        self._core.sessions.remove(session)  # the settle and lease steps leave it from here
        self._dirty.discard(session.handle)
        now = self._core.real_clock()
        self._released.pop(session.handle, None)  # let go again: kept from now, at the end
        self._released[session.handle] = (session.checkpoint, now)
        while self._released:  # forget the oldest ones past their time (the first one kept stops it)
            oldest = next(iter(self._released))
            if now - self._released[oldest][1] < RELEASED_KEPT_S:
                break
            del self._released[oldest]

    def take_back(self, session: Session) -> None:
        """Undo :meth:`let_go`: the session is in the table again, its handle not among those let go.

        For a release that failed (a restart follows, which flushes the session's journal).
        """
        if self._core.sessions.get(session.handle) is None:
            self._core.sessions.add(session)
        self._released.pop(session.handle, None)

    def queue_heartbeats(self) -> None:
        """Queue the registry rows of writers seen since the last flush (their last heartbeat)."""
        dirty, self._dirty = self._dirty, set()
        for handle in dirty:
            session = self._core.sessions.get(handle)
            if session is not None and session.state == WriterState.OPEN:
                self._core.bookkeeping.writer(session.record())


def _copy(closed: ClosedWriter) -> ClosedWriter:
    """A close's answer to hand out (the kept one stays as it is, whoever changes theirs)."""
    return ClosedWriter(replace(closed.counts), list(closed.incomplete_sources), closed.incomplete_count)
