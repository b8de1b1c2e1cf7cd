"""Refusals in gRPC's standard error model, as a client in any language reads them.

A raw gRPC call to a real ``tally serve`` fails; ``grpc_status.rpc_status.from_call`` (the Python
twin of Go's ``status.FromError``) returns the ``google.rpc.Status`` from ``grpc-status-details-bin``:
its code and message match the call's, its details unpack to ErrorInfo and, for an invalid argument,
to BadRequest naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer


@pytest.fixture
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_address) as chan:
        yield chan


def refused(call: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)  # type: ignore[operator]
    return info.value


def rich_status(err: grpc.RpcError, code: grpc.StatusCode) -> status_pb2.Status:
    """The standard Status of a failed call, checked against the call's own code and message."""
    assert err.code() == code  # type: ignore[attr-defined]
    status = rpc_status.from_call(err)  # raises ValueError if code or message disagree with the call
    assert status is not None, "no grpc-status-details-bin in the trailers"
    assert status.code == code.value[0]
    assert status.message == err.details()  # type: ignore[attr-defined]
    return status


def unpacked(
    status: status_pb2.Status,
) -> tuple[error_details_pb2.ErrorInfo, error_details_pb2.BadRequest | None]:
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    infos = [d.Unpack(info) for d in status.details if d.Is(info.DESCRIPTOR)]
    bads = [d.Unpack(bad) for d in status.details if d.Is(bad.DESCRIPTOR)]
    assert infos == [True], [d.type_url for d in status.details]
    assert len(status.details) == 1 + len(bads)
    return info, bad if bads else None


def test_an_invalid_argument_names_its_field_in_errorinfo_and_badrequest(
    server: RunningServer, channel: grpc.Channel
) -> None:
    stub = pb_grpc.CoordinatorStub(channel)
    err = refused(stub.OpenWriter, pb.OpenWriterRequest(checkpoint="a//b", writer_id="w1"))
    status = rich_status(err, grpc.StatusCode.INVALID_ARGUMENT)
    assert "checkpoint name" in status.message
    info, bad = unpacked(status)
    assert (info.reason, info.domain) == ("INVALID_ARGUMENT", "tally.dev")
    assert dict(info.metadata) == {"field": "checkpoint"}
    assert bad is not None and [(v.field, v.description) for v in bad.field_violations] == [
        ("checkpoint", status.message)
    ]
    # The same field in the HTTP body's details.
    reply = httpx.post(f"{server.http_url}/v1/writers", json={"checkpoint": "a//b", "writer_id": "w1"})
    assert reply.status_code == 400 and reply.json()["error"]["details"] == {"field": "checkpoint"}


@pytest.mark.parametrize(
    ("method", "request_", "field"),
    [
        ("OpenWriter", pb.OpenWriterRequest(checkpoint="cp", writer_id="w/1"), "writer_id"),
        ("OpenWriter", pb.OpenWriterRequest(checkpoint="cp", writer_id="w", pid=-1), "pid"),
        (
            "OpenWriter",
            pb.OpenWriterRequest(checkpoint="cp", writer_id="w", fingerprint={"": "x"}),
            "fingerprint",
        ),
        ("GetCheckpoint", pb.GetCheckpointRequest(name="../x"), "name"),
        ("ListEvents", pb.ListEventsRequest(checkpoint="cp", limit=5000), "limit"),
        ("AreCompleted", pb.AreCompletedRequest(checkpoint="cp", source_ids=["a", ""]), "source_ids[1]"),
    ],
)
def test_the_field_violation_is_the_request_field_at_fault(
    channel: grpc.Channel, method: str, request_: object, field: str
) -> None:
    stub = pb_grpc.CoordinatorStub(channel)
    if method == "ListEvents":  # the checkpoint must exist before its events' limit is checked
        stub.OpenWriter(pb.OpenWriterRequest(checkpoint="cp", writer_id="w0"))
    _info, bad = unpacked(
        rich_status(refused(getattr(stub, method), request_), grpc.StatusCode.INVALID_ARGUMENT)
    )
    assert bad is not None and [v.field for v in bad.field_violations] == [field]


def test_a_bad_delta_is_named_by_its_index_in_the_batch(channel: grpc.Channel) -> None:
    stub = pb_grpc.CoordinatorStub(channel)
    handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="cp", writer_id="w1")).handle
    batch = [pb.Delta(task_id="t", source_id="a", delta=1), pb.Delta(task_id="t", source_id="", delta=1)]
    err = refused(stub.ApplyDeltas, pb.ApplyDeltasRequest(handle=handle, deltas=batch))
    info, bad = unpacked(rich_status(err, grpc.StatusCode.INVALID_ARGUMENT))
    assert info.metadata["field"] == "deltas[1].source_id"
    assert bad is not None and bad.field_violations[0].field == "deltas[1].source_id"


def test_not_found_carries_errorinfo_and_no_badrequest(channel: grpc.Channel) -> None:
    stub = pb_grpc.CoordinatorStub(channel)
    err = refused(stub.GetCheckpoint, pb.GetCheckpointRequest(name="never/made"))
    info, bad = unpacked(rich_status(err, grpc.StatusCode.NOT_FOUND))
    assert (info.reason, info.domain, bad) == ("NOT_FOUND", "tally.dev", None)


def test_a_failed_precondition_carries_its_details_as_errorinfo_metadata(
    server: RunningServer, channel: grpc.Channel
) -> None:
    stub = pb_grpc.CoordinatorStub(channel)
    stub.OpenWriter(pb.OpenWriterRequest(checkpoint="busy", writer_id="w1"))
    err = refused(stub.ResetCheckpoint, pb.ResetCheckpointRequest(name="busy"))
    info, bad = unpacked(rich_status(err, grpc.StatusCode.FAILED_PRECONDITION))
    assert (info.reason, bad) == ("FAILED_PRECONDITION", None)
    assert dict(info.metadata) == {"live_writers": "1"}  # ErrorInfo holds strings: JSON for the others
    # The JSON trailer keeps the types, and the SDK reads it: the same details as over HTTP.
    trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    assert json.loads(trailers["tally-error-details"]) == {"live_writers": 1}
    for address in (server.grpc_address, server.http_url):
        with tally.Client(address) as client, pytest.raises(tally.FailedPrecondition) as sdk:
            client.reset("busy")
        assert sdk.value.details == {"live_writers": 1}


def test_an_undecodable_request_and_a_request_id_come_with_the_status(channel: grpc.Channel) -> None:
    raw = channel.unary_unary("/tally.v1.Coordinator/GetCheckpoint")
    not_utf8 = b"\x0a\x02\xff\xfe"  # GetCheckpointRequest.name = two bytes that are not UTF-8
    with pytest.raises(grpc.RpcError) as info:
        raw(not_utf8, metadata=[("x-request-id", "req-7")])
    err = info.value
    error_info, bad = unpacked(rich_status(err, grpc.StatusCode.INVALID_ARGUMENT))
    assert "could not be decoded" in err.details() and error_info.reason == "INVALID_ARGUMENT"  # type: ignore[attr-defined]
    assert bad is None  # no field is known
    assert dict(err.trailing_metadata() or ()).get("x-request-id") == "req-7"  # type: ignore[attr-defined]


def test_the_longest_refusal_still_arrives_with_its_own_code(channel: grpc.Channel) -> None:
    """A message at its cap and details near theirs stay under the client's metadata limit.

    Sent whole in both trailers, they would pass gRPC's default 8 KiB and the client would see
    RESOURCE_EXHAUSTED instead: the ErrorInfo metadata and then the JSON details are left out first.
    """
    stub = pb_grpc.CoordinatorStub(channel)
    keys = {f"k{i:02d}-" + "x" * 150: "a" for i in range(25)}  # the fingerprint's keys are the details
    stub.OpenWriter(pb.OpenWriterRequest(checkpoint="fp", writer_id="w1", fingerprint=keys))
    changed = {key: "b" for key in keys}
    err = refused(stub.OpenWriter, pb.OpenWriterRequest(checkpoint="fp", writer_id="w2", fingerprint=changed))
    status = rich_status(err, grpc.StatusCode.FAILED_PRECONDITION)
    assert "different fingerprint" in status.message and "message cut" in status.message
    info, _bad = unpacked(status)
    assert info.reason == "FAILED_PRECONDITION"
    assert "omitted" in info.metadata
