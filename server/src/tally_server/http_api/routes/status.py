"""A checkpoint's writers, events and progress, and its live status as Server-Sent Events."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from enum import Enum
from typing import Annotated

from fastapi import Depends, FastAPI, Query
from fastapi.responses import StreamingResponse
from pydantic import TypeAdapter

from tally_server.domain.validation import MAX_EVENT_ID
from tally_server.http_api import replies as r
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import ERROR_REPLIES
from tally_server.service import CheckpointView, CoordinatorService, EventPage, ReplicasView

_CHECKPOINT_JSON = TypeAdapter(CheckpointView)


TAGS: list[str | Enum] = ["status"]
_EVENT_STREAM = {
    "description": "Server-Sent Events, until the client goes away: each event's data is a CheckpointView "
    "as JSON, the first at once, then one whenever the checkpoint changes (checked every interval_ms) "
    "and about every 15 s regardless.",
    "content": {
        "text/event-stream": {
            "schema": {"type": "string"},
            "example": 'data: {"name": "curation/run-42", "completed_count": 1200, ...}\n\n',
        }
    },
}


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
        checkpoint: s.CheckpointParam,
        include_closed: Annotated[
            bool, Query(description="Past writers too (closed, expired, lost), after the live ones.")
        ] = False,
        after: Annotated[
            str,
            Query(
                description="Start after this position: the previous page's next_after, unchanged; '' first."
            ),
        ] = "",
        limit: Annotated[int, Query(description=s.STATUS_PAGE_LIMIT.format(what="Writers"))] = 0,
    ) -> r.ListWritersReply:
        """Writers of a checkpoint: live ones by writer_id, then (include_closed) past ones, newest first."""
        page = await service.list_writers(checkpoint, include_closed=include_closed, after=after, limit=limit)
        return r.ListWritersReply(writers=page.writers, next_after=page.next_after)

    @app.get(
        "/v1/cursors",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.GetCursorReply,
        dependencies=[Depends(guard.requires("GetCursor"))],
    )
    async def get_cursor(checkpoint: s.CheckpointParam, source_id: s.SourceIdParam) -> r.GetCursorReply:
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
        checkpoint: s.CheckpointParam,
        limit: Annotated[int, Query(description="Events per page: 1 to 1,000.")] = 50,
        before_id: Annotated[
            int,
            Query(
                ge=0,
                le=MAX_EVENT_ID,
                description="Events older than this id: the previous page's next_before_id; 0: the newest.",
            ),
        ] = 0,
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
    async def progress(
        checkpoint: s.CheckpointParam,
        since: Annotated[
            float,
            Query(allow_inf_nan=False, description="Samples from this time on (Unix time, in seconds)."),
        ] = 0.0,
    ) -> r.ProgressReply:
        """Completed count over time (persisted samples, then the live count now)."""
        return r.ProgressReply(samples=await service.progress(checkpoint, since=since))

    @app.get(
        "/v1/watch",
        tags=TAGS,
        responses={**ERROR_REPLIES, 200: _EVENT_STREAM},
        response_class=StreamingResponse,
        dependencies=[Depends(guard.requires("WatchCheckpoint"))],
    )
    async def watch(
        checkpoint: s.CheckpointParam,
        interval_ms: Annotated[
            int,
            Query(
                ge=0,
                lt=2**31,
                description="Milliseconds between checks for a change, clamped to 50 to 60,000; "
                "an unchanged status is sent again every ~15 s so idle streams stay open.",
            ),
        ] = 1000,
    ) -> StreamingResponse:
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
