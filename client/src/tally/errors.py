"""The SDK's error hierarchy.

Every failure the SDK reports is a :class:`TallyError` carrying a :class:`StatusCode`, whichever
transport produced it, so callers never import grpc or inspect HTTP statuses. The gRPC and HTTP
transports each translate their wire errors with one mapping table into these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

__all__ = [
    "AlreadyExists",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "LeaseLost",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "StatusCode",
    "TallyError",
    "Unauthenticated",
    "Unavailable",
    "error_for_code",
]


class StatusCode(StrEnum):
    """Status codes of Tally errors (the gRPC code names, without importing grpc)."""

    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class TallyError(Exception):
    """Base class of every error raised by the Tally SDK.

    Attributes:
        message: What was wrong and, where the server knows, what to do about it.
        code: The status code.
        details: Structured details from the server (may be empty).
    """

    default_code: StatusCode = StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        code: StatusCode | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """Create an error.

        Args:
            message: Human-readable description.
            code: Status code; defaults to the class's ``default_code``.
            details: Structured details, e.g. the limit that was exceeded.
        """
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.details: dict[str, Any] = dict(details or {})

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code.value})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (Ray actors, multiprocessing); the default
        # reduction would keep only the message and lose code and details.
        return (type(self), (self.message, self.code, self.details))


class InvalidArgument(TallyError):
    """The request was malformed or exceeded a limit; resending it will not help."""

    default_code = StatusCode.INVALID_ARGUMENT


class NotFound(TallyError):
    """The checkpoint, writer or resource does not exist."""

    default_code = StatusCode.NOT_FOUND


class AlreadyExists(TallyError):
    """The resource exists already, e.g. a writer id that is live."""

    default_code = StatusCode.ALREADY_EXISTS


class FailedPrecondition(TallyError):
    """The system is not in a state that allows the operation, e.g. a fingerprint mismatch."""

    default_code = StatusCode.FAILED_PRECONDITION


class ResourceExhausted(TallyError):
    """A server limit was reached (batch size, writers per checkpoint, ...)."""

    default_code = StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(TallyError):
    """No valid token was presented."""

    default_code = StatusCode.UNAUTHENTICATED


class PermissionDenied(TallyError):
    """The token's role does not allow the operation."""

    default_code = StatusCode.PERMISSION_DENIED


class Unavailable(TallyError):
    """The coordinator could not be reached or did not answer in time. Retryable."""

    default_code = StatusCode.UNAVAILABLE


class LeaseLost(NotFound):
    """The coordinator no longer knows this writer: its lease expired or it was dropped.

    The writer's pending counts are gone on the server; its unfinished sources replay on the next
    run. Completed sources are unaffected.
    """


class Internal(TallyError):
    """The coordinator failed unexpectedly, or answered something the SDK cannot read."""

    default_code = StatusCode.INTERNAL


# Codes the Tally server does not send still get a sensible class, so that any status maps.
_CLASS_FOR_CODE: dict[StatusCode, type[TallyError]] = {
    StatusCode.CANCELLED: Unavailable,
    StatusCode.UNKNOWN: Internal,
    StatusCode.INVALID_ARGUMENT: InvalidArgument,
    StatusCode.DEADLINE_EXCEEDED: Unavailable,
    StatusCode.NOT_FOUND: NotFound,
    StatusCode.ALREADY_EXISTS: AlreadyExists,
    StatusCode.PERMISSION_DENIED: PermissionDenied,
    StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    StatusCode.ABORTED: Unavailable,
    StatusCode.OUT_OF_RANGE: InvalidArgument,
    StatusCode.UNIMPLEMENTED: Internal,
    StatusCode.INTERNAL: Internal,
    StatusCode.UNAVAILABLE: Unavailable,
    StatusCode.DATA_LOSS: Internal,
    StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def error_for_code(code: StatusCode, message: str, details: Mapping[str, Any] | None = None) -> TallyError:
    """Build the error of the class that matches ``code``.

    Args:
        code: The status code reported by the server or transport.
        message: The error message.
        details: Structured details, if any.

    Returns:
        An instance of the matching :class:`TallyError` subclass.
    """
    return _CLASS_FOR_CODE[code](message, code, details)
