"""Public value types returned by the SDK, plus the internal records the transports exchange.

All public types are frozen dataclasses built by ``_convert``; users never see wire messages.
Times are floats, seconds since the epoch (``created_at``, ``Event.at``, ``Claim.until``, ...); each
such field ``<name>`` also has a read-only ``<name>_dt`` property: the same time as a timezone-aware
UTC ``datetime`` (None where the float is 0, meaning "not yet" or "none").
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

#: One delta: ``(task_id, source_id, delta)``.
Delta = tuple[str, str, int]

#: What a writer asks for when its fingerprint differs from the checkpoint's recorded one.
OnMismatch = Literal["refuse", "reset", "ignore"]


def _utc(seconds: float) -> datetime:
    """Seconds since the epoch as a timezone-aware UTC datetime."""
    return datetime.fromtimestamp(seconds, tz=UTC)


def _utc_or_none(seconds: float) -> datetime | None:
    """Like :func:`_utc`, but None for 0 (the fields where 0 means "not yet" or "none")."""
    return _utc(seconds) if seconds else None


@dataclass(frozen=True)
class ApplyCounts:
    """What the coordinator did with a writer's deltas.

    Attributes:
        applied: Deltas that changed a pending count.
        skipped: Retried deltas recognised by task id and ignored.
        rewritten: Deltas whose task id came back with a different value and replaced it.
        anomalies: Deltas for a source this writer already completed (the source was un-completed).
        completed: Sources completed.
    """

    applied: int = 0
    skipped: int = 0
    rewritten: int = 0
    anomalies: int = 0
    completed: int = 0

    def __add__(self, other: ApplyCounts) -> ApplyCounts:
        return ApplyCounts(
            self.applied + other.applied,
            self.skipped + other.skipped,
            self.rewritten + other.rewritten,
            self.anomalies + other.anomalies,
            self.completed + other.completed,
        )


@dataclass(frozen=True)
class WriterStatus:
    """One writer of a checkpoint, as the coordinator sees it.

    Attributes:
        writer_id: The writer's id (NeMo Curator style ``<host>-<pid>`` by default).
        host: Host the writer runs on.
        pid: Process id of the writer.
        labels: Free-form labels given at open (e.g. SLURM job ids).
        state: Where the writer is in its life: ``"open"``, ``"closed"`` (by its client),
            ``"expired"`` (its lease ran out), ``"lost"`` (open when the coordinator stopped and
            not restored) or ``"reset"`` (closed by a forced checkpoint reset).
        pending_sources: Sources with a non-zero pending count in this writer.
        counts: Totals of what the writer's deltas did.
        opened_at: Open time, seconds since the epoch.
        last_seen_at: Last heartbeat or call, seconds since the epoch.
        closed_at: When the writer closed, expired or was lost, seconds since the epoch; 0 while
            it is open.
    """

    writer_id: str
    host: str
    pid: int
    labels: Mapping[str, str]
    state: str
    pending_sources: int
    counts: ApplyCounts
    opened_at: float
    last_seen_at: float
    closed_at: float = 0.0

    @property
    def opened_at_dt(self) -> datetime:
        """``opened_at`` as a timezone-aware UTC datetime."""
        return _utc(self.opened_at)

    @property
    def last_seen_at_dt(self) -> datetime:
        """``last_seen_at`` as a timezone-aware UTC datetime."""
        return _utc(self.last_seen_at)

    @property
    def closed_at_dt(self) -> datetime | None:
        """``closed_at`` as a timezone-aware UTC datetime; None while the writer is open."""
        return _utc_or_none(self.closed_at)


@dataclass(frozen=True)
class CheckpointStatus:
    """A checkpoint's live state.

    Attributes:
        name: Checkpoint name, e.g. ``curation/run-42``.
        completed_count: Sources in the completed set.
        live_writers: Writers currently holding a lease.
        pending_sources: Sources pending in any live writer.
        settling_sources: Sources whose count reached zero and are inside the settle window.
        anomalies: Anomalies recorded (deltas for already completed sources).
        unreadable_files: Completion files that could not be read (never counted as complete).
        created_at: Creation time, seconds since the epoch.
        last_activity_at: Last change, seconds since the epoch.
        writers: The checkpoint's writers.
        fingerprint: The fingerprint recorded by the first writer.
        owner: The coordinator applying the checkpoint's deltas: on a PostgreSQL store the name of
            the replica that owns the store (see :meth:`Client.replicas`); empty on the LMDB store.
        failed_sources: Sources that failed ``max_attempts`` times (skipped until retried; see
            :meth:`Client.failures`). Always 0 with an unlimited budget.
        max_attempts: The checkpoint's failure budget; 0 is unlimited (no source ever fails).
        total: Declared sources (:meth:`Client.declare`); 0 when no total is known (no percent).
        remaining: Declared sources not completed yet (:meth:`Client.remaining` lists them); -1
            when not known (only a count was declared, or the coordinator has not counted yet).
        claimed_sources: Sources live writers hold a claim on now (:meth:`Writer.acquire`).
    """

    name: str
    completed_count: int
    live_writers: int
    pending_sources: int
    settling_sources: int
    anomalies: int
    unreadable_files: int
    created_at: float
    last_activity_at: float
    writers: tuple[WriterStatus, ...]
    fingerprint: Mapping[str, str]
    owner: str = ""
    failed_sources: int = 0
    max_attempts: int = 0
    total: int = 0
    remaining: int = -1
    claimed_sources: int = 0

    @property
    def created_at_dt(self) -> datetime:
        """``created_at`` as a timezone-aware UTC datetime."""
        return _utc(self.created_at)

    @property
    def last_activity_at_dt(self) -> datetime:
        """``last_activity_at`` as a timezone-aware UTC datetime."""
        return _utc(self.last_activity_at)

    @property
    def percent(self) -> float | None:
        """Completed share of the declared total, 0 to 100; None when no total is known."""
        if self.total <= 0:
            return None
        return min(100.0, 100.0 * self.completed_count / self.total)


@dataclass(frozen=True)
class CloseResult:
    """Outcome of closing a writer.

    Attributes:
        counts: Totals of what the writer's deltas did.
        incomplete_sources: Sources still pending at close (as many as the server lists); they
            replay on the next run. Empty when the close's first answer was lost in a coordinator
            restart and the restarted coordinator answered it again (``incomplete_count`` holds).
        incomplete_count: How many sources were still pending in total.
    """

    counts: ApplyCounts = field(default_factory=ApplyCounts)
    incomplete_sources: tuple[str, ...] = ()
    incomplete_count: int = 0


@dataclass(frozen=True)
class WriterHealth:
    """A snapshot of a writer's client-side state, cheap to take at any time.

    Attributes:
        open: The writer is open (opened and neither closed nor stopped).
        lease_lost: The coordinator dropped the writer; its pending state is gone.
        last_error: The most recent error seen by the background sender or heartbeat, if any.
        buffered: Deltas accepted by ``apply_deltas`` and not yet acknowledged by the server.
        batches_sent: Batches acknowledged by the server.
        retries: Batch resends after a retryable failure.
        dropped: Deltas discarded (after a lost lease, a refused batch, or after close).
        refused: Deltas the coordinator did not apply because another live writer held a claim
            on their source (see :meth:`tally.Writer.acquire`); the coordinator records an event.
    """

    open: bool
    lease_lost: bool
    last_error: str | None
    buffered: int
    batches_sent: int
    retries: int
    dropped: int = 0
    refused: int = 0


class Severity(StrEnum):
    """How much an event matters, as the coordinator rates its kind.

    ``error`` needs someone to act (an unreadable or quarantined completion file), ``warning``
    deserves a look (an anomaly, an expired or lost writer, a reset, an ignored fingerprint
    mismatch), ``info`` is the ordinary course of a run. The values compare as strings, not by
    rank: use :meth:`at_least` to filter.
    """

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """0 for info, 1 for warning, 2 for error."""
        return _SEVERITY_RANK[self]

    def at_least(self, other: Severity) -> bool:
        """Whether this severity is ``other`` or worse."""
        return self.rank >= other.rank

    @classmethod
    def from_wire(cls, value: str) -> Severity:
        """The severity a server sent.

        Empty (a server older than the severity field) and levels this SDK does not know (a newer
        server) read as ``info``: the SDK never guesses a severity from the event's kind.
        """
        try:
            return cls(value)
        except ValueError:
            return cls.INFO


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


@dataclass(frozen=True)
class Event:
    """One entry of a checkpoint's event log (anomalies, unreadable files, resets, writers ...).

    Attributes:
        id: Event id, increasing with time; pass it as ``before_id`` to page backwards.
        checkpoint: The checkpoint the event belongs to.
        kind: What happened, e.g. ``"anomaly"`` or ``"writer_opened"``.
        message: A sentence for people.
        at: When, seconds since the epoch.
        writer_id: The writer involved, or ``""``.
        data: The event's structured fields (e.g. ``task_id``, ``source_id``, old and new delta).
        severity: How much it matters (see :class:`Severity`); colour and filter by this rather
            than by ``kind``. ``info`` from a server that does not send it.
    """

    id: int
    checkpoint: str
    kind: str
    message: str
    at: float
    writer_id: str
    data: dict[str, Any]
    severity: Severity = Severity.INFO

    @property
    def at_dt(self) -> datetime:
        """``at`` as a timezone-aware UTC datetime."""
        return _utc(self.at)


@dataclass(frozen=True)
class EventPage:
    """One page of events, newest first.

    Attributes:
        events: The events of this page.
        next_before_id: Pass as ``before_id`` to get the next (older) page; None when there is none.
    """

    events: tuple[Event, ...]
    next_before_id: int | None


@dataclass(frozen=True)
class ProgressSample:
    """A checkpoint's completed count at one point in time.

    Attributes:
        at: Sample time, seconds since the epoch.
        completed_count: Sources in the completed set at that time.
    """

    at: float
    completed_count: int

    @property
    def at_dt(self) -> datetime:
        """``at`` as a timezone-aware UTC datetime."""
        return _utc(self.at)


@dataclass(frozen=True)
class ImportResult:
    """Outcome of :meth:`tally.Client.import_completed`.

    Attributes:
        imported: Ids that were not completed before the import.
        completed_count: The checkpoint's completed count afterwards.
    """

    imported: int
    completed_count: int


@dataclass(frozen=True)
class ResetResult:
    """Outcome of :meth:`tally.Client.reset`.

    Attributes:
        moved_to: Where the checkpoint's files went, relative to the server's data directory.
        files_moved: How many files were moved.
        writers_closed: Live writers closed by a forced reset.
    """

    moved_to: str
    files_moved: int
    writers_closed: int


@dataclass(frozen=True)
class FailedAttempt:
    """One failed attempt at a source, as reported by :meth:`tally.Writer.report_failure`.

    Attributes:
        reason: What the writer said went wrong (at most 1000 characters kept).
        at: When it was reported, seconds since the epoch.
        writer_id: The writer that reported it.
    """

    reason: str
    at: float
    writer_id: str

    @property
    def at_dt(self) -> datetime:
        """``at`` as a timezone-aware UTC datetime."""
        return _utc(self.at)


@dataclass(frozen=True)
class SourceFailures:
    """A source's failed attempts (see :meth:`tally.Client.failures`).

    Attributes:
        source_id: The source.
        attempts: Failed attempts counted since it last completed or was retried.
        failed: Whether ``attempts`` reached the checkpoint's ``max_attempts``: the source is
            skipped (e.g. by the NeMo Curator drop-in) until :meth:`tally.Client.retry_failed`.
        recent: The latest attempts, oldest first (the coordinator keeps the last 10).
    """

    source_id: str
    attempts: int
    failed: bool
    recent: tuple[FailedAttempt, ...] = ()

    @property
    def last_reason(self) -> str:
        """The reason of the latest failed attempt ("" when none is kept)."""
        return self.recent[-1].reason if self.recent else ""


@dataclass(frozen=True)
class Claim:
    """Where a source stands for a writer that asked to claim it (see :meth:`tally.Writer.acquire`).

    Attributes:
        source_id: The source.
        state: ``"acquired"``: this writer holds it now (or held it already) and should do its
            work; ``"held"``: another live writer holds it; ``"completed"``: it is done;
            ``"failed"``: it used up the checkpoint's failure budget (see
            :meth:`tally.Client.retry_failed`).
        token: For ``"acquired"``, the fencing token: larger than any earlier claim's on this
            source. Pass it with writes to an output store that checks
            :meth:`tally.Client.token_is_current`. 0 otherwise.
        holder: For ``"held"``, the writer id holding it.
        until: For ``"held"``, when the holder's lease runs out unless it is renewed (seconds since
            the epoch); the claim ends then, or earlier when the source completes or the holder
            closes.
    """

    source_id: str
    state: str
    token: int = 0
    holder: str = ""
    until: float = 0.0

    @property
    def until_dt(self) -> datetime | None:
        """``until`` as a timezone-aware UTC datetime; None when no other writer holds the source."""
        return _utc_or_none(self.until)

    @property
    def acquired(self) -> bool:
        """Whether this writer holds the source now."""
        return self.state == "acquired"


@dataclass(frozen=True)
class FailureReport:
    """Outcome of :meth:`tally.Writer.report_failure`.

    Attributes:
        attempts: The source's failed attempts so far, this one included.
        failed: Whether the source is failed now (``attempts`` reached ``max_attempts``).
        max_attempts: The checkpoint's failure budget; 0 is unlimited.
    """

    attempts: int
    failed: bool
    max_attempts: int = 0


@dataclass(frozen=True)
class FailurePage:
    """One page of sources with failed attempts (internal), by source id; ``next_after`` is ``""``
    on the last page."""

    sources: tuple[SourceFailures, ...]
    next_after: str
    max_attempts: int = 0


@dataclass(frozen=True)
class CompletedPage:
    """One page of completed source ids (internal); ``next_after`` is ``""`` on the last page."""

    source_ids: tuple[str, ...]
    next_after: str


@dataclass(frozen=True)
class CheckpointPage:
    """One page of checkpoints by name (internal); ``next_after`` is ``""`` on the last page."""

    checkpoints: tuple[CheckpointStatus, ...]
    next_after: str


@dataclass(frozen=True)
class WriterPage:
    """One page of a checkpoint's writers (internal); ``next_after`` is ``""`` on the last page."""

    writers: tuple[WriterStatus, ...]
    next_after: str


@dataclass(frozen=True)
class WriterSpec:
    """What a writer presents when it opens (internal: transports turn it into a request)."""

    checkpoint: str
    writer_id: str
    fingerprint: Mapping[str, str]
    labels: Mapping[str, str]
    host: str
    pid: int
    on_mismatch: OnMismatch = "refuse"
    # Picked once per writer: an open retried after its answer was lost (a coordinator restart)
    # attaches to the session it created instead of being refused as a live writer id.
    session_token: str = field(default_factory=lambda: secrets.token_hex(16))
    # The checkpoint's failure budget, set (SetFailureBudget) before the writer opens; None: leave it.
    max_attempts: int | None = None
    # Sources declared (DeclareSources) before the writer opens: checked ids or a count; None: none.
    expected_sources: tuple[str, ...] | int | None = field(default=None, repr=False)


@dataclass(frozen=True)
class OpenedWriter:
    """The coordinator's answer to an open (internal)."""

    handle: str
    writer_id: str
    lease_ttl_s: float
    completed_count: int
    settle_ms: int
    # The coordinator reads a batch sent as columns (gRPC and HTTP); an older one does not.
    delta_columns: bool = False
    # Batches the coordinator lets this writer have on the wire at once (sent as ``ordered``).
    max_batches_in_flight: int = 1


@dataclass(frozen=True)
class Replica:
    """One coordinator serving a PostgreSQL store.

    Attributes:
        name: Its name (``TALLY_REPLICA_NAME``, default HOSTNAME-PID).
        grpc_address: Where the other replicas reach its gRPC port.
        http_address: Where the other replicas reach its HTTP port.
        owner: Whether it owns the store (applies every writer's deltas; the others forward to it).
        started_at: When it started, seconds since the epoch.
        silent_s: Seconds since it last showed it is alive (it does every second).
        shards: On a store of several shards, the shards it holds (``owner`` when it holds any);
            empty on a store of one shard.
    """

    name: str
    grpc_address: str
    http_address: str
    owner: bool
    started_at: float
    silent_s: float
    shards: tuple[int, ...] = ()

    @property
    def started_at_dt(self) -> datetime:
        """``started_at`` as a timezone-aware UTC datetime."""
        return _utc(self.started_at)


@dataclass(frozen=True)
class Replicas:
    """The coordinators serving the store.

    Attributes:
        replicas: Every one, by name; empty on the LMDB store (one coordinator, no replicas).
        epoch: The store's fencing epoch: grows by one each time a replica takes the store over.
        answered_by: The replica that answered.
    """

    replicas: tuple[Replica, ...]
    epoch: int
    answered_by: str

    @property
    def owner(self) -> Replica | None:
        """The replica owning the store, if one is listed."""
        return next((r for r in self.replicas if r.owner), None)
