"""JSON bodies of the HTTP API (field names match the tally.v1 protobuf messages).

Request bodies are strict: a number is not a string, ``true`` is not ``1``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tally_server.domain.validation import MAX_PID


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True)


class OpenWriterBody(RequestBody):
    checkpoint: str = Field(description="Checkpoint name, e.g. 'curation/run-42'.")
    writer_id: str = Field(default="", description="Empty: the server picks one.")
    fingerprint: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    host: str = ""
    pid: int = Field(default=0, ge=0, le=MAX_PID, description="The writer's process id; 0: unknown.")
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


class DeltaBody(RequestBody):
    task_id: str
    source_id: str
    delta: int


class ApplyDeltasBody(RequestBody):
    deltas: list[DeltaBody]
    batch_seq: int = Field(default=0, ge=0, lt=2**64)

    def batch(self) -> list[tuple[str, str, int]]:
        return [(d.task_id, d.source_id, d.delta) for d in self.deltas]


class Counts(BaseModel):
    applied: int
    skipped: int
    rewritten: int
    anomalies: int
    completed: int


class ApplyDeltasReply(BaseModel):
    counts: Counts


class AreCompletedBody(RequestBody):
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


class ImportBody(RequestBody):
    checkpoint: str
    source_ids: list[str]
    import_id: str = Field(description="Names the file the ids are written to: <import_id>.mdb.")


class ImportReply(BaseModel):
    imported: int
    completed_count: int


class ResetBody(RequestBody):
    name: str
    force: bool = False


class ResetReply(BaseModel):
    moved_to: str
    files_moved: int
    writers_closed: int
