"""``/v1/checkpoints`` and ``/v1/are-completed``: checkpoints' progress and the live completed set."""

# No "from __future__ import annotations": the Annotated dependencies name the local guard, which
# FastAPI could not resolve from a string.
from enum import Enum
from typing import Annotated

from fastapi import Depends, FastAPI, Path, Query, Request
from starlette.convertors import Convertor, register_url_convertor

from tally_server.auth import Principal
from tally_server.http_api import bodies
from tally_server.http_api import replies as r
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import ERROR_REPLIES
from tally_server.service import CheckpointView, CoordinatorService


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


TAGS: list[str | Enum] = ["checkpoints"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard) -> None:
    """Add the checkpoint routes to ``app``."""
    limits = service.limits

    @app.post(
        "/v1/are-completed",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.AreCompletedReply,
        openapi_extra=bodies.request_body(s.AreCompletedBody),
    )
    async def are_completed(
        request: Request,
        caller: Annotated[Principal, Depends(guard.requires("AreCompleted", checkpoint_in_body=True))],
    ) -> r.AreCompletedReply:
        """Parallel booleans from the live completed set of the checkpoint (no writer needed)."""
        body, ids = await bodies.parse(
            request, lambda raw: bodies.source_ids(s.AreCompletedBody, raw, limits)
        )
        caller.require("AreCompleted", body.checkpoint)
        return r.AreCompletedReply(completed=await service.are_completed(body.checkpoint, ids))

    @app.get("/v1/checkpoints", tags=TAGS, responses=ERROR_REPLIES, response_model=r.ListCheckpointsReply)
    async def list_checkpoints(
        caller: Annotated[Principal, Depends(guard.requires("ListCheckpoints"))],
        after: Annotated[
            str,
            Query(
                description="Start after this checkpoint name (byte order): the previous page's "
                "next_after; '' first."
            ),
        ] = "",
        limit: Annotated[int, Query(description=s.STATUS_PAGE_LIMIT.format(what="Checkpoints"))] = 0,
        writers: Annotated[
            bool,
            Query(
                description="false: each checkpoint's `writers` is empty (`live_writers` still counts them); "
                "a list that shows counts only should ask so: with them, a page costs the server time "
                "and bytes in proportion to every live writer of its checkpoints."
            ),
        ] = True,
    ) -> r.ListCheckpointsReply:
        """Checkpoints with their progress by name, paged (a scoped token: those it may read)."""
        page = await service.list_checkpoints(
            after=after, limit=limit, visible=caller.may_read, writers=writers
        )
        return r.ListCheckpointsReply(checkpoints=page.checkpoints, next_after=page.next_after)

    @app.get(
        "/v1/checkpoints/{name:tally_any_path}",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=CheckpointView,
        dependencies=[Depends(guard.requires("GetCheckpoint"))],
    )
    async def get_checkpoint(name: Annotated[str, Path(description=s.CHECKPOINT)]) -> CheckpointView:
        """One checkpoint: completed count, live writers, pending sources, anomalies."""
        return await service.get_checkpoint(name)
