"""The HTTP face of refusals: status codes, the ``{"error": {...}}`` body, the exception handlers."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Route

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
    # 409 Conflict like ALREADY_EXISTS (the body's code tells them apart): 412 is for conditional
    # requests (If-Match and friends), which this API has none of.
    ErrorCode.FAILED_PRECONDITION: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAVAILABLE: 503,
}
# Statuses Starlette raises itself (unknown path, a body it could not read); 405 has a code of its own.
_CODE_BY_STATUS: dict[int, str] = {
    404: ErrorCode.NOT_FOUND,
    405: "METHOD_NOT_ALLOWED",
    400: ErrorCode.INVALID_ARGUMENT,
}

_REFUSALS: dict[int, str] = {
    400: "INVALID_ARGUMENT: the body, a query parameter or a value in them is not valid; the message "
    "names it (this server never answers 422).",
    401: "UNAUTHENTICATED: no bearer token, or one the coordinator does not know (only when it has tokens).",
    403: "PERMISSION_DENIED: the token's role or its checkpoint scopes do not allow this.",
    404: "NOT_FOUND: the checkpoint or writer does not exist (a writer whose lease ran out is gone).",
    409: "ALREADY_EXISTS (e.g. a live writer_id) or FAILED_PRECONDITION (e.g. a fingerprint mismatch, a "
    "reset while writers are live); the error's code says which.",
    413: "RESOURCE_EXHAUSTED: the body is over max_message_bytes; send smaller batches.",
    429: "RESOURCE_EXHAUSTED: a limit of the coordinator's (deltas or ids per call, writers per checkpoint).",
    500: "INTERNAL: a bug; the server log has the traceback.",
    503: "UNAVAILABLE: the coordinator cannot do this now (shutting down, a reset under way, storage "
    "failing); retry.",
}
#: The error replies every ``/v1`` route documents (``responses=`` of its router).
ERROR_REPLIES: dict[int | str, dict[str, Any]] = {
    status: {"model": s.ErrorReply, "description": text} for status, text in _REFUSALS.items()
}
# A 400 lists this many problems of a body; the rest are counted.
_PROBLEMS_SHOWN = 5
_CHALLENGE = 'Bearer realm="tally"'
# Where FastAPI found a bad value (the first item of an error's loc), as a message names it.
_PARAMETER_KINDS = {"query": "query parameter", "path": "path parameter", "header": "header"}


def error_response(
    status: int,
    code: ErrorCode | str,
    message: str,
    details: dict[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The JSON error reply every refusal uses: ``{"error": {"code", "message", "details"}}``."""
    error = {
        "code": str(code),
        "message": bounded_message(message),
        "details": bounded_details(details or {}),
    }
    body = {"error": error}
    return JSONResponse(status_code=status, content=body, headers=headers)


def www_authenticate(authorization: str | None) -> str:
    """The ``WWW-Authenticate`` challenge of a 401 (RFC 6750): a bad token is ``invalid_token``."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return f'{_CHALLENGE}, error="invalid_token"'
    return _CHALLENGE


def allowed_methods(routes: Iterable[BaseRoute], path: str) -> list[str]:
    """The methods some route answers at ``path``, sorted (the ``Allow`` header of a 405).

    Starlette's own 405 names only the methods of the first route whose path matched, so
    ``DELETE /v1/writers`` would be told ``GET`` though ``POST`` is served there too.
    """
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, Route) and route.methods and route.path_regex.fullmatch(path):
            methods |= route.methods
    return sorted(methods)


def install_handlers(app: FastAPI) -> None:
    """Answer refusals, bad requests, unknown routes, storage errors (503) and bugs with the error body."""

    @app.exception_handler(TallyServerError)
    async def _domainerror_response(request: Request, exc: TallyServerError) -> JSONResponse:
        headers = None
        if exc.code is ErrorCode.UNAUTHENTICATED:
            headers = {"WWW-Authenticate": www_authenticate(request.headers.get("authorization"))}
        return error_response(HTTP_STATUS[exc.code], exc.code, exc.message, exc.details, headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        problems = []
        for err in errors[:_PROBLEMS_SHOWN]:
            # Keys of the client's maps end up in loc: shown cut, like every echoed value.
            loc = [p if isinstance(p, str) and len(p) <= 80 else describe(p) for p in err["loc"]]
            if len(loc) > 1 and loc[0] in _PARAMETER_KINDS:
                # A query, path or header parameter, by the name the client sent, with what it sent.
                where = f"{_PARAMETER_KINDS[loc[0]]} {'.'.join(map(str, loc[1:]))!r}"
                sent = err.get("input")
                if isinstance(sent, str):
                    where += f" (sent {describe(sent)})"
            else:
                where = ".".join(map(str, loc))
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
        message = f"{exc.detail}: {request.method} {shown}"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request.app.router.routes, path))
            message += f"; this path allows {headers['Allow']}"
        return error_response(exc.status_code, code, message, headers=headers)

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
