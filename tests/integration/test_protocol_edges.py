"""Protocol edges over the real transports (issue #7, points 4 and 12): undecodable stream requests,
strict numbers, names with newlines, unbounded echoes of client input, numbers out of range."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.client import HTTPConnection
from typing import Any

import grpc
import httpx
import pytest

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer
from tests.polling import wait_until

# What a transport may send back in full; a gRPC peer refuses trailers over 8-16 KiB.
SHORT = 4096


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        yield client


def refusal(call: Any, *args: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value.code(), info.value.details()


def error_of(reply: httpx.Response) -> dict[str, Any]:
    error = reply.json()["error"]
    assert isinstance(error, dict)
    return error


def raw_http(server: RunningServer, method: str, path: str) -> tuple[int, dict[str, Any]]:
    """A request httpx would refuse to build (its URLs stop at 64 KiB)."""
    host, port = server.http_address.rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=b"", headers={"content-length": "0"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def test_watch_with_undecodable_bytes_is_invalid_argument_without_a_traceback(
    server: RunningServer, stub: pb_grpc.CoordinatorStub
) -> None:
    # A WatchCheckpointRequest whose checkpoint is not UTF-8: field 1, length 2, bytes ff fe.
    with grpc.insecure_channel(server.grpc_address) as channel:
        watch = channel.unary_stream(
            "/tally.v1.Coordinator/WatchCheckpoint",
            request_serializer=lambda b: b,
            response_deserializer=pb.CheckpointStatus.FromString,
        )
        code, message = refusal(lambda: list(watch(b"\x0a\x02\xff\xfe", timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in message
    # Refusals inside the stream still carry their own code.
    code, message = refusal(lambda: next(stub.WatchCheckpoint(pb.WatchCheckpointRequest(checkpoint="nope"))))
    assert code == grpc.StatusCode.NOT_FOUND and "does not exist" in message
    code, _ = refusal(lambda: next(stub.WatchCheckpoint(pb.WatchCheckpointRequest(checkpoint="../x"))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("delta", [True, "1", 1.5, None, [1]])
def test_http_delta_must_be_an_integer(http: httpx.Client, delta: object) -> None:
    handle = http.post("/v1/writers", json={"checkpoint": "cp", "writer_id": "w"}).json()["handle"]
    good = {"task_id": "t0", "source_id": "s", "delta": 1}
    reply = http.post(
        f"/v1/writers/{handle}/deltas",
        json={"deltas": [good, {"task_id": "t1", "source_id": "s", "delta": delta}]},
    )
    assert reply.status_code == 400
    error = error_of(reply)
    assert error["code"] == "INVALID_ARGUMENT"
    assert "deltas.1.delta" in error["message"] and "integer" in error["message"]
    # The whole batch was refused: nothing of it was applied.
    writers = http.get("/v1/writers", params={"checkpoint": "cp"}).json()["writers"]
    assert [w["counts"]["applied"] for w in writers] == [0]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/writers", {"checkpoint": "cp", "pid": "123"}, "pid"),
        ("/v1/writers", {"checkpoint": "cp", "pid": 12.0}, "pid"),
        ("/v1/writers", {"checkpoint": "cp", "pid": True}, "pid"),
        ("/v1/writers", {"checkpoint": 7}, "checkpoint"),
        ("/v1/are-completed", {"checkpoint": "cp", "source_ids": ["a", 1]}, "source_ids.1"),
        ("/v1/import", {"checkpoint": "cp", "source_ids": ["a"], "import_id": 5}, "import_id"),
        ("/v1/reset", {"name": "cp", "force": 1}, "force"),
        ("/v1/reset", {"name": "cp", "force": "true"}, "force"),
    ],
)
def test_http_body_fields_are_strict(
    http: httpx.Client, server: RunningServer, path: str, body: dict[str, Any], field: str
) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == 400
    error = error_of(reply)
    assert error["code"] == "INVALID_ARGUMENT" and f"body.{field}" in error["message"]
    assert not (server.data_dir / "checkpoints" / "cp").exists()


def test_checkpoint_name_with_a_newline_in_the_path_is_invalid_not_missing(http: httpx.Client) -> None:
    for path in ["/v1/checkpoints/a%0Ab", "/v1/checkpoints/a%0A", "/v1/checkpoints/x/%0D%0A/y"]:
        reply = http.get(path)
        assert reply.status_code == 400, path
        error = error_of(reply)
        assert error["code"] == "INVALID_ARGUMENT" and "checkpoint name" in error["message"], path
    assert http.get("/v1/checkpoints/never/made").status_code == 404  # a valid name still routes


def test_a_huge_handle_is_not_found_with_a_short_message(
    server: RunningServer, stub: pb_grpc.CoordinatorStub
) -> None:
    handle = "h" * 100_000
    for call, request in [
        (stub.KeepAlive, pb.KeepAliveRequest(handle=handle)),
        (stub.Flush, pb.FlushRequest(handle=handle)),
        (stub.CloseWriter, pb.CloseWriterRequest(handle=handle)),
    ]:
        code, message = refusal(call, request)
        assert code == grpc.StatusCode.NOT_FOUND
        assert "100000 characters" in message and len(message) < SHORT
    # The dev group installs httptools, which uvicorn would take by itself and which refuses this
    # path in plain text: tally serve names h11 (app.HTTP_PARSER), which lets Tally answer.
    status, body = raw_http(server, "POST", f"/v1/writers/{handle}/keepalive")
    assert status == 404
    assert body["error"]["code"] == "NOT_FOUND" and len(body["error"]["message"]) < SHORT


def test_a_huge_label_key_is_invalid_argument_with_a_short_message(
    stub: pb_grpc.CoordinatorStub, http: httpx.Client
) -> None:
    key = "k" * 100_000
    code, message = refusal(stub.OpenWriter, pb.OpenWriterRequest(checkpoint="cp", labels={key: "v"}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "label key" in message and "max_id_bytes" in message and len(message) < SHORT
    reply = http.post("/v1/writers", json={"checkpoint": "cp", "labels": {key: "v"}})
    assert reply.status_code == 400
    assert "label key" in error_of(reply)["message"] and len(reply.content) < SHORT
    # A body whose problems name huge keys of a map: each is cut, and so is the list of problems.
    labels = {f"{i}" + "k" * 10_000: i for i in range(100)}
    reply = http.post("/v1/writers", json={"checkpoint": "cp", "labels": labels})
    assert reply.status_code == 400 and len(reply.content) < SHORT
    assert "and 95 more" in error_of(reply)["message"]


def test_a_refusal_that_lists_much_client_input_is_cut_not_lost(
    stub: pb_grpc.CoordinatorStub, http: httpx.Client
) -> None:
    # 64 fingerprint components of 500 bytes that all differ: the refusal names each one, which made
    # a trailer of ~70 KB that the client could not read (it saw RESOURCE_EXHAUSTED).
    first = {f"component-{i:02d}-" + "x" * 400: "a" * 500 for i in range(64)}
    second = {k: "b" * 500 for k in first}
    opened = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="cp", writer_id="w1", fingerprint=first))
    stub.CloseWriter(pb.CloseWriterRequest(handle=opened.handle))
    code, message = refusal(
        stub.OpenWriter, pb.OpenWriterRequest(checkpoint="cp", writer_id="w2", fingerprint=second)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "different fingerprint" in message and "message cut" in message and len(message) < SHORT
    reply = http.post("/v1/writers", json={"checkpoint": "cp", "writer_id": "w2", "fingerprint": second})
    assert reply.status_code == 409 and len(reply.content) < 2 * SHORT
    assert "different fingerprint" in error_of(reply)["message"]


@pytest.mark.parametrize("pid", [-1, 2**31, 2**63 - 1])
def test_grpc_pid_out_of_range_is_refused_and_opens_nothing(
    server: RunningServer, stub: pb_grpc.CoordinatorStub, pid: int
) -> None:
    code, message = refusal(stub.OpenWriter, pb.OpenWriterRequest(checkpoint="cp", writer_id="w", pid=pid))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "pid" in message and "out of range" in message
    assert not (server.data_dir / "checkpoints" / "cp").exists()
    code, _ = refusal(stub.GetCheckpoint, pb.GetCheckpointRequest(name="cp"))
    assert code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("pid", [-1, 2**31, 2**63, 2**64])
def test_http_pid_out_of_range_is_refused_and_opens_nothing(
    server: RunningServer, http: httpx.Client, pid: int
) -> None:
    reply = http.post("/v1/writers", json={"checkpoint": "cp", "writer_id": "w", "pid": pid})
    assert reply.status_code == 400
    assert error_of(reply)["code"] == "INVALID_ARGUMENT" and "body.pid" in error_of(reply)["message"]
    assert http.get("/v1/checkpoints/cp").status_code == 404
    assert "Traceback" not in server.log()


def test_largest_pid_is_accepted(stub: pb_grpc.CoordinatorStub, http: httpx.Client) -> None:
    stub.OpenWriter(pb.OpenWriterRequest(checkpoint="cp", writer_id="w1", pid=2**31 - 1))
    reply = http.post("/v1/writers", json={"checkpoint": "cp", "writer_id": "w2", "pid": 2**31 - 1})
    assert reply.status_code == 200
    pids = {
        w["writer_id"]: w["pid"]
        for w in http.get("/v1/writers", params={"checkpoint": "cp"}).json()["writers"]
    }
    assert pids == {"w1": 2**31 - 1, "w2": 2**31 - 1}


def test_paging_and_stream_numbers_out_of_range_are_refused(
    server: RunningServer, stub: pb_grpc.CoordinatorStub, http: httpx.Client
) -> None:
    stub.OpenWriter(pb.OpenWriterRequest(checkpoint="cp", writer_id="w"))
    code, message = refusal(stub.ListEvents, pb.ListEventsRequest(checkpoint="cp", before_id=-1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "before_id" in message
    for params in [
        {"checkpoint": "cp", "before_id": str(2**63)},
        {"checkpoint": "cp", "before_id": "-1"},
    ]:
        reply = http.get("/v1/events", params=params)
        assert reply.status_code == 400 and "before_id" in error_of(reply)["message"], params
    assert http.get("/v1/events", params={"checkpoint": "cp", "before_id": str(2**63 - 1)}).status_code == 200
    reply = http.get("/v1/watch", params={"checkpoint": "cp", "interval_ms": str(10**400)})
    assert reply.status_code == 400 and "interval_ms" in error_of(reply)["message"]
    reply = http.get("/v1/progress", params={"checkpoint": "cp", "since": "nan"})
    assert reply.status_code == 400 and "since" in error_of(reply)["message"]
    assert "Traceback" not in server.log()


def test_a_writer_id_at_its_length_limit_gets_its_completions_stored(server: RunningServer) -> None:
    """The longest writer id allowed (251 bytes: ``<id>.mdb`` fills a 255-byte file name) once made
    the temporary name of its new file too long to create, and the writer retried for ever."""
    import tally
    from tests.integration.workload import tree

    writer_id = "w" * 251
    with tally.Client(server.grpc_address, timeout=20) as client:
        with client.writer("edges/long-writer", writer_id=writer_id) as w:
            w.apply_deltas(tree("s"))
            w.flush()
        assert client.are_completed("edges/long-writer", ["s"]) == [True]
        with pytest.raises(tally.InvalidArgument, match="over the limit of 251"):
            client.writer("edges/long-writer", writer_id=writer_id + "w").open()


def test_watch_streams_cancelled_by_their_callers_never_crash_the_server(server: RunningServer) -> None:
    """Callers that take one snapshot and hang up: the stream's access line is written after the call
    is gone, and once read the peer from the dead call (a segfault, about one cancel in ten)."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        stub.OpenWriter(pb.OpenWriterRequest(checkpoint="edges/watched", writer_id="w"))
        for _ in range(150):
            watch = stub.WatchCheckpoint(pb.WatchCheckpointRequest(checkpoint="edges/watched"))
            assert next(watch).name == "edges/watched"
            watch.cancel()
        assert server.process.poll() is None, server.log()[-3000:]
        assert stub.GetCheckpoint(pb.GetCheckpointRequest(name="edges/watched")).live_writers == 1
        # Each still gets its access line: cancelled, with the caller's address read while it was there.
        wait_until(
            lambda: server.log().count("/tally.v1.Coordinator/WatchCheckpoint CANCELLED") == 150,
            timeout=30,
            what="150 access lines of cancelled watches",
        )
        assert "WatchCheckpoint CANCELLED" in server.log() and "from ipv4:127.0.0.1:" in server.log()
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        for _ in range(50):
            with http.stream("GET", "/v1/watch", params={"checkpoint": "edges/watched"}) as events:
                assert next(events.iter_lines()).startswith("data: ")
    assert server.process.poll() is None, server.log()[-3000:]
