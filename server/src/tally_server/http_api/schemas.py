"""Request bodies of the HTTP API (field names match the tally.v1 protobuf messages), and the error reply.

Request bodies are strict: a number is not a string, ``true`` is not ``1``. Replies are the service's
views (``service/views.py``) and the envelopes in ``replies.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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


class ApplyDeltasBody(RequestBody):
    """A batch of deltas, applied in order; ``batch_seq`` numbers it so a resent batch is recognised."""

    deltas: list[DeltaBody]
    batch_seq: int = Field(default=0, ge=0, lt=2**64)

    def batch(self) -> list[tuple[str, str, int]]:
        """The deltas as ``(task_id, source_id, delta)`` tuples."""
        return [(d.task_id, d.source_id, d.delta) for d in self.deltas]


class AreCompletedBody(RequestBody):
    """Ask which sources are completed."""

    checkpoint: str
    source_ids: list[str]


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
