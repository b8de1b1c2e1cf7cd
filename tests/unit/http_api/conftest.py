"""The HTTP app in process: a real CoordinatorService on real stores in a temp dir, over ASGI.

No sockets and no server process: ``httpx.ASGITransport`` calls the FastAPI app directly on the
test's event loop, where the service lives too (as under ``tally serve``, minus the thread hop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tally_server.app import build_service
from tally_server.auth import Authorizer, load_tokens
from tally_server.http_api.app import create_app
from tally_server.metrics import Metrics
from tally_server.service import CoordinatorService
from tally_server.settings import Settings


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class InProcess:
    """One coordinator's HTTP face, in process."""

    service: CoordinatorService
    app: FastAPI
    http: httpx.AsyncClient
    data_dir: Path


Serve = Callable[..., AbstractAsyncContextManager[InProcess]]


@pytest.fixture
def serve(tmp_path: Path) -> Serve:
    """``async with serve(tokens="t:reader", ...) as served``: a started service and its app."""
    count = 0

    @asynccontextmanager
    async def serving(**overrides: Any) -> AsyncIterator[InProcess]:
        nonlocal count
        count += 1
        data_dir = tmp_path / f"data-{count}"
        settings = Settings(data_dir=data_dir, **{"settle_ms": 0, **overrides})
        service = build_service(settings)
        await service.start()
        try:
            authorizer = Authorizer(load_tokens(settings.tokens, settings.tokens_file))
            app = create_app(service, settings, Metrics(service), authorizer)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://tally.test") as http:
                yield InProcess(service, app, http, data_dir)
        finally:
            service.stop_accepting()
            await service.shutdown()

    return serving


@pytest.fixture
async def served(serve: Serve) -> AsyncIterator[InProcess]:
    """A coordinator without tokens (authentication off) and with settle_ms=0."""
    async with serve() as s:
        yield s
