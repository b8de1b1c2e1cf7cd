"""A storage error the client can wait out is UNAVAILABLE on gRPC and 503 on HTTP, end to end.

The SDK retries UNAVAILABLE and gives up on INTERNAL, so a registry database or a data directory
that refuses for a while must never surface as an internal error (issue 8, point 5).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1.coordinator_pb2_grpc import CoordinatorStub
from tally_server.store.disk import TRASH_DIRNAME
from tally_server.testing import RunningServer, running_server
from tests.fault.test_registry_failure import registry_broken
from tests.integration.workload import tree


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RunningServer]:
    with running_server(tmp_path / "data", settle_ms=0) as srv:
        yield srv


def grpc_code(server: RunningServer, method: str, request: object) -> tuple[str, str]:
    with grpc.insecure_channel(server.grpc_address) as channel:
        try:
            getattr(CoordinatorStub(channel), method)(request, timeout=30)
        except grpc.RpcError as err:
            return err.code().name, err.details()  # type: ignore[attr-defined]
    return "OK", ""


def http_code(server: RunningServer, method: str, path: str, **kwargs: object) -> tuple[int, dict[str, str]]:
    reply = httpx.request(method, f"{server.http_url}{path}", timeout=30, **kwargs)  # type: ignore[arg-type]
    return reply.status_code, reply.json().get("error", {})


def test_a_data_directory_that_refuses_a_reset_is_unavailable_not_internal(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        for checkpoint in ("disk/grpc", "disk/http"):
            with client.writer(checkpoint, writer_id="w") as w:
                w.apply_deltas(tree("a"))
    # Where reset moves a checkpoint's files is taken by a plain file: the disk says ENOTDIR.
    blocker = server.data_dir / TRASH_DIRNAME
    blocker.write_text("in the way")

    code, message = grpc_code(server, "ResetCheckpoint", pb.ResetCheckpointRequest(name="disk/grpc"))
    assert code == "UNAVAILABLE", message
    assert "retry" in message and "Not a directory" in message
    status, error = http_code(server, "POST", "/v1/reset", json={"name": "disk/http"})
    assert status == 503, error
    assert error["code"] == "UNAVAILABLE" and "retry" in error["message"]
    with tally.Client(server.http_url) as client:
        assert client.are_completed("disk/grpc", ["a"]) == client.are_completed("disk/http", ["a"]) == [True]

    blocker.unlink()  # the operator clears the way: the same calls now succeed
    assert grpc_code(server, "ResetCheckpoint", pb.ResetCheckpointRequest(name="disk/grpc"))[0] == "OK"
    assert http_code(server, "POST", "/v1/reset", json={"name": "disk/http"})[0] == 200
    assert "Traceback" in server.log()  # an unexpected path: logged with its cause for the operator


def test_a_registry_that_refuses_is_unavailable_on_both_transports(server: RunningServer) -> None:
    with tally.Client(server.grpc_address) as client:
        with client.writer("reg/up", writer_id="w") as w:
            w.apply_deltas(tree("a"))
    with registry_broken(server.data_dir):
        code, message = grpc_code(
            server, "OpenWriter", pb.OpenWriterRequest(checkpoint="reg/new", writer_id="w")
        )
        assert code == "UNAVAILABLE" and "registry database" in message, message
        status, error = http_code(
            server, "POST", "/v1/writers", json={"checkpoint": "reg/new2", "writer_id": "w"}
        )
        assert status == 503 and "registry database" in error["message"], error
        code, message = grpc_code(server, "ListEvents", pb.ListEventsRequest(checkpoint="reg/up"))
        assert code == "UNAVAILABLE", message
        status, error = http_code(server, "GET", "/v1/events", params={"checkpoint": "reg/up"})
        assert status == 503 and error["code"] == "UNAVAILABLE", error
    status, _ = http_code(server, "GET", "/v1/events", params={"checkpoint": "reg/up"})
    assert status == 200
