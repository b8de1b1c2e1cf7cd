"""Transport-neutral errors. Transports map ``ErrorCode`` to gRPC status codes and HTTP statuses."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from tally_server.domain.ports import CompletionWriteError


class ErrorCode(StrEnum):
    """What kind of refusal an error is; each transport maps it to its own status."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class TallyServerError(Exception):
    """A refusal with a code and a message that says what was wrong and what to do.

    ``details`` travel beside the message (gRPC trailers, the HTTP body). On an InvalidArgument,
    ``details["field"]`` names the request field at fault as a path (``checkpoint``,
    ``deltas[3].source_id``); gRPC also sends it as a ``google.rpc.BadRequest`` field violation.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidArgument(TallyServerError):
    """The request is malformed or a value in it is out of bounds; retrying it unchanged fails again."""

    code = ErrorCode.INVALID_ARGUMENT


class NotFound(TallyServerError):
    """The checkpoint or writer named does not exist (or no longer does)."""

    code = ErrorCode.NOT_FOUND


class AlreadyExists(TallyServerError):
    """The name is taken, e.g. a writer id that is already live."""

    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(TallyServerError):
    """The request is valid but the state does not allow it now (e.g. a reset while writers are live)."""

    code = ErrorCode.FAILED_PRECONDITION


class ResourceExhausted(TallyServerError):
    """A limit of the coordinator's was reached (writers per checkpoint, ids or bytes in one call)."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class Unavailable(TallyServerError):
    """The coordinator cannot do this right now (shutting down, storage failing); retrying may succeed."""

    code = ErrorCode.UNAVAILABLE


class NotOwned(Unavailable):
    """The checkpoint named belongs to another coordinator of the store (its shard's owner).

    UNAVAILABLE, so the SDK retries: the replicas route calls to a checkpoint's owner, so this is
    only answered while ownership moves between coordinators.
    """

    def __init__(self, checkpoint: str, replica: str = "") -> None:
        here = f"this coordinator (replica {replica!r})" if replica else "this coordinator"
        super().__init__(
            f"checkpoint {checkpoint!r} is not owned by {here}: it belongs to its shard's owner "
            "elsewhere; retry (calls are routed to the owner, so this is only seen while ownership "
            "moves between coordinators)",
            checkpoint=checkpoint,
            replica=replica,
        )


class RegistryFenced(Unavailable):
    """A registry write refused by the store's fence (``store.registry_fence``): nothing of it was written.

    UNAVAILABLE, so a call refused so is retried, and reaches the checkpoint's owner now.

    Attributes:
        shard: the shard whose epoch moved on or that is no longer held (None: the whole store's,
            or no shard held at all).
        refused: the checkpoints written that this coordinator can never write again (those of
            the shards refused, when the fence knows the store's shards; else all of them). Empty
            only if refused for a shard none of them is in: it may pass once that shard left the
            fence.
    """

    def __init__(self, message: str, shard: int | None, refused: frozenset[str]) -> None:
        super().__init__(message, cause=message[:500])
        self.shard = shard
        self.refused = refused


class Unauthenticated(TallyServerError):
    """The request carries no valid token."""

    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(TallyServerError):
    """The token's role does not allow this operation on this checkpoint."""

    code = ErrorCode.PERMISSION_DENIED


#: Errors of the disk or the system under the stores that reached a transport unmapped. They clear
#: once the cause does (space freed, a volume remounted, a path made free), so a client should
#: retry them: :func:`storage_unavailable` answers them as UNAVAILABLE, never as INTERNAL (which the
#: SDK does not retry). ``TimeoutError`` is an OSError too, and waiting longer is the answer to it.
STORAGE_ERRORS: tuple[type[Exception], ...] = (OSError, CompletionWriteError)


def storage_unavailable(exc: Exception) -> Unavailable:
    """The UNAVAILABLE refusal for one of :data:`STORAGE_ERRORS`, saying what the system said."""
    cause = str(exc) or type(exc).__name__
    return Unavailable(
        f"the coordinator's storage refused the operation ({cause}); retry, and if it persists check "
        "the disk and the permissions of the data directory",
        cause=cause,
    )
