"""Logs of a real ``tally serve``: JSON with ``--log-format json``, a request id on each line of a request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

import tally
from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.testing import RunningServer, running_server
from tests.integration.workload import tree


@pytest.fixture
def json_server(tmp_path: Path) -> Iterator[RunningServer]:
    with running_server(tmp_path / "data", settle_ms=0, args=["--log-format", "json"]) as srv:
        yield srv


def json_lines(server: RunningServer) -> list[dict[str, Any]]:
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert lines, "the server logged nothing"
    entries = []
    for line in lines:
        entry = json.loads(line)  # every line, not just ours
        assert {"ts", "level", "logger", "request_id", "message"} <= entry.keys(), line
        entries.append(entry)
    return entries


def lines_about(entries: list[dict[str, Any]], needle: str) -> list[dict[str, Any]]:
    found = [e for e in entries if needle in e["message"]]
    assert found, f"no log line mentions {needle!r}"
    return found


def open_over_grpc(server: RunningServer, checkpoint: str, metadata: tuple[tuple[str, str], ...] = ()) -> str:
    """OpenWriter with the given metadata; returns the request id the server echoed."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        _, call = stub.OpenWriter.with_call(
            pb.OpenWriterRequest(checkpoint=checkpoint, writer_id="w"), metadata=metadata
        )
        echoed = dict(call.trailing_metadata())  # a unary call's id comes back with its status
    return str(echoed["x-request-id"])


def test_every_line_is_json_and_a_grpc_request_id_reaches_the_service_lines(
    json_server: RunningServer,
) -> None:
    echoed = open_over_grpc(json_server, "logs/grpc", (("x-request-id", "test-123"),))
    assert echoed == "test-123"
    entries = json_lines(json_server)
    # Both lines are logged by the service, two layers below the interceptor.
    for entry in lines_about(entries, "logs/grpc [checkpoint_created]"):
        assert entry["request_id"] == "test-123"
    for entry in lines_about(entries, "logs/grpc [writer_opened]"):
        assert entry["request_id"] == "test-123"
        assert entry["logger"] == "tally_server.service"
    # Lines outside any request carry "-".
    startup = lines_about(entries, "tally serving")
    assert [e["request_id"] for e in startup] == ["-"]


def test_a_grpc_call_without_an_id_gets_a_fresh_one_per_call(json_server: RunningServer) -> None:
    first = open_over_grpc(json_server, "logs/fresh-1")
    second = open_over_grpc(json_server, "logs/fresh-2")
    assert first and second and first != second and "-" not in (first, second)
    entries = json_lines(json_server)
    assert {e["request_id"] for e in lines_about(entries, "logs/fresh-1 [")} == {first}
    assert {e["request_id"] for e in lines_about(entries, "logs/fresh-2 [")} == {second}


def test_http_request_id_header_is_logged_and_echoed(json_server: RunningServer) -> None:
    body = {"checkpoint": "logs/http", "writer_id": "w"}
    reply = httpx.post(f"{json_server.http_url}/v1/writers", json=body, headers={"X-Request-ID": "http-456"})
    assert reply.status_code == 200
    assert reply.headers["X-Request-ID"] == "http-456"
    handle = reply.json()["handle"]

    closed = httpx.post(f"{json_server.http_url}/v1/writers/{handle}/close")
    assert closed.status_code == 200
    generated = closed.headers["X-Request-ID"]
    assert generated and generated != "http-456"

    # An id that is not a short plain token is not echoed into logs or headers.
    odd = httpx.get(f"{json_server.http_url}/healthz", headers={"X-Request-ID": "a b\tc" * 50})
    assert odd.headers["X-Request-ID"] != "a b\tc" * 50

    entries = json_lines(json_server)
    for entry in lines_about(entries, "logs/http [writer_opened]"):
        assert entry["request_id"] == "http-456"
    for entry in lines_about(entries, "logs/http [writer_closed]"):
        assert entry["request_id"] == generated


def test_sdk_traffic_over_both_transports_logs_only_json(json_server: RunningServer) -> None:
    for address in (json_server.grpc_address, json_server.http_url):
        with tally.Client(address) as client, client.writer("logs/sdk") as w:
            w.apply_deltas(tree("a"))
            w.flush()
    entries = json_lines(json_server)
    request_ids = {e["request_id"] for e in lines_about(entries, "logs/sdk [writer_opened]")}
    assert len(request_ids) == 2 and "-" not in request_ids


def test_text_format_is_the_default_and_carries_the_request_id(server: RunningServer) -> None:
    open_over_grpc(server, "logs/text", (("x-request-id", "text-789"),))
    lines = [line for line in server.log().splitlines() if "logs/text [writer_opened]" in line]
    assert len(lines) == 1
    assert "[text-789]" in lines[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[0])


def test_a_refused_grpc_call_echoes_its_request_id_beside_the_error_details(server: RunningServer) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        first = pb.OpenWriterRequest(checkpoint="logs/fp", writer_id="a", fingerprint={"model": "v1"})
        stub.CloseWriter(pb.CloseWriterRequest(handle=stub.OpenWriter(first).handle))
        other = pb.OpenWriterRequest(checkpoint="logs/fp", writer_id="b", fingerprint={"model": "v2"})
        with pytest.raises(grpc.RpcError) as caught:
            stub.OpenWriter(other, metadata=(("x-request-id", "refused-1"),))
    err = caught.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    trailing = dict(err.trailing_metadata())  # type: ignore[attr-defined]
    assert trailing["x-request-id"] == "refused-1"
    assert json.loads(trailing["tally-error-details"])["differing"] == ["model"]
