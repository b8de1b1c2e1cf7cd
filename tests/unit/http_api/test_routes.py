"""Every ``/v1`` route declares the operation it serves, and with it its role and where its checkpoint is."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, Depends, FastAPI
from fastapi.routing import APIRoute

from tally.v1 import coordinator_pb2 as pb
from tally_server.auth import CHECKPOINT_FIELD, HANDLE_OPERATIONS, REQUIRED, UNSCOPED_OPERATIONS, Authorizer
from tally_server.http_api.auth import Guard, api_routes, check_declared, declared_operation
from tests.unit.http_api.conftest import InProcess


def v1_routes(app: FastAPI) -> list[APIRoute]:
    routes = [r for r in app.routes if isinstance(r, APIRoute) and r.path.startswith("/v1/")]
    assert [r.path for r in routes] == [r.path for r in api_routes(app.routes) if r.path.startswith("/v1/")]
    return routes


@pytest.mark.anyio
async def test_every_v1_route_declares_its_operation(served: InProcess) -> None:
    spec = served.app.openapi()
    seen = set()
    for route in v1_routes(served.app):
        requires = declared_operation(route)
        assert requires is not None, f"{route.path} declares no operation"
        operation = requires.operation
        assert operation in REQUIRED, f"{route.path}: {operation} is no tally.v1 RPC (it would be admin-only)"
        seen.add(operation)
        params = {p.name for p in route.dependant.path_params + route.dependant.query_params}
        if requires.checkpoint_in_body:
            # The handler checks the body's checkpoint: there must be a body, naming it.
            (method,) = route.methods
            body = spec["paths"][route.path][method.lower()]["requestBody"]
            name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
            fields = spec["components"]["schemas"][name]["properties"]
            assert CHECKPOINT_FIELD[operation] in fields, route.path
        elif operation in HANDLE_OPERATIONS:
            assert "handle" in params, route.path
        elif operation != "ListCheckpoints" and operation not in UNSCOPED_OPERATIONS:
            assert CHECKPOINT_FIELD[operation] in params, route.path
    # Every RPC but the stream's twin on HTTP has a route (and WatchCheckpoint has /v1/watch).
    assert seen == {m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods}


def test_an_app_with_an_undeclared_v1_route_is_refused() -> None:
    guard = Guard(Authorizer({}), lambda handle: None, metrics_auth=False)
    for included in (False, True):
        app = FastAPI()
        router: FastAPI | APIRouter = APIRouter() if included else app

        @router.get("/v1/declared", dependencies=[Depends(guard.requires("ListCheckpoints"))])
        async def declared() -> None: ...

        @router.get("/healthz")
        async def open_to_all() -> None: ...

        @router.get("/v1/forgotten")
        async def forgotten() -> None: ...

        if isinstance(router, APIRouter):
            app.include_router(router)
        with pytest.raises(RuntimeError, match=r"/v1/forgotten declares no operation"):
            check_declared(app)
