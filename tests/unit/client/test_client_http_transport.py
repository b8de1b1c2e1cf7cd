"""HTTP transports against a small in-process HTTP server speaking the ``/v1`` JSON contract."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import tally
from tally import _calls as calls
from tally._transport.contact import NeverReached
from tally._transport.http import AsyncHttpTransport, HttpTransport
from tally._types import CheckpointPage, WriterSpec
from tests.unit.client.dropping_listener import dropping_listener

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

# (method, path) -> (status, body); a body of bytes is sent verbatim, an SseBody as an event stream.
Routes = dict[tuple[str, str], tuple[int, Any]]


@dataclass
class SseBody:
    """A text/event-stream answer: chunks written one by one; then, if ``hold`` is set, the
    connection stays open (silent) until the event is set or the client goes away."""

    chunks: list[bytes]
    hold: threading.Event | None = None


def sse(*statuses: dict[str, Any]) -> list[bytes]:
    return [f"data: {json.dumps(s)}\n\n".encode() for s in statuses]


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
            ("GET", "/v1/checkpoints?limit=1000"): (200, {"checkpoints": [CHECKPOINT_JSON]}),
            ("GET", "/v1/checkpoints/curation/run%2042"): (200, CHECKPOINT_JSON),
            ("GET", "/v1/writers?checkpoint=a%2Fb+c&include_closed=true&limit=5"): (
                200,
                {"writers": [{**CHECKPOINT_JSON["writers"][0], "state": "closed", "closed_at": 3.5}]},
            ),
            ("GET", "/v1/events?checkpoint=cp&limit=2"): (
                200,
                {
                    "events": [
                        {
                            "id": 9,
                            "checkpoint": "cp",
                            "kind": "anomaly",
                            "message": "m",
                            "at": 1.5,
                            "writer_id": "w1",
                            "data": {"task_id": "t"},
                            "severity": "warning",
                        },
                        {"id": 8, "checkpoint": "cp", "kind": "writer_opened", "message": "", "at": 1.0},
                    ],
                    "next_before_id": 8,
                },
            ),
            ("GET", "/v1/events?checkpoint=cp&limit=2&before_id=8"): (
                200,
                {"events": [], "next_before_id": 0},
            ),
            ("GET", "/v1/progress?checkpoint=cp&since=1.5"): (
                200,
                {"samples": [{"at": 2.0, "completed_count": 1}, {"at": 3.0, "completed_count": 5}]},
            ),
            ("GET", "/v1/progress?checkpoint=cp"): (200, {"samples": []}),
            ("GET", "/v1/completed?checkpoint=cp&limit=2"): (
                200,
                {"source_ids": ["a", "b"], "next_after": "b"},
            ),
            ("GET", "/v1/completed?checkpoint=cp&limit=2&after=b"): (
                200,
                {"source_ids": ["c"], "next_after": ""},
            ),
            ("POST", "/v1/import"): (200, {"imported": 2, "completed_count": 7}),
            ("POST", "/v1/reset"): (200, {"moved_to": ".trash/cp/1", "files_moved": 2, "writers_closed": 0}),
            ("POST", "/v1/writers/h%2F1/cursors"): (200, {"saved": 1, "completed": 1}),
            ("GET", "/v1/cursors?checkpoint=cp%2Fa&source_id=s+1"): (
                200,
                {"found": True, "data": "AHJvdz03", "saved_at": 3.5, "writer_id": "w1"},
            ),
            ("GET", "/v1/cursors?checkpoint=cp%2Fa&source_id=never"): (
                200,
                {"found": False, "data": "", "saved_at": 0.0, "writer_id": ""},
            ),
            ("GET", "/v1/watch?checkpoint=cp&interval_ms=250"): (
                200,
                SseBody(
                    [
                        b": a comment line, ignored\n\n",
                        *sse({**CHECKPOINT_JSON, "completed_count": 1}),
                        # One event split over two data lines and two writes, with CRLF endings.
                        b'event: status\r\ndata: {"name": "cp",\r\n',
                        b'data: "completed_count": 2}\r\n\r\n',
                    ]
                ),
            ),
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
            if isinstance(payload, SseBody):
                self._stream(status, payload)
                return
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, status: int, body: SseBody) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for chunk in body.chunks:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                if body.hold is not None:
                    body.hold.wait(10)
            except OSError:
                pass  # the client went away

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
    opened = transport.send(calls.OpenWriter(SPEC), 5)
    assert opened.handle == "h/1" and opened.lease_ttl_s == 9.0 and opened.completed_count == 4
    assert transport.send(calls.KeepAlive("h/1"), 5) == 9.0
    assert transport.send(
        calls.ApplyDeltas("h/1", [("t1", "s1", 1), ("t2", "s1", -1)], 5), 5
    ) == calls.BatchAnswer(tally.ApplyCounts(applied=2, completed=1), settled=False)
    assert transport.send(calls.AreCompleted("cp", ["a", "b"]), 5) == [True, False]
    assert transport.send(calls.Flush("h/1"), 5) == 7
    assert transport.send(calls.CloseWriter("h/1"), 5) == tally.CloseResult(
        tally.ApplyCounts(applied=2), ("s1",), 1
    )
    status = transport.send(calls.GetCheckpoint("curation/run 42"), 5)
    assert transport.send(calls.ListCheckpoints(), 5) == CheckpointPage((status,), "")
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
        "session_token": SPEC.session_token,
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
        # 409 is both: the coordinator's body says which.
        (409, {"error": {"code": "FAILED_PRECONDITION", "message": "m"}}, tally.FailedPrecondition, None),
        (412, {"error": {"code": "FAILED_PRECONDITION", "message": "m"}}, tally.FailedPrecondition, None),
        # HTTP's own code for a method the route does not serve (an SDK newer than the server).
        (405, {"error": {"code": "METHOD_NOT_ALLOWED", "message": "m"}}, tally.Internal, "UNIMPLEMENTED"),
        (
            400,
            {"error": {"code": "SOMETHING_NEW", "message": "m"}},
            tally.InvalidArgument,
            "INVALID_ARGUMENT",
        ),
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
        transport.send(calls.OpenWriter(SPEC), 5)
    transport.close()
    assert type(info.value) is error
    if code is not None:
        assert info.value.code == tally.StatusCode(code)
    if isinstance(body, dict) and "error" in body:
        assert info.value.message == "m" and info.value.details == body["error"].get("details", {})


def test_unreachable_http_coordinator_is_unavailable() -> None:
    transport = HttpTransport("http://127.0.0.1:1")
    with pytest.raises(NeverReached, match="no Tally coordinator is listening at http://127.0.0.1:1") as info:
        transport.send(calls.Flush("h"), 2)
    assert "unreachable" in info.value.refused.message


def test_a_connection_that_broke_mid_call_was_reached_and_a_refused_connection_is_retried() -> None:
    """A coordinator killed while it answered a client's very first request broke an open
    connection: the refusal while it restarts is an outage, not NeverReached (bench/faults.py kill9)."""
    with dropping_listener() as (port, down):
        transport = HttpTransport(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(tally.Unavailable, match="Server disconnected") as broke:
                transport.send(calls.GetCheckpoint("c"), 5)
            assert not isinstance(broke.value, NeverReached)
            down()
            with pytest.raises(tally.Unavailable, match="Connection refused") as refused:
                transport.send(calls.GetCheckpoint("c"), 5)
            assert not isinstance(refused.value, NeverReached)
        finally:
            transport.close()


def test_async_http_transport_speaks_the_same_contract_without_threads(
    http_server: tuple[str, Recorder],
) -> None:
    base, recorder = http_server

    async def main() -> None:
        transport = AsyncHttpTransport(base)
        assert (await transport.send(calls.OpenWriter(SPEC), 5)).handle == "h/1"
        assert await transport.send(calls.KeepAlive("h/1"), 5) == 9.0
        assert (await transport.send(calls.ApplyDeltas("h/1", [("t", "s", 1)], 1), 5)).counts.applied == 2
        assert await transport.send(calls.AreCompleted("cp", ["a", "b"]), 5) == [True, False]
        assert await transport.send(calls.Flush("h/1"), 5) == 7
        assert (await transport.send(calls.CloseWriter("h/1"), 5)).incomplete_count == 1
        assert (await transport.send(calls.GetCheckpoint("curation/run 42"), 5)).completed_count == 3
        assert len((await transport.send(calls.ListCheckpoints(), 5)).checkpoints) == 1
        # Nothing ran in the loop's executor (asyncio.to_thread's workers are named asyncio_N);
        # the fake server's own threads come and go, so they are not counted.
        assert not [t.name for t in threading.enumerate() if t.name.startswith("asyncio_")]
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


def test_status_routes_follow_the_json_contract(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server
    transport = HttpTransport(base, token="tok")
    (writer,) = transport.send(calls.ListWriters("a/b c", True, 5), 5).writers
    assert writer.state == "closed" and writer.closed_at == 3.5 and writer.labels == {"team": "x"}
    page = transport.send(calls.ListEvents("cp", 2, None), 5)
    assert page.events[0] == tally.Event(
        9, "cp", "anomaly", "m", 1.5, "w1", {"task_id": "t"}, tally.Severity.WARNING
    )
    assert page.events[1].severity == tally.Severity.INFO  # not sent (an older server): info
    assert page.events[1].data == {} and page.events[1].writer_id == "" and page.next_before_id == 8
    assert transport.send(calls.ListEvents("cp", 2, 8), 5) == tally.EventPage((), None)
    assert transport.send(calls.GetProgress("cp", 1.5), 5) == [
        tally.ProgressSample(2.0, 1),
        tally.ProgressSample(3.0, 5),
    ]
    assert transport.send(calls.GetProgress("cp", None), 5) == []
    first = transport.send(calls.ListCompleted("cp", "", 2), 5)
    assert (first.source_ids, first.next_after) == (("a", "b"), "b")
    assert transport.send(calls.ListCompleted("cp", "b", 2), 5).next_after == ""
    assert transport.send(calls.ImportCompleted("cp", ["x", "y"], "imported-1"), 5) == tally.ImportResult(
        2, 7
    )
    assert transport.send(calls.ResetCheckpoint("cp", True), 5) == tally.ResetResult(".trash/cp/1", 2, 0)
    transport.close()
    bodies = {path: body for method, path, _, body in recorder.requests if method == "POST"}
    assert bodies["/v1/import"] == {"checkpoint": "cp", "source_ids": ["x", "y"], "import_id": "imported-1"}
    assert bodies["/v1/reset"] == {"name": "cp", "force": True}
    assert all(headers["Authorization"] == "Bearer tok" for _, _, headers, _ in recorder.requests)


def test_watch_reads_server_sent_events(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server
    transport = HttpTransport(base, token="tok")
    statuses = list(transport.watch(calls.WatchCheckpoint("cp", 250), 5))
    assert [(s.name, s.completed_count) for s in statuses] == [("curation/run 42", 1), ("cp", 2)]
    assert statuses[0].writers[0].counts.completed == 3
    _, path, headers, _ = recorder.requests[-1]
    assert path == "/v1/watch?checkpoint=cp&interval_ms=250"
    assert headers["Accept"] == "text/event-stream" and headers["Authorization"] == "Bearer tok"


@pytest.mark.parametrize(
    ("status", "payload", "error", "match"),
    [
        (
            404,
            {"error": {"code": "NOT_FOUND", "message": "checkpoint 'x' does not exist"}},
            tally.NotFound,
            "x",
        ),
        (
            200,
            SseBody(sse({"error": {"code": "UNAVAILABLE", "message": "shutting down"}})),
            tally.Unavailable,
            "down",
        ),
        (200, SseBody([b"data: {not json\n\n"]), tally.Internal, "not JSON"),
    ],
)
def test_watch_errors_map_to_sdk_errors(
    http_server: tuple[str, Recorder], status: int, payload: Any, error: type[tally.TallyError], match: str
) -> None:
    base, recorder = http_server
    recorder.routes[("GET", "/v1/watch?checkpoint=x&interval_ms=1000")] = (status, payload)
    with pytest.raises(error, match=match):
        list(HttpTransport(base).watch(calls.WatchCheckpoint("x", 1000), 5))


def test_watch_of_an_unreachable_coordinator_is_unavailable() -> None:
    with pytest.raises(NeverReached, match="no Tally coordinator is listening at http://127.0.0.1:1") as info:
        next(HttpTransport("http://127.0.0.1:1").watch(calls.WatchCheckpoint("cp", 1000), 2))
    assert "unreachable" in info.value.refused.message


def test_a_quiet_stream_outlives_the_timeout_and_closes_from_another_thread(
    http_server: tuple[str, Recorder],
) -> None:
    base, recorder = http_server
    hold = threading.Event()
    recorder.routes[("GET", "/v1/watch?checkpoint=q&interval_ms=1000")] = (
        200,
        SseBody(sse({"name": "q"}), hold),
    )
    stream = HttpTransport(base).event_stream(calls.WatchCheckpoint("q", 1000), 0.2)
    stream.open()
    assert next(stream).name == "q"
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(next(stream, None)))
    reader.start()
    reader.join(0.6)  # three times the timeout: the read is still waiting, not timed out
    assert reader.is_alive() and got == []
    stream.close()
    reader.join(5)
    hold.set()
    assert not reader.is_alive() and got == [None]


def test_async_watch_over_http(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server
    hold = threading.Event()
    recorder.routes[("GET", "/v1/watch?checkpoint=q&interval_ms=100")] = (
        200,
        SseBody(sse({"name": "q", "completed_count": 4}), hold),
    )

    async def main() -> None:
        transport = AsyncHttpTransport(base)
        assert [s.completed_count async for s in transport.watch(calls.WatchCheckpoint("cp", 250), 5)] == [
            1,
            2,
        ]
        assert len((await transport.send(calls.ListWriters("a/b c", True, 5), 5)).writers) == 1
        assert (await transport.send(calls.ListEvents("cp", 2, None), 5)).next_before_id == 8
        assert len(await transport.send(calls.GetProgress("cp", 1.5), 5)) == 2
        assert (await transport.send(calls.ListCompleted("cp", "b", 2), 5)).source_ids == ("c",)
        assert (await transport.send(calls.ImportCompleted("cp", ["x"], "i"), 5)).completed_count == 7
        assert (await transport.send(calls.ResetCheckpoint("cp", False), 5)).moved_to == ".trash/cp/1"
        # Cancelling a task blocked on a quiet stream ends it promptly.
        stream = transport.watch(calls.WatchCheckpoint("q", 100), 5)
        assert (await anext(stream)).completed_count == 4
        task = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        await transport.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    hold.set()


def test_client_pages_completed_and_watches_over_http(http_server: tuple[str, Recorder]) -> None:
    base, _ = http_server
    with tally.Client(base) as client:
        assert list(client.completed("cp", page_size=2)) == ["a", "b", "c"]
        stream = client.watch("cp", interval_s=0.25)
        # The server ends the stream after two events; the client reconnects and carries on.
        assert [next(stream).completed_count for _ in range(3)] == [1, 2, 1]
        stream.close()  # type: ignore[attr-defined]


def test_cursor_routes_follow_the_json_contract(http_server: tuple[str, Recorder]) -> None:
    base, recorder = http_server
    transport = HttpTransport(base)
    saved = transport.send(calls.SaveCursors("h/1", [("a", b"\x00\x01"), ("done", b"")], "w1"), 5)
    assert saved == calls.CursorsSaved(saved=1, completed=1)
    assert transport.send(calls.GetCursor("cp/a", "s 1"), 5) == calls.SavedCursor(b"\x00row=7", 3.5, "w1")
    assert transport.send(calls.GetCursor("cp/a", "never"), 5) is None
    transport.close()
    bodies = {path: body for method, path, _, body in recorder.requests if method == "POST"}
    assert bodies["/v1/writers/h%2F1/cursors"] == {
        "cursors": [{"source_id": "a", "data": "AAE="}, {"source_id": "done", "data": ""}]
    }
