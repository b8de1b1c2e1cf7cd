"""The HTTP face of domain errors: status codes and the ``{"error": {...}}`` body, for every responder."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tally_server.domain.validation import bounded_details, bounded_message
from tally_server.errors import ErrorCode

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.FAILED_PRECONDITION: 412,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAVAILABLE: 503,
}


def error_response(
    status: int, code: ErrorCode | str, message: str, details: dict[str, Any] | None = None
) -> JSONResponse:
    error = {
        "code": str(code),
        "message": bounded_message(message),
        "details": bounded_details(details or {}),
    }
    body = {"error": error}
    return JSONResponse(status_code=status, content=body)
