"""Declared totals (issue #12): the sources a pipeline said it will process, and how many remain.

A pipeline declares its sources (ids, idempotent and additive; or a count when it cannot list them).
Status then carries ``total`` and ``remaining`` (declared sources not completed), exact: the
checkpoint's completed set counts the completed among the declared as completions come and go
(``CompletedSet.watch``). The declared ids live in the registry and, for every checkpoint, in
memory (read back at start); they are meant for up to about a million sources per checkpoint.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint
from tally_server.errors import InvalidArgument
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.status import completed_limit
from tally_server.service.views import CompletedPage

MAX_DECLARED_COUNT = 10**12
DEFAULT_PAGE = 1000


class Totals:
    """Declare sources and page through those not completed yet."""

    def __init__(self, core: Core, checkpoints: CheckpointTable) -> None:
        self._core = core
        self._checkpoints = checkpoints
        self._ordered: dict[str, list[str]] = {}  # declared ids in order, per checkpoint (a cache)

    def restore(
        self, checkpoints: Iterable[Checkpoint], declared: dict[str, set[str]], counts: dict[str, int]
    ) -> None:
        """The declared sources and counts the registry holds, onto ``checkpoints`` (those restored)."""
        for cp in checkpoints:
            cp.declared = declared.get(cp.name, set())
            cp.declared_count = counts.get(cp.name, 0)
            self._ordered.pop(cp.name, None)

    def forget(self, names: Iterable[str]) -> None:
        """Checkpoints given up (``CoordinatorService.release``): their cached order goes."""
        for name in names:
            self._ordered.pop(name, None)

    async def declare(self, checkpoint: str, source_ids: Sequence[str], count: int) -> tuple[int, int]:
        """Add declared sources (durable on return); the checkpoint's total and remaining now."""
        core = self._core
        validation.checkpoint_name(checkpoint, core.limits)
        ids = validation.source_ids(list(source_ids), core.limits)
        if not 0 <= count <= MAX_DECLARED_COUNT:
            raise InvalidArgument(
                f"count {count} is out of range; give 0 to {MAX_DECLARED_COUNT:,} sources (0: no count)",
                field="count",
            )
        cp = await self._checkpoints.find(checkpoint, create=True)
        assert cp is not None  # created if missing
        completed = await self._checkpoints.completed(cp)
        new = [sid for sid in dict.fromkeys(ids) if sid not in cp.declared]
        raise_count = count > cp.declared_count
        if new or raise_count:
            await core.registry_write(
                core.registry.add_declared, checkpoint, new, count if raise_count else 0
            )
        # From here to the end, no await: the count below and the completions' own counting agree.
        completed = cp.completed or completed
        if raise_count:
            cp.declared_count = count
        if new:
            cp.declared.update(new)
            self._ordered.pop(checkpoint, None)
            done = completed.declared_done if completed.declared is cp.declared else 0
            if completed.declared is not cp.declared:
                done = sum(completed.contains_many(list(cp.declared)))
            else:
                done += sum(completed.contains_many(new))
            completed.watch(cp.declared, done)
        return cp.total, cp.remaining

    async def remaining(self, checkpoint: str, *, after: str = "", limit: int = 0) -> CompletedPage:
        """A page of declared sources not completed, in byte order after ``after``."""
        core = self._core
        limit = limit or DEFAULT_PAGE
        completed_limit(limit, core.limits)
        cp = await self._checkpoints.existing(checkpoint)
        completed = await self._checkpoints.completed(cp)
        ordered = self._ordered.get(checkpoint)
        if ordered is None or len(ordered) != len(cp.declared):
            ordered = self._ordered[checkpoint] = sorted(cp.declared)
        at = bisect.bisect_right(ordered, after) if after else 0
        page: list[str] = []
        while at < len(ordered) and len(page) <= limit:  # one more than asked: is there a next page
            chunk = ordered[at : at + limit + 1]
            at += len(chunk)
            page += [sid for sid, done in zip(chunk, completed.contains_many(chunk), strict=True) if not done]
        more = len(page) > limit
        page = page[:limit]
        return CompletedPage(page, page[-1] if more else "")
