"""Refusals in gRPC's standard error model: a ``google.rpc.Status`` in ``grpc-status-details-bin``.

Clients in any language read it with their gRPC library's rich-status helpers (Go's
``status.FromError(err).Details()``, Java's ``StatusProto.fromThrowable``, Python's
``grpc_status.rpc_status.from_call``; grpcurl prints it). The Status holds the code and message of
the call and, as details:

- ``google.rpc.ErrorInfo``: ``reason`` the refusal's code name (``FAILED_PRECONDITION``), ``domain``
  :data:`DOMAIN`, ``metadata`` the refusal's details (strings as they are, other values as JSON);
- ``google.rpc.BadRequest``, on an INVALID_ARGUMENT that names its field (``details["field"]``):
  one field violation, that field with the message.

Beside it, the JSON of the details stays in ``tally-error-details``: the SDK reads it back into
``TallyError.details`` with their JSON types (ErrorInfo's metadata holds strings only).

All of it travels in trailers, which a peer refuses over its metadata limit (8 KiB by default),
answering RESOURCE_EXHAUSTED instead of the refusal: :func:`refusal` keeps the whole under
:data:`TRAILERS_BUDGET`, leaving out the ErrorInfo's metadata first, then the JSON details.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tally_server.domain.validation import bounded_details, bounded_message
from tally_server.errors import ErrorCode

#: ErrorInfo.domain of every refusal of Tally's.
DOMAIN = "tally.dev"

#: The trailing-metadata key of the JSON details (read by the SDK).
DETAILS_KEY = "tally-error-details"

#: At most this many bytes of trailers per refusal (message, JSON details, Status), well under
#: gRPC's default metadata limit of 8 KiB, leaving room for the request id and the HTTP/2 framing.
TRAILERS_BUDGET = 6 * 1024

#: The longest field violation description; longer messages are cut (the Status carries them whole).
MAX_VIOLATION_BYTES = 512

Trailers = tuple[tuple[str, str | bytes], ...]


def refusal(code: ErrorCode, message: str, details: dict[str, Any]) -> tuple[grpc.StatusCode, str, Trailers]:
    """The status code, message and trailers that answer a refusal, within :data:`TRAILERS_BUDGET`.

    The code and message come out of the Status itself, so that they match it as clients check.
    """
    message = bounded_message(message)
    details = bounded_details(details)
    field = details.get("field")
    omitted = {"omitted": f"the details were left out to keep the trailers under {TRAILERS_BUDGET} bytes"}
    shorter = omitted if details else {}
    for sent, metadata in ((details, _metadata(details)), (details, shorter), (shorter, shorter)):
        status = rpc_status.to_status(_status(code, message, metadata, field))
        json_pairs: Trailers = ((DETAILS_KEY, json.dumps(sent, default=str)),) if sent else ()
        trailers: Trailers = (*json_pairs, *status.trailing_metadata)
        if _size(message, trailers) <= TRAILERS_BUDGET:
            break
    return status.code, status.details, trailers


def _status(code: ErrorCode, message: str, metadata: dict[str, str], field: object) -> status_pb2.Status:
    grpc_code = STATUS[code]
    status = status_pb2.Status(code=grpc_code.value[0], message=message)
    status.details.add().Pack(
        error_details_pb2.ErrorInfo(reason=code.value, domain=DOMAIN, metadata=metadata)
    )
    if code is ErrorCode.INVALID_ARGUMENT and isinstance(field, str) and field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=_cut(message))
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return status


def _metadata(details: dict[str, Any]) -> dict[str, str]:
    """ErrorInfo's metadata: string values as they are, the others as compact JSON."""
    return {
        str(key): value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))
        for key, value in details.items()
    }


def _cut(message: str) -> str:
    encoded = message.encode()
    if len(encoded) <= MAX_VIOLATION_BYTES:
        return message
    return encoded[: MAX_VIOLATION_BYTES - 40].decode("utf-8", "ignore") + "... (see the status message)"


def _size(message: str, trailers: Trailers) -> int:
    """Bytes on the wire: grpc-message is percent-encoded, -bin values base64-encoded."""
    size = sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in message.encode())
    for key, value in trailers:
        length = len(base64.b64encode(value)) if isinstance(value, bytes) else len(value.encode())
        size += len(key) + length
    return size


#: The status code of each refusal's code.
STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}
