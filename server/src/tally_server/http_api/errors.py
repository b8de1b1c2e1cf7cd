"""The HTTP face of refusals: status codes, the ``{"error": {...}}`` body, the exception handlers."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tally_server.domain.validation import bounded_details, bounded_message, describe
from tally_server.errors import STORAGE_ERRORS, ErrorCode, TallyServerError, storage_unavailable
from tally_server.http_api import schemas as s

log = logging.getLogger(__name__)

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
_CODE_BY_STATUS = {status: code for code, status in HTTP_STATUS.items()}

#: The error replies every ``/v1`` route documents (``responses=`` of its router).
ERROR_REPLIES: dict[int | str, dict[str, Any]] = {
    status: {"model": s.ErrorReply} for status in (400, 404, 409, 412, 413, 429, 500, 503)
}
# A 400 lists this many problems of a body; the rest are counted.
_PROBLEMS_SHOWN = 5


def error_response(
    status: int, code: ErrorCode | str, message: str, details: dict[str, Any] | None = None
) -> JSONResponse:
    """The JSON error reply every refusal uses: ``{"error": {"code", "message", "details"}}``."""
    error = {
        "code": str(code),
        "message": bounded_message(message),
        "details": bounded_details(details or {}),
    }
    body = {"error": error}
    return JSONResponse(status_code=status, content=body)


def install_handlers(app: FastAPI) -> None:
    """Answer refusals, bad requests, unknown routes, storage errors (503) and bugs with the error body."""

    @app.exception_handler(TallyServerError)
    async def _domainerror_response(request: Request, exc: TallyServerError) -> JSONResponse:
        return error_response(HTTP_STATUS[exc.code], exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        problems = []
        for err in errors[:_PROBLEMS_SHOWN]:
            # Keys of the client's maps end up in loc: shown cut, like every echoed value.
            where = ".".join(p if isinstance(p, str) and len(p) <= 80 else describe(p) for p in err["loc"])
            problems.append(f"{where}: {err.get('msg')}")
        if len(errors) > _PROBLEMS_SHOWN:
            problems.append(f"and {len(errors) - _PROBLEMS_SHOWN} more")
        message = "request is not valid: " + "; ".join(problems) + " (see /openapi.json for the schema)"
        return error_response(400, ErrorCode.INVALID_ARGUMENT, message)

    @app.exception_handler(StarletteHTTPException)
    async def _httperror_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _CODE_BY_STATUS.get(exc.status_code, ErrorCode.INVALID_ARGUMENT)
        path = request.url.path
        shown = path if len(path) <= 80 else describe(path)
        return error_response(exc.status_code, code, f"{exc.detail}: {request.method} {shown}")

    async def _storage_refusal(request: Request, exc: Exception) -> JSONResponse:
        # Nothing mapped it on the way, so it is logged with its traceback; the caller may retry.
        log.error(
            "storage error in %s %s, answered UNAVAILABLE", request.method, request.url.path, exc_info=exc
        )
        refusal = storage_unavailable(exc)
        return error_response(HTTP_STATUS[refusal.code], refusal.code, refusal.message, refusal.details)

    for storage_error in STORAGE_ERRORS:
        app.add_exception_handler(storage_error, _storage_refusal)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, ErrorCode.INTERNAL, "internal error; see the server log")
