"""Who may call which route: roles, token scopes, handles, /metrics — in process, one app per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.integration.workload import tree
from tests.unit.http_api.conftest import InProcess, Serve

pytestmark = pytest.mark.anyio

TOKENS = (
    "r:reader, w:worker, a:admin, ta:worker@team-a/, tb:worker@team-b/, ta-admin:admin@team-a/, "
    "tb-reader:reader@team-b/"
)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def error(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


@pytest.fixture
async def guarded(serve: Serve) -> AsyncIterator[InProcess]:
    async with serve(tokens=TOKENS) as s:
        yield s


async def open_writer(http: httpx.AsyncClient, token: str, checkpoint: str, writer_id: str = "w") -> str:
    reply = await http.post(
        "/v1/writers", json={"checkpoint": checkpoint, "writer_id": writer_id}, headers=bearer(token)
    )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["handle"])


async def complete(http: httpx.AsyncClient, token: str, handle: str, source: str) -> None:
    deltas = [{"task_id": t, "source_id": s, "delta": d} for t, s, d in tree(source)]
    reply = await http.post(f"/v1/writers/{handle}/deltas", json={"deltas": deltas}, headers=bearer(token))
    assert reply.status_code == 200 and reply.json()["counts"]["completed"] == 1, reply.text


async def test_no_token_or_an_unknown_one_is_401_naming_the_operation(guarded: InProcess) -> None:
    http = guarded.http
    reply = await http.get("/v1/checkpoints")
    assert reply.status_code == 401
    assert error(reply) == {
        "code": "UNAUTHENTICATED",
        "message": "ListCheckpoints needs a bearer token (header 'authorization: Bearer <token>'); pass "
        "token=... to tally.Client or set TALLY_TOKEN",
        "details": {},
    }
    reply = await http.get("/v1/events", params={"checkpoint": "x"}, headers=bearer("nope"))
    assert reply.status_code == 401
    assert error(reply)["message"] == "ListEvents: the bearer token is not known to this coordinator"
    reply = await http.post("/v1/writers/h/flush", headers={"authorization": "Basic dTpw"})
    assert reply.status_code == 401 and error(reply)["message"].startswith("Flush needs a bearer token")


async def test_a_role_too_low_is_403_saying_which_role_is_needed(guarded: InProcess) -> None:
    http = guarded.http
    reply = await http.post("/v1/writers", json={"checkpoint": "x"}, headers=bearer("r"))
    assert reply.status_code == 403
    assert error(reply) == {
        "code": "PERMISSION_DENIED",
        "message": "OpenWriter needs the worker role; this token has reader",
        "details": {},
    }
    for path, body in [("/v1/reset", {"name": "x"}), ("/v1/import", {"checkpoint": "x", "source_ids": []})]:
        reply = await http.post(path, json=body, headers=bearer("w"))
        assert reply.status_code == 403 and "needs the admin role; this token has worker" in reply.text
    assert (await http.get("/v1/checkpoints", headers=bearer("r"))).status_code == 200


async def test_nothing_of_a_body_is_read_for_a_caller_without_the_role(guarded: InProcess) -> None:
    """Authentication comes first: a body that is not even JSON gets 401/403, not 400."""
    http = guarded.http
    garbage = {"content": b"{not json", "headers": {"content-type": "application/json"}}
    for path in ("/v1/writers", "/v1/reset", "/v1/import", "/v1/are-completed", "/v1/writers/h/deltas"):
        reply = await http.post(path, **garbage)  # type: ignore[arg-type]
        assert reply.status_code == 401, (path, reply.text)
    for path in ("/v1/writers", "/v1/reset", "/v1/writers/h/deltas"):
        reply = await http.post(path, content=b"{not json", headers={**bearer("r"), **garbage["headers"]})
        assert reply.status_code == 403, (path, reply.text)
    # With the role, the body is read and its problem named.
    reply = await http.post(
        "/v1/writers", content=b"{not json", headers={**bearer("w"), **garbage["headers"]}
    )
    assert reply.status_code == 400 and "JSON" in error(reply)["message"]


async def test_a_caller_without_the_role_is_refused_as_such_whatever_its_body_size(serve: Serve) -> None:
    async with serve(tokens=TOKENS, max_message_bytes=100) as s:
        big = {"checkpoint": "x", "source_ids": ["s" * 50] * 10}
        assert (await s.http.post("/v1/are-completed", json=big)).status_code == 401
        assert (
            await s.http.post("/v1/reset", json={"name": "x" * 200}, headers=bearer("r"))
        ).status_code == 403
        reply = await s.http.post("/v1/are-completed", json=big, headers=bearer("r"))
        assert reply.status_code == 413 and "max_message_bytes" in error(reply)["message"]


async def test_scoped_tokens_reach_only_their_prefix_by_name(guarded: InProcess) -> None:
    http = guarded.http
    mine, theirs = "team-a/run", "team-b/run"
    await complete(http, "ta", await open_writer(http, "ta", mine), "x")
    await complete(http, "tb", await open_writer(http, "tb", theirs), "y")
    # In the path and the query.
    for path, params in [
        (f"/v1/checkpoints/{theirs}", {}),
        ("/v1/writers", {"checkpoint": theirs}),
        ("/v1/events", {"checkpoint": theirs}),
        ("/v1/progress", {"checkpoint": theirs}),
        ("/v1/completed", {"checkpoint": theirs}),
        ("/v1/watch", {"checkpoint": theirs}),
    ]:
        reply = await http.get(path, params=params, headers=bearer("ta"))
        assert reply.status_code == 403, (path, reply.text)
        assert error(reply)["details"] == {"prefixes": ["team-a/"]}
        assert "outside this token's scope" in error(reply)["message"]
    assert (await http.get(f"/v1/checkpoints/{mine}", headers=bearer("ta"))).status_code == 200
    # A repeated query parameter: the handler reads the last one, so that is the one checked.
    smuggled = [("checkpoint", mine), ("checkpoint", theirs)]
    assert (await http.get("/v1/events", params=smuggled, headers=bearer("ta"))).status_code == 403
    reply = await http.get("/v1/events", params=smuggled[::-1], headers=bearer("ta"))
    assert reply.status_code == 200 and {e["checkpoint"] for e in reply.json()["events"]} == {mine}
    # In the body.
    for path, body, token in [
        ("/v1/are-completed", {"checkpoint": theirs, "source_ids": ["y"]}, "ta"),
        ("/v1/writers", {"checkpoint": theirs}, "ta"),
        ("/v1/import", {"checkpoint": theirs, "source_ids": ["z"], "import_id": "i"}, "ta-admin"),
        ("/v1/reset", {"name": theirs, "force": True}, "ta-admin"),
    ]:
        reply = await http.post(path, json=body, headers=bearer(token))
        assert reply.status_code == 403, (path, reply.text)
        assert error(reply)["details"] == {"prefixes": ["team-a/"]}
    reply = await http.post(
        "/v1/are-completed", json={"checkpoint": theirs, "source_ids": ["y"]}, headers=bearer("r")
    )
    assert reply.json() == {"completed": [True]}  # nothing was reset or imported
    # A listing shows a scoped token its own checkpoints only.
    reply = await http.get("/v1/checkpoints", headers=bearer("tb-reader"))
    assert [c["name"] for c in reply.json()["checkpoints"]] == [theirs]


async def test_a_handle_is_checked_against_its_checkpoint(guarded: InProcess) -> None:
    http = guarded.http
    handle = await open_writer(http, "tb", "team-b/run")
    await complete(http, "tb", handle, "y")
    deltas = {"deltas": [{"task_id": "0_y", "source_id": "y", "delta": 5}]}  # would un-complete y
    for action in ("keepalive", "deltas", "flush", "close"):
        reply = await http.post(f"/v1/writers/{handle}/{action}", json=deltas, headers=bearer("ta"))
        assert reply.status_code == 403, (action, reply.text)
        assert "'team-a/'" in error(reply)["message"]
    reply = await http.post(
        "/v1/are-completed", json={"checkpoint": "team-b/run", "source_ids": ["y"]}, headers=bearer("r")
    )
    assert reply.json() == {"completed": [True]}
    # An unknown handle has no checkpoint to protect: the service says it is not found.
    assert (await http.post("/v1/writers/nope/flush", headers=bearer("ta"))).status_code == 404
    assert (await http.post(f"/v1/writers/{handle}/close", headers=bearer("tb"))).status_code == 200


async def test_metrics_need_an_unscoped_token_only_with_metrics_auth(serve: Serve) -> None:
    async with serve(tokens=TOKENS, metrics_auth=True) as s:
        assert (await s.http.get("/metrics")).status_code == 401
        assert (await s.http.get("/metrics", headers=bearer("nope"))).status_code == 401
        scoped = await s.http.get("/metrics", headers=bearer("tb-reader"))
        assert scoped.status_code == 403 and "unscoped token" in error(scoped)["message"]
        for token in ("r", "w", "a"):
            assert (await s.http.get("/metrics", headers=bearer(token))).status_code == 200
    async with serve(tokens=TOKENS) as s:
        assert (await s.http.get("/metrics")).status_code == 200


async def test_probes_the_schema_and_the_dashboard_stay_open(guarded: InProcess) -> None:
    http = guarded.http
    for path in ("/healthz", "/readyz", "/openapi.json", "/", "/ui/app.js"):
        assert (await http.get(path)).status_code == 200, path
    # Unknown /v1 paths and methods are answered as such, whoever asks.
    assert (await http.get("/v1/nothing-here")).status_code == 404
    assert (await http.delete("/v1/checkpoints")).status_code == 405


async def test_without_tokens_everything_is_allowed(served: InProcess) -> None:
    http = served.http
    handle = await open_writer(http, "", "any/run")
    await complete(http, "", handle, "x")
    reply = await http.post("/v1/reset", json={"name": "any/run", "force": True})
    assert reply.status_code == 200 and reply.json()["files_moved"] == 1
