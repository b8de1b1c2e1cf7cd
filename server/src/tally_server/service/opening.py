"""How a writer session begins.

Opened by a client (validated, admitted, its fingerprint checked, journaled and registered, all
or nothing), or restored from the journal after a restart.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence

from tally_server.domain import fingerprint, validation
from tally_server.domain.admission import admit_writer
from tally_server.domain.checkpoint import Checkpoint
from tally_server.domain.effects import made_durable
from tally_server.domain.events import EventKind
from tally_server.domain.fingerprint import OnMismatch
from tally_server.domain.journal import JournaledWriter, Opened, replay
from tally_server.domain.ledger import WriterLedger
from tally_server.domain.ports import CheckpointRecord, OpenJournal, PutCompleted
from tally_server.errors import InvalidArgument, Unavailable
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.sessions import Session
from tally_server.service.views import OpenedWriter
from tally_server.service.writers import MAX_BATCHES_IN_FLIGHT, Writers

# What a writer brought back from the journal gets on top of its lease to come back.
RESTORE_GRACE_S = 10.0


class Opening:
    """Opens writers and restores them from the journal.

    Args:
        core: what the service's parts share.
        checkpoints: the checkpoint table.
        writers: the writer operations (lease renewal, the commit path).
        reset: resets a checkpoint (for a writer that asked ``on_mismatch="reset"``).
    """

    def __init__(
        self,
        core: Core,
        checkpoints: CheckpointTable,
        writers: Writers,
        reset: Callable[[str], Awaitable[object]],
    ) -> None:
        self._core = core
        self._checkpoints = checkpoints
        self._writers = writers
        self._durability = writers.durability
        self._reset = reset

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
                f"on_mismatch {validation.describe(on_mismatch)} is not one of refuse, reset, ignore",
                field="on_mismatch",
            ) from None
        validation.checkpoint_name(checkpoint, core.limits)
        writer_id = writer_id or f"{socket.gethostname()}-tally-{uuid.uuid4().hex[:8]}"
        validation.writer_id(writer_id, core.limits)
        validation.labels(labels, core.limits)
        validation.labels(fingerprint_, core.limits, "fingerprint")
        validation.host(host, core.limits)
        validation.pid(pid)
        validation.session_token(session_token)
        live = core.sessions.live(checkpoint).get(writer_id)
        if live is not None and session_token and live.session_token == session_token:
            self._writers.renew(live)
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
            handle=uuid.uuid4().hex + (core.handle_tag(checkpoint) if core.handle_tag is not None else ""),
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
                    writers=[session.record()],
                )
            )
        except BaseException:
            core.sessions.remove(session)
            if records_fingerprint and cp.fingerprint == fingerprint_:
                cp.fingerprint = {}
            if journaled:
                await self._durability.forget(session)
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
            session.handle,
            session.writer_id,
            core.lease_ttl_s,
            cp.completed_count,
            core.settle_ms,
            max_batches_in_flight=MAX_BATCHES_IN_FLIGHT,
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

    async def restore(self, journaled: Sequence[JournaledWriter]) -> list[Session]:
        """Bring back every writer the journal holds, under its handle, exactly where it was."""
        core = self._core
        restored = []
        for writer in journaled:
            who = writer.opened
            cp = await self._checkpoints.find(who.checkpoint, create=True, restoring=True)
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
                self._durability.persisted(session, sorted(rebuilt.unconfirmed))
            # Un-completes of its anomalies may not have reached the files before the stop.
            ledger = rebuilt.ledger
            doubtful = sorted(ledger.uncompleted - ledger.own_completed)
            stale = [
                sid for sid, done in zip(doubtful, completed.contains_many(doubtful), strict=True) if done
            ]
            if stale:
                for sid in stale:
                    completed.discard(sid)
                self._durability.undeleted.setdefault(cp.name, set()).update(stale)
            core.event(
                cp.name,
                EventKind.WRITER_RESTORED,
                f"writer {who.writer_id} restored from the journal after a restart ({ledger.in_flight} "
                f"sources in flight, {len(ledger.settling)} settling); it carries on where it was",
                who.writer_id,
                pending=ledger.in_flight,
            )
        return restored
