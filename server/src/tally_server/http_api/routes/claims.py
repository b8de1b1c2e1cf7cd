"""Claims with fencing tokens: a writer acquires sources; anyone checks whether a token is current."""

# No "from __future__ import annotations": the Annotated dependencies name the local guard, which
# FastAPI could not resolve from a string.
from enum import Enum
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request

from tally_server.http_api import bodies
from tally_server.http_api import replies as r
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import ERROR_REPLIES
from tally_server.service import CoordinatorService, TokenCheck

TAGS: list[str | Enum] = ["claims"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard) -> None:
    """Add the claim routes (acquire, token check) to ``app``."""

    @app.post(
        "/v1/writers/{handle}/acquire",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.AcquireReply,
        dependencies=[Depends(guard.requires("Acquire"))],
        openapi_extra=bodies.request_body(s.AcquireBody),
    )
    async def acquire(handle: s.HandleParam, request: Request) -> r.AcquireReply:
        """Claim sources for the writer: each acquired (with a fencing token), held, completed or failed."""
        body = await bodies.parse(request, lambda raw: bodies.model(s.AcquireBody, raw))
        return r.AcquireReply(claims=await service.acquire(handle, body.source_ids))

    @app.get(
        "/v1/claims/current",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=TokenCheck,
        dependencies=[Depends(guard.requires("TokenIsCurrent"))],
    )
    async def token_is_current(
        checkpoint: s.CheckpointParam,
        source_id: s.SourceIdParam,
        token: Annotated[int, Query(description="The fencing token an acquire answered.")],
    ) -> TokenCheck:
        """Whether a fencing token is the live claim on a source: fence late writes with it."""
        return await service.token_is_current(checkpoint, source_id, token)
