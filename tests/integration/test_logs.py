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
from tests.polling import wait_until


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


def test_each_call_of_one_grpc_method_echoes_and_logs_its_own_request_id(json_server: RunningServer) -> None:
    # The method's handler is wrapped once and reused: each call's id must still be its own.
    echoed = [
        open_over_grpc(json_server, f"logs/same-{i}", (("x-request-id", f"same-{i}"),)) for i in range(3)
    ]
    assert echoed == ["same-0", "same-1", "same-2"]
    entries = json_lines(json_server)
    for i in range(3):
        assert {e["request_id"] for e in lines_about(entries, f"logs/same-{i} [")} == {f"same-{i}"}


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


def access_lines(server: RunningServer, count: int) -> list[dict[str, Any]]:
    """The access lines, once there are ``count`` (each is logged just after its answer is sent)."""
    found: list[dict[str, Any]] = []

    def enough() -> bool:
        found[:] = [e for e in json_lines(server) if e["logger"] == "tally_server.access"]
        return len(found) >= count

    wait_until(enough, timeout=10, what=f"{count} access lines")
    return found


def test_service_events_carry_checkpoint_writer_and_kind_as_fields(json_server: RunningServer) -> None:
    with tally.Client(json_server.grpc_address) as client, client.writer("logs/fields", writer_id="w1") as w:
        w.apply_deltas(tree("a"))
    entries = json_lines(json_server)
    (created,) = lines_about(entries, "logs/fields [checkpoint_created]")
    assert (created["checkpoint"], created["event"]) == ("logs/fields", "checkpoint_created")
    assert "writer" not in created  # not known for this event: no key rather than null
    for kind in ("writer_opened", "writer_closed"):
        (line,) = lines_about(entries, f"logs/fields [{kind}]")
        assert (line["checkpoint"], line["writer"], line["event"]) == ("logs/fields", "w1", kind)
    # Lines that are not events have none of these keys.
    (startup,) = lines_about(entries, "tally serving")
    assert not {"checkpoint", "writer", "event"} & startup.keys()


def test_one_access_line_per_http_request_and_grpc_call(json_server: RunningServer) -> None:
    url = json_server.http_url
    opened = httpx.post(
        f"{url}/v1/writers",
        json={"checkpoint": "logs/access", "writer_id": "h"},
        headers={"X-Request-ID": "a-1"},
    )
    assert opened.status_code == 200
    assert httpx.get(f"{url}/v1/no/such/route", headers={"X-Request-ID": "a-2"}).status_code == 404
    open_over_grpc(json_server, "logs/access", (("x-request-id", "a-3"),))
    with grpc.insecure_channel(json_server.grpc_address) as channel:
        with pytest.raises(grpc.RpcError):
            stub = pb_grpc.CoordinatorStub(channel)
            stub.KeepAlive(pb.KeepAliveRequest(handle="gone"), metadata=(("x-request-id", "a-4"),))
    # Heartbeats, health checks and scrapes that succeed: no line at INFO.
    handle = opened.json()["handle"]
    assert httpx.post(f"{url}/v1/writers/{handle}/keepalive").status_code == 200
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    # A last request: once its line is there, lines of the quiet ones before it would be too.
    assert httpx.get(f"{url}/v1/checkpoints", headers={"X-Request-ID": "a-5"}).status_code == 200

    lines = {e["request_id"]: e for e in access_lines(json_server, 5)}
    assert set(lines) == {"a-1", "a-2", "a-3", "a-4", "a-5"}, sorted(lines)
    for entry in lines.values():
        assert entry["level"] == "info"
        assert isinstance(entry["duration_ms"], float) and 0 <= entry["duration_ms"] < 10_000
    http_open, http_404, grpc_open, grpc_keepalive = (lines[f"a-{i}"] for i in range(1, 5))
    assert (http_open["transport"], http_open["method"], http_open["path"], http_open["status"]) == (
        "http", "POST", "/v1/writers", 200,
    )  # fmt: skip
    assert (http_404["path"], http_404["status"]) == ("/v1/no/such/route", 404)
    assert http_open["peer"].startswith("127.0.0.1:")
    assert "code" not in http_open
    assert (grpc_open["transport"], grpc_open["method"], grpc_open["code"]) == (
        "grpc", "/tally.v1.Coordinator/OpenWriter", "OK",
    )  # fmt: skip
    assert grpc_open["peer"].startswith("ipv4:127.0.0.1:")
    assert "status" not in grpc_open and "path" not in grpc_open
    # A quiet method that failed is worth a line at INFO.
    assert (grpc_keepalive["method"], grpc_keepalive["code"]) == (
        "/tally.v1.Coordinator/KeepAlive",
        "NOT_FOUND",
    )
    assert "POST /v1/writers 200" in http_open["message"]


def test_heartbeats_health_checks_and_scrapes_are_logged_at_debug(tmp_path: Path) -> None:
    args = ["--log-format", "json", "--log-level", "debug"]
    with running_server(tmp_path / "data", settle_ms=0, args=args) as server:
        with grpc.insecure_channel(server.grpc_address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            handle = stub.OpenWriter(pb.OpenWriterRequest(checkpoint="logs/quiet", writer_id="w")).handle
            stub.KeepAlive(pb.KeepAliveRequest(handle=handle), metadata=(("x-request-id", "q-1"),))
        assert httpx.get(f"{server.http_url}/metrics", headers={"X-Request-ID": "q-2"}).status_code == 200
        assert httpx.get(f"{server.http_url}/healthz", headers={"X-Request-ID": "q-3"}).status_code == 200
        quiet: dict[str, dict[str, Any]] = {}

        def logged() -> bool:
            quiet.update((e["request_id"], e) for e in access_lines(server, 1))
            return {"q-1", "q-2", "q-3"} <= quiet.keys()

        wait_until(logged, timeout=10, what="the quiet calls' access lines")
    quiet = {rid: e for rid, e in quiet.items() if rid.startswith("q-")}
    assert {rid: e["level"] for rid, e in quiet.items()} == {"q-1": "debug", "q-2": "debug", "q-3": "debug"}
    assert quiet["q-1"]["method"] == "/tally.v1.Coordinator/KeepAlive"
    assert (quiet["q-2"]["path"], quiet["q-3"]["path"]) == ("/metrics", "/healthz")
