"""The HTTP replies that wrap a bare answer of the service (a number, a list) in a JSON object.

Every record inside them is a service view (``service/views.py``), declared once; these only name
the envelope, field for field as in the tally.v1 response messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tally_server.domain.ledger import ApplyCounts
from tally_server.service import CheckpointView, ClaimView, ProgressSample, WriterView


@dataclass(frozen=True)
class KeepAliveReply:
    """The renewed lease."""

    lease_ttl_s: float = field(metadata={"description": "Seconds from now until the lease runs out."})


@dataclass(frozen=True)
class ApplyDeltasReply:
    """What the counting rules did with the batch.

    ``settled``: everything the writer applied was durable as this answer left (nothing settling,
    no commit in flight), so a flush now would return at once.
    """

    counts: ApplyCounts
    settled: bool = False
    refused: int = field(
        default=0,
        metadata={"description": "Deltas not applied: another live writer holds their source's claim."},
    )


@dataclass(frozen=True)
class AreCompletedReply:
    """One boolean per source id asked about, in the same order."""

    completed: list[bool]


@dataclass(frozen=True)
class SaveCursorsReply:
    """What a save of cursors did: ``saved`` are durable; ``completed`` were of completed sources."""

    saved: int
    completed: int


@dataclass(frozen=True)
class GetCursorReply:
    """The cursor saved for a source: ``data`` base64 (empty when ``found`` is false)."""

    found: bool
    data: str = field(metadata={"description": "The cursor's bytes, base64 (at most 4,096 decoded)."})
    saved_at: float = field(metadata={"description": "Unix time, in seconds; 0 when not found."})
    writer_id: str


@dataclass(frozen=True)
class RetryFailedReply:
    """Sources whose failed attempts were cleared."""

    cleared: int


@dataclass(frozen=True)
class FailureBudgetReply:
    """The checkpoint's failure budget now, and the sources failed under it."""

    max_attempts: int
    failed_sources: int


@dataclass(frozen=True)
class DeclareReply:
    """The checkpoint's total (declared sources) and how many of them are not completed."""

    total: int
    remaining: int


@dataclass(frozen=True)
class FlushReply:
    """Sources this writer has completed so far, all durable."""

    completed: int


@dataclass(frozen=True)
class ListCheckpointsReply:
    """A page of checkpoints with their progress, by name in byte order."""

    checkpoints: list[CheckpointView]
    next_after: str = field(
        metadata={
            "description": "Pass as after for the next page (the last name listed); empty on the last page."
        },
    )


@dataclass(frozen=True)
class ListWritersReply:
    """A page of one checkpoint's writers: live ones by writer_id, then ended ones newest first."""

    writers: list[WriterView]
    next_after: str = field(
        metadata={
            "description": "Pass as after for the next page, unchanged (a position such as "
            "'live/<writer_id>', not a writer id); empty on the last page."
        },
    )


@dataclass(frozen=True)
class ProgressReply:
    """A checkpoint's completed count over time, oldest first."""

    samples: list[ProgressSample]


@dataclass(frozen=True)
class AcquireReply:
    """One claim per distinct source asked about, in the order asked."""

    claims: list[ClaimView]
