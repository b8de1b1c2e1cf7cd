"""Failure budgets: failed attempts at sources, listing them, retrying them, a checkpoint's budget."""

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
from tally_server.service import CoordinatorService, FailurePage, ReportedFailure

TAGS: list[str | Enum] = ["failures"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard) -> None:
    """Add the failure-budget routes (report, list, retry, budget) to ``app``."""

    @app.post(
        "/v1/writers/{handle}/failures",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=ReportedFailure,
        dependencies=[Depends(guard.requires("ReportFailure"))],
        openapi_extra=bodies.request_body(s.ReportFailureBody),
    )
    async def report_failure(handle: s.HandleParam, request: Request) -> ReportedFailure:
        """Count a failed attempt at a source (durable on return); failed at the checkpoint's budget."""
        body = await bodies.parse(request, lambda raw: bodies.model(s.ReportFailureBody, raw))
        return await service.report_failure(handle, body.source_id, body.reason, body.attempt_id)

    @app.get(
        "/v1/failures",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=FailurePage,
        dependencies=[Depends(guard.requires("ListFailures"))],
    )
    async def list_failures(
        checkpoint: s.CheckpointParam,
        source_id: Annotated[
            list[str] | None, Query(description="Only these sources (repeat the parameter).")
        ] = None,
        failed_only: Annotated[bool, Query(description="Only sources at the failure budget.")] = False,
        after: s.AfterParam = "",
        limit: Annotated[
            int, Query(description=f"Sources per page: 1 to {s.MAX_IDS:,} (max_ids_per_query); 0: 1,000.")
        ] = 0,
    ) -> FailurePage:
        """Sources with failed attempts by source id, with their latest reasons; paged with next_after."""
        return await service.list_failures(
            checkpoint, source_ids=source_id or (), failed_only=failed_only, after=after, limit=limit
        )

    @app.post(
        "/v1/failures/retry",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.RetryFailedReply,
        openapi_extra=bodies.request_body(s.RetryFailedBody),
    )
    async def retry_failed(
        request: Request,
        caller: Annotated[Principal, Depends(guard.requires("RetryFailed", checkpoint_in_body=True))],
    ) -> r.RetryFailedReply:
        """Clear sources' failed attempts (every source's with no ids): they run again."""
        body = await bodies.parse(request, lambda raw: bodies.model(s.RetryFailedBody, raw))
        caller.require("RetryFailed", body.checkpoint)
        return r.RetryFailedReply(cleared=await service.retry_failed(body.checkpoint, body.source_ids))

    @app.post(
        "/v1/failures/budget",
        tags=TAGS,
        responses=ERROR_REPLIES,
        response_model=r.FailureBudgetReply,
        openapi_extra=bodies.request_body(s.FailureBudgetBody),
    )
    async def set_failure_budget(
        request: Request,
        caller: Annotated[Principal, Depends(guard.requires("SetFailureBudget", checkpoint_in_body=True))],
    ) -> r.FailureBudgetReply:
        """Set a checkpoint's failure budget: attempts after which a source is failed (0: unlimited)."""
        body = await bodies.parse(request, lambda raw: bodies.model(s.FailureBudgetBody, raw))
        caller.require("SetFailureBudget", body.checkpoint)
        budget, failed = await service.set_failure_budget(body.checkpoint, body.max_attempts)
        return r.FailureBudgetReply(max_attempts=budget, failed_sources=failed)
