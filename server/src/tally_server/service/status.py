"""What the service answers about checkpoints and writers: the live view, status, history.

Status comes from memory (counts kept per checkpoint, live writers in the session table); only
``are_completed`` and ``list_completed`` need a checkpoint's completed set, and load it if needed.
Past writers, events and progress samples come from the registry, merged with the rows still
waiting in its write-behind queue so nothing that just happened is missing.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint, WriterState
from tally_server.domain.events import severity_of
from tally_server.domain.ports import EventRecord, WriterRecord
from tally_server.errors import InvalidArgument, Unavailable
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.views import (
    CheckpointPage,
    CheckpointView,
    CompletedPage,
    CursorView,
    EventPage,
    EventView,
    ProgressSample,
    WriterPage,
    WriterView,
)


@dataclass(frozen=True)
class CheckpointGauges:
    """What the metrics collector reads per checkpoint at scrape time."""

    live_writers: int
    pending_sources: int
    completed_sources: int
    unreadable_files: int
    loaded_bytes: int
    declared_sources: int  # 0: none declared
    remaining_sources: int  # -1: not known
    claimed_sources: int
    remembered_tasks: int


class Status:
    """Read-side operations of the service."""

    def __init__(self, core: Core, checkpoints: CheckpointTable, accepting: Callable[[], bool]) -> None:
        self._core = core
        self._checkpoints = checkpoints
        self._accepting = accepting

    def view(self, cp: Checkpoint, *, writers: bool = True) -> CheckpointView:
        """A checkpoint's status from memory, with its live writers (``writers`` False: counted only)."""
        sessions = self._core.sessions
        live = sessions.live(cp.name)
        return CheckpointView(
            name=cp.name,
            completed_count=cp.completed_count,
            live_writers=len(live),
            pending_sources=sessions.pending_sources(cp.name),
            settling_sources=sessions.settling_sources(cp.name),
            anomalies=cp.anomalies,
            unreadable_files=len(cp.unreadable_files),
            created_at=cp.created_at,
            last_activity_at=cp.last_activity_at,
            writers=[WriterView.of_live(s) for s in live.values()] if writers else [],
            fingerprint=dict(cp.fingerprint),
            owner=self._core.owner_name,
            failed_sources=cp.failed_count,
            max_attempts=cp.max_attempts,
            total=cp.total,
            remaining=cp.remaining,
            claimed_sources=len(cp.claims),
        )

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every known checkpoint's status as JSON-ready dicts (what the owner publishes for replicas)."""
        return {name: view_json(self.view(cp)) for name, cp in self._checkpoints.known.items()}

    def gauges(self) -> dict[str, CheckpointGauges]:
        """Per known checkpoint, read at scrape time (never loads an id set)."""
        sessions = self._core.sessions
        return {
            name: CheckpointGauges(
                live_writers=len(sessions.live(name)),
                pending_sources=sessions.pending_sources(name),
                completed_sources=cp.completed_count,
                unreadable_files=len(cp.unreadable_files),
                loaded_bytes=cp.completed.estimated_bytes() if cp.completed is not None else 0,
                declared_sources=cp.total,
                remaining_sources=cp.remaining,
                claimed_sources=len(cp.claims),
                remembered_tasks=sessions.remembered_tasks(name),
            )
            for name, cp in self._checkpoints.known.items()
        }

    async def get_checkpoint(self, name: str) -> CheckpointView:
        """One checkpoint's status, from memory (its id set is not loaded for this)."""
        return self.view(await self._checkpoints.existing(name))

    async def list_checkpoints(
        self,
        *,
        after: str = "",
        limit: int = 0,
        visible: Callable[[str], bool] = lambda name: True,
        writers: bool = True,
    ) -> CheckpointPage:
        """A page of the checkpoints ``visible`` lets through, by name in byte order after ``after``.

        From memory: no registry query, no id set loaded. ``limit`` 0 is the default page.
        ``writers`` False leaves each checkpoint's live writers out (``live_writers`` still counts
        them): a listing with them costs the server time in proportion to every live writer.
        """
        limit = validation.status_page_limit(limit, "checkpoints")
        validation.checkpoint_after(after, self._core.limits)
        names = sorted(
            (name for name in self._checkpoints.known if name.encode() > after.encode() and visible(name)),
            key=str.encode,
        )
        page = [self.view(self._checkpoints.known[name], writers=writers) for name in names[:limit]]
        return CheckpointPage(page, page[-1].name if len(names) > limit else "")

    async def are_completed(self, checkpoint: str, source_ids: Sequence[str]) -> list[bool]:
        """Whether each source is in the checkpoint's live completed set (loads it if needed)."""
        core = self._core
        core.check_reads()
        validation.checkpoint_name(checkpoint, core.limits)
        source_ids = validation.source_ids(source_ids, core.limits)
        cp = await self._checkpoints.find(checkpoint, create=False)
        if cp is None:
            return [False] * len(source_ids)
        completed = await self._checkpoints.completed(cp)
        return completed.contains_many(source_ids)

    async def _written(self) -> None:
        """Let the registry's write-behind finish what it has, so a read sees what just happened.

        Rows that cannot be written now are merged from the queue by the caller.
        """
        try:
            await self._core.bookkeeping.flush()
        except Unavailable:
            pass  # the read below says so if the registry is down

    async def list_writers(
        self, checkpoint: str, *, include_closed: bool = False, after: str = "", limit: int = 0
    ) -> WriterPage:
        """A page of writers: live ones by writer id, then (``include_closed``) past ones, newest first.

        Live writers' counters are fresh from memory; past ones come from the registry. ``after`` is
        a ``next_after`` this returned (see :func:`writer_position`).
        """
        limit = validation.status_page_limit(limit, "writers")
        start = writer_position(after) if after else None
        cp = await self._checkpoints.existing(checkpoint)
        live = self.view(cp).writers
        records: list[WriterRecord] = []
        if include_closed:
            core = self._core
            await self._written()
            records = await core.registry_read(core.registry.list_writers, checkpoint)
            queued = {r.handle: r for r in core.bookkeeping.queued_writers(checkpoint)}
            records = [queued.pop(r.handle, r) for r in records] + list(queued.values())
        return writer_page(live, records, start, limit)

    async def list_events(self, checkpoint: str, *, limit: int = 50, before_id: int = 0) -> EventPage:
        """The checkpoint's events newest first, read once the write-behind has written what it queued."""
        await self._checkpoints.existing(checkpoint)
        events_limit(limit)
        validation.before_id(before_id)
        core = self._core
        await self._written()
        records = await core.registry_read(
            lambda: core.registry.list_events(checkpoint, limit=limit + 1, before_id=before_id or None)
        )
        return event_page(records, limit)

    async def progress(self, checkpoint: str, *, since: float = 0.0) -> list[ProgressSample]:
        """Persisted samples, plus the live count now, so a plot always ends at the present."""
        cp = await self._checkpoints.existing(checkpoint)
        core = self._core
        await self._written()
        records = await core.registry_read(lambda: core.registry.list_samples(checkpoint, since=since))
        queued = [r for r in core.bookkeeping.queued_samples(checkpoint) if r.at >= since]
        samples = [ProgressSample(r.at, r.completed_count) for r in [*records, *queued]]
        samples.append(ProgressSample(core.wall(), cp.completed_count))
        return samples

    async def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> AsyncIterator[CheckpointView]:
        """A status snapshot now and then whenever it changes, checked every ``interval_s``."""
        cp = await self._checkpoints.existing(checkpoint)
        known = self._checkpoints.known

        async def view() -> CheckpointView | None:
            # Given up to another coordinator meanwhile: the stream ends (watched there next).
            return self.view(cp) if known.get(cp.name) is cp else None

        async for snapshot in watching(view, interval_s, self._accepting):
            yield snapshot

    async def get_cursor(self, checkpoint: str, source_id: str) -> CursorView:
        """The cursor last saved for a source; none once the source is completed (then it is deleted)."""
        core = self._core
        core.check_reads()
        validation.checkpoint_name(checkpoint, core.limits)
        validation.source_id(source_id, core.limits)
        cp = await self._checkpoints.find(checkpoint, create=False)
        if cp is None:
            return CursorView(False)
        record = await core.registry_read(core.registry.get_cursor, checkpoint, source_id)
        if record is None:
            return CursorView(False)
        completed = await self._checkpoints.completed(cp)
        if source_id in completed:  # saved before its completion, or before a restart: gone now
            cp.cursored.discard(source_id)
            try:
                await core.registry_write(core.registry.delete_cursors, checkpoint, [source_id])
            except Unavailable:
                pass  # deleted at a later read
            return CursorView(False)
        return CursorView(True, record.data, record.saved_at, record.writer_id)

    async def list_completed(self, checkpoint: str, *, after: str = "", limit: int = 10_000) -> CompletedPage:
        """A page of completed ids in byte order after ``after`` (loads the set if needed)."""
        self._core.check_reads()
        cp = await self._checkpoints.existing(checkpoint)
        completed_limit(limit, self._core.limits)
        completed = await self._checkpoints.completed(cp)
        origins = completed.origins
        if not origins:  # a set held in memory only
            ordered = completed.in_byte_order()
            start = bisect.bisect_right(ordered, after.encode()) if after else 0
            page = [sid.decode() for sid in ordered[start : start + limit]]
            more = start + limit < len(ordered)
            return CompletedPage(page, page[-1] if more and page else "")
        # The ids are in the files: read them in key order there, keep those the live set holds.
        page = []
        cursor = after.encode()
        cp.pins += 1
        try:
            while len(page) <= limit:
                keys, last = await self._checkpoints.run(
                    self._core.completions.keys_after, cp.name, origins, cursor, limit + 1 - len(page)
                )
                ids = [k.decode(errors="replace") for k in keys]
                page += [sid for sid, done in zip(ids, completed.contains_many(ids), strict=True) if done]
                if last or not keys:
                    break
                cursor = keys[-1]
        finally:
            cp.pins -= 1
        more = len(page) > limit
        page = page[:limit]
        return CompletedPage(page, page[-1] if more and page else "")


def counted(view: CheckpointView, writers: bool) -> CheckpointView:
    """``view`` as a listing without writers shows it (``writers`` False): live writers counted only."""
    return view if writers or not view.writers else dataclasses.replace(view, writers=[])


def view_json(view: CheckpointView) -> dict[str, Any]:
    """``dataclasses.asdict(view)`` without its deep copies, ten times faster.

    The owner makes one per checkpoint every half second (:meth:`Status.snapshot`); the view's maps
    are its own already (``view`` copies them).
    """
    plain = dict(vars(view))
    plain["writers"] = [{**vars(w), "counts": dict(vars(w.counts))} for w in view.writers]
    return plain


def events_limit(limit: int) -> None:
    """Refuse an events page size out of 1 to 1000 (INVALID_ARGUMENT)."""
    if not 0 < limit <= 1000:
        raise InvalidArgument(
            f"limit {limit} is out of range; ask for 1 to 1000 events per page", field="limit"
        )


def completed_limit(limit: int, limits: validation.Limits) -> None:
    """Refuse a page of completed ids out of 1 to ``max_ids_per_query`` (INVALID_ARGUMENT)."""
    most = limits.max_ids_per_query
    if not 0 < limit <= most:
        raise InvalidArgument(
            f"limit {limit} is out of range; ask for 1 to {most} ids per page (setting max_ids_per_query)",
            field="limit",
        )


def event_page(records: Sequence[EventRecord], limit: int) -> EventPage:
    """A page of events from up to ``limit + 1`` registry records, newest first (one more: a next page)."""
    page = records[:limit]
    events = [
        EventView(
            r.id or 0,
            r.checkpoint,
            r.kind,
            r.message,
            r.at,
            r.writer_id or "",
            dict(r.data),
            severity_of(r.kind),
        )
        for r in page
    ]
    more = len(records) > limit
    return EventPage(events, events[-1].id if more and events else 0)


def writer_page(
    live: Sequence[WriterView], records: Sequence[WriterRecord], start: _Position | None, limit: int
) -> WriterPage:
    """A page of ListWriters: the live writers, then the past ones among ``records`` (the registry's).

    A record of a live writer still open is left out (the live one has its fresh counters).
    """
    listed = [(_live_key(w), w) for w in live]
    live_ids = {w.writer_id for w in live}
    listed += [
        (_ended_key(w), w)
        for w in (
            WriterView.of(r) for r in records if r.state != WriterState.OPEN or r.writer_id not in live_ids
        )
    ]
    listed.sort(key=lambda entry: entry[0])
    if start is not None:
        listed = [entry for entry in listed if entry[0] > start]
    page = listed[:limit]
    more = len(listed) > limit
    return WriterPage([w for _, w in page], _writer_cursor(page[-1][1], page[-1][0]) if more else "")


# Where a writer stands in ListWriters' order: live writers by writer id, then ended ones newest first.
# Both shapes start with the group (0: live, 1: ended), so the tuples of the two groups compare.
_Position = tuple[int, bytes] | tuple[int, float, bytes]


def _live_key(w: WriterView) -> _Position:
    return (0, w.writer_id.encode())


def _ended_key(w: WriterView) -> _Position:
    return (1, -w.opened_at, w.writer_id.encode())


def _writer_cursor(w: WriterView, key: _Position) -> str:
    """The ``next_after`` after ``w``: ``live/<writer_id>`` or ``ended/<opened_at>/<writer_id>``."""
    return f"live/{w.writer_id}" if key[0] == 0 else f"ended/{w.opened_at!r}/{w.writer_id}"


def writer_position(after: str) -> _Position:
    """The position an ``after`` of ListWriters names (a ``next_after`` it returned), else raise."""
    group, _, rest = after.partition("/")
    if group == "live" and rest:
        return (0, rest.encode("utf-8", "surrogatepass"))
    if group == "ended":
        opened_at, _, writer_id = rest.partition("/")
        try:
            at = float(opened_at)
        except ValueError:
            at = math.nan
        if writer_id and math.isfinite(at):
            return (1, -at, writer_id.encode("utf-8", "surrogatepass"))
    raise InvalidArgument(
        f"after {validation.describe(after)} is not a position in the list of writers: pass the "
        "previous page's next_after unchanged ('live/<writer_id>' or 'ended/<opened_at>/<writer_id>'), "
        "or '' for the first page",
        field="after",
    )


async def watching(
    read: Callable[[], Awaitable[CheckpointView | None]], interval_s: float, running: Callable[[], bool]
) -> AsyncIterator[CheckpointView]:
    """Snapshots from ``read`` every ``interval_s`` (clamped to 0.05..60 s), each one that changed.

    An unchanged snapshot is sent again every ~15 s, so proxies do not cut idle streams. Ends when
    ``running`` says so or ``read`` finds the checkpoint no longer there (None).
    """
    interval_s = min(max(interval_s, 0.05), 60.0)
    last: tuple[Any, ...] | None = None
    heartbeat_every = max(1, round(15.0 / interval_s))
    quiet = 0
    while running():
        view = await read()
        if view is None:
            return
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
