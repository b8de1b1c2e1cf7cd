"""Making writers' work durable.

Each session's journal entries in order, the completion and un-complete commits grouped after
them, and the settle step that completes sources whose window ran out.

Ordering guarantees that matter:

* a completion becomes visible in the live set only after its completion-file commit is durable;
* completion and un-complete commits go through one FIFO group committer, and their effects on
  the live set are applied in that same order, so a late anomaly always wins over an earlier
  completion of the same source;
* a completion the settle loop is committing is queued before the un-complete of any later anomaly
  of the writer for the same source (``Writers.apply`` waits for it), and is not made visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from tally_server.domain.checkpoint import Checkpoint, WriterState
from tally_server.domain.effects import (
    BatchEffects,
    commit_failed,
    made_durable,
    settle_due,
    uncomplete_durable,
)
from tally_server.domain.journal import Completing, Persisted, Reverted, Snapshot
from tally_server.domain.ports import (
    CompletionOp,
    DeleteCompleted,
    ForgetWriter,
    JournalEntry,
    PutCompleted,
)
from tally_server.domain.words import count
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.sessions import Session

log = logging.getLogger(__name__)


async def _outcomes(futures: Sequence[asyncio.Future[None]]) -> list[BaseException | None]:
    """``asyncio.gather(*futures, return_exceptions=True)``, awaited one after another.

    A commit's futures are resolved together, in order, so the caller resumes as soon as its first
    one is, in the very turn of the loop in which an earlier or later submitter with one future
    would: submitters resume in the order their operations were queued, whatever their number.
    (``gather`` resumes its caller one turn later, behind submitters queued after it: a completion
    made visible after a later un-complete of the same source would then stand in the live set
    while no file holds it.)
    """
    outcomes: list[BaseException | None] = []
    for future in futures:
        try:
            await future
        except Exception as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)
    return outcomes


class Durability:
    """The commit path every writer operation shares.

    Args:
        core: what the service's parts share.
        checkpoints: the checkpoint table.
    """

    def __init__(self, core: Core, checkpoints: CheckpointTable) -> None:
        self._core = core
        self._checkpoints = checkpoints
        self.finalizers: set[asyncio.Task[None]] = set()
        # Un-completes whose commit failed, by checkpoint: retried until they are durable.
        self.undeleted: dict[str, set[str]] = {}
        # Failure budgets' hook: sources completed lose their failed attempts (set by the service).
        self.on_failures_completed: Callable[[Checkpoint, Sequence[str]], None] | None = None
        self.on_claims_completed: Callable[[Checkpoint, Sequence[str]], None] | None = None

    async def commit(
        self, session: Session, changes: Sequence[CompletionOp] = ()
    ) -> list[BaseException | None]:
        """Make the session's queued journal entries durable, and ``changes`` after them in the same group.

        Returns, per change, its error or None.

        Raises:
            Unavailable: the journal could not be written; the entries stay queued, in order, for
                the next try, and none of ``changes`` was committed.
        """
        committer = self._core.committer
        async with session.journal_lock:
            entries, session.journal_queue = session.journal_queue, []
            first = session.journal_index + 1
            # The entries go into one group together: one future answers for all of them.
            written = (
                [
                    committer.enqueue_all(
                        [
                            JournalEntry(session.handle, first + i, e, session.checkpoint)
                            for i, e in enumerate(entries)
                        ]
                    )
                ]
                if entries
                else []
            )
            committed = [committer.enqueue(change) for change in changes]
            journal = await _outcomes(written)
            results = await _outcomes(committed)
            failed = next((r for r in journal if isinstance(r, BaseException)), None)
            if failed is not None:
                session.journal_queue[:0] = entries
                raise failed
            session.journal_index += len(entries)
            return [r if isinstance(r, BaseException) else None for r in results]

    def changes_failed(
        self, session: Session, effects: BatchEffects, results: Sequence[BaseException | None] | None = None
    ) -> None:
        """Some of a batch's commits failed: retry un-completes, let completions settle again."""
        uncomplete_failed = bool(effects.uncomplete) and (results is None or results[0] is not None)
        complete_failed = bool(effects.complete) and (results is None or results[-1] is not None)
        if uncomplete_failed:
            # A completion left in a file would come back at the next start: retried until durable.
            self.undeleted.setdefault(session.checkpoint, set()).update(effects.uncomplete)
        if complete_failed:
            self.revert(session, effects.complete)
        if uncomplete_failed or complete_failed:
            session.failed_commits += 1

    def revert(self, session: Session, sources: list[str]) -> None:
        """Completions whose commit failed are not completed: they settle again.

        The journal says so too.
        """
        commit_failed(session.ledger, sources, self._core.clock())
        session.unconfirmed.difference_update(sources)
        session.journal_queue.append(Reverted(sources))

    @staticmethod
    def completing(session: Session, sources: list[str]) -> None:
        """The ledger completed ``sources``: journal that before their commit.

        Replay then sees them complete exactly where the writer did (unconfirmed until the commit
        is durable).
        """
        session.unconfirmed.update(sources)
        session.journal_queue.append(Completing(sources))

    @staticmethod
    def persisted(session: Session, sources: list[str]) -> None:
        """Their commit is durable (journaled with the session's next entries)."""
        session.unconfirmed.difference_update(sources)
        session.journal_queue.append(Persisted(sources))

    def maybe_snapshot(self, session: Session, deltas: int) -> None:
        """Now and then, let the journal's entries give way to a snapshot of the ledger.

        So a writer's journal never holds much more than its ledger, however long it runs.
        """
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

    def completed_cleanup(self, cp: Checkpoint, sources: Sequence[str]) -> None:
        """Sources completed: their cursors, failed attempts and claims go (behind the answer)."""
        if cp.failures and self.on_failures_completed is not None:
            self.on_failures_completed(cp, sources)
        if cp.claims and self.on_claims_completed is not None:
            self.on_claims_completed(cp, sources)
        if cp.cursored:
            self._cursors_done(cp, sources)

    def _cursors_done(self, cp: Checkpoint, sources: Sequence[str]) -> None:
        """Sources completed: delete their cursors (behind; a completed source's is never shown)."""
        done = cp.cursored.intersection(sources)
        if not done:
            return
        cp.cursored.difference_update(done)
        # If the registry is down, read-time deletion covers it: a completed source's is never shown.
        self._core.write_behind(
            f"delete the cursors of {count(len(done), 'completed source')} of {cp.name}",
            self._core.registry.delete_cursors,
            cp.name,
            sorted(done),
        )

    async def persist(
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
            (result,) = await self.commit(session, [PutCompleted(cp.name, session.writer_id, sources)])
            if result is not None:
                raise result
            own = session.ledger.own_completed
            if own.issuperset(sources):
                made_durable(cp.ids(), sources, session.writer_id)
            else:
                # An anomaly un-completed some while this commit was in flight: they stay out of
                # the live set; the anomaly's un-complete, committed after this, removes them from
                # the files (see Writers.apply).
                made_durable(cp.ids(), [sid for sid in sources if sid in own], session.writer_id)
            self.persisted(session, sources)
            self._core.stats.completions[cp.name] += len(sources)
            if cp.cursored or cp.failures or cp.claims:
                self.completed_cleanup(cp, sources)
        except Exception:
            session.failed_commits += 1
            self.revert(session, sources)
            raise
        finally:
            session.commits_in_flight -= 1
            await session.notify()

    async def forget(self, session: Session) -> None:
        """Drop the journal of a session that ended.

        Best effort: a journal left behind brings the writer back at the next start, where its
        lease then runs out.
        """
        try:
            await self._core.committer.submit(ForgetWriter(session.handle, session.checkpoint))
        except Exception as exc:
            log.warning("could not drop the journal of writer %s: %s", session.writer_id, exc)

    async def release_files(self, session: Session, *, last: bool) -> None:
        """Close the store's handles on the files of a session that ended (best effort).

        Its own file; once it was the checkpoint's last writer, every file of the checkpoint (those
        an anomaly's un-complete opened again too). On the commit thread, between two commits.
        """
        store, writer_id = self._core.completions, None if last else session.writer_id
        try:
            await self._core.committer.run(store.release_files, session.checkpoint, writer_id)
        except Exception as exc:
            log.warning("could not close the completion files of writer %s: %s", session.writer_id, exc)

    async def settle_journals(self) -> None:
        """On a graceful stop: make every queued journal entry durable (best effort)."""
        for session in self._core.sessions:
            try:
                await self.commit(session)
            except Exception as exc:
                log.warning(
                    "could not write the journal of writer %s on shutdown: %s", session.writer_id, exc
                )

    async def settle_step(self) -> None:
        """Complete settling sources whose window passed; retry un-completes that failed."""
        core = self._core
        now = core.clock()
        for session in core.sessions:
            if not session.ledger.settling or session.state != WriterState.OPEN:
                continue
            completing = settle_due(session.ledger, now)
            if completing:
                self.completing(session, completing)
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
            await self.persist(cp, session, sources, counted=True)

    async def settle_undeleted(self, which: Callable[[str], bool]) -> None:
        """Commit now the un-completes left to retry of the checkpoints ``which`` accepts.

        Before they are given up (``CoordinatorService.release``): their next owner loads what the
        store holds, so an anomaly's un-complete must be there first.

        Raises:
            Unavailable: the commit failed (they stay to retry).
        """
        for name, sources in list(self.undeleted.items()):
            if not which(name):
                continue
            if sources:
                retry = sorted(sources)
                await self._core.committer.submit(DeleteCompleted(name, retry))
                sources.difference_update(retry)
            if not sources:
                self.undeleted.pop(name, None)

    def forget_undeleted(self, checkpoint: str) -> None:
        """A reset moved every file away: nothing is left to un-complete."""
        self.undeleted.pop(checkpoint, None)
