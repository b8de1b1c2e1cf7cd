"""create_app(service, settings, metrics, authorizer): the FastAPI application.

Handlers translate and call one service method; they live in ``routes/``, one module per resource,
and each ``/v1`` route declares the operation it serves (``auth.py``): its role and scope check.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tally_server import __version__
from tally_server.auth import Authorizer
from tally_server.http_api import openapi, reference
from tally_server.http_api import schemas as s
from tally_server.http_api.auth import Guard, check_declared
from tally_server.http_api.body_limit import BodyLimit
from tally_server.http_api.dashboard import build_router as build_dashboard_router
from tally_server.http_api.errors import install_handlers
from tally_server.http_api.request_context import RequestMiddleware
from tally_server.http_api.routes import admin, checkpoints, claims, failures, health, status, totals, writers
from tally_server.metrics import Metrics
from tally_server.service import CoordinatorService
from tally_server.settings import Settings


def create_app(
    service: CoordinatorService,
    settings: Settings,
    metrics: Metrics,
    authorizer: Authorizer,
    router: tuple[Any, dict[str, Any]] | None = None,
) -> FastAPI:
    """The HTTP API, ``/metrics``, the probes and the dashboard of one coordinator.

    ``metrics`` and ``authorizer`` are the coordinator's own (built once in the composition root and
    shared with the gRPC server). ``router``: a middleware class and its options, run inside the
    body limit (on a store of several shards, ``sharding.HttpShardRouter``).
    """
    app = FastAPI(
        title="Tally coordinator",
        version=__version__,
        description="Checkpoint coordination for resumable batch pipelines (the HTTP face of tally.v1).",
        # FastAPI's pages load Swagger UI and ReDoc from a CDN; reference.py serves them itself.
        docs_url=None,
        redoc_url=None,
    )
    if router is not None:
        app.add_middleware(router[0], **router[1])
    app.add_middleware(BodyLimit, limit=settings.max_message_bytes)
    # Added last, so outermost: requests refused by the body limit are timed and carry an id too.
    app.add_middleware(RequestMiddleware, latency=metrics.http_request_duration)
    install_handlers(app)

    guard = Guard(authorizer, service.checkpoint_of, metrics_auth=settings.metrics_auth)
    health.add_routes(app, service, guard, metrics)
    # On the app itself, not through include_router: a walk of app.routes then sees every route
    # (recent FastAPI keeps an included router as one entry).
    for resource in (writers, checkpoints, status, admin, failures, totals, claims):
        resource.add_routes(app, service, guard)
    app.include_router(build_dashboard_router())  # GET / and /ui/*: the dashboard
    app.include_router(reference.build_router())  # GET /docs, /redoc and /docs/assets/*
    check_declared(app)
    # Routes that read their bodies themselves publish the body models here.
    openapi.customize(
        app,
        [
            s.OpenWriterBody,
            s.ApplyDeltasBody,
            s.AreCompletedBody,
            s.ImportBody,
            s.ResetBody,
            s.SaveCursorsBody,
            s.ReportFailureBody,
            s.RetryFailedBody,
            s.FailureBudgetBody,
            s.DeclareBody,
            s.AcquireBody,
        ],
        metrics_auth=settings.metrics_auth,
    )
    return app
