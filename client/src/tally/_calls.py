"""Call descriptions: what each coordinator operation sends and how the SDK treats it. No I/O.

httpx builds a request without I/O and sends it through one ``send`` per flavour; the SDK does the
same. A call description is a frozen record of one operation and its arguments, typed by what its
answer reads as (``Call[T]``), with the sentence that names it in errors and whether it may be
retried. Each wire maps descriptions to its own requests and reads the answers
(``_transport/grpc_convert.py``, ``_transport/http_convert.py``); each flavour sends them through
one function (``_retry.send`` / ``_retry.async_send``).

Operations made of several calls (chunked queries, batched imports, a reset whose lost answer must
not be retried) are *plans*: generators that yield calls, receive their answers (or their errors,
thrown in) and return the result. :func:`drive` and :func:`async_drive` run a plan; the plan itself
is written once for both flavours.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from tally._types import (
    ApplyCounts,
    CheckpointPage,
    CheckpointStatus,
    Claim,
    CloseResult,
    CompletedPage,
    Delta,
    EventPage,
    FailurePage,
    FailureReport,
    ImportResult,
    OpenedWriter,
    ProgressSample,
    Replicas,
    ResetResult,
    SourceFailures,
    WriterPage,
    WriterSpec,
    WriterStatus,
)
from tally._words import count
from tally.errors import Internal, InvalidArgument, TallyError, Unavailable

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# Queries are split so that one huge list stays well under the server's ids-per-query limit
# (100 000 by default) and under gRPC's message size limit.
ARE_COMPLETED_CHUNK = 10_000
# Ids per ImportCompleted call: well under the server's ids-per-call limit and gRPC's message cap.
IMPORT_CHUNK = 50_000
# The most bytes of one cursor (SaveCursors refuses more with INVALID_ARGUMENT).
MAX_CURSOR_BYTES = 4096
# Cursor bytes per SaveCursors call: one call in practice (256 full-size cursors), always far
# under gRPC's 4 MiB message cap.
CURSORS_CHUNK_BYTES = 1 << 20
# Ids per ListFailures / RetryFailed call that names its sources (like ARE_COMPLETED_CHUNK).
FAILURES_CHUNK = 10_000
# ListFailures names its sources in the URL over HTTP (repeated ``source_id`` parameters): httpx
# refuses a URL over 64 KiB, and a proxy in front of a coordinator may cap the request line at 8 KiB
# (nginx's default). The ids of one call stay within this many URL-encoded bytes, on gRPC too (the
# plan does not know the wire; the calls are small either way).
FAILURES_QUERY_BYTES = 6_000
# The highest failure budget the coordinator accepts (SetFailureBudget refuses more).
MAX_ATTEMPTS = 1_000_000
# Ids per DeclareSources call: the server refuses more than its ids-per-query limit (100 000 by
# default) in one call.
DECLARE_CHUNK = 10_000


class Call(Generic[T_co]):
    """One call of a coordinator operation whose answer reads as ``T_co``."""

    #: Whether an ``Unavailable`` answer may be retried within the caller's deadline.
    retry: ClassVar[bool] = True

    @property
    def what(self) -> str:
        """The operation in words, for error messages (``"list writers of 'cp'"``)."""
        raise NotImplementedError


@dataclass(frozen=True)
class OpenWriter(Call[OpenedWriter]):
    spec: WriterSpec

    @property
    def what(self) -> str:
        return f"open writer {self.spec.writer_id!r} on checkpoint {self.spec.checkpoint!r}"


@dataclass(frozen=True)
class KeepAlive(Call[float]):
    """Answers the lease TTL in seconds."""

    handle: str

    @property
    def what(self) -> str:
        return "keep-alive"


@dataclass(frozen=True)
class BatchAnswer:
    """A batch's counts, and whether the coordinator said the writer is settled.

    ``settled``: everything the writer applied was durable as the answer left, so a flush right
    after needs no call of its own (older coordinators never say so).
    """

    counts: ApplyCounts
    settled: bool = False
    refused: int = 0  # deltas another live writer's claim kept from being applied


@dataclass(frozen=True)
class ApplyDeltas(Call[BatchAnswer]):
    """``batch_seq`` numbers the writer's batches; a resent batch carries its first number."""

    handle: str
    deltas: Sequence[Delta]
    batch_seq: int
    # Send the batch as columns (the coordinator said it reads them).
    columns: bool = False
    # The batch follows batch ``batch_seq - 1``, which may still be on the wire (the coordinator
    # said it allows several batches in flight): it applies them in order.
    ordered: bool = False

    @property
    def what(self) -> str:
        return f"batch {self.batch_seq} ({count(len(self.deltas), 'delta')})"


@dataclass(frozen=True)
class AreCompleted(Call[list[bool]]):
    checkpoint: str
    source_ids: Sequence[str]

    @property
    def what(self) -> str:
        return f"are_completed({self.checkpoint!r}, {count(len(self.source_ids), 'id')})"


@dataclass(frozen=True)
class Flush(Call[int]):
    """Answers the writer's durable completions so far. ``writer_id`` only names it in errors."""

    handle: str
    writer_id: str = ""

    @property
    def what(self) -> str:
        return f"flush writer {self.writer_id!r}"


@dataclass(frozen=True)
class CloseWriter(Call[CloseResult]):
    """``writer_id`` only names the writer in errors."""

    handle: str
    writer_id: str = ""

    @property
    def what(self) -> str:
        return f"close writer {self.writer_id!r}"


@dataclass(frozen=True)
class CursorsSaved:
    """A SaveCursors answer: cursors written (durable now), and cursors not written because their
    source is completed already (a completed source has no cursor)."""

    saved: int
    completed: int


@dataclass(frozen=True)
class SaveCursors(Call[CursorsSaved]):
    """The latest cursor of each source, in order; ``writer_id`` only names the writer in errors.

    Safe to retry: a resent cursor replaces itself.
    """

    handle: str
    cursors: Sequence[tuple[str, bytes]]
    writer_id: str = ""

    @property
    def what(self) -> str:
        return f"save {count(len(self.cursors), 'cursor')} of writer {self.writer_id!r}"


@dataclass(frozen=True)
class SavedCursor:
    """A GetCursor answer that found a cursor: its bytes, when it was saved and by which writer."""

    data: bytes
    saved_at: float = 0.0
    writer_id: str = ""


@dataclass(frozen=True)
class GetCursor(Call[SavedCursor | None]):
    """Answers None when the source has no cursor (never saved, or the source is completed)."""

    checkpoint: str
    source_id: str

    @property
    def what(self) -> str:
        return f"get the cursor of {self.source_id!r} in {self.checkpoint!r}"


@dataclass(frozen=True)
class ReportFailure(Call[FailureReport]):
    """A failed attempt at a source, counted (durably) before the answer; ``writer_id`` only names
    the writer in errors.

    Safe to retry: ``attempt_id`` (random, one per report) names the attempt, so a retry after a
    lost answer (the coordinator counted it, then became unreachable) is not counted again.
    """

    handle: str
    source_id: str
    reason: str
    writer_id: str = ""
    attempt_id: str = ""

    @property
    def what(self) -> str:
        return f"report a failed attempt at {self.source_id!r} by writer {self.writer_id!r}"


@dataclass(frozen=True)
class Acquire(Call[list[Claim]]):
    """Claim sources for a writer: one claim per distinct source, in the order asked; ``writer_id``
    only names the writer in errors.

    Safe to retry: a source the writer holds already is answered with its token again.
    """

    handle: str
    source_ids: Sequence[str]
    writer_id: str = ""

    @property
    def what(self) -> str:
        return f"acquire {count(len(self.source_ids), 'source')} for writer {self.writer_id!r}"


@dataclass(frozen=True)
class TokenIsCurrent(Call[bool]):
    """Whether a fencing token is the live claim on a source."""

    checkpoint: str
    source_id: str
    token: int

    @property
    def what(self) -> str:
        return f"check token {self.token} of {self.source_id!r} in {self.checkpoint!r}"


@dataclass(frozen=True)
class ListFailures(Call[FailurePage]):
    """Sources with failed attempts: those of ``source_ids`` (others left out), or with none named a
    page of every such source after ``after`` (at most ``limit``), by source id."""

    checkpoint: str
    source_ids: Sequence[str] = ()
    failed_only: bool = False
    after: str = ""
    limit: int = 0

    @property
    def what(self) -> str:
        return f"list failed attempts of {self.checkpoint!r}"


@dataclass(frozen=True)
class RetryFailed(Call[int]):
    """Clear failed attempts (of every source when ``source_ids`` is empty); answers how many
    sources were cleared. Safe to retry: a second clear finds nothing left."""

    checkpoint: str
    source_ids: Sequence[str] = ()

    @property
    def what(self) -> str:
        return f"retry failed sources of {self.checkpoint!r}"


@dataclass(frozen=True)
class FailureBudget:
    """A SetFailureBudget answer: the budget now, and how many sources are failed under it."""

    max_attempts: int
    failed_sources: int


@dataclass(frozen=True)
class SetFailureBudget(Call[FailureBudget]):
    """``max_attempts`` 0 is unlimited; creates the checkpoint if it is new."""

    checkpoint: str
    max_attempts: int

    @property
    def what(self) -> str:
        return f"set the failure budget of {self.checkpoint!r}"


@dataclass(frozen=True)
class Declared:
    """A DeclareSources answer: the checkpoint's total, and its remaining sources (-1: not known)."""

    total: int
    remaining: int


@dataclass(frozen=True)
class DeclareSources(Call[Declared]):
    """Add ``source_ids`` to the checkpoint's declared sources, or (no ids) say there are at least
    ``count``; creates the checkpoint if it is new. Safe to retry: declaring twice changes nothing."""

    checkpoint: str
    source_ids: Sequence[str] = ()
    count: int = 0

    @property
    def what(self) -> str:
        if self.source_ids:
            return f"declare {count(len(self.source_ids), 'source')} of {self.checkpoint!r}"
        return f"declare {count(self.count, 'source')} of {self.checkpoint!r}"


@dataclass(frozen=True)
class ListRemaining(Call[CompletedPage]):
    """Declared ids not completed, strictly after ``after`` in byte order, at most ``limit``."""

    checkpoint: str
    after: str
    limit: int

    @property
    def what(self) -> str:
        return f"list remaining ids of {self.checkpoint!r}"


@dataclass(frozen=True)
class GetCheckpoint(Call[CheckpointStatus]):
    name: str

    @property
    def what(self) -> str:
        return f"get checkpoint {self.name!r}"


@dataclass(frozen=True)
class ListCheckpoints(Call[CheckpointPage]):
    """Checkpoints after ``after`` by name (byte order), at most ``limit`` (0: the server's 1,000).

    ``writers`` False: each checkpoint's ``writers`` comes empty (``live_writers`` still counts them).
    """

    after: str = ""
    limit: int = 0
    writers: bool = True

    @property
    def what(self) -> str:
        return "list checkpoints"


@dataclass(frozen=True)
class ListReplicas(Call[Replicas]):
    @property
    def what(self) -> str:
        return "list the store's replicas"


@dataclass(frozen=True)
class ListWriters(Call[WriterPage]):
    """Writers after the position ``after`` (a ``next_after``; "" first), at most ``limit``: live ones
    by writer id, then (``include_closed``) ended ones newest first."""

    checkpoint: str
    include_closed: bool
    limit: int
    after: str = ""

    @property
    def what(self) -> str:
        return f"list writers of {self.checkpoint!r}"


@dataclass(frozen=True)
class ListEvents(Call[EventPage]):
    checkpoint: str
    limit: int
    before_id: int | None

    @property
    def what(self) -> str:
        return f"list events of {self.checkpoint!r}"


@dataclass(frozen=True)
class GetProgress(Call[list[ProgressSample]]):
    checkpoint: str
    since: float | None

    @property
    def what(self) -> str:
        return f"get progress of {self.checkpoint!r}"


@dataclass(frozen=True)
class ListCompleted(Call[CompletedPage]):
    """Completed ids strictly after ``after`` in byte order, at most ``limit`` of them."""

    checkpoint: str
    after: str
    limit: int

    @property
    def what(self) -> str:
        return f"list completed ids of {self.checkpoint!r}"


@dataclass(frozen=True)
class ImportCompleted(Call[ImportResult]):
    checkpoint: str
    source_ids: Sequence[str]
    import_id: str

    @property
    def what(self) -> str:
        return f"import {count(len(self.source_ids), 'id')} into {self.checkpoint!r}"


@dataclass(frozen=True)
class ResetCheckpoint(Call[ResetResult]):
    """Never retried: a reset whose answer was lost may have happened, and a second one would
    move files written since."""

    retry: ClassVar[bool] = False
    name: str
    force: bool

    @property
    def what(self) -> str:
        return f"reset of {self.name!r}"


@dataclass(frozen=True)
class WatchCheckpoint:
    """The one stream: status snapshots of a checkpoint, at most one per ``interval_ms``."""

    checkpoint: str
    interval_ms: int


# --------------------------------------------------------------------------- plans

#: Yields calls, is sent their answers (errors are thrown in), returns ``T``.
Plan = Generator[Call[Any], Any, T]


def single(call: Call[T]) -> Plan[T]:
    """The plan of one call."""
    answer: T = yield call
    return answer


def source_id_chunks(ids: Iterable[str]) -> list[list[str]]:
    """Validate ``ids`` locally (strings only) and split them into query-sized chunks.

    Raises:
        InvalidArgument: ``ids`` is a single string or holds something that is not a string.
    """
    if isinstance(ids, str | bytes):
        # A lone string would be iterated character by character: almost surely a mistake.
        raise InvalidArgument(f"source ids must be a list of strings, not a single {type(ids).__name__}")
    items = list(ids)
    chunks = [items[i : i + ARE_COMPLETED_CHUNK] for i in range(0, len(items), ARE_COMPLETED_CHUNK)]
    try:
        for chunk in chunks:
            "".join(chunk)  # refuses anything but a str, at C speed (a chunk at a time: little memory)
    except TypeError:
        for i, sid in enumerate(items):
            if not isinstance(sid, str):
                raise InvalidArgument(
                    f"source_ids[{i}] is {type(sid).__name__} {sid!r}; source ids are strings"
                ) from None
    return chunks


def are_completed(checkpoint: str, ids: Iterable[str]) -> Plan[list[bool]]:
    """Chunked query; the ids are checked now, before any call (each chunk is one call)."""
    return _are_completed(checkpoint, source_id_chunks(ids))


def _are_completed(checkpoint: str, chunks: list[list[str]]) -> Plan[list[bool]]:
    answer: list[bool] = []
    for chunk in chunks:
        answer += yield AreCompleted(checkpoint, chunk)
    return answer


def import_completed(checkpoint: str, source_ids: Iterable[str], import_id: object) -> Plan[ImportResult]:
    """Import in calls of at most :data:`IMPORT_CHUNK` ids; arguments are checked now."""
    if not isinstance(import_id, str) or not import_id:
        raise InvalidArgument(f"import_id must be a non-empty string, got {import_id!r}")
    # Duplicates removed so that the per-call "imported" counts add up exactly.
    ids = list(dict.fromkeys(sid for chunk in source_id_chunks(source_ids) for sid in chunk))
    batches = [ids[i : i + IMPORT_CHUNK] for i in range(0, len(ids), IMPORT_CHUNK)] or [[]]
    return _import_completed(checkpoint, batches, import_id)


def _import_completed(checkpoint: str, batches: list[list[str]], import_id: str) -> Plan[ImportResult]:
    imported, result = 0, ImportResult(0, 0)
    for batch in batches:
        result = yield ImportCompleted(checkpoint, batch, import_id)
        imported += result.imported
    return ImportResult(imported=imported, completed_count=result.completed_count)


def list_checkpoints(page_size: int, writers: bool = True) -> Plan[list[CheckpointStatus]]:
    """Every checkpoint, by name, in pages of ``page_size`` (``writers`` False: live writers counted only)."""
    found: list[CheckpointStatus] = []
    after = ""
    while True:
        page: CheckpointPage = yield ListCheckpoints(after, page_size, writers)
        found.extend(page.checkpoints)
        if not page.next_after:
            return found
        # A cursor that does not move forward would page forever.
        if page.next_after.encode() <= after.encode():
            raise Internal(
                f"the coordinator's checkpoints cursor went backwards: {after!r} -> {page.next_after!r}"
            )
        after = page.next_after


def list_writers(
    checkpoint: str, include_closed: bool, limit: int | None, page_size: int
) -> Plan[list[WriterStatus]]:
    """A checkpoint's writers in the server's order, at most ``limit`` (None: all), in pages of ``page_size``.

    A writer that ended between two pages is listed by the server twice (live, then ended): only its
    first listing is kept.
    """
    found: list[WriterStatus] = []
    seen: set[tuple[str, float]] = set()
    after = ""
    while limit is None or len(found) < limit:
        size = page_size if limit is None else min(page_size, limit - len(found))
        page: WriterPage = yield ListWriters(checkpoint, include_closed, size, after)
        for w in page.writers:
            if (w.writer_id, w.opened_at) not in seen:
                seen.add((w.writer_id, w.opened_at))
                found.append(w)
        if not page.next_after:
            break
        if page.next_after == after:
            raise Internal(f"the coordinator's writers cursor did not move: {after!r}")
        after = page.next_after
    return found if limit is None else found[:limit]


def reset(name: str, force: bool) -> Plan[ResetResult]:
    """A reset, with what a lost answer means spelled out (see :class:`ResetCheckpoint`)."""
    try:
        result: ResetResult = yield ResetCheckpoint(name, force)
    except Unavailable as err:
        raise Unavailable(
            f"reset of {name!r} got no answer ({err.message}); it may or may not have happened: "
            f"check the checkpoint's status before trying again",
            err.code,
            err.details,
        ) from None
    return result


def cursor_bytes(source_id: object, data: object) -> bytes:
    """Check a cursor locally and return an immutable copy of its bytes.

    Raises:
        TypeError: ``source_id`` is not a string, or ``data`` is not bytes-like.
        ValueError: ``source_id`` is empty, or ``data`` is longer than :data:`MAX_CURSOR_BYTES`.
    """
    if not isinstance(source_id, str):
        raise TypeError(f"a cursor's source id must be a string, got {source_id!r}")
    if not source_id:
        raise ValueError("a cursor's source id must be a non-empty string")
    if isinstance(data, str):
        raise TypeError(f"a cursor is bytes, not str: encode it first (e.g. {data[:20]!r}.encode())")
    try:
        view = memoryview(data)  # type: ignore[arg-type]  # checked right here
    except TypeError:
        raise TypeError(f"a cursor is bytes-like, got {type(data).__name__}") from None
    if view.nbytes > MAX_CURSOR_BYTES:
        raise ValueError(
            f"the cursor of {source_id!r} is {view.nbytes} bytes; a cursor holds at most "
            f"{MAX_CURSOR_BYTES} bytes (4 KiB): save an offset, not the data"
        )
    return view.tobytes()


def cursor_chunks(cursors: Sequence[tuple[str, bytes]]) -> list[list[tuple[str, bytes]]]:
    """Split cursors into SaveCursors calls of at most :data:`CURSORS_CHUNK_BYTES` of data each."""
    chunks: list[list[tuple[str, bytes]]] = []
    size = 0
    for source_id, data in cursors:
        if not chunks or (chunks[-1] and size + len(data) > CURSORS_CHUNK_BYTES):
            chunks.append([])
            size = 0
        chunks[-1].append((source_id, data))
        size += len(data)
    return chunks


def get_cursor(checkpoint: str, source_id: str) -> Plan[bytes | None]:
    """The cursor's bytes, or None when the source has none; ``source_id`` is checked now."""
    if not isinstance(source_id, str) or not source_id:
        raise InvalidArgument(f"source_id must be a non-empty string, got {source_id!r}")
    return _get_cursor(GetCursor(checkpoint, source_id))


def _get_cursor(call: GetCursor) -> Plan[bytes | None]:
    found: SavedCursor | None = yield call
    return None if found is None else found.data


def acquire_ids(source_ids: object) -> list[str]:
    """Check the sources of an acquire locally: an iterable of non-empty strings (not one string)."""
    if isinstance(source_ids, str | bytes):
        raise InvalidArgument(
            f"acquire takes a list of source ids, got the string {source_ids!r}; "
            f"write acquire([{source_ids!r}])"
        )
    try:
        ids = list(source_ids)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(
            f"acquire takes an iterable of source ids, got {type(source_ids).__name__}"
        ) from None
    for i, sid in enumerate(ids):
        if not isinstance(sid, str) or not sid:
            raise InvalidArgument(f"source_ids[{i}] must be a non-empty string, got {sid!r}")
    return list(dict.fromkeys(ids))


def acquire_calls(handle: str, source_ids: Sequence[str], writer_id: str) -> list[Acquire]:
    """The Acquire calls for ``source_ids`` (distinct, in order), :data:`ARE_COMPLETED_CHUNK` per call."""
    return [
        Acquire(handle, source_ids[i : i + ARE_COMPLETED_CHUNK], writer_id)
        for i in range(0, len(source_ids), ARE_COMPLETED_CHUNK)
    ]


def failure_source_id(source_id: object) -> str:
    """Check the source id of a failed attempt locally."""
    if not isinstance(source_id, str) or not source_id:
        raise InvalidArgument(f"source_id must be a non-empty string, got {source_id!r}")
    return source_id


def failure_reason(reason: object) -> str:
    if not isinstance(reason, str):
        raise InvalidArgument(f"reason must be a string, got {type(reason).__name__}")
    return reason


def max_attempts(value: object) -> int:
    """Check a failure budget locally: 0 (unlimited) to :data:`MAX_ATTEMPTS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ATTEMPTS:
        raise InvalidArgument(
            f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS}, or 0 for unlimited, got {value!r}"
        )
    return value


def id_list(name: str, ids: Iterable[str]) -> list[str]:
    """Materialize named source ids, refusing a bare string (it would iterate as characters)."""
    if isinstance(ids, str | bytes):
        raise InvalidArgument(f"{name} must be an iterable of source ids, not a single {type(ids).__name__}")
    listed = list(ids)
    for sid in listed:
        failure_source_id(sid)
    return listed


def failures_of(checkpoint: str, source_ids: Sequence[str], failed_only: bool) -> Plan[list[SourceFailures]]:
    """The failures of the named sources (those without any left out), in calls of
    :data:`FAILURES_CHUNK` ids; no call at all for no ids."""
    found: list[SourceFailures] = []
    for chunk in query_chunks(source_ids):
        page: FailurePage = yield ListFailures(checkpoint, tuple(chunk), failed_only)
        found.extend(page.sources)
    return found


def query_chunks(source_ids: Sequence[str]) -> list[list[str]]:
    """Split ids into ListFailures calls: at most :data:`FAILURES_CHUNK` ids and
    :data:`FAILURES_QUERY_BYTES` bytes of them as query parameters each."""
    chunks: list[list[str]] = []
    size = 0
    for sid in source_ids:
        cost = len("&source_id=") + len(urllib.parse.quote(sid, safe=""))
        if (
            not chunks
            or len(chunks[-1]) >= FAILURES_CHUNK
            or (chunks[-1] and size + cost > FAILURES_QUERY_BYTES)
        ):
            chunks.append([])
            size = 0
        chunks[-1].append(sid)
        size += cost
    return chunks


def retry_failed(checkpoint: str, source_ids: Sequence[str] | None) -> Plan[int]:
    """Clear failed attempts: every source's for None, else the named ones' (none: no call)."""
    if source_ids is None:
        cleared: int = yield RetryFailed(checkpoint, ())
        return cleared
    total = 0
    for start in range(0, len(source_ids), FAILURES_CHUNK):
        count: int = yield RetryFailed(checkpoint, tuple(source_ids[start : start + FAILURES_CHUNK]))
        total += count
    return total


def failed_under(call: SetFailureBudget) -> Plan[int]:
    """Set a budget; how many sources are failed under it."""
    budget: FailureBudget = yield call
    return budget.failed_sources


def expected_sources(value: object) -> tuple[str, ...] | int:
    """Check declared sources locally: an iterable of non-empty source ids, or a count (>= 0)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"expected sources must be source ids or a count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"a count of sources must be 0 or more, got {value}")
        return value
    if not isinstance(value, Iterable):
        raise InvalidArgument(f"expected sources must be source ids or a count, got {type(value).__name__}")
    # Duplicates removed: they change nothing and cost a call's worth of bytes.
    return tuple(dict.fromkeys(id_list("source ids", value)))


def declare_calls(checkpoint: str, sources: tuple[str, ...] | int) -> list[DeclareSources]:
    """The DeclareSources calls of checked sources: one per :data:`DECLARE_CHUNK` ids (one call for
    no ids at all, which still creates the checkpoint), or one with a count."""
    if isinstance(sources, int):
        return [DeclareSources(checkpoint, (), sources)]
    chunks = [sources[i : i + DECLARE_CHUNK] for i in range(0, len(sources), DECLARE_CHUNK)] or [()]
    return [DeclareSources(checkpoint, chunk) for chunk in chunks]


def declare_plan(checkpoint: str, ids: Iterable[str] | None, count: int | None) -> Plan[int]:
    """``declare(checkpoint, ids)`` or ``declare(checkpoint, count=n)``; arguments checked now."""
    if (ids is None) == (count is None):
        raise InvalidArgument("declare takes source ids or a count (count=n), not both and not neither")
    return declare(checkpoint, expected_sources(ids if ids is not None else count))


def declare(checkpoint: str, sources: tuple[str, ...] | int) -> Plan[int]:
    """Declare in chunks; the total after the last call."""
    declared = Declared(0, -1)
    for call in declare_calls(checkpoint, sources):
        declared = yield call
    return declared.total


def drive(plan: Plan[T], send: Callable[[Call[Any]], Any]) -> T:
    """Run ``plan``, sending each call it yields with ``send`` (blocking)."""
    try:
        call = next(plan)
        while True:
            try:
                answer = send(call)
            except TallyError as err:
                call = plan.throw(err)
            else:
                call = plan.send(answer)
    except StopIteration as done:
        result: T = done.value
        return result


async def async_drive(plan: Plan[T], send: Callable[[Call[Any]], Awaitable[Any]]) -> T:
    """asyncio twin of :func:`drive`."""
    try:
        call = next(plan)
        while True:
            try:
                answer = await send(call)
            except TallyError as err:
                call = plan.throw(err)
            else:
                call = plan.send(answer)
    except StopIteration as done:
        result: T = done.value
        return result
