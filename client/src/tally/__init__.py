"""Tally: the client SDK of the Tally checkpoint coordinator.

Example::

    import tally

    client = tally.Client("grpc://coordinator:50051")
    with client.writer("curation/run-42", fingerprint={"pipeline": h1, "input": h2}) as w:
        todo = [s for s, done in zip(sources, w.are_completed(sources)) if not done]
        w.apply_deltas([(task_id, source_id, +1)])  # fire-and-forget, batched, never raises
        w.flush()  # barrier when you need one
"""

from tally._client import AsyncClient, Client
from tally._config import ClientConfig
from tally._types import (
    ApplyCounts,
    CheckpointStatus,
    Claim,
    CloseResult,
    Event,
    EventPage,
    FailedAttempt,
    FailureReport,
    ImportResult,
    ProgressSample,
    Replica,
    Replicas,
    ResetResult,
    Severity,
    SourceFailures,
    WriterHealth,
    WriterStatus,
)
from tally._writer import AsyncWriter, Writer
from tally.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LeaseLost,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StatusCode,
    TallyError,
    Unauthenticated,
    Unavailable,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "ApplyCounts",
    "AsyncClient",
    "AsyncWriter",
    "CheckpointStatus",
    "Claim",
    "Client",
    "ClientConfig",
    "CloseResult",
    "Event",
    "EventPage",
    "FailedAttempt",
    "FailedPrecondition",
    "FailureReport",
    "ImportResult",
    "Internal",
    "InvalidArgument",
    "LeaseLost",
    "NotFound",
    "PermissionDenied",
    "ProgressSample",
    "Replica",
    "Replicas",
    "ResetResult",
    "ResourceExhausted",
    "Severity",
    "SourceFailures",
    "StatusCode",
    "TallyError",
    "Unauthenticated",
    "Unavailable",
    "Writer",
    "WriterHealth",
    "WriterStatus",
]
