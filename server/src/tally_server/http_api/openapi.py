"""What ``/openapi.json`` says beyond what FastAPI infers from the routes.

- Each ``/v1`` operation is named after the tally.v1 RPC it serves (``ApplyDeltas``), taken from the
  operation its route declares (``auth.py``), so the HTTP and gRPC references line up.
- Guarded operations carry the ``bearer`` security scheme (HTTP bearer); ``/metrics`` needs it only
  with ``metrics_auth``.
- FastAPI documents a 422 for every route with parameters; this server never answers 422 (its
  request-validation handler answers 400 INVALID_ARGUMENT, ``errors.py``), so the 422s and their
  schemas are dropped and the 400 each route documents stands.
- Routes that read their bodies themselves publish their body models under ``components/schemas``
  (:func:`tally_server.http_api.bodies.request_body` points at them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from tally_server.http_api.auth import api_routes, declared_operation

__all__ = ["BEARER", "customize"]

#: The name of the security scheme in ``components/securitySchemes``.
BEARER = "bearer"
_BEARER_SCHEME = {
    "type": "http",
    "scheme": "bearer",
    "description": "A token of the coordinator's (TALLY_TOKENS or TALLY_TOKENS_FILE) with a role "
    "(reader, worker, admin) and optionally checkpoint-prefix scopes. A coordinator started without "
    "tokens checks none.",
}
# FastAPI's request-validation reply, which this server never sends.
_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def customize(app: FastAPI, body_models: Sequence[type[BaseModel]], *, metrics_auth: bool) -> None:
    """Name and secure ``app``'s operations and make its ``/openapi.json`` say what the server does.

    Call it once every route is added.
    """
    for route in api_routes(app.routes):
        declared = declared_operation(route)
        if declared is not None:
            route.operation_id = declared.operation
            route.openapi_extra = {**(route.openapi_extra or {}), "security": [{BEARER: []}]}
        elif route.path == "/metrics" and metrics_auth:
            route.openapi_extra = {**(route.openapi_extra or {}), "security": [{BEARER: []}]}
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = build()  # caches itself in app.openapi_schema, so the changes below are kept
        components = spec.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for model in body_models:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        components.setdefault("securitySchemes", {})[BEARER] = _BEARER_SCHEME
        for operations in spec.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in _VALIDATION_SCHEMAS:  # HTTPValidationError refers to ValidationError: in this order
            if f'"#/components/schemas/{name}"' not in json.dumps(spec):
                schemas.pop(name, None)
        return spec

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the spec
