"""Request bodies of the HTTP API (field names match the tally.v1 protobuf messages), and the error reply.

Request bodies are strict: a number is not a string, ``true`` is not ``1``. Replies are the service's
views (``service/views.py``) and the envelopes in ``replies.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Path, Query
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tally_server.domain.validation import (
    DEFAULT_STATUS_PAGE,
    MAX_CURSOR_BYTES,
    MAX_DETAILS_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_PID,
    MAX_SESSION_TOKEN,
    MAX_STATUS_PAGE,
    Limits,
)

# Field and query-parameter descriptions: units and limits. The limits quoted are the defaults;
# each is a server setting (named in brackets), so a coordinator may be configured otherwise.
_LIMITS = Limits()
MAX_IDS = _LIMITS.max_ids_per_query
CHECKPOINT = (
    "Checkpoint name: segments of letters, digits, '.', '_' and '-' separated by '/' (e.g. "
    f"'curation/run-42'); at most {_LIMITS.max_name_bytes} bytes of UTF-8 (max_name_bytes)."
)
SOURCE_ID = (
    "A source (an input file, a shard, a partition): any non-empty UTF-8 text of at most "
    f"{_LIMITS.max_id_bytes} bytes (max_id_bytes)."
)
TASK_ID = (
    f"A task working on the source: non-empty UTF-8, at most {_LIMITS.max_id_bytes} bytes (max_id_bytes)."
)
SOURCE_IDS = (
    f"Source ids (each as source_id); at most {_LIMITS.max_ids_per_query:,} per call (max_ids_per_query)."
)
FILE_NAME = (
    "Names the file <value>.mdb: letters, digits, '.', '_' and '-', starting with a letter, digit or "
    f"'_'; at most {min(_LIMITS.max_name_bytes, 255 - len('.mdb'))} bytes (max_name_bytes)."
)
_PAIRS = (
    f"At most {_LIMITS.max_labels} (max_labels); keys non-empty UTF-8 of at most {_LIMITS.max_id_bytes} "
    "bytes, values UTF-8."
)


class RequestBody(BaseModel):
    """A JSON request body, validated strictly (no type coercion)."""

    model_config = ConfigDict(strict=True)


class OpenWriterBody(RequestBody):
    """Register a writer of a checkpoint."""

    checkpoint: str = Field(description=CHECKPOINT)
    writer_id: str = Field(default="", description="Empty: the server picks one. " + FILE_NAME)
    fingerprint: dict[str, str] = Field(
        default_factory=dict,
        description="What the run's output depends on (pipeline version, input, parameters); a writer "
        "whose fingerprint differs from the checkpoint's recorded one meets on_mismatch. " + _PAIRS,
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Shown with the writer, e.g. slurm_array_task_id. " + _PAIRS,
    )
    host: str = Field(default="", description="The writer's host name, for people.")
    pid: int = Field(default=0, ge=0, le=MAX_PID, description="The writer's process id; 0: unknown.")
    on_mismatch: Literal["refuse", "reset", "ignore"] = Field(
        default="refuse", description="When the fingerprint differs from the checkpoint's recorded one."
    )
    session_token: str = Field(
        default="",
        max_length=MAX_SESSION_TOKEN,
        description="A random token the client picks for this session: an open retried with the token "
        "of a live session of the same writer_id attaches to it instead of being refused. At most "
        f"{MAX_SESSION_TOKEN} printable ASCII characters.",
    )


class DeltaBody(RequestBody):
    """One delta: a task's count for a source goes up or down."""

    task_id: str = Field(description=TASK_ID)
    source_id: str = Field(description=SOURCE_ID)
    delta: int = Field(description="How the task's count for the source changes: +1 or -1, usually.")


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

    deltas: list[DeltaBody] | None = Field(
        default=None,
        description=f"At most {_LIMITS.max_deltas_per_call:,} per call (max_deltas_per_call), and the "
        "whole body at most max_message_bytes (64 MiB by default).",
    )
    columns: DeltaColumnsBody | None = Field(default=None, description="The same batch as three columns.")
    batch_seq: int = Field(
        default=0,
        ge=0,
        lt=2**64,
        description="The writer's number for this batch (1, 2, 3, ...): a batch resent with the number "
        "of one already applied is not applied twice. 0: not numbered.",
    )
    ordered: bool = Field(
        default=False,
        description="The batch follows batch batch_seq - 1, which may still be on its way (a writer "
        "with up to max_batches_in_flight batches on the wire, as its open answered): the coordinator "
        "applies them in their numbers' order, and answers a resent earlier one again.",
    )

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

    checkpoint: str = Field(description=CHECKPOINT)
    source_ids: list[str] = Field(description=SOURCE_IDS)


class CursorItem(BaseModel):
    """Where a writer got to inside one source."""

    source_id: str = Field(description=SOURCE_ID)
    data: str = Field(
        description=f"The cursor, base64 (at most {MAX_CURSOR_BYTES:,} bytes decoded); opaque to Tally."
    )


class SaveCursorsBody(RequestBody):
    """Cursors to save, in order: a later one of a source replaces an earlier one."""

    cursors: list[CursorItem] = Field(
        description=f"At most {_LIMITS.max_ids_per_query:,} per call (max_ids_per_query)."
    )


class AcquireBody(RequestBody):
    """Sources to claim for the writer."""

    source_ids: list[str] = Field(description=SOURCE_IDS)


class ReportFailureBody(RequestBody):
    """A failed attempt at a source."""

    source_id: str = Field(description=SOURCE_ID)
    reason: str = Field(
        default="", description="What went wrong, for people (the first 1,000 characters are kept)."
    )
    attempt_id: str = Field(
        default="",
        description=(
            "Names this attempt (at most 128 printable ASCII characters; the SDK sends a random one per "
            "report): a request repeated with the same id, a retry after a lost answer, is answered as "
            "the first was and not counted again. Empty: counted every time."
        ),
    )


class RetryFailedBody(RequestBody):
    """Sources whose failed attempts to clear."""

    checkpoint: str = Field(description=CHECKPOINT)
    source_ids: list[str] = Field(
        default_factory=list, description="Empty: every source of the checkpoint. " + SOURCE_IDS
    )


class FailureBudgetBody(RequestBody):
    """A checkpoint's failure budget."""

    checkpoint: str = Field(description=CHECKPOINT)
    max_attempts: int = Field(description="Failed attempts after which a source is failed; 0: unlimited.")


class DeclareBody(RequestBody):
    """Sources a pipeline will process (added to those declared), or how many when the ids are unknown."""

    checkpoint: str = Field(description=CHECKPOINT)
    source_ids: list[str] = Field(default_factory=list, description=SOURCE_IDS)
    count: int = Field(default=0, description="When the ids are not known: how many sources there are.")


class ErrorDetail(BaseModel):
    """What went wrong: a code, a message for people, and machine-readable details."""

    code: str = Field(
        description="A tally.v1 status name (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, "
        "FAILED_PRECONDITION, ...), or METHOD_NOT_ALLOWED for a method the path does not serve."
    )
    message: str = Field(description=f"What was wrong and what to do; at most {MAX_MESSAGE_BYTES:,} bytes.")
    details: dict[str, object] = Field(
        default_factory=dict, description=f"Machine-readable; at most {MAX_DETAILS_BYTES:,} bytes of JSON."
    )


class ErrorReply(BaseModel):
    """The body of every error reply."""

    error: ErrorDetail


class ImportBody(RequestBody):
    """Adopt completions made elsewhere."""

    checkpoint: str = Field(description=CHECKPOINT)
    source_ids: list[str] = Field(description=SOURCE_IDS)
    import_id: str = Field(description="The file the ids are written to. " + FILE_NAME)


class ResetBody(RequestBody):
    """Start a checkpoint over."""

    name: str = Field(description=CHECKPOINT)
    force: bool = Field(default=False, description="Reset even while writers are live (they are closed).")


# Query and path parameters that several routes share.
CheckpointParam = Annotated[str, Query(description=CHECKPOINT)]
SourceIdParam = Annotated[str, Query(description=SOURCE_ID)]
AfterParam = Annotated[
    str,
    Query(description="Start after this source id (byte order): the previous page's next_after; '' first."),
]
STATUS_PAGE_LIMIT = f"{{what}} per page: 1 to {MAX_STATUS_PAGE:,}; 0: {DEFAULT_STATUS_PAGE:,}."
HandleParam = Annotated[str, Path(description="The writer's handle, as OpenWriter returned it.")]
