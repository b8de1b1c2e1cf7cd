"""Bad input over both transports: a clear refusal with the right code, and nothing changes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        yield client


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "tally-serve.log" not in p.name}


def open_writer(stub: pb_grpc.CoordinatorStub, checkpoint: str = "cp", writer_id: str = "w1") -> str:
    reply = stub.OpenWriter(pb.OpenWriterRequest(checkpoint=checkpoint, writer_id=writer_id))
    return str(reply.handle)


def code_of(call: object, *args: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)  # type: ignore[operator]
    return info.value.code(), info.value.details()


ESCAPING_NAMES = ["..", "../x", "a/../../x", "/etc/x", "a\\b", "a\x00b", "a//b", ".", "", "x" * 300]


@pytest.mark.parametrize("name", ESCAPING_NAMES)
def test_checkpoint_names_that_escape_are_refused_and_create_nothing(
    server: RunningServer, stub: pb_grpc.CoordinatorStub, http: httpx.Client, name: str
) -> None:
    before = files_under(server.data_dir.parent)
    code, message = code_of(stub.OpenWriter, pb.OpenWriterRequest(checkpoint=name, writer_id="w"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "checkpoint name" in message
    reply = http.post("/v1/writers", json={"checkpoint": name, "writer_id": "w"})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert "checkpoint name" in reply.json()["error"]["message"]
    assert files_under(server.data_dir.parent) == before


@pytest.mark.parametrize("writer_id", ["../evil", "a/b", ".hidden", "w\x00"])
def test_writer_ids_that_are_not_file_names_are_refused(
    stub: pb_grpc.CoordinatorStub, writer_id: str
) -> None:
    code, message = code_of(stub.OpenWriter, pb.OpenWriterRequest(checkpoint="cp", writer_id=writer_id))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "writer_id" in message


def test_bad_ids_in_a_batch_refuse_the_whole_batch(stub: pb_grpc.CoordinatorStub) -> None:
    handle = open_writer(stub)
    good = pb.Delta(task_id="t0", source_id="s", delta=1)
    for bad, what in [
        (pb.Delta(task_id="", source_id="s", delta=1), "task_id is empty"),
        (pb.Delta(task_id="t", source_id="", delta=-1), "source_id is empty"),
        (pb.Delta(task_id="t", source_id="s" * 2000, delta=-1), "max_id_bytes"),
    ]:
        code, message = code_of(stub.ApplyDeltas, pb.ApplyDeltasRequest(handle=handle, deltas=[good, bad]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert what in message
    # Nothing of the refused batches was applied: t0 is new, so +1 then -1 completes "s".
    counts = stub.ApplyDeltas(pb.ApplyDeltasRequest(handle=handle, deltas=[good])).counts
    assert (counts.applied, counts.skipped) == (1, 0)


def test_oversize_batch_and_query_name_the_limit(stub: pb_grpc.CoordinatorStub, http: httpx.Client) -> None:
    handle = open_writer(stub)
    many = [pb.Delta(task_id=f"t{i}", source_id="s", delta=1) for i in range(100_001)]
    code, message = code_of(stub.ApplyDeltas, pb.ApplyDeltasRequest(handle=handle, deltas=many))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_deltas_per_call" in message and "100000" in message
    reply = http.post("/v1/are-completed", json={"checkpoint": "cp", "source_ids": ["s"] * 100_001})
    assert reply.status_code == 429
    assert "max_ids_per_query" in reply.json()["error"]["message"]
    status = stub.GetCheckpoint(pb.GetCheckpointRequest(name="cp"))
    assert status.pending_sources == 0


def test_non_utf8_bytes_are_refused_with_invalid_argument(server: RunningServer) -> None:
    # Hand-encode an AreCompletedRequest whose source id is not UTF-8: field 2, length 2, bytes ff fe.
    raw = pb.AreCompletedRequest(checkpoint="cp").SerializeToString() + b"\x12\x02\xff\xfe"
    with grpc.insecure_channel(server.grpc_address) as channel:
        call = channel.unary_unary(
            "/tally.v1.Coordinator/AreCompleted",
            request_serializer=lambda b: b,
            response_deserializer=pb.AreCompletedResponse.FromString,
        )
        code, message = code_of(call, raw)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in message


def test_lone_surrogate_over_http_is_refused(http: httpx.Client) -> None:
    body = b'{"checkpoint": "cp", "source_ids": ["ok", "\\ud800"]}'
    reply = http.post("/v1/are-completed", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert "UTF-8" in reply.json()["error"]["message"]


def test_malformed_json_gets_400_with_a_message(http: httpx.Client) -> None:
    reply = http.post("/v1/writers", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert "JSON" in error["message"]
    reply = http.post("/v1/writers", json={"writer_id": "w"})
    assert reply.status_code == 400
    assert "checkpoint" in reply.json()["error"]["message"]


def test_unknown_writer_is_not_found_on_both_transports(
    stub: pb_grpc.CoordinatorStub, http: httpx.Client
) -> None:
    code, message = code_of(stub.KeepAlive, pb.KeepAliveRequest(handle="nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "open a new writer" in message
    reply = http.post(
        "/v1/writers/nope/deltas", json={"deltas": [{"task_id": "t", "source_id": "s", "delta": 1}]}
    )
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "NOT_FOUND"


def test_live_writer_id_is_refused_and_can_be_reused_after_close(stub: pb_grpc.CoordinatorStub) -> None:
    handle = open_writer(stub, writer_id="host-1")
    code, message = code_of(stub.OpenWriter, pb.OpenWriterRequest(checkpoint="cp", writer_id="host-1"))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "already live" in message
    stub.CloseWriter(pb.CloseWriterRequest(handle=handle))
    assert open_writer(stub, writer_id="host-1") != handle


def test_server_survives_garbage_and_keeps_serving(server: RunningServer, http: httpx.Client) -> None:
    for body in [b"\x00\xff" * 50, b"[]", b'{"deltas": 5}', b'{"checkpoint": 7}']:
        reply = http.post("/v1/writers", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400
    assert http.get("/healthz").json() == {"status": "ok"}
    assert server.process.poll() is None


def test_unknown_checkpoint_status_is_not_found_and_are_completed_is_false(
    stub: pb_grpc.CoordinatorStub, http: httpx.Client, server: RunningServer
) -> None:
    code, _ = code_of(stub.GetCheckpoint, pb.GetCheckpointRequest(name="never/made"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert list(
        stub.AreCompleted(pb.AreCompletedRequest(checkpoint="never/made", source_ids=["a"])).completed
    ) == [False]
    assert http.get("/v1/checkpoints/never/made").status_code == 404
    assert not (server.data_dir / "checkpoints" / "never").exists()


def test_oversize_http_body_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from tally_server.testing import running_server

    with running_server(tmp_path / "data", settle_ms=0, env={"TALLY_MAX_MESSAGE_BYTES": "1000"}) as small:
        body = {"checkpoint": "cp", "source_ids": ["s" * 100] * 20}
        reply = httpx.post(f"{small.http_url}/v1/are-completed", json=body)
        assert reply.status_code == 413
        assert "max_message_bytes" in reply.json()["error"]["message"]
        assert httpx.post(
            f"{small.http_url}/v1/are-completed", json={"checkpoint": "cp", "source_ids": ["s"]}
        ).json() == {"completed": [False]}
