"""What the service answers: plain result records that both transports translate.

They are also the HTTP API's reply schemas (FastAPI takes dataclasses as ``response_model``): a
docstring here is the record's description in ``/openapi.json``, and a field's
``metadata={"description": ...}`` its field's. gRPC builds its messages from them in
``grpc_api/convert.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tally_server.domain.checkpoint import WriterSession
from tally_server.domain.events import Severity
from tally_server.domain.ledger import ApplyCounts
from tally_server.domain.ports import FailedAttemptRecord, WriterRecord

_UNIX = "Unix time, in seconds."
_LEASE = (
    "each call of the writer renews it (the SDK sends a heartbeat every third of it); a writer silent "
    "this long is closed and its pending state dropped."
)


def _doc(description: str) -> dict[str, str]:
    """A field's description in ``/openapi.json``."""
    return {"description": description}


@dataclass(frozen=True)
class OpenedWriter:
    """A writer just opened: its handle for every later call, its lease and the checkpoint's progress."""

    handle: str = field(metadata=_doc("Names this writer in every later call (the HTTP paths' {handle})."))
    writer_id: str
    lease_ttl_s: float = field(metadata=_doc(f"Seconds the lease lasts without a call; {_LEASE}"))
    completed_count: int
    settle_ms: int = field(
        metadata=_doc("Milliseconds a source whose count reached zero waits before it is completed.")
    )
    # The batch of an ApplyDeltas may come as columns (gRPC DeltaColumns, HTTP "columns").
    accepts_delta_columns: bool = True
    max_batches_in_flight: int = field(
        default=1,
        metadata=_doc(
            "Most batches of this writer the coordinator takes on the wire at once, each sent with "
            "'ordered' and the next batch_seq: it applies them in their numbers' order."
        ),
    )


@dataclass(frozen=True)
class AppliedBatch:
    """What the counting rules did with a batch, and whether the writer is settled.

    ``settled``: as the answer left, everything the writer applied was durable (nothing settling,
    no commit in flight), so a flush now would return at once; False when that is not certain.
    """

    counts: ApplyCounts
    settled: bool
    refused: int = 0  # deltas not applied: another live writer holds their source's claim


@dataclass(frozen=True)
class ClosedWriter:
    """A writer's totals at close, and the sources it left incomplete (they replay next run)."""

    counts: ApplyCounts
    incomplete_sources: list[str]
    incomplete_count: int


@dataclass(frozen=True)
class WriterView:
    """One writer of a checkpoint: who it is, its state and what it did."""

    writer_id: str
    host: str
    pid: int
    labels: dict[str, str]
    state: str
    pending_sources: int
    counts: ApplyCounts
    opened_at: float = field(metadata=_doc(_UNIX))
    last_seen_at: float = field(metadata=_doc("Its last call or heartbeat. " + _UNIX))
    closed_at: float = field(default=0.0, metadata=_doc("0 while the writer is open. " + _UNIX))

    @classmethod
    def of(cls, r: WriterRecord) -> WriterView:
        """The view of a writer's registry row (a live writer's from ``Session.record``)."""
        return cls(
            writer_id=r.writer_id,
            host=r.host,
            pid=r.pid,
            labels=dict(r.labels),
            state=r.state,
            pending_sources=r.pending_sources,
            counts=ApplyCounts(r.applied, r.skipped, r.rewritten, r.anomalies, r.completed),
            opened_at=r.opened_at,
            last_seen_at=r.last_seen_at,
            closed_at=r.closed_at or 0.0,
        )

    @classmethod
    def of_live(cls, s: WriterSession) -> WriterView:
        """The view of a live writer, straight from its session (what ``of(session.record())`` gives).

        Status builds one per live writer per read, so it skips the registry row: a writer's labels
        never change once it is open, so they are shared, not copied; its counters are copied.
        """
        t = s.ledger.totals
        return cls(
            s.writer_id,
            s.host,
            s.pid,
            s.labels,
            s.state,
            s.ledger.in_flight,
            ApplyCounts(t.applied, t.skipped, t.rewritten, t.anomalies, t.completed),
            s.opened_at,
            s.last_seen_at,
        )


@dataclass(frozen=True)
class EventView:
    """Something that happened to a checkpoint (a writer opened, an anomaly, a reset, ...)."""

    id: int
    checkpoint: str
    kind: str
    message: str
    at: float = field(metadata=_doc(_UNIX))
    writer_id: str
    data: dict[str, Any]
    severity: Severity = field(metadata={"description": "How much it matters; set from the kind."})


@dataclass(frozen=True)
class EventPage:
    """Events, newest first."""

    events: list[EventView]
    next_before_id: int = field(
        metadata={"description": "Pass as before_id for the next page; 0 when there is none."}
    )


@dataclass(frozen=True)
class ProgressSample:
    """A checkpoint's completed count at one time."""

    at: float = field(metadata=_doc(_UNIX))
    completed_count: int


@dataclass(frozen=True)
class CompletedPage:
    """Completed source ids in byte order."""

    source_ids: list[str]
    next_after: str = field(
        metadata={"description": "Pass as after for the next page; empty on the last page."}
    )


@dataclass(frozen=True)
class CheckpointPage:
    """Checkpoints by name in byte order; ``next_after`` pages on ("" on the last page)."""

    checkpoints: list[CheckpointView]
    next_after: str


@dataclass(frozen=True)
class WriterPage:
    """Writers in their listing order (live by id, then ended newest first); ``next_after`` pages on."""

    writers: list[WriterView]
    next_after: str


@dataclass(frozen=True)
class ImportResult:
    """How many of the offered source ids were new, and the checkpoint's completed count after."""

    imported: int
    completed_count: int


@dataclass(frozen=True)
class ResetResult:
    """Where a reset moved the checkpoint's files, and how many live writers it closed."""

    moved_to: str
    files_moved: int
    writers_closed: int


@dataclass(frozen=True)
class CheckpointView:
    """A checkpoint's progress: completed and pending sources, live writers, anomalies."""

    name: str
    completed_count: int
    live_writers: int
    pending_sources: int
    settling_sources: int
    anomalies: int
    unreadable_files: int
    created_at: float = field(metadata=_doc(_UNIX))
    last_activity_at: float = field(metadata=_doc(_UNIX))
    writers: list[WriterView]
    fingerprint: dict[str, str]
    owner: str = field(
        default="", metadata=_doc("The replica applying its deltas (a PostgreSQL store's owner); '' on LMDB.")
    )
    failed_sources: int = field(default=0, metadata=_doc("At the failure budget and not completed."))
    max_attempts: int = field(default=0, metadata=_doc("The failure budget; 0: unlimited."))
    total: int = field(default=0, metadata=_doc("Declared sources; 0: no total is known."))
    remaining: int = field(default=-1, metadata=_doc("Declared sources not completed; -1: not known."))
    claimed_sources: int = field(default=0, metadata=_doc("Sources live writers hold claims on."))


@dataclass(frozen=True)
class ReplicaView:
    """One coordinator serving a PostgreSQL store, as it announced itself."""

    name: str
    grpc_address: str
    http_address: str
    owner: bool = field(
        metadata=_doc("It owns the store: applies every writer's deltas; the others forward.")
    )
    started_at: float = field(metadata=_doc(_UNIX))
    silent_s: float = field(
        metadata=_doc("Seconds since it last showed it is alive (it does every second while it runs).")
    )
    shards: tuple[int, ...] = field(
        default=(),
        metadata=_doc(
            "On a store of several shards: the shards it holds, whose checkpoints' deltas it applies "
            "(owner is true when it holds any); empty on a store of one shard."
        ),
    )


@dataclass(frozen=True)
class ReplicasView:
    """The coordinators serving the store (none listed on the LMDB store) and its fencing epoch."""

    replicas: list[ReplicaView]
    epoch: int
    answered_by: str


@dataclass(frozen=True)
class SavedCursors:
    """What a SaveCursors call did."""

    saved: int  # durable now
    completed: int  # of sources already completed: not saved


@dataclass(frozen=True)
class CursorView:
    """The cursor saved for a source (none once it is completed)."""

    found: bool
    data: bytes = b""
    saved_at: float = 0.0
    writer_id: str = ""


@dataclass(frozen=True)
class ClaimView:
    """The answer of an acquire for one source.

    ``state``: ``acquired`` (``token`` is the fencing token), ``held`` (by ``holder``, a writer id,
    whose lease runs out at ``until``, Unix time, unless renewed), ``completed`` or ``failed``.
    """

    source_id: str
    state: str
    token: int = field(default=0, metadata=_doc("The fencing token (acquired only); tokens only grow."))
    holder: str = ""
    until: float = field(default=0.0, metadata=_doc("When the holder's lease runs out (held only). " + _UNIX))


@dataclass(frozen=True)
class TokenCheck:
    """Whether a fencing token is the live claim on a source, and the live claim's token (0: none)."""

    current: bool
    live_token: int


@dataclass(frozen=True)
class ReportedFailure:
    """A failed attempt counted: the attempts so far, and whether the source is failed now."""

    attempts: int
    failed: bool
    max_attempts: int


@dataclass(frozen=True)
class SourceFailuresView:
    """A source's failed attempts: how many, whether at the budget, the latest ones."""

    source_id: str
    attempts: int
    failed: bool
    recent: list[FailedAttemptRecord]


@dataclass(frozen=True)
class FailurePage:
    """Sources with failed attempts, by source id; ``next_after`` pages on ("" on the last page)."""

    sources: list[SourceFailuresView]
    next_after: str
    max_attempts: int
