"""Every /v1 resource in process: what each route answers, field for field (the wire JSON)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.workload import tree
from tests.unit.http_api.conftest import InProcess

pytestmark = pytest.mark.anyio

COUNTS = {"applied", "skipped", "rewritten", "anomalies", "completed"}
WRITER = {
    "writer_id",
    "host",
    "pid",
    "labels",
    "state",
    "pending_sources",
    "counts",
    "opened_at",
    "last_seen_at",
}
CHECKPOINT = {
    "name",
    "owner",
    "completed_count",
    "live_writers",
    "pending_sources",
    "settling_sources",
    "anomalies",
    "unreadable_files",
    "created_at",
    "last_activity_at",
    "writers",
    "fingerprint",
    "failed_sources",
    "max_attempts",
    "total",
    "remaining",
    "claimed_sources",
}


def deltas(items: list[tuple[str, str, int]]) -> dict[str, Any]:
    return {"deltas": [{"task_id": t, "source_id": s, "delta": d} for t, s, d in items]}


async def ok(reply: httpx.Response) -> Any:
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_a_writer_from_open_to_close(served: InProcess) -> None:
    http = served.http
    body = {"checkpoint": "res/run", "writer_id": "w", "labels": {"k": "v"}, "host": "h", "pid": 7}
    opened = await ok(await http.post("/v1/writers", json=body))
    assert set(opened) == {
        "handle",
        "writer_id",
        "lease_ttl_s",
        "completed_count",
        "settle_ms",
        "accepts_delta_columns",
        "max_batches_in_flight",
    }
    assert (opened["writer_id"], opened["completed_count"], opened["settle_ms"]) == ("w", 0, 0)
    assert opened["accepts_delta_columns"] is True
    handle = opened["handle"]

    assert set(await ok(await http.post(f"/v1/writers/{handle}/keepalive"))) == {"lease_ttl_s"}
    applied = await ok(
        await http.post(f"/v1/writers/{handle}/deltas", json=deltas(tree("a") + [("0_b", "b", 1)]))
    )
    counts = {"applied": 7, "skipped": 0, "rewritten": 0, "anomalies": 0, "completed": 1}
    assert applied == {"counts": counts, "settled": True, "refused": 0}  # settle 0: "a" is durable already
    retried = await ok(await http.post(f"/v1/writers/{handle}/deltas", json=deltas(tree("a"))))
    assert retried["counts"]["skipped"] == 6
    assert await ok(await http.post(f"/v1/writers/{handle}/flush")) == {"completed": 1}

    status = await ok(await http.get("/v1/checkpoints/res/run"))
    assert set(status) == CHECKPOINT
    assert (status["completed_count"], status["live_writers"], status["pending_sources"]) == (1, 1, 1)
    (writer,) = status["writers"]
    assert set(writer) == WRITER | {"closed_at"} and set(writer["counts"]) == COUNTS
    assert (writer["labels"], writer["host"], writer["pid"], writer["state"]) == ({"k": "v"}, "h", 7, "open")

    closed = await ok(await http.post(f"/v1/writers/{handle}/close"))
    assert closed == {
        "counts": {"applied": 7, "skipped": 6, "rewritten": 0, "anomalies": 0, "completed": 1},
        "incomplete_sources": ["b"],
        "incomplete_count": 1,
    }
    answer = await ok(
        await http.post("/v1/are-completed", json={"checkpoint": "res/run", "source_ids": ["a", "b"]})
    )
    assert answer == {"completed": [True, False]}
    assert (await http.post(f"/v1/writers/{handle}/flush")).status_code == 404


async def test_status_listings_and_pages(served: InProcess) -> None:
    http = served.http
    for writer_id in ("w1", "w2"):
        handle = (
            await ok(await http.post("/v1/writers", json={"checkpoint": "res/ls", "writer_id": writer_id}))
        )["handle"]
        await ok(await http.post(f"/v1/writers/{handle}/deltas", json=deltas(tree(f"s-{writer_id}"))))
        await ok(await http.post(f"/v1/writers/{handle}/close"))

    listed = await ok(await http.get("/v1/checkpoints"))
    assert [c["name"] for c in listed["checkpoints"]] == ["res/ls"]
    writers = await ok(await http.get("/v1/writers", params={"checkpoint": "res/ls", "include_closed": True}))
    assert sorted((w["writer_id"], w["state"]) for w in writers["writers"]) == [
        ("w1", "closed"),
        ("w2", "closed"),
    ]
    assert all(w["closed_at"] > 0 for w in writers["writers"])

    events = await ok(await http.get("/v1/events", params={"checkpoint": "res/ls", "limit": 2}))
    assert set(events) == {"events", "next_before_id"} and len(events["events"]) == 2
    members = {"id", "checkpoint", "kind", "message", "at", "writer_id", "data", "severity"}
    assert set(events["events"][0]) == members
    assert {e["severity"] for e in events["events"]} == {"info"}  # writers opening and closing
    older = await ok(
        await http.get("/v1/events", params={"checkpoint": "res/ls", "before_id": events["next_before_id"]})
    )
    assert older["events"] and older["events"][0]["id"] < events["events"][-1]["id"]

    samples = await ok(await http.get("/v1/progress", params={"checkpoint": "res/ls"}))
    assert samples["samples"][-1]["completed_count"] == 2 and set(samples["samples"][-1]) == {
        "at",
        "completed_count",
    }

    page = await ok(await http.get("/v1/completed", params={"checkpoint": "res/ls", "limit": 1}))
    assert page == {"source_ids": ["s-w1"], "next_after": "s-w1"}
    page = await ok(await http.get("/v1/completed", params={"checkpoint": "res/ls", "after": "s-w1"}))
    assert page == {"source_ids": ["s-w2"], "next_after": ""}


async def test_import_then_reset(served: InProcess) -> None:
    http = served.http
    body = {"checkpoint": "res/imp", "source_ids": ["x", "y", "x"], "import_id": "nemo"}
    assert await ok(await http.post("/v1/import", json=body)) == {"imported": 2, "completed_count": 2}
    assert await ok(await http.post("/v1/import", json=body)) == {"imported": 0, "completed_count": 2}
    reset = await ok(await http.post("/v1/reset", json={"name": "res/imp"}))
    assert set(reset) == {"moved_to", "files_moved", "writers_closed"}
    assert (reset["files_moved"], reset["writers_closed"]) == (1, 0)
    assert (served.data_dir / reset["moved_to"]).is_dir()
    answer = await ok(
        await http.post("/v1/are-completed", json={"checkpoint": "res/imp", "source_ids": ["x"]})
    )
    assert answer == {"completed": [False]}


async def test_bodies_are_strict_and_refusals_name_the_field(served: InProcess) -> None:
    http = served.http
    for path, body, field in [
        ("/v1/writers", {"checkpoint": "res/x", "pid": "7"}, "body.pid"),
        ("/v1/writers", {"checkpoint": "res/x", "on_mismatch": "maybe"}, "body.on_mismatch"),
        ("/v1/reset", {"name": "res/x", "force": 1}, "body.force"),
        ("/v1/are-completed", {"checkpoint": "res/x", "source_ids": [1]}, "body.source_ids.0"),
        (
            "/v1/writers/h/deltas",
            {"deltas": [{"task_id": "t", "source_id": "s", "delta": True}]},
            "body.deltas.0",
        ),
    ]:
        reply = await http.post(path, json=body)
        assert reply.status_code == 400, (path, reply.text)
        assert field in reply.json()["error"]["message"], (path, reply.text)
    assert (await http.get("/v1/checkpoints/res/x")).status_code == 404  # nothing was created


async def test_request_ids_are_echoed(served: InProcess) -> None:
    reply = await served.http.get("/healthz", headers={"x-request-id": "abc-123"})
    assert reply.headers["x-request-id"] == "abc-123"
    assert (await served.http.get("/healthz")).headers["x-request-id"]
