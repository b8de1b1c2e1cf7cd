"""Refusals over HTTP: the status, and the ``{"error": {...}}`` body, for each kind of failure."""

from __future__ import annotations

import pytest

from tally_server.store.disk import TRASH_DIRNAME
from tests.integration.workload import tree
from tests.unit.http_api.conftest import InProcess

pytestmark = pytest.mark.anyio


async def test_refusals_of_the_service_keep_their_code(served: InProcess) -> None:
    http = served.http
    reply = await http.post("/v1/writers/nope/keepalive")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "NOT_FOUND"
    assert (await http.post("/v1/writers", json={"checkpoint": "x", "writer_id": "w"})).status_code == 200
    reply = await http.post("/v1/writers", json={"checkpoint": "x", "writer_id": "w"})
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "ALREADY_EXISTS"
    reply = await http.post("/v1/reset", json={"name": "x"})
    assert reply.status_code == 412 and reply.json()["error"]["details"] == {"live_writers": 1}
    reply = await http.get("/v1/checkpoints/..%2Fescape")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "INVALID_ARGUMENT"


async def test_a_storage_error_is_503_unavailable_and_changes_nothing(served: InProcess) -> None:
    http = served.http
    handle = (await http.post("/v1/writers", json={"checkpoint": "x", "writer_id": "w"})).json()["handle"]
    deltas = [{"task_id": t, "source_id": s, "delta": d} for t, s, d in tree("a")]
    await http.post(f"/v1/writers/{handle}/deltas", json={"deltas": deltas})
    await http.post(f"/v1/writers/{handle}/close")
    (served.data_dir / TRASH_DIRNAME).write_text("a file where reset moves folders")
    reply = await http.post("/v1/reset", json={"name": "x"})
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "UNAVAILABLE" and "storage refused" in error["message"]
    assert "Not a directory" in error["details"]["cause"]
    reply = await http.post("/v1/are-completed", json={"checkpoint": "x", "source_ids": ["a"]})
    assert reply.json() == {"completed": [True]}
