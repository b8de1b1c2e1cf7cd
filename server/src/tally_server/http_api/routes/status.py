"""A checkpoint's writers, events and progress, and its live status as Server-Sent Events."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from enum import Enum

from fastapi import Depends, FastAPI, Query
from fastapi.responses import StreamingResponse
from pydantic import TypeAdapter

from tally_server.domain.validation import MAX_EVENT_ID
from tally_server.http_api import replies as r
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import ERROR_REPLIES
from tally_server.service import CheckpointView, CoordinatorService, EventPage, ReplicasView

_CHECKPOINT_JSON = TypeAdapter(CheckpointView)


TAGS: list[str | Enum] = ["status"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard) -> None:
    """Add the status routes (writers, events, progress, watch) to ``app``."""

    @app.get(
        "/v1/writers",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.ListWritersReply,
        dependencies=[Depends(guard.requires("ListWriters"))],
    )
    async def list_writers(
        checkpoint: str, include_closed: bool = False, limit: int = 100
    ) -> r.ListWritersReply:
        """Writers of a checkpoint: live ones, then (include_closed) past ones, newest first."""
        writers = await service.list_writers(checkpoint, include_closed=include_closed, limit=limit)
        return r.ListWritersReply(writers=writers)

    @app.get(
        "/v1/cursors",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.GetCursorReply,
        dependencies=[Depends(guard.requires("GetCursor"))],
    )
    async def get_cursor(checkpoint: str, source_id: str) -> r.GetCursorReply:
        """The cursor last saved for a source by any writer; none once the source is completed."""
        found = await service.get_cursor(checkpoint, source_id)
        data = base64.b64encode(found.data).decode("ascii")
        return r.GetCursorReply(
            found=found.found, data=data, saved_at=found.saved_at, writer_id=found.writer_id
        )

    @app.get(
        "/v1/replicas",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=ReplicasView,
        dependencies=[Depends(guard.requires("ListReplicas"))],
    )
    async def list_replicas() -> ReplicasView:
        """The coordinators serving a PostgreSQL store: which owns it, which are replicas (none on LMDB)."""
        return await service.list_replicas()

    @app.get(
        "/v1/events",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=EventPage,
        dependencies=[Depends(guard.requires("ListEvents"))],
    )
    async def list_events(
        checkpoint: str, limit: int = 50, before_id: int = Query(0, ge=0, le=MAX_EVENT_ID)
    ) -> EventPage:
        """Events of a checkpoint, newest first; page with next_before_id."""
        return await service.list_events(checkpoint, limit=limit, before_id=before_id)

    @app.get(
        "/v1/progress",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.ProgressReply,
        dependencies=[Depends(guard.requires("GetProgress"))],
    )
    async def progress(checkpoint: str, since: float = Query(0.0, allow_inf_nan=False)) -> r.ProgressReply:
        """Completed count over time (persisted samples, then the live count now)."""
        return r.ProgressReply(samples=await service.progress(checkpoint, since=since))

    @app.get(
        "/v1/watch",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_class=StreamingResponse,
        dependencies=[Depends(guard.requires("WatchCheckpoint"))],
    )
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
