"""Refusals over HTTP: the status, and the ``{"error": {...}}`` body, for each kind of failure."""

from __future__ import annotations

import pytest

from tally_server.store.disk import TRASH_DIRNAME
from tests.integration.workload import tree
from tests.unit.http_api.conftest import InProcess, Serve

pytestmark = pytest.mark.anyio


async def test_refusals_of_the_service_keep_their_code(served: InProcess) -> None:
    http = served.http
    reply = await http.post("/v1/writers/nope/keepalive")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "NOT_FOUND"
    assert (await http.post("/v1/writers", json={"checkpoint": "x", "writer_id": "w"})).status_code == 200
    reply = await http.post("/v1/writers", json={"checkpoint": "x", "writer_id": "w"})
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "ALREADY_EXISTS"
    reply = await http.post("/v1/reset", json={"name": "x"})
    assert reply.status_code == 409 and reply.json()["error"]["details"] == {"live_writers": 1}
    assert reply.json()["error"]["code"] == "FAILED_PRECONDITION"  # 409 as ALREADY_EXISTS: the code tells
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


async def test_an_unknown_method_is_405_naming_every_method_the_path_serves(served: InProcess) -> None:
    http = served.http
    reply = await http.delete("/v1/checkpoints")
    assert reply.status_code == 405 and reply.headers["allow"] == "GET"
    error = reply.json()["error"]
    assert error["code"] == "METHOD_NOT_ALLOWED" and "allows GET" in error["message"]
    # Two routes share /v1/writers (GET lists, POST opens): both are allowed, not only the first.
    reply = await http.delete("/v1/writers")
    assert reply.status_code == 405 and reply.headers["allow"] == "GET, POST"
    reply = await http.get("/v1/writers/some-handle/flush")
    assert reply.status_code == 405 and reply.headers["allow"] == "POST"
    # An unknown path stays 404.
    assert (await http.delete("/v1/nothing-here")).json()["error"]["code"] == "NOT_FOUND"


async def test_a_missing_or_unknown_token_is_401_with_a_bearer_challenge(serve: Serve) -> None:
    async with serve(tokens="good:reader") as s:
        reply = await s.http.get("/v1/checkpoints")
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == 'Bearer realm="tally"'
        assert reply.json()["error"]["code"] == "UNAUTHENTICATED"
        reply = await s.http.get("/v1/checkpoints", headers={"authorization": "Bearer bad"})
        assert reply.status_code == 401
        assert reply.headers["www-authenticate"] == 'Bearer realm="tally", error="invalid_token"'
        reply = await s.http.get("/v1/checkpoints", headers={"authorization": "Bearer good"})
        assert reply.status_code == 200 and "www-authenticate" not in reply.headers


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("checkpoint=x&limit=abc", "query parameter 'limit' (sent 'abc')"),
        ("limit=5", "query parameter 'checkpoint': Field required"),
        ("checkpoint=x&include_closed=maybe", "query parameter 'include_closed' (sent 'maybe')"),
    ],
)
async def test_a_bad_query_parameter_is_400_naming_it(served: InProcess, query: str, named: str) -> None:
    reply = await served.http.get(f"/v1/writers?{query}")
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and named in error["message"], error["message"]
