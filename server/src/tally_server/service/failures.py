"""Failure budgets (issue #12): failed attempts at sources, and the sources that used up their budget.

A writer reports a failed attempt at a source (with a reason); the registry counts them and keeps
the latest reasons, durably, before the call answers. A checkpoint's ``max_attempts`` (0, the
default: unlimited) makes a source with that many failed attempts *failed*: listed as such, counted
in status, skipped by the NeMo Curator drop-in's source stage, until ``retry`` clears it. A source
that completes loses its failed attempts. Nothing here touches the completion files.

Counts live in memory per checkpoint (failures are few; they are read back at start), so status
reads never query for them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint
from tally_server.domain.events import EventKind
from tally_server.domain.ports import FailedAttemptRecord
from tally_server.domain.words import count
from tally_server.errors import FailedPrecondition, InvalidArgument
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.views import FailurePage, ReportedFailure, SourceFailuresView

log = logging.getLogger(__name__)

KEEP_REASONS = 10  # latest failed attempts kept per source, with their reasons
MAX_REASON_CHARS = 1000
MAX_ATTEMPTS = 1_000_000
DEFAULT_PAGE = 1000


class Failures:
    """Report, list and retry failed attempts; set a checkpoint's failure budget."""

    def __init__(self, core: Core, checkpoints: CheckpointTable) -> None:
        self._core = core
        self._checkpoints = checkpoints

    def restore(
        self, checkpoints: Iterable[Checkpoint], failures: dict[str, dict[str, int]], budgets: dict[str, int]
    ) -> None:
        """The failed attempts and budgets the registry holds, onto ``checkpoints`` (those restored)."""
        for cp in checkpoints:
            cp.failures = dict(failures.get(cp.name, {}))
            cp.max_attempts = budgets.get(cp.name, 0)

    async def report(
        self, cp: Checkpoint, writer_id: str, source_id: str, reason: str, attempt_id: str = ""
    ) -> ReportedFailure:
        """Count a failed attempt at ``source_id`` (durable on return); says whether it is failed now.

        A repeat of an attempt (same non-empty ``attempt_id``, e.g. a retry after a lost answer) is
        answered as the first was and not counted again.
        """
        core = self._core
        validation.source_id(source_id, core.limits)
        if source_id in cp.ids():
            raise FailedPrecondition(
                f"source {validation.describe(source_id)} of checkpoint {cp.name!r} is completed; a failed "
                "attempt at it is not counted (a completed source has no failures)"
            )
        validation.attempt_id(attempt_id)
        attempt = FailedAttemptRecord(reason[:MAX_REASON_CHARS], core.wall(), writer_id, attempt_id)
        attempts, repeated = await core.registry_write(
            core.registry.record_failure, cp.name, source_id, attempt, KEEP_REASONS
        )
        cp.failures[source_id] = attempts
        failed = bool(cp.max_attempts) and attempts >= cp.max_attempts
        if failed and attempts == cp.max_attempts and not repeated:
            core.event(
                cp.name,
                EventKind.SOURCE_FAILED,
                f"source {source_id} failed {count(attempts, 'time')}, the checkpoint's budget: it is "
                f"skipped until retried (tally retry {cp.name} {source_id}); last reason: {attempt.reason}",
                writer_id,
                source_id=source_id,
                attempts=attempts,
            )
        return ReportedFailure(attempts, failed, cp.max_attempts)

    async def listing(
        self,
        checkpoint: str,
        *,
        source_ids: Sequence[str] = (),
        failed_only: bool = False,
        after: str = "",
        limit: int = 0,
    ) -> FailurePage:
        """Sources with failed attempts by source id: those asked about, or a page of all."""
        core = self._core
        validation.checkpoint_name(checkpoint, core.limits)
        limit = failures_limit(limit, core.limits)
        asked = validation.source_ids(list(source_ids), core.limits) if source_ids else None
        cp = await self._checkpoints.existing(checkpoint)
        if cp.failures:
            # Completions whose clearing of failures did not reach the registry before a restart.
            completed = await self._checkpoints.completed(cp)
            self.completed(cp, [s for s in cp.failures if s in completed])
        budget = cp.max_attempts
        names = sorted(s for s in (asked or cp.failures) if s in cp.failures and (asked or s > after))
        if failed_only:
            names = [s for s in names if budget and cp.failures[s] >= budget]
        page = names if asked else names[:limit]
        records = await core.registry_read(core.registry.list_failures, checkpoint, page) if page else []
        views = [
            SourceFailuresView(r.source_id, r.attempts, bool(budget) and r.attempts >= budget, list(r.recent))
            for r in records
        ]
        more = not asked and len(names) > limit
        return FailurePage(views, page[-1] if more and page else "", budget)

    async def retry(self, checkpoint: str, source_ids: Sequence[str] = ()) -> int:
        """Clear failed attempts (every source's with no ids): those sources run again. How many."""
        core = self._core
        validation.checkpoint_name(checkpoint, core.limits)
        asked = validation.source_ids(list(source_ids), core.limits) if source_ids else None
        cp = await self._checkpoints.existing(checkpoint)
        cleared = sorted(s for s in (asked or cp.failures) if s in cp.failures)
        if not cleared:
            return 0
        await core.registry_write(core.registry.clear_failures, checkpoint, cleared if asked else None)
        for sid in cleared:
            cp.failures.pop(sid, None)
        core.event(
            checkpoint,
            EventKind.FAILURES_CLEARED,
            f"failed attempts of {count(len(cleared), 'source')} cleared; "
            + ("it runs again" if len(cleared) == 1 else "they run again")
            + (f": {', '.join(cleared[:10])}" + (" ..." if len(cleared) > 10 else "") if asked else ""),
            cleared=len(cleared),
        )
        return len(cleared)

    async def set_budget(self, checkpoint: str, max_attempts: int) -> tuple[int, int]:
        """Set the checkpoint's budget (0: unlimited); the budget and how many sources are failed now."""
        core = self._core
        validation.checkpoint_name(checkpoint, core.limits)
        if not 0 <= max_attempts <= MAX_ATTEMPTS:
            raise InvalidArgument(
                f"max_attempts {max_attempts} is out of range; give 1 to {MAX_ATTEMPTS} attempts, or 0 for "
                "an unlimited budget",
                field="max_attempts",
            )
        cp = await self._checkpoints.find(checkpoint, create=True)
        assert cp is not None  # created if missing
        await core.registry_write(core.registry.set_budget, checkpoint, max_attempts)
        cp.max_attempts = max_attempts
        return max_attempts, cp.failed_count

    def completed(self, cp: Checkpoint, sources: Sequence[str]) -> None:
        """Sources completed: their failed attempts go (behind; never counted for a completed source)."""
        done = [s for s in sources if s in cp.failures]
        if not done:
            return
        for sid in done:
            del cp.failures[sid]
        # If the registry is down, they are cleared later: retry clears them, completion wins anyway.
        self._core.write_behind(
            f"clear the failures of {count(len(done), 'completed source')} of {cp.name}",
            self._core.registry.clear_failures,
            cp.name,
            done,
        )


def failures_limit(limit: int, limits: validation.Limits) -> int:
    """A page size of failures (0: the default), refused out of 1 to ``max_ids_per_query``."""
    limit = limit or DEFAULT_PAGE
    if not 0 < limit <= limits.max_ids_per_query:
        raise InvalidArgument(
            f"limit {limit} is out of range; ask for 1 to {limits.max_ids_per_query} sources per "
            "page (setting max_ids_per_query)",
            field="limit",
        )
    return limit
