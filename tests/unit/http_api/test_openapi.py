"""The HTTP contract, pinned: ``/openapi.json`` must equal the committed snapshot.

A change to a route, a body or a reply shows up here as a readable list of differences. When the
change is meant, rewrite the snapshot and say in the commit message what changed and why::

    TALLY_UPDATE_OPENAPI=1 .venv/bin/pytest tests/unit/http_api/test_openapi.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from openapi_spec_validator import validate

from tally_server.auth import REQUIRED
from tally_server.http_api.auth import api_routes, declared_operation
from tests.unit.http_api.conftest import InProcess, Serve

SNAPSHOT = Path(__file__).resolve().parents[2] / "fixtures" / "openapi.json"
UPDATE = "TALLY_UPDATE_OPENAPI"


def comparable(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without what changes on every release (the package version)."""
    spec = json.loads(json.dumps(spec))
    spec.get("info", {}).pop("version", None)
    return spec


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """One line per difference, named by its JSON path (``paths./v1/writers.post.responses``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(old.keys() | new.keys()):
            path = f"{where}.{key}" if where else str(key)
            if key not in new:
                found.append(f"- removed {path}: {json.dumps(old[key])[:200]}")
            elif key not in old:
                found.append(f"+ added   {path}: {json.dumps(new[key])[:200]}")
            else:
                found.extend(differences(old[key], new[key], path))
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = enumerate(zip(old, new, strict=True))
        return [line for i, (a, b) in pairs for line in differences(a, b, f"{where}[{i}]")]
    if old != new:
        return [f"~ changed {where}: {json.dumps(old)[:200]} -> {json.dumps(new)[:200]}"]
    return []


@pytest.mark.anyio
async def test_openapi_matches_the_committed_snapshot(served: InProcess) -> None:
    reply = await served.http.get("/openapi.json")
    assert reply.status_code == 200
    spec = comparable(reply.json())
    if os.environ.get(UPDATE):
        SNAPSHOT.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    expected = json.loads(SNAPSHOT.read_text())
    found = differences(expected, spec)
    assert not found, (
        f"/openapi.json differs from {SNAPSHOT}:\n"
        + "\n".join(found)
        + f"\n\nIf this change to the HTTP contract is meant, refresh the snapshot with\n    {UPDATE}=1 "
        "pytest tests/unit/http_api/test_openapi.py\nand say in the commit message what changed and why."
    )


def test_the_differences_are_named_by_their_path() -> None:
    old = {"paths": {"/a": {"get": {"x": 1}}, "/b": {}}, "list": [1, 2]}
    new = {"paths": {"/a": {"get": {"x": 2}}, "/c": {}}, "list": [1, 3]}
    assert differences(old, new) == [
        "~ changed list[1]: 2 -> 3",
        "~ changed paths./a.get.x: 1 -> 2",
        "- removed paths./b: {}",
        "+ added   paths./c: {}",
    ]


@pytest.mark.anyio
async def test_the_spec_is_valid_openapi_and_says_what_the_server_does(served: InProcess) -> None:
    spec = (await served.http.get("/openapi.json")).json()
    validate(spec)  # raises, naming the place, if the document is not valid OpenAPI 3.1
    operations = {
        (path, method): operation
        for path, item in spec["paths"].items()
        for method, operation in item.items()
    }
    # Each /v1 operation is named after the tally.v1 RPC its route declares, and needs a bearer token.
    declared = {
        (route.path_format, method.lower()): declared_operation(route)
        for route in api_routes(served.app.routes)
        for method in route.methods or ()
        if route.path.startswith("/v1/")
    }
    assert declared and {key: operations[key]["operationId"] for key in declared} == {
        key: requires.operation for key, requires in declared.items() if requires is not None
    }
    assert {operations[key]["operationId"] for key in declared} <= set(REQUIRED)
    ids = [operation["operationId"] for operation in operations.values()]
    assert len(ids) == len(set(ids)), ids
    bearer = spec["components"]["securitySchemes"]["bearer"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    for key in declared:
        assert operations[key]["security"] == [{"bearer": []}], key
        # The server answers a bad request with 400 INVALID_ARGUMENT, never FastAPI's 422.
        assert "422" not in operations[key]["responses"], key
        assert operations[key]["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorReply"
        }
    assert not {"HTTPValidationError", "ValidationError"} & set(spec["components"]["schemas"])
    assert "security" not in operations[("/metrics", "get")]  # open unless metrics_auth
    assert set(operations[("/v1/watch", "get")]["responses"]["200"]["content"]) == {"text/event-stream"}
    # Units and limits where they matter.
    params = {p["name"]: p for p in operations[("/v1/watch", "get")]["parameters"]}
    assert "Milliseconds" in params["interval_ms"]["description"]
    assert "255 bytes" in params["checkpoint"]["description"]
    schemas = spec["components"]["schemas"]
    assert "Seconds" in schemas["OpenedWriter"]["properties"]["lease_ttl_s"]["description"]
    assert "511 bytes" in schemas["DeltaBody"]["properties"]["source_id"]["description"]
    assert "100,000" in schemas["ApplyDeltasBody"]["properties"]["deltas"]["description"]


@pytest.mark.anyio
async def test_metrics_documents_its_token_when_metrics_auth_is_on(serve: Serve) -> None:
    async with serve(tokens="a:admin", metrics_auth=True) as s:
        spec = (await s.http.get("/openapi.json")).json()
    validate(spec)
    assert spec["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
