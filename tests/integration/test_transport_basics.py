"""gRPC health checking and reflection, HTTP health, OpenAPI: what operators and tools rely on."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import tally
from tally_server.testing import RunningServer, running_server


def test_grpc_health_reports_serving(server: RunningServer) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tally.v1.Coordinator"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_reflection_lists_the_coordinator(server: RunningServer) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "tally.v1.Coordinator" in names
    assert "grpc.health.v1.Health" in names


def test_http_health_and_openapi(server: RunningServer) -> None:
    with httpx.Client(base_url=server.http_url) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").json() == {"status": "ready"}
        spec = http.get("/openapi.json").json()
    assert {"/v1/writers", "/v1/writers/{handle}/deltas", "/v1/are-completed"} <= set(spec["paths"])


def test_already_exists_and_failed_precondition_share_409_and_the_sdk_tells_them_apart(
    server: RunningServer,
) -> None:
    with tally.Client(server.http_url) as client, httpx.Client(base_url=server.http_url) as http:
        with client.writer("codes/run", writer_id="live"):
            with pytest.raises(tally.AlreadyExists):
                client.writer("codes/run", writer_id="live").open()
            with pytest.raises(tally.FailedPrecondition, match="live writer"):
                client.reset("codes/run")
            taken = http.post("/v1/writers", json={"checkpoint": "codes/run", "writer_id": "live"})
            refused = http.post("/v1/reset", json={"name": "codes/run"})
    assert (taken.status_code, taken.json()["error"]["code"]) == (409, "ALREADY_EXISTS")
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "FAILED_PRECONDITION")


def test_http_refusals_carry_their_headers(tmp_path: Path) -> None:
    with running_server(tmp_path, env={"TALLY_TOKENS": "secret:reader"}) as served:
        with httpx.Client(base_url=served.http_url) as http:
            anonymous = http.get("/v1/checkpoints")
            wrong_method = http.put("/v1/checkpoints", headers={"authorization": "Bearer secret"})
        with tally.Client(served.http_url) as client, pytest.raises(tally.Unauthenticated):
            client.checkpoints()
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Bearer")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "GET"
    assert wrong_method.json()["error"]["code"] == "METHOD_NOT_ALLOWED"
