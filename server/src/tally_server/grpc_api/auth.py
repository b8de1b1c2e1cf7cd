"""gRPC authentication: the bearer token in the ``authorization`` metadata, checked per RPC."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tally_server.auth import Authorizer
from tally_server.errors import TallyServerError
from tally_server.grpc_api.interceptors import STATUS

_PREFIX = "/tally.v1.Coordinator/"


def _refuse(exc: TallyServerError) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        await context.abort(STATUS[exc.code], exc.message)

    async def stream(request: Any, context: Any) -> Any:
        await context.abort(STATUS[exc.code], exc.message)
        yield  # pragma: no cover - makes this an async generator

    return unary, stream


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Checks tally.v1 calls only; health checking and reflection stay open for probes and tools."""

    def __init__(self, authorizer: Authorizer) -> None:
        self._authorizer = authorizer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        method: str = details.method
        if not self._authorizer.enabled or not method.startswith(_PREFIX):
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization")
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        try:
            self._authorizer.check(method[len(_PREFIX) :], header)
        except TallyServerError as exc:
            handler = await continuation(details)
            unary, stream = _refuse(exc)
            if handler is not None and handler.unary_stream is not None:
                return grpc.unary_stream_rpc_method_handler(
                    stream,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
            return grpc.unary_unary_rpc_method_handler(unary)
        return await continuation(details)
