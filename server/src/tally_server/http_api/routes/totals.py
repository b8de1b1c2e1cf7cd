"""Declared totals: declare a checkpoint's sources, and page through those not completed yet."""

# No "from __future__ import annotations": the Annotated dependencies name the local guard, which
# FastAPI could not resolve from a string.
from enum import Enum
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request

from tally_server.auth import Principal
from tally_server.http_api import bodies
from tally_server.http_api import replies as r
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import ERROR_REPLIES
from tally_server.service import CompletedPage, CoordinatorService

TAGS: list[str | Enum] = ["totals"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard) -> None:
    """Add the declared-totals routes (declare, remaining) to ``app``."""
    limits = service.limits

    @app.post(
        "/v1/declare",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.DeclareReply,
        openapi_extra=bodies.request_body(s.DeclareBody),
    )
    async def declare(
        request: Request,
        caller: Annotated[Principal, Depends(guard.requires("DeclareSources", checkpoint_in_body=True))],
    ) -> r.DeclareReply:
        """Declare a checkpoint's sources (idempotent, additive), or only how many there are."""
        body, ids = await bodies.parse(request, lambda raw: bodies.source_ids(s.DeclareBody, raw, limits))
        caller.require("DeclareSources", body.checkpoint)
        total, remaining = await service.declare_sources(body.checkpoint, ids, body.count)
        return r.DeclareReply(total=total, remaining=remaining)

    @app.get(
        "/v1/remaining",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=CompletedPage,
        dependencies=[Depends(guard.requires("ListRemaining"))],
    )
    async def list_remaining(
        checkpoint: s.CheckpointParam,
        after: s.AfterParam = "",
        limit: Annotated[
            int, Query(description=f"Ids per page: 1 to {s.MAX_IDS:,} (max_ids_per_query); 0: 1,000.")
        ] = 0,
    ) -> CompletedPage:
        """Declared sources not completed yet, in byte order; page with next_after."""
        return await service.list_remaining(checkpoint, after=after, limit=limit)
