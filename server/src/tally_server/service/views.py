"""What the service answers: plain result records that both transports translate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tally_server.domain.ledger import ApplyCounts


@dataclass(frozen=True)
class OpenedWriter:
    handle: str
    writer_id: str
    lease_ttl_s: float
    completed_count: int
    settle_ms: int


@dataclass(frozen=True)
class ClosedWriter:
    counts: ApplyCounts
    incomplete_sources: list[str]
    incomplete_count: int


@dataclass(frozen=True)
class WriterView:
    writer_id: str
    host: str
    pid: int
    labels: dict[str, str]
    state: str
    pending_sources: int
    counts: ApplyCounts
    opened_at: float
    last_seen_at: float
    closed_at: float = 0.0


@dataclass(frozen=True)
class EventView:
    id: int
    checkpoint: str
    kind: str
    message: str
    at: float
    writer_id: str
    data: dict[str, Any]


@dataclass(frozen=True)
class EventPage:
    events: list[EventView]
    next_before_id: int  # 0: no older events


@dataclass(frozen=True)
class ProgressSample:
    at: float
    completed_count: int


@dataclass(frozen=True)
class CompletedPage:
    source_ids: list[str]
    next_after: str  # "": last page


@dataclass(frozen=True)
class ImportResult:
    imported: int
    completed_count: int


@dataclass(frozen=True)
class ResetResult:
    moved_to: str
    files_moved: int
    writers_closed: int


@dataclass(frozen=True)
class CheckpointView:
    name: str
    completed_count: int
    live_writers: int
    pending_sources: int
    settling_sources: int
    anomalies: int
    unreadable_files: int
    created_at: float
    last_activity_at: float
    writers: list[WriterView]
    fingerprint: dict[str, str]
