"""gRPC health checking and reflection, HTTP health, OpenAPI: what operators and tools rely on."""

from __future__ import annotations

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tally_server.testing import RunningServer


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
