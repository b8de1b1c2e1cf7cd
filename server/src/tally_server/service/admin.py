"""Operations an administrator asks for: adopt completions made elsewhere, start a checkpoint over."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from tally_server.domain import validation
from tally_server.domain.admission import check_reset
from tally_server.domain.checkpoint import WriterState
from tally_server.domain.events import EventKind
from tally_server.domain.ports import CheckpointRecord, PutCompleted
from tally_server.domain.words import count
from tally_server.errors import AlreadyExists, NotFound, Unavailable
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.views import ImportResult, ResetResult
from tally_server.service.writers import Writers


class Admin:
    """Import and reset."""

    def __init__(self, core: Core, checkpoints: CheckpointTable, writers: Writers) -> None:
        self._core = core
        self._checkpoints = checkpoints
        self._writers = writers

    async def import_completed(
        self, checkpoint: str, source_ids: Sequence[str], *, import_id: str
    ) -> ImportResult:
        """Adopt completions made elsewhere, written to their own file ``<import_id>.mdb``."""
        core = self._core
        core.check_accepting()
        validation.checkpoint_name(checkpoint, core.limits)
        validation.writer_id(import_id, core.limits, "import_id")
        source_ids = validation.source_ids(source_ids, core.limits)
        if checkpoint in self._checkpoints.resetting:
            raise Unavailable(f"checkpoint {checkpoint!r} is being reset; retry in a moment")
        cp = await self._checkpoints.find(checkpoint, create=True)
        assert cp is not None
        if import_id in core.sessions.live(checkpoint):
            raise AlreadyExists(f"{import_id!r} is a live writer of {checkpoint!r}; choose another import_id")
        cp.pins += 1  # the set must stay loaded until the commit made it durable
        try:
            completed = await self._checkpoints.completed(cp)
            if not source_ids:
                return ImportResult(0, len(completed))
            offered = list(dict.fromkeys(source_ids))
            new = [
                sid for sid, done in zip(offered, completed.contains_many(offered), strict=True) if not done
            ]
            if new:
                await core.committer.submit(PutCompleted(cp.name, import_id, new))
                completed.add(new, import_id)
                core.stats.completions[cp.name] += len(new)
        finally:
            cp.pins -= 1
        cp.last_activity_at = core.wall()
        core.event(
            checkpoint,
            EventKind.IMPORTED,
            f"{count(len(new), 'completed source')} imported into {import_id}.mdb "
            f"({len(source_ids) - len(new)} already completed)"
            if new
            else "nothing imported: "
            + (
                "the one source offered was"
                if len(source_ids) == 1
                else f"all {count(len(source_ids), 'source')} offered were"
            )
            + " already completed",
            import_id,
            imported=len(new),
            offered=len(source_ids),
        )
        return ImportResult(len(new), len(completed))

    async def reset_checkpoint(self, name: str, *, force: bool = False) -> ResetResult:
        """Start a checkpoint over: its files go to the trash folder (never deleted)."""
        core = self._core
        core.check_accepting()
        cp = await self._checkpoints.existing(name)
        live = dict(core.sessions.live(name))
        check_reset(name, live, force=force)
        if name in self._checkpoints.resetting:
            raise Unavailable(f"checkpoint {name!r} is already being reset")
        self._checkpoints.resetting.add(name)
        try:
            closed = 0
            for session in live.values():
                try:
                    await self._writers.close(
                        session, WriterState.RESET, "closed by a forced checkpoint reset"
                    )
                    closed += 1
                except NotFound:
                    pass
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(core.wall())) + f"-{uuid.uuid4().hex[:6]}"
            moved_to, files = await core.committer.run(core.completions.trash, name, stamp)
            cp.completed = self._checkpoints.empty_set(name)
            if cp.declared:  # the declared sources stay; none of them is completed now
                cp.completed.watch(cp.declared, 0)
            cp.known_count = 0
            cp.anomalies = 0
            cp.unreadable_files = []
            cp.fingerprint = {}
            cp.last_activity_at = core.wall()
            self._writers.durability.forget_undeleted(name)
            self._checkpoints.forget_progress(name)
            await core.registry_write(core.registry.delete_samples, name)
            await core.registry_write(core.registry.delete_cursors, name, None)
            cp.cursored.clear()
            # Every source runs again: failed attempts go too (the budget stays).
            await core.registry_write(core.registry.clear_failures, name, None)
            cp.failures.clear()
            await core.registry_write(
                lambda: core.registry.write_batch(
                    checkpoints=[CheckpointRecord(name, cp.created_at, cp.last_activity_at, {})]
                )
            )
            core.event(
                name,
                EventKind.CHECKPOINT_RESET,
                f"checkpoint reset: {count(files, 'file')} moved to {moved_to} (the trash); "
                f"{count(closed, 'live writer')} closed"
                if moved_to
                else f"checkpoint reset: no files to move; {count(closed, 'live writer')} closed",
                moved_to=moved_to,
                files_moved=files,
                writers_closed=closed,
            )
            return ResetResult(moved_to, files, closed)
        finally:
            self._checkpoints.resetting.discard(name)
