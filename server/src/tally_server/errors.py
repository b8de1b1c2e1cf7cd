"""Transport-neutral errors. Transports map ``ErrorCode`` to gRPC status codes and HTTP statuses."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from tally_server.domain.ports import CompletionWriteError


class ErrorCode(StrEnum):
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
    """A refusal with a code and a message that says what was wrong and what to do."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidArgument(TallyServerError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(TallyServerError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(TallyServerError):
    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(TallyServerError):
    code = ErrorCode.FAILED_PRECONDITION


class ResourceExhausted(TallyServerError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class Unavailable(TallyServerError):
    code = ErrorCode.UNAVAILABLE


class Unauthenticated(TallyServerError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(TallyServerError):
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
