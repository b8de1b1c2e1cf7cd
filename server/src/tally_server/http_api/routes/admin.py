"""Export and import of completed sources, and resetting a checkpoint."""

# No "from __future__ import annotations": the Annotated dependencies name the local guard, which
# FastAPI could not resolve from a string.
from enum import Enum
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request

from tally_server.auth import Principal
from tally_server.http_api import bodies
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import ERROR_REPLIES
from tally_server.service import CompletedPage, CoordinatorService, ImportResult, ResetResult

TAGS: list[str | Enum] = ["admin"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard) -> None:
    """Add the admin routes (import, reset) to ``app``."""
    limits = service.limits

    @app.get(
        "/v1/completed",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=CompletedPage,
        dependencies=[Depends(guard.requires("ListCompleted"))],
    )
    async def list_completed(
        checkpoint: s.CheckpointParam,
        after: s.AfterParam = "",
        limit: Annotated[
            int, Query(description=f"Ids per page: 1 to {s.MAX_IDS:,} (max_ids_per_query).")
        ] = 10_000,
    ) -> CompletedPage:
        """Completed source ids in byte order, paged with next_after (for export)."""
        return await service.list_completed(checkpoint, after=after, limit=limit)

    @app.post(
        "/v1/import",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=ImportResult,
        openapi_extra=bodies.request_body(s.ImportBody),
    )
    async def import_completed(
        request: Request,
        caller: Annotated[Principal, Depends(guard.requires("ImportCompleted", checkpoint_in_body=True))],
    ) -> ImportResult:
        """Adopt completed source ids (e.g. from a folder NeMo Curator wrote) into <import_id>.mdb."""
        body, ids = await bodies.parse(request, lambda raw: bodies.source_ids(s.ImportBody, raw, limits))
        caller.require("ImportCompleted", body.checkpoint)
        return await service.import_completed(body.checkpoint, ids, import_id=body.import_id)

    @app.post(
        "/v1/reset",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=ResetResult,
        openapi_extra=bodies.request_body(s.ResetBody),
    )
    async def reset(
        request: Request,
        caller: Annotated[Principal, Depends(guard.requires("ResetCheckpoint", checkpoint_in_body=True))],
    ) -> ResetResult:
        """Move a checkpoint's files to the trash folder and start it over.

        Refused while writers are live, unless ``force``.
        """
        body = await bodies.parse(request, lambda raw: bodies.model(s.ResetBody, raw))
        caller.require("ResetCheckpoint", body.name)
        return await service.reset_checkpoint(body.name, force=body.force)
