"""HTTP transports against a small in-process HTTP server speaking the ``/v1`` JSON contract."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import tally
from tally._http import AsyncHttpTransport, HttpTransport
from tally._types import WriterSpec

CHECKPOINT_JSON = {
    "name": "curation/run 42",
    "completed_count": 3,
    "live_writers": 1,
    "pending_sources": 2,
    "settling_sources": 0,
    "anomalies": 1,
    "unreadable_files": 1,
    "created_at": 1.0,
    "last_activity_at": 2.0,
    "writers": [
        {
            "writer_id": "w1",
            "host": "h",
            "pid": 7,
            "labels": {"team": "x"},
            "state": "live",
            "pending_sources": 2,
            "counts": {"applied": 4, "skipped": 1, "rewritten": 0, "anomalies": 1, "completed": 3},
            "opened_at": 1.5,
            "last_seen_at": 1.75,
        }
    ],
    "fingerprint": {"pipeline": "h1"},
}

# (method, path) -> (status, body); a body of bytes is sent verbatim.
Routes = dict[tuple[str, str], tuple[int, Any]]


class Recorder:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.routes: Routes = {
            ("POST", "/v1/writers"): (
                200,
                {
                    "handle": "h/1",
                    "writer_id": "w1",
                    "lease_ttl_s": 9.0,
                    "completed_count": 4,
                    "settle_ms": 250,
                },
            ),
            ("POST", "/v1/writers/h%2F1/keepalive"): (200, {"lease_ttl_s": 9.0}),
            ("POST", "/v1/writers/h%2F1/deltas"): (200, {"counts": {"applied": 2, "completed": 1}}),
            ("POST", "/v1/writers/h%2F1/flush"): (200, {"completed": 7}),
            ("POST", "/v1/writers/h%2F1/close"): (
                200,
                {"counts": {"applied": 2}, "incomplete_sources": ["s1"], "incomplete_count": 1},
            ),
            ("POST", "/v1/are-completed"): (200, {"completed": [True, False]}),
            ("GET", "/v1/checkpoints"): (200, {"checkpoints": [CHECKPOINT_JSON]}),
            ("GET", "/v1/checkpoints/curation/run%2042"): (200, CHECKPOINT_JSON),
        }


@pytest.fixture
def http_server() -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            recorder.requests.append((self.command, self.path, dict(self.headers), body))
            status, payload = recorder.routes.get(
                (self.command, self.path),
                (404, {"error": {"code": "NOT_FOUND", "message": f"no route {self.path}", "details": {}}}),
            )
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", recorder
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


SPEC = WriterSpec("cp", "w1", {}, {"team": "x"}, "host1", 42)


def test_requests_follow_the_json_contract(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server
    transport = HttpTransport(base, token="s3cret")
    opened = transport.open_writer(SPEC, 5)
    assert opened.handle == "h/1" and opened.lease_ttl_s == 9.0 and opened.completed_count == 4
    assert transport.keep_alive("h/1", 5) == 9.0
    assert transport.apply_deltas("h/1", [("t1", "s1", 1), ("t2", "s1", -1)], 5, 5) == tally.ApplyCounts(
        applied=2, completed=1
    )
    assert transport.are_completed("cp", ["a", "b"], 5) == [True, False]
    assert transport.flush("h/1", 5) == 7
    assert transport.close_writer("h/1", 5) == tally.CloseResult(tally.ApplyCounts(applied=2), ("s1",), 1)
    status = transport.get_checkpoint("curation/run 42", 5)
    assert transport.list_checkpoints(5) == [status]
    transport.close()

    assert status.name == "curation/run 42" and status.unreadable_files == 1
    assert status.writers[0].counts == tally.ApplyCounts(4, 1, 0, 1, 3)
    assert status.writers[0].labels == {"team": "x"} and status.fingerprint == {"pipeline": "h1"}
    method, path, headers, body = recorder.requests[0]
    assert (method, path) == ("POST", "/v1/writers")
    assert headers["Authorization"] == "Bearer s3cret" and headers["Content-Type"] == "application/json"
    # Empty optional members are omitted.
    assert body == {
        "checkpoint": "cp",
        "writer_id": "w1",
        "labels": {"team": "x"},
        "host": "host1",
        "pid": 42,
    }
    assert recorder.requests[2][3] == {
        "deltas": [
            {"task_id": "t1", "source_id": "s1", "delta": 1},
            {"task_id": "t2", "source_id": "s1", "delta": -1},
        ],
        "batch_seq": 5,
    }
    assert recorder.requests[3][3] == {"checkpoint": "cp", "source_ids": ["a", "b"]}


@pytest.mark.parametrize(
    ("status", "body", "error", "code"),
    [
        # The body's code wins over the status.
        (
            400,
            {"error": {"code": "NOT_FOUND", "message": "m", "details": {"k": 1}}},
            tally.NotFound,
            "NOT_FOUND",
        ),
        (409, {"error": {"code": "ALREADY_EXISTS", "message": "m"}}, tally.AlreadyExists, "ALREADY_EXISTS"),
        (412, {"error": {"code": "FAILED_PRECONDITION", "message": "m"}}, tally.FailedPrecondition, None),
        # No Tally error body: map by status.
        (400, b"bad", tally.InvalidArgument, "INVALID_ARGUMENT"),
        (401, b"", tally.Unauthenticated, "UNAUTHENTICATED"),
        (403, {"detail": "no"}, tally.PermissionDenied, "PERMISSION_DENIED"),
        (404, b"Not Found", tally.NotFound, "NOT_FOUND"),
        (409, b"", tally.AlreadyExists, "ALREADY_EXISTS"),
        (412, b"", tally.FailedPrecondition, "FAILED_PRECONDITION"),
        (422, {"detail": []}, tally.InvalidArgument, "INVALID_ARGUMENT"),
        (429, b"", tally.ResourceExhausted, "RESOURCE_EXHAUSTED"),
        (500, b"oops", tally.Internal, "INTERNAL"),
        (503, b"", tally.Unavailable, "UNAVAILABLE"),
        (504, b"", tally.Unavailable, "DEADLINE_EXCEEDED"),
        (418, b"", tally.InvalidArgument, "INVALID_ARGUMENT"),
        (200, b"not json", tally.Internal, "INTERNAL"),
        (200, {"unexpected": True}, tally.Internal, "INTERNAL"),
    ],
)
def test_http_errors_map_to_sdk_errors(
    http_server: tuple[str, Recorder], status: int, body: Any, error: type[tally.TallyError], code: str | None
) -> None:
    base, recorder = http_server
    recorder.routes[("POST", "/v1/writers")] = (status, body)
    transport = HttpTransport(base)
    with pytest.raises(error) as info:
        transport.open_writer(SPEC, 5)
    transport.close()
    assert type(info.value) is error
    if code is not None:
        assert info.value.code == tally.StatusCode(code)
    if isinstance(body, dict) and "error" in body:
        assert info.value.message == "m" and info.value.details == body["error"].get("details", {})


def test_unreachable_http_coordinator_is_unavailable() -> None:
    transport = HttpTransport("http://127.0.0.1:1")
    with pytest.raises(tally.Unavailable, match="unreachable"):
        transport.flush("h", 2)


def test_async_http_transport_runs_the_sync_one_in_threads(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server

    async def main() -> None:
        transport = AsyncHttpTransport(HttpTransport(base))
        assert (await transport.open_writer(SPEC, 5)).handle == "h/1"
        assert await transport.keep_alive("h/1", 5) == 9.0
        assert (await transport.apply_deltas("h/1", [("t", "s", 1)], 1, 5)).applied == 2
        assert await transport.are_completed("cp", ["a", "b"], 5) == [True, False]
        assert await transport.flush("h/1", 5) == 7
        assert (await transport.close_writer("h/1", 5)).incomplete_count == 1
        assert (await transport.get_checkpoint("curation/run 42", 5)).completed_count == 3
        assert len(await transport.list_checkpoints(5)) == 1
        await transport.close()

    asyncio.run(main())
    assert len(recorder.requests) == 8


def test_sync_client_end_to_end_over_http(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server
    with tally.Client(base, token="t") as client, client.writer("cp", writer_id="w1") as w:
        w.apply_deltas([("t1", "s1", 1)])
        w.flush()
        assert client.checkpoints()[0].name == "curation/run 42"
    paths = [path for _, path, _, _ in recorder.requests]
    assert paths[0] == "/v1/writers"
    assert paths.index("/v1/writers/h%2F1/deltas") < paths.index("/v1/writers/h%2F1/flush")
    assert paths[-1] == "/v1/writers/h%2F1/close"


def test_async_client_end_to_end_over_http(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server

    async def main() -> None:
        async with tally.AsyncClient(base) as client, client.writer("cp") as w:
            w.apply_deltas([("t1", "s1", 1)])
            await w.flush()

    asyncio.run(main())
    paths = [path for _, path, _, _ in recorder.requests]
    assert paths[-3:] == ["/v1/writers/h%2F1/deltas", "/v1/writers/h%2F1/flush", "/v1/writers/h%2F1/close"]
