"""create_app(service, settings): the FastAPI application. Handlers translate and call one service method."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tally_server import __version__
from tally_server.errors import ErrorCode, TallyServerError
from tally_server.http_api import schemas as s
from tally_server.service import CheckpointView, CoordinatorService
from tally_server.settings import Settings

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

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": s.ErrorReply} for status in (400, 404, 409, 412, 429, 500, 503)
}


def _error(
    status: int, code: ErrorCode | str, message: str, details: dict[str, Any] | None = None
) -> JSONResponse:
    body = {"error": {"code": str(code), "message": message, "details": details or {}}}
    return JSONResponse(status_code=status, content=body)


def _status(view: CheckpointView) -> s.CheckpointStatus:
    return s.CheckpointStatus.model_validate(dataclasses.asdict(view))


class BodyLimit:
    """Refuses a request whose declared body is larger than the limit, before reading it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = dict(scope["headers"]).get(b"content-length", b"0")
            if declared.isdigit() and int(declared) > self.limit:
                message = (
                    f"request body is {int(declared)} bytes, over the limit of {self.limit} "
                    "(setting max_message_bytes); send smaller batches"
                )
                response = _error(413, ErrorCode.RESOURCE_EXHAUSTED, message)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(service: CoordinatorService, settings: Settings) -> FastAPI:
    app = FastAPI(
        title="Tally coordinator",
        version=__version__,
        description="Checkpoint coordination for resumable batch pipelines (the HTTP face of tally.v1).",
    )

    app.add_middleware(BodyLimit, limit=settings.max_message_bytes)

    @app.exception_handler(TallyServerError)
    async def _domain_error(request: Request, exc: TallyServerError) -> JSONResponse:
        return _error(HTTP_STATUS[exc.code], exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            problems.append(f"{where}: {err.get('msg')}")
        message = "request body is not valid: " + "; ".join(problems) + " (see /openapi.json for the schema)"
        return _error(400, ErrorCode.INVALID_ARGUMENT, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _CODE_BY_STATUS.get(exc.status_code, ErrorCode.INVALID_ARGUMENT)
        return _error(exc.status_code, code, f"{exc.detail}: {request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(500, ErrorCode.INTERNAL, "internal error; see the server log")

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves requests."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"model": s.ErrorReply}})
    async def readyz() -> Any:
        """Readiness: stores are open and the coordinator accepts work (503 while shutting down)."""
        if not service.ready:
            return _error(503, ErrorCode.UNAVAILABLE, "not ready: starting or shutting down")
        return {"status": "ready"}

    @app.post("/v1/writers", response_model=s.OpenWriterReply, responses=_ERRORS, tags=["writers"])
    async def open_writer(body: s.OpenWriterBody) -> s.OpenWriterReply:
        """Register a writer of a checkpoint (refuses a writer_id that is live)."""
        opened = await service.open_writer(
            body.checkpoint,
            writer_id=body.writer_id,
            fingerprint=body.fingerprint,
            labels=body.labels,
            host=body.host,
            pid=body.pid,
        )
        return s.OpenWriterReply.model_validate(dataclasses.asdict(opened))

    @app.post(
        "/v1/writers/{handle}/keepalive", response_model=s.KeepAliveReply, responses=_ERRORS, tags=["writers"]
    )
    async def keep_alive(handle: str) -> s.KeepAliveReply:
        """Renew the writer's lease; 404 means its pending state is gone."""
        return s.KeepAliveReply(lease_ttl_s=await service.keep_alive(handle))

    @app.post(
        "/v1/writers/{handle}/deltas", response_model=s.ApplyDeltasReply, responses=_ERRORS, tags=["writers"]
    )
    async def apply_deltas(handle: str, body: s.ApplyDeltasBody) -> s.ApplyDeltasReply:
        """Apply (task_id, source_id, delta) in order under the counting rules."""
        batch = [(d.task_id, d.source_id, d.delta) for d in body.deltas]
        counts = await service.apply_deltas(handle, batch)
        return s.ApplyDeltasReply(counts=s.Counts.model_validate(dataclasses.asdict(counts)))

    @app.post("/v1/writers/{handle}/flush", response_model=s.FlushReply, responses=_ERRORS, tags=["writers"])
    async def flush(handle: str) -> s.FlushReply:
        """Barrier: returns when every completion from deltas applied so far is durable."""
        return s.FlushReply(completed=await service.flush(handle))

    @app.post(
        "/v1/writers/{handle}/close", response_model=s.CloseWriterReply, responses=_ERRORS, tags=["writers"]
    )
    async def close_writer(handle: str) -> s.CloseWriterReply:
        """Flush, complete settling sources, drop pending state; lists what was left incomplete."""
        closed = await service.close_writer(handle)
        return s.CloseWriterReply.model_validate(dataclasses.asdict(closed))

    @app.post(
        "/v1/are-completed", response_model=s.AreCompletedReply, responses=_ERRORS, tags=["checkpoints"]
    )
    async def are_completed(body: s.AreCompletedBody) -> s.AreCompletedReply:
        """Parallel booleans from the live completed set of the checkpoint (no writer needed)."""
        return s.AreCompletedReply(completed=await service.are_completed(body.checkpoint, body.source_ids))

    @app.get(
        "/v1/checkpoints", response_model=s.ListCheckpointsReply, responses=_ERRORS, tags=["checkpoints"]
    )
    async def list_checkpoints() -> s.ListCheckpointsReply:
        """Every checkpoint with its progress."""
        return s.ListCheckpointsReply(checkpoints=[_status(v) for v in await service.list_checkpoints()])

    @app.get(
        "/v1/checkpoints/{name:path}",
        response_model=s.CheckpointStatus,
        responses=_ERRORS,
        tags=["checkpoints"],
    )
    async def get_checkpoint(name: str) -> s.CheckpointStatus:
        """One checkpoint: completed count, live writers, pending sources, anomalies."""
        return _status(await service.get_checkpoint(name))

    return app
