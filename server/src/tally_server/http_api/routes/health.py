"""Probes and the Prometheus scrape: open to all (``/metrics`` guarded with ``metrics_auth``)."""

from __future__ import annotations

from enum import Enum
from typing import Any

from fastapi import Depends, FastAPI
from starlette.responses import Response

from tally_server.errors import ErrorCode
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard
from tally_server.http_api.errors import error_response
from tally_server.metrics import CONTENT_TYPE, Metrics
from tally_server.service import CoordinatorService

TAGS: list[str | Enum] = ["health"]


def add_routes(app: FastAPI, service: CoordinatorService, guard: Guard, metrics: Metrics) -> None:
    """Add the health, readiness and metrics routes to ``app``."""

    @app.get("/healthz", tags=TAGS, operation_id="CheckLiveness")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves requests."""
        return {"status": "ok"}

    @app.get(
        "/metrics",
        tags=TAGS,
        operation_id="GetMetrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text format 0.0.4.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
        dependencies=[Depends(guard.metrics)],
    )
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition (async on purpose: reads service state on the event loop)."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/readyz", tags=TAGS, operation_id="CheckReadiness", responses={503: {"model": s.ErrorReply}})
    async def readyz() -> Any:
        """Readiness: whether the coordinator can do its work.

        It accepts work, can persist completions and its background loops work; otherwise 503,
        naming what is wrong.
        """
        problems = service.problems()
        if problems:
            return error_response(503, ErrorCode.UNAVAILABLE, "not ready: " + "; ".join(problems))
        return {"status": "ready"}
