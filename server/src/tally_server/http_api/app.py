"""create_app(service, settings): the FastAPI application. Handlers translate and call one service method."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tally_server import __version__, auth
from tally_server.auth import Authorizer, load_tokens
from tally_server.domain.validation import MAX_EVENT_ID, describe
from tally_server.errors import ErrorCode, TallyServerError
from tally_server.http_api import bodies
from tally_server.http_api import replies as r
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import AuthMiddleware
from tally_server.http_api.dashboard import build_router as build_dashboard_router
from tally_server.http_api.errors import HTTP_STATUS, error_response
from tally_server.http_api.middleware import RequestMiddleware
from tally_server.metrics import CONTENT_TYPE, Metrics
from tally_server.service import (
    CheckpointView,
    ClosedWriter,
    CompletedPage,
    CoordinatorService,
    EventPage,
    ImportResult,
    OpenedWriter,
    ResetResult,
)
from tally_server.settings import Settings

log = logging.getLogger(__name__)

_CODE_BY_STATUS = {status: code for code, status in HTTP_STATUS.items()}

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": s.ErrorReply} for status in (400, 404, 409, 412, 413, 429, 500, 503)
}
# A 400 lists this many problems of a body; the rest are counted.
_PROBLEMS_SHOWN = 5


class _AnyPath(Convertor[str]):
    """Starlette's ``path`` matches no newline, so ``a%0Ab`` found no route (404, not "invalid name").

    This one matches every character and leaves the verdict to the service's name validation.
    """

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("tally_any_path", _AnyPath())


_CHECKPOINT_JSON = TypeAdapter(CheckpointView)


class _BodyTooLarge(Exception):
    """Raised into the app by BodyLimit's receive once the body passed the limit (the 413 is sent)."""


class BodyLimit:
    """Refuses a request body over the limit without holding more of it than the limit.

    A declared Content-Length over the limit is refused before anything is read. A body without one
    (``Transfer-Encoding: chunked``) is counted as it arrives and refused as soon as it passes the
    limit; the server discards the rest as it comes in.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _refusal(self, size: str) -> JSONResponse:
        message = (
            f"request body is {size} bytes, over the limit of {self.limit} (setting max_message_bytes); "
            "send smaller batches"
        )
        return error_response(413, ErrorCode.RESOURCE_EXHAUSTED, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refusal(str(int(declared)))(scope, receive, send)
            return
        received = 0
        started = refused = False

        async def counted_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if not started and not refused:
                        refused = True
                        await self._refusal(f"more than {self.limit}")(scope, receive, send)
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # whatever the app makes of the aborted read: the 413 is the answer
            started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _BodyTooLarge:
            pass


def create_app(
    service: CoordinatorService,
    settings: Settings,
    metrics: Metrics | None = None,
    authorizer: Authorizer | None = None,
) -> FastAPI:
    app = FastAPI(
        title="Tally coordinator",
        version=__version__,
        description="Checkpoint coordination for resumable batch pipelines (the HTTP face of tally.v1).",
    )

    app.add_middleware(BodyLimit, limit=settings.max_message_bytes)
    if authorizer is None:
        authorizer = Authorizer(load_tokens(settings.tokens, settings.tokens_file))
    app.add_middleware(
        AuthMiddleware,
        authorizer=authorizer,
        checkpoint_of=service.checkpoint_of,
        metrics_auth=settings.metrics_auth,
    )
    # Added last, so outermost: requests refused by the body limit are timed and carry an id too.
    exported = metrics if metrics is not None else Metrics(service)
    app.add_middleware(RequestMiddleware, latency=exported.http_request_duration)

    limits = service.limits
    bodies.document(app, [s.ApplyDeltasBody, s.AreCompletedBody, s.ImportBody])

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

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, ErrorCode.INTERNAL, "internal error; see the server log")

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves requests."""
        return {"status": "ok"}

    @app.get("/metrics", tags=["health"], response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition (async on purpose: reads service state on the event loop)."""
        return Response(exported.exposition(), media_type=CONTENT_TYPE)

    @app.get("/readyz", tags=["health"], responses={503: {"model": s.ErrorReply}})
    async def readyz() -> Any:
        """Readiness: the coordinator accepts work, can persist completions and its background loops
        work (503 naming what is wrong otherwise)."""
        problems = service.problems()
        if problems:
            return error_response(503, ErrorCode.UNAVAILABLE, "not ready: " + "; ".join(problems))
        return {"status": "ready"}

    @app.post("/v1/writers", response_model=OpenedWriter, responses=_ERRORS, tags=["writers"])
    async def open_writer(body: s.OpenWriterBody) -> OpenedWriter:
        """Register a writer of a checkpoint (refuses a writer_id that is live)."""
        caller = auth.current()
        caller.require("OpenWriter", body.checkpoint)
        return await service.open_writer(
            body.checkpoint,
            writer_id=body.writer_id,
            fingerprint=body.fingerprint,
            labels=body.labels,
            host=body.host,
            pid=body.pid,
            on_mismatch=body.on_mismatch,
            allow_reset=caller.may_reset(body.checkpoint),
        )

    @app.post(
        "/v1/writers/{handle}/keepalive", response_model=r.KeepAliveReply, responses=_ERRORS, tags=["writers"]
    )
    async def keep_alive(handle: str) -> r.KeepAliveReply:
        """Renew the writer's lease; 404 means its pending state is gone."""
        return r.KeepAliveReply(lease_ttl_s=await service.keep_alive(handle))

    @app.post(
        "/v1/writers/{handle}/deltas",
        response_model=r.ApplyDeltasReply,
        responses=_ERRORS,
        tags=["writers"],
        openapi_extra=bodies.request_body(s.ApplyDeltasBody),
    )
    async def apply_deltas(handle: str, request: Request) -> r.ApplyDeltasReply:
        """Apply (task_id, source_id, delta) in order under the counting rules."""
        batch = await bodies.parse(request, lambda raw: bodies.deltas(raw, limits))
        return r.ApplyDeltasReply(counts=await service.apply_deltas(handle, batch))

    @app.post("/v1/writers/{handle}/flush", response_model=r.FlushReply, responses=_ERRORS, tags=["writers"])
    async def flush(handle: str) -> r.FlushReply:
        """Barrier: returns when every completion from deltas applied so far is durable."""
        return r.FlushReply(completed=await service.flush(handle))

    @app.post("/v1/writers/{handle}/close", response_model=ClosedWriter, responses=_ERRORS, tags=["writers"])
    async def close_writer(handle: str) -> ClosedWriter:
        """Flush, complete settling sources, drop pending state; lists what was left incomplete."""
        return await service.close_writer(handle)

    @app.post(
        "/v1/are-completed",
        response_model=r.AreCompletedReply,
        responses=_ERRORS,
        tags=["checkpoints"],
        openapi_extra=bodies.request_body(s.AreCompletedBody),
    )
    async def are_completed(request: Request) -> r.AreCompletedReply:
        """Parallel booleans from the live completed set of the checkpoint (no writer needed)."""
        body, ids = await bodies.parse(
            request, lambda raw: bodies.source_ids(s.AreCompletedBody, raw, limits)
        )
        auth.current().require("AreCompleted", body.checkpoint)
        return r.AreCompletedReply(completed=await service.are_completed(body.checkpoint, ids))

    @app.get("/v1/writers", response_model=r.ListWritersReply, responses=_ERRORS, tags=["status"])
    async def list_writers(
        checkpoint: str, include_closed: bool = False, limit: int = 100
    ) -> r.ListWritersReply:
        """Writers of a checkpoint: live ones, then (include_closed) past ones, newest first."""
        writers = await service.list_writers(checkpoint, include_closed=include_closed, limit=limit)
        return r.ListWritersReply(writers=writers)

    @app.get("/v1/events", response_model=EventPage, responses=_ERRORS, tags=["status"])
    async def list_events(
        checkpoint: str, limit: int = 50, before_id: int = Query(0, ge=0, le=MAX_EVENT_ID)
    ) -> EventPage:
        """Events of a checkpoint, newest first; page with next_before_id."""
        return await service.list_events(checkpoint, limit=limit, before_id=before_id)

    @app.get("/v1/progress", response_model=r.ProgressReply, responses=_ERRORS, tags=["status"])
    async def progress(checkpoint: str, since: float = Query(0.0, allow_inf_nan=False)) -> r.ProgressReply:
        """Completed count over time (persisted samples, then the live count now)."""
        return r.ProgressReply(samples=await service.progress(checkpoint, since=since))

    @app.get("/v1/watch", responses=_ERRORS, tags=["status"], response_class=StreamingResponse)
    async def watch(checkpoint: str, interval_ms: int = Query(1000, ge=0, lt=2**31)) -> StreamingResponse:
        """Server-Sent Events: a CheckpointStatus JSON whenever the checkpoint changes."""
        stream = service.watch(checkpoint, interval_s=interval_ms / 1000)
        first = await anext(stream)  # refusals (unknown checkpoint) become a normal error reply

        async def events() -> AsyncIterator[str]:
            yield f"data: {_CHECKPOINT_JSON.dump_json(first).decode()}\n\n"
            async for view in stream:
                yield f"data: {_CHECKPOINT_JSON.dump_json(view).decode()}\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.get("/v1/completed", response_model=CompletedPage, responses=_ERRORS, tags=["admin"])
    async def list_completed(checkpoint: str, after: str = "", limit: int = 10_000) -> CompletedPage:
        """Completed source ids in byte order, paged with next_after (for export)."""
        return await service.list_completed(checkpoint, after=after, limit=limit)

    @app.post(
        "/v1/import",
        response_model=ImportResult,
        responses=_ERRORS,
        tags=["admin"],
        openapi_extra=bodies.request_body(s.ImportBody),
    )
    async def import_completed(request: Request) -> ImportResult:
        """Adopt completed source ids (e.g. from a folder NeMo Curator wrote) into <import_id>.mdb."""
        body, ids = await bodies.parse(request, lambda raw: bodies.source_ids(s.ImportBody, raw, limits))
        auth.current().require("ImportCompleted", body.checkpoint)
        return await service.import_completed(body.checkpoint, ids, import_id=body.import_id)

    @app.post("/v1/reset", response_model=ResetResult, responses=_ERRORS, tags=["admin"])
    async def reset(body: s.ResetBody) -> ResetResult:
        """Move a checkpoint's files to the trash folder and start it over (refused while writers are
        live unless force)."""
        auth.current().require("ResetCheckpoint", body.name)
        return await service.reset_checkpoint(body.name, force=body.force)

    @app.get(
        "/v1/checkpoints", response_model=r.ListCheckpointsReply, responses=_ERRORS, tags=["checkpoints"]
    )
    async def list_checkpoints() -> r.ListCheckpointsReply:
        """Every checkpoint with its progress (for a scoped token: the checkpoints it may read)."""
        views = [v for v in await service.list_checkpoints() if auth.current().may_read(v.name)]
        return r.ListCheckpointsReply(checkpoints=views)

    @app.get(
        "/v1/checkpoints/{name:tally_any_path}",
        response_model=CheckpointView,
        responses=_ERRORS,
        tags=["checkpoints"],
    )
    async def get_checkpoint(name: str) -> CheckpointView:
        """One checkpoint: completed count, live writers, pending sources, anomalies."""
        return await service.get_checkpoint(name)

    app.include_router(build_dashboard_router())  # GET / and /ui/*: the dashboard

    return app
