"""Builds the grpc.aio server: Coordinator, health checking and reflection."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tally.v1 import coordinator_pb2 as pb
from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.auth import Authorizer
from tally_server.grpc_api.auth import AuthInterceptor
from tally_server.grpc_api.columns import ColumnsReader
from tally_server.grpc_api.errors import ErrorInterceptor
from tally_server.grpc_api.request_context import RequestInterceptor
from tally_server.grpc_api.servicer import CoordinatorServicer
from tally_server.listen import add_grpc_port
from tally_server.metrics import Metrics
from tally_server.service import CoordinatorService

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name


def server_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> grpc.ServerCredentials:
    """TLS from PEM files; with ``client_ca``, clients must present a certificate it signed (mTLS)."""
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca is not None else None,
        require_client_auth=client_ca is not None,
    )


def build_server(
    service: CoordinatorService,
    listen: str,
    max_message_bytes: int,
    metrics: Metrics,
    authorizer: Authorizer,
    credentials: grpc.ServerCredentials | None = None,
    router: grpc.aio.ServerInterceptor | None = None,  # type: ignore[type-arg]
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Return the (not yet started) server, the bound port and its health servicer.

    ``metrics`` and ``authorizer`` are the coordinator's own, shared with the HTTP app: unary call
    latencies go to its ``tally_grpc_request_duration_seconds``. With ``credentials``
    (:func:`server_credentials`) the port serves TLS only. ``router`` (on a store of several shards,
    ``sharding.ShardRouter``) sees each call before the token checks: a call it forwards is checked
    by the coordinator it goes to.
    """
    auth = AuthInterceptor(authorizer, service.checkpoint_of)
    request_interceptor = RequestInterceptor(metrics.grpc_request_duration)
    server = grpc.aio.server(
        # Request ids and timing outermost, so they see the status code the error interceptor sets
        # (refused calls are timed and carry a request id too). Auth inside the error interceptor,
        # which answers its refusals like any other. ApplyDeltas' reader of plain columns innermost:
        # the others hand its deserializer on.
        interceptors=[
            request_interceptor,
            ErrorInterceptor(),
            *([router] if router else []),
            auth,
            ColumnsReader(service.limits),
        ],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(service), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return server, add_grpc_port(server, listen, credentials), health
