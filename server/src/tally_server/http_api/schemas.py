"""Request bodies of the HTTP API (field names match the tally.v1 protobuf messages), and the error reply.

Request bodies are strict: a number is not a string, ``true`` is not ``1``. Replies are the service's
views (``service/views.py``) and the envelopes in ``replies.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tally_server.domain.validation import MAX_PID


class RequestBody(BaseModel):
    """A JSON request body, validated strictly (no type coercion)."""

    model_config = ConfigDict(strict=True)


class OpenWriterBody(RequestBody):
    """Register a writer of a checkpoint."""

    checkpoint: str = Field(description="Checkpoint name, e.g. 'curation/run-42'.")
    writer_id: str = Field(default="", description="Empty: the server picks one.")
    fingerprint: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    host: str = ""
    pid: int = Field(default=0, ge=0, le=MAX_PID, description="The writer's process id; 0: unknown.")
    on_mismatch: Literal["refuse", "reset", "ignore"] = Field(
        default="refuse", description="When the fingerprint differs from the checkpoint's recorded one."
    )
    session_token: str = Field(
        default="",
        max_length=128,
        description="A random token the client picks for this session: an open retried with the token "
        "of a live session of the same writer_id attaches to it instead of being refused.",
    )


class DeltaBody(RequestBody):
    """One delta: a task's count for a source goes up or down."""

    task_id: str
    source_id: str
    delta: int


class DeltaColumnsBody(RequestBody):
    """A batch as three parallel columns: delta i is (task_ids[i], source_ids[i], deltas[i])."""

    task_ids: list[str]
    source_ids: list[str]
    deltas: list[int]


class ApplyDeltasBody(RequestBody):
    """A batch of deltas, applied in order; ``batch_seq`` numbers it so a resent batch is recognised.

    The batch comes as ``deltas`` (one object per delta) or as ``columns`` (half the bytes, and
    parsed in less than half the time), never both.
    """

    deltas: list[DeltaBody] | None = None
    columns: DeltaColumnsBody | None = None
    batch_seq: int = Field(default=0, ge=0, lt=2**64)

    @model_validator(mode="after")
    def _one_form(self) -> ApplyDeltasBody:
        if (self.deltas is None) == (self.columns is None):
            raise ValueError("send the batch as either 'deltas' or 'columns' (exactly one of them)")
        c = self.columns
        if c is not None and not len(c.task_ids) == len(c.source_ids) == len(c.deltas):
            raise ValueError(
                f"the batch's columns differ in length ({len(c.task_ids)} task_ids, {len(c.source_ids)} "
                f"source_ids, {len(c.deltas)} deltas); send one task id, source id and delta per delta"
            )
        return self

    def batch(self) -> list[tuple[str, str, int]]:
        """The deltas as ``(task_id, source_id, delta)`` tuples (columns of unequal length: an error)."""
        if self.columns is not None:
            c = self.columns
            return list(zip(c.task_ids, c.source_ids, c.deltas, strict=True))
        return [(d.task_id, d.source_id, d.delta) for d in self.deltas or ()]


class AreCompletedBody(RequestBody):
    """Ask which sources are completed."""

    checkpoint: str
    source_ids: list[str]


class CursorItem(BaseModel):
    """Where a writer got to inside one source."""

    source_id: str
    data: str = Field(description="The cursor, base64 (at most 4,096 bytes decoded); opaque to Tally.")


class SaveCursorsBody(RequestBody):
    """Cursors to save, in order: a later one of a source replaces an earlier one."""

    cursors: list[CursorItem]


class AcquireBody(RequestBody):
    """Sources to claim for the writer."""

    source_ids: list[str]


class ReportFailureBody(RequestBody):
    """A failed attempt at a source."""

    source_id: str
    reason: str = Field(
        default="", description="What went wrong, for people (the first 1,000 characters are kept)."
    )


class RetryFailedBody(RequestBody):
    """Sources whose failed attempts to clear."""

    checkpoint: str
    source_ids: list[str] = Field(default_factory=list, description="Empty: every source of the checkpoint.")


class FailureBudgetBody(RequestBody):
    """A checkpoint's failure budget."""

    checkpoint: str
    max_attempts: int = Field(description="Failed attempts after which a source is failed; 0: unlimited.")


class DeclareBody(RequestBody):
    """Sources a pipeline will process (added to those declared), or how many when the ids are unknown."""

    checkpoint: str
    source_ids: list[str] = Field(default_factory=list)
    count: int = Field(default=0, description="When the ids are not known: how many sources there are.")


class ErrorDetail(BaseModel):
    """What went wrong: a code, a message for people, and machine-readable details."""

    code: str
    message: str
    details: dict[str, object] = Field(default_factory=dict)


class ErrorReply(BaseModel):
    """The body of every error reply."""

    error: ErrorDetail


class ImportBody(RequestBody):
    """Adopt completions made elsewhere."""

    checkpoint: str
    source_ids: list[str]
    import_id: str = Field(description="Names the file the ids are written to: <import_id>.mdb.")


class ResetBody(RequestBody):
    """Start a checkpoint over."""

    name: str
    force: bool = False
