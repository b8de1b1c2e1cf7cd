"""JSON bodies of the HTTP API (field names match the tally.v1 protobuf messages)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class OpenWriterBody(BaseModel):
    checkpoint: str = Field(description="Checkpoint name, e.g. 'curation/run-42'.")
    writer_id: str = Field(default="", description="Empty: the server picks one.")
    fingerprint: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    host: str = ""
    pid: int = 0
    on_mismatch: Literal["refuse", "reset", "ignore"] = Field(
        default="refuse", description="When the fingerprint differs from the checkpoint's recorded one."
    )


class OpenWriterReply(BaseModel):
    handle: str
    writer_id: str
    lease_ttl_s: float
    completed_count: int
    settle_ms: int


class KeepAliveReply(BaseModel):
    lease_ttl_s: float


class DeltaBody(BaseModel):
    task_id: str
    source_id: str
    delta: int


class ApplyDeltasBody(BaseModel):
    deltas: list[DeltaBody]
    batch_seq: int = 0


class Counts(BaseModel):
    applied: int
    skipped: int
    rewritten: int
    anomalies: int
    completed: int


class ApplyDeltasReply(BaseModel):
    counts: Counts


class AreCompletedBody(BaseModel):
    checkpoint: str
    source_ids: list[str]


class AreCompletedReply(BaseModel):
    completed: list[bool]


class FlushReply(BaseModel):
    completed: int


class CloseWriterReply(BaseModel):
    counts: Counts
    incomplete_sources: list[str]
    incomplete_count: int


class WriterStatus(BaseModel):
    writer_id: str
    host: str
    pid: int
    labels: dict[str, str]
    state: str
    pending_sources: int
    counts: Counts
    opened_at: float
    last_seen_at: float
    closed_at: float = 0.0


class CheckpointStatus(BaseModel):
    name: str
    completed_count: int
    live_writers: int
    pending_sources: int
    settling_sources: int
    anomalies: int
    unreadable_files: int
    created_at: float
    last_activity_at: float
    writers: list[WriterStatus]
    fingerprint: dict[str, str]


class ListCheckpointsReply(BaseModel):
    checkpoints: list[CheckpointStatus]


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: dict[str, object] = Field(default_factory=dict)


class ErrorReply(BaseModel):
    error: ErrorDetail


class ListWritersReply(BaseModel):
    writers: list[WriterStatus]


class Event(BaseModel):
    id: int
    checkpoint: str
    kind: str
    message: str
    at: float
    writer_id: str
    data: dict[str, object]


class ListEventsReply(BaseModel):
    events: list[Event]
    next_before_id: int = Field(description="Pass as before_id for the next page; 0 when there is none.")


class ProgressSample(BaseModel):
    at: float
    completed_count: int


class ProgressReply(BaseModel):
    samples: list[ProgressSample]


class ListCompletedReply(BaseModel):
    source_ids: list[str]
    next_after: str = Field(description="Pass as after for the next page; empty on the last page.")


class ImportBody(BaseModel):
    checkpoint: str
    source_ids: list[str]
    import_id: str = Field(description="Names the file the ids are written to: <import_id>.mdb.")


class ImportReply(BaseModel):
    imported: int
    completed_count: int


class ResetBody(BaseModel):
    name: str
    force: bool = False


class ResetReply(BaseModel):
    moved_to: str
    files_moved: int
    writers_closed: int
